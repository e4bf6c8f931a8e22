"""Checkpoint transfer benchmark: rallypoint HTTP and PG vs torchft 0.2 HTTP and PG vs a raw socket.

Sender and receiver are separate processes on loopback. Per case the sender process
serves one state dict three ways at once (rallypoint ``HTTPTransport``, torchft's
``HTTPTransport`` with ``num_chunks`` 0 (its Manager's default) and 4, and a plain socket
that ``sendall``s the same tensor bytes: the ceiling). Each contender has its own receiver
process; they take turns, round by round (one warm-up round, then ``--repeats``), so a
shared machine's changing load hits all of them alike. ``rp_inplace`` is rallypoint
receiving into a state dict of the same shapes that the receiver already holds (healing's
real situation; that memory is part of its baseline RSS).

Process-group transports: ``rp_pg`` is rallypoint's ``PGTransport`` on our
``ProcessGroupGloo``, ``torchft_pg`` is torchft 0.2's ``PGTransport`` on torchft's
``ProcessGroupGloo``; each is a 2-rank group (sender rank 0 in the sender process, a
thread that sends the state dict again each time the previous send completed; the
receiver is rank 1), both receiving into fresh tensors (``state_dict=None``/``into=None``);
``rp_pg_inplace`` receives into a state dict of the same shapes that the receiver holds.
torchft's receiver calls ``Tensor.numpy()`` to unpickle its metadata; where numpy is not
installed the benchmark gives that receiver process a minimal stand-in (``tobytes`` of the
buffer: one copy, as numpy's).

Cases: 100 MB of 3 MB float32 tensors, 1 GB of them (``--full``), 4,000 tiny tensors.
Reported per contender: the first (cold: fresh process, fresh memory, as in a real
healing) fetch, the median of the others, GB/s of the median, CPU seconds of receiver and
sender per fetch, and the receiver's peak RSS (``VmHWM``): absolute, and above its RSS
before the first fetch as a multiple of the state size (after one fetch; after all).

    python bench/transport.py [--full] [--repeats 3] [--cases 100MB,tiny4000] [--json-only]

Prints a table and one JSON line. Ratios are measured in the same run; on a shared,
loaded machine the absolute numbers move, the ratios less so. Later (warm) fetches of a
fresh-allocating receiver depend on glibc: it may keep freed 3 MB blocks in its heap (no
page faults next time) or return them to the kernel; the first fetch has no such luck.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

TENSOR_NUMEL = 3 * 1024 * 1024 // 4  # 3 MiB of float32
CASES = {
    "100MB": ("big", 100 * 1024 * 1024 // (TENSOR_NUMEL * 4)),
    "1GB": ("big", 1024 * 1024 * 1024 // (TENSOR_NUMEL * 4)),
    "tiny4000": ("tiny", 4000),
}
CONTENDERS = ["rallypoint", "rp_inplace", "torchft0", "torchft4", "socket", "rp_pg", "rp_pg_inplace", "torchft_pg"]
TIMEOUT = timedelta(seconds=300)


def make_state(case: str) -> dict[str, Any]:
    import torch

    kind, n = CASES[case]
    g = torch.Generator().manual_seed(0)
    if kind == "big":
        return {f"layer{i}.weight": torch.randn(TENSOR_NUMEL, generator=g) for i in range(n)}
    return {f"p{i}": torch.randn(16, generator=g) for i in range(n)}


def state_bytes(case: str) -> int:
    kind, n = CASES[case]
    return n * (TENSOR_NUMEL * 4 if kind == "big" else 64)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


# --------------------------------------------------------------------------- sender


def run_sender(case: str) -> None:
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

    from rallypoint.transports._tensors import byte_view
    from rallypoint.transports.http import HTTPTransport

    sd = make_state(case)
    rp = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0", advertise_host="127.0.0.1")
    rp.send_checkpoint([1], 1, sd, TIMEOUT)
    tf0 = TorchftHTTP(TIMEOUT, num_chunks=0)
    tf0.send_checkpoint([1], 1, sd, TIMEOUT)
    tf4 = TorchftHTTP(TIMEOUT, num_chunks=4)
    tf4.send_checkpoint([1], 1, sd, TIMEOUT)
    views = [byte_view(t) for t in sd.values()]
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(TIMEOUT.total_seconds())
                for v in views:
                    conn.sendall(v)

    threading.Thread(target=serve, daemon=True).start()

    import torch.distributed as dist

    pg_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

    def serve_pg(contender: str) -> None:
        """Rank 0 of a 2-rank group: send the state dict, again and again (daemon thread)."""
        addr = f"127.0.0.1:{pg_store.port}/{contender}"
        if contender.startswith("rp_pg"):
            from rallypoint.process_groups import ProcessGroupGloo
            from rallypoint.transports.pg import PGTransport

            pg = ProcessGroupGloo(timeout=TIMEOUT)
            pg.configure(addr, "bench_sender", 0, 2, quorum_id=1)
            tr: Any = PGTransport(pg, TIMEOUT)
        else:
            from torchft.checkpointing.pg_transport import PGTransport as TorchftPG
            from torchft.process_group import ProcessGroupGloo as TorchftGloo

            pg = TorchftGloo(timeout=TIMEOUT)
            pg.configure(addr, "bench_sender", 0, 2, quorum_id=1)
            tr = TorchftPG(pg, TIMEOUT, torch.device("cpu"))
        while True:
            try:
                tr.send_checkpoint([1], 1, sd, TIMEOUT)
            except Exception:  # noqa: BLE001 - the receiver went away: stop serving
                return

    for c in ("rp_pg", "rp_pg_inplace", "torchft_pg"):
        threading.Thread(target=serve_pg, args=(c,), daemon=True).start()
    print(
        json.dumps(
            {
                "rp_pg": f"127.0.0.1:{pg_store.port}/rp_pg",
                "rp_pg_inplace": f"127.0.0.1:{pg_store.port}/rp_pg_inplace",
                "torchft_pg": f"127.0.0.1:{pg_store.port}/torchft_pg",
                "rallypoint": rp.metadata(),
                "torchft0": tf0.metadata(),
                "torchft4": tf4.metadata(),
                "socket": lsock.getsockname()[1],
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )
    sys.stdin.readline()  # the parent closes stdin (or dies) when done
    lsock.close()
    rp.shutdown()
    tf0.shutdown()
    tf4.shutdown()


# --------------------------------------------------------------------------- receiver


def run_receiver(case: str, contender: str, addr: str) -> None:
    import torch

    from rallypoint.transports._tensors import byte_view

    nbytes = state_bytes(case)
    if contender == "rallypoint":
        from rallypoint.transports.http import HTTPTransport

        t = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0")
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT)  # noqa: E731
    elif contender == "rp_inplace":
        # Healing's real situation: the joiner already holds a model of the same shapes;
        # receive straight into it (its memory is part of the baseline RSS).
        from rallypoint.transports.http import HTTPTransport

        t = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0")
        template = {k: torch.zeros_like(v) for k, v in make_state(case).items()}
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT, into=template, in_place=True)  # noqa: E731
    elif contender.startswith("rp_pg"):
        from rallypoint.process_groups import ProcessGroupGloo
        from rallypoint.transports.pg import PGTransport

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(addr, "bench_receiver", 1, 2, quorum_id=1)
        t = PGTransport(pg, TIMEOUT)
        pg_template = {k: torch.zeros_like(v) for k, v in make_state(case).items()} if contender == "rp_pg_inplace" else None
        fetch = lambda: t.recv_checkpoint(0, "<pg>", 1, TIMEOUT, into=pg_template)  # noqa: E731
    elif contender == "torchft_pg":
        from torchft.checkpointing.pg_transport import PGTransport as TorchftPG
        from torchft.process_group import ProcessGroupGloo as TorchftGloo

        try:
            import numpy  # noqa: F401
        except ImportError:  # torchft unpickles buf.cpu().numpy().tobytes(): a stand-in

            class _Bytes:
                def __init__(self, x: Any) -> None:
                    self._x = x.contiguous()

                def tobytes(self) -> bytes:
                    return bytes(byte_view(self._x))

            torch.Tensor.numpy = lambda self, *a, **k: _Bytes(self)  # type: ignore[method-assign]
        pg = TorchftGloo(timeout=TIMEOUT)
        pg.configure(addr, "bench_receiver", 1, 2, quorum_id=1)
        t = TorchftPG(pg, TIMEOUT, torch.device("cpu"))
        fetch = lambda: t.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)  # noqa: E731
    elif contender.startswith("torchft"):
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        t = TorchftHTTP(TIMEOUT, num_chunks=int(contender[-1]))
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT)  # noqa: E731
    else:
        port = int(addr)

        def fetch() -> Any:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            view = byte_view(buf)
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT.total_seconds()) as s:
                got = 0
                while got < nbytes:
                    k = s.recv_into(view[got:])
                    if not k:
                        raise RuntimeError(f"socket closed after {got} of {nbytes} bytes")
                    got += k
            return buf

    gc.collect()
    base = rss_kb("VmRSS")
    first_hwm = -1
    # One fetch per "fetch" line on stdin, so the parent can interleave the contenders
    # round-robin (a shared machine's load then hits them alike).
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "fetch":
            break
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = fetch()
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if first_hwm < 0:
            # Peak of one receive. Later ones add allocator effects (glibc raises its mmap
            # threshold after the first frees, so freed 3 MB blocks stay in the heap).
            first_hwm = rss_kb("VmHWM")
        del out
        gc.collect()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        print(json.dumps({"t": dt, "cpu": cpu}), flush=True)
    print(json.dumps({"base_kb": base, "first_hwm_kb": first_hwm, "hwm_kb": rss_kb("VmHWM")}), flush=True)
    if contender != "socket":
        t.shutdown()
    if contender in ("rp_pg", "rp_pg_inplace", "torchft_pg"):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def proc_cpu(pid: int) -> float:
    """user+system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- orchestration


def child(args: list[str], timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def read_json_line(p: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    box: list[str] = []
    th = threading.Thread(target=lambda: box.append(p.stdout.readline() if p.stdout else ""), daemon=True)
    th.start()
    th.join(timeout)
    if not box or not box[0].strip():
        raise RuntimeError(f"{what}: no answer within {timeout:.0f} s (rc={p.poll()})")
    return json.loads(box[0])


def kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        try:
            os.kill(p.pid, 9)
        except ProcessLookupError:
            pass
    p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="also the 1 GB case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=None, help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "sender":
        return run_sender(a.case)
    if a.role == "receiver":
        return run_receiver(a.case, a.contender, a.addr)

    cases = a.cases.split(",") if a.cases else [c for c in CASES if c != "1GB" or a.full]
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        sender = child(["--role", "sender", "--case", case], 120)
        receivers: dict[str, subprocess.Popen[str]] = {}
        try:
            addrs = read_json_line(sender, 180, f"sender {case}")
            for c in CONTENDERS:
                addr = addrs["rallypoint" if c == "rp_inplace" else c]
                receivers[c] = child(["--role", "receiver", "--case", case, "--contender", c, "--addr", str(addr)], 600)
                read_json_line(receivers[c], 180, f"receiver {case}/{c} start")
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
            first: dict[str, float] = {}
            for rnd in range(a.repeats + 1):  # round 0 is the warm-up
                for c, r in receivers.items():
                    s0 = proc_cpu(sender.pid)
                    assert r.stdin is not None
                    r.stdin.write("fetch\n")
                    r.stdin.flush()
                    out = read_json_line(r, 600, f"receiver {case}/{c}")
                    out["sender_cpu"] = proc_cpu(sender.pid) - s0
                    if rnd:
                        runs[c].append(out)
                    else:
                        first[c] = out["t"]
            for c, r in receivers.items():
                assert r.stdin is not None
                r.stdin.write("quit\n")
                r.stdin.flush()
                mem = read_json_line(r, 60, f"receiver {case}/{c} end")
                med = statistics.median(x["t"] for x in runs[c])
                results.setdefault(case, {})[c] = {
                    "median_s": med,
                    "first_s": first[c],
                    "gbps": state_bytes(case) / med / 1e9,
                    "recv_cpu_s": statistics.median(x["cpu"] for x in runs[c]),
                    "send_cpu_s": statistics.median(x["sender_cpu"] for x in runs[c]),
                    "peak_rss_mb": mem["hwm_kb"] / 1024,
                    "peak_over_base_x_state": (mem["first_hwm_kb"] - mem["base_kb"]) * 1024 / state_bytes(case),
                    "peak_over_base_x_state_all_repeats": (mem["hwm_kb"] - mem["base_kb"]) * 1024 / state_bytes(case),
                }
        finally:
            for r in receivers.values():
                kill(r)
            if sender.stdin:
                sender.stdin.close()
            try:
                sender.wait(20)
            except subprocess.TimeoutExpired:
                kill(sender)
    summary: dict[str, Any] = {"bench": "transport", "repeats": a.repeats, "cases": results, "ratios": {}}
    for case, rs in results.items():
        rp, ip = rs["rallypoint"]["median_s"], rs["rp_inplace"]["median_s"]
        summary["ratios"][case] = {
            "rallypoint_vs_torchft0": rs["torchft0"]["median_s"] / rp,
            "rallypoint_vs_torchft4": rs["torchft4"]["median_s"] / rp,
            "rallypoint_of_socket": rs["socket"]["median_s"] / rp,
            "inplace_vs_torchft0": rs["torchft0"]["median_s"] / ip,
            "first_fetch_rallypoint_vs_torchft0": rs["torchft0"]["first_s"] / rs["rallypoint"]["first_s"],
            "first_fetch_inplace_vs_torchft0": rs["torchft0"]["first_s"] / rs["rp_inplace"]["first_s"],
            "pg_vs_torchft_pg": rs["torchft_pg"]["median_s"] / rs["rp_pg"]["median_s"],
            "pg_inplace_vs_torchft_pg": rs["torchft_pg"]["median_s"] / rs["rp_pg_inplace"]["median_s"],
            "first_fetch_pg_vs_torchft_pg": rs["torchft_pg"]["first_s"] / rs["rp_pg"]["first_s"],
        }
    if not a.json_only:
        print(
            f"{'case':<10}{'contender':<12}{'first s':>9}{'median s':>10}{'GB/s':>8}"
            f"{'recv CPU s':>12}{'send CPU s':>12}"
            f"{'peak RSS MB':>13}{'(peak-base)/state':>19}{'same, all repeats':>19}"
        )
        for case, rs in results.items():
            for c, r in rs.items():
                print(
                    f"{case:<10}{c:<12}{r['first_s']:>9.4f}{r['median_s']:>10.4f}{r['gbps']:>8.3f}"
                    f"{r['recv_cpu_s']:>12.3f}"
                    f"{r['send_cpu_s']:>12.3f}{r['peak_rss_mb']:>13.0f}"
                    f"{r['peak_over_base_x_state']:>19.2f}{r['peak_over_base_x_state_all_repeats']:>19.2f}"
                )
            rt = summary["ratios"][case]
            print(
                f"{case:<10}ratios (median): {rt['rallypoint_vs_torchft0']:.2f}x torchft(0), "
                f"{rt['rallypoint_vs_torchft4']:.2f}x torchft(4), {rt['rallypoint_of_socket']:.0%} of socket, "
                f"in-place {rt['inplace_vs_torchft0']:.2f}x torchft(0); first fetch: "
                f"{rt['first_fetch_rallypoint_vs_torchft0']:.2f}x, in-place "
                f"{rt['first_fetch_inplace_vs_torchft0']:.2f}x torchft(0)"
            )
            print(
                f"{case:<10}PG ratio (median): ours {rt['pg_vs_torchft_pg']:.2f}x torchft PG, "
                f"ours in place {rt['pg_inplace_vs_torchft_pg']:.2f}x; "
                f"first fetch {rt['first_fetch_pg_vs_torchft_pg']:.2f}x"
            )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
