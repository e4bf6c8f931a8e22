"""Checkpoint transfer benchmark: rallypoint HTTP and PG vs torchft 0.2 HTTP and PG vs a raw socket.

Sender and receiver are separate processes on loopback. Per case the sender process
serves one state dict several ways at once (rallypoint ``HTTPTransport``, torchft's
``HTTPTransport`` with ``num_chunks`` 0 (its Manager's default) and 4, and a plain socket
that ``sendall``s the same tensor bytes: the ceiling). Each contender has its own receiver
process. Below 2 GiB (the 100MB, 1GB and tiny4000 cases) all receivers live at once and
take turns, round by round (one warm-up round, then ``--repeats``), so a shared machine's
changing load hits all of them alike. From that size on (``--cases 4GB``, never a
default) ~6 receivers of 4 GB plus the sender do not fit in 24 GiB, so one receiver
process runs at a time and fetches once (started, one fetch, stopped), round by round,
the contenders' order rotating each round: every fetch is then a real healing's (a fresh
process, fresh memory), and no contender's later fetches depend on whether glibc reused
the heap its previous fetch freed (at 4 GB that luck moved a median by 2x). ``rp_inplace`` is
rallypoint receiving into a state dict of the same shapes that the receiver already holds
(healing's real situation; that memory is part of its baseline RSS), writing it as bytes
arrive (``in_place=True``: a broken transfer leaves it torn); ``rp_into`` receives into
the same held state without ever tearing it (``into=`` alone, what the Manager's heal on
the training thread does): into buffers kept from the previous fetch, landed by swapping
memory once every byte verified (``rallypoint/transports/_pool.py``), with XXH3 inline sums
(the default); ``rp_into_crc`` is the same asking for CRC-32 sums (an older peer's), and
``rp_into_nosum`` asking for none (``checksum="none"``, opt-in: the bytes trusted to the
connection, as torchft's are).

The plain-socket ceiling (``_sockets``: the receiver asks for a part, the sender
``sendall``s its tensors' bytes, the receiver ``recv_into``s each tensor in order):
``socket`` receives into a fresh destination per fetch, allocated the way rallypoint's
fresh receiver allocates (``torch.empty`` per tensor + ``advise_huge_pages``; the process
keeps its freed heap, as ours in effect does: ``_sockets.keep_freed_heap``), over
one connection: the reference for ``rallypoint`` (fresh vs fresh; ``faults`` columns:
minor page faults per fetch). ``socket_inplace`` receives into one destination allocated and zeroed before the
first fetch and reused: the network ceiling without page faults, the reference for
``rp_inplace``. ``socket4``: the same in-place destination, a quarter of the tensors over
each of 4 parallel connections; ``socket2_xxh3`` and ``socket4_xxh3`` the same over 2 or 4
connections with every tensor summed (XXH3, a MiB at a time) by the sender just before it
leaves and by the receiver as it lands, then checked: the floor of a heal that verifies
every byte, the reference for ``rp_into`` (the faster one run: ``verified_floor``). The
goal ratio ``inplace_of_best_socket`` is against the
faster of ``socket_inplace`` and ``socket4`` (named in ``best_inplace_socket``).
``http_bare``: rallypoint's sender (the same ranges and bytes as ``rp_into_nosum``) read by
a receiver that only ``recv_into``s them over two connections (no ``http.client``, parsing,
checks or landing) into one buffer; ``http_bare_tensors`` the same, each piece into its
place in tensors the receiver holds: ``rp_into_nosum`` against them is what our receiver
costs, they against the plain sockets what our sender and HTTP cost.

Process-group transports: ``rp_pg`` is rallypoint's ``PGTransport`` on our
``ProcessGroupGloo``, ``torchft_pg`` is torchft 0.2's ``PGTransport`` on torchft's
``ProcessGroupGloo``; each is a 2-rank group (sender rank 0 in the sender process, a
thread that sends the state dict again each time the previous send completed; the
receiver is rank 1), both receiving into fresh tensors (``state_dict=None``/``into=None``);
``rp_pg_inplace`` receives into a state dict of the same shapes that the receiver holds.
torchft's receiver calls ``Tensor.numpy()`` to unpickle its metadata; where numpy is not
installed the benchmark gives that receiver process a minimal stand-in (``tobytes`` of the
buffer: one copy, as numpy's).

TLS (``--tls``): three more contenders in the same rounds, each right after its
clear-text twin. ``http_tls``: rallypoint's ``HTTPTransport`` serving over mutual TLS
with a job token (a throw-away CA and a certificate for this host, made with ``trustme``
in a temporary directory removed at the end), its receiver verifying the sender against
that CA and presenting the same certificate, receiving into fresh tensors like
``rallypoint``; ``http_tls_inplace``: the same receiving in place like ``rp_inplace``
(healing's real situation, and free of the page faults of fresh 1 GB allocations);
``socket_tls``: ``socket`` over the same mutual TLS (one ``ssl`` connection, fresh
destination: the machine's TLS ceiling). Ratios (time over TLS / in clear
text; goal <= 1.15 for the 1 GB heal): ``http_tls_vs_http``,
``http_tls_inplace_vs_inplace``, ``first_fetch_http_tls_vs_http``,
``socket_tls_vs_socket``, and ``http_tls_of_socket_tls``. ``fast_path_sockets`` counts
the socket types the receiver's requests went over (``SSLSocket``: TLS, each body
decrypted straight into the tensors).

Cases: 100 MB of 3 MB float32 tensors, 1 GB of them (``--full``), 4 GB of them (only
``--cases 4GB``), 4,000 tiny tensors. Reported per contender: the first (cold: fresh
process, fresh memory, as in a real healing) fetch, the median of the others, GB/s of the
median, CPU seconds of receiver and sender per fetch, and the receiver's peak RSS
(``VmHWM``): absolute, and above its RSS before the first fetch as a multiple of the
state size (after one fetch; after all). Goals (the issue's, printed per case): HTTP
receive >= 1.3x torchft's (``torchft0``: its Manager's default) and >= 80% of the
socket ceiling (``rallypoint_of_socket`` fresh vs fresh, ``inplace_of_best_socket``).

    python bench/transport.py [--full] [--repeats 3] [--cases 100MB,tiny4000] [--json-only] [--tls]
                              [--contenders rallypoint,rp_inplace,socket,socket_inplace]

Prints a table and one JSON line. Ratios are measured in the same run; on a shared,
loaded machine the absolute numbers move, the ratios less so. Later (warm) fetches of a
fresh-allocating receiver depend on glibc: it may keep freed 3 MB blocks in its heap (no
page faults next time) or return them to the kernel; the first fetch has no such luck.
torchft's receivers are given the kept heap (``--torchft-heap kept``, the default: its best
case in every run; ``glibc`` leaves it to the allocator).
"""

from __future__ import annotations

import argparse
import collections
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _util  # noqa: E402
from _transport_util import (  # noqa: E402
    CASES,
    CONTENDERS,
    PG_CONTENDERS,
    SEQUENTIAL_FROM_BYTES,
    BARE_HTTP,
    BARE_HTTP_TENSORS,
    SOCKETS,
    TLS_CONTENDER,
    TLS_CONTENDERS,
    TLS_INPLACE,
    TLS_SOCKET,
    bare_http_fetcher,
    make_state,
    proc_cpu,
    read_json_line,
    report,
    rss_kb,
    state_bytes,
    zeros_state,
)
from _sockets import keep_freed_heap, serve_socket, socket_fetcher  # noqa: E402
from _transport_util import child as _child  # noqa: E402
from _transport_util import kill  # noqa: E402

TIMEOUT = timedelta(seconds=300)


# --------------------------------------------------------------------------- sender


def _port(sock: socket.socket) -> int:
    """The port the OS picked for a socket bound to port 0 (it stays bound: no race)."""
    _, port = sock.getsockname()
    return int(port)


def run_sender(case: str, tls_dir: str | None = None, pg_contenders: tuple[str, ...] = PG_CONTENDERS) -> None:
    import torch
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

    from rallypoint.transports._tensors import byte_view
    from rallypoint.transports.http import HTTPTransport

    sd = make_state(case)
    rp = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0", advertise_host="127.0.0.1")
    rp.send_checkpoint([1], 1, sd, TIMEOUT)
    rp_tls = None
    if tls_dir:
        job = _util.TlsJob.from_dir(tls_dir)
        rp_tls = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0", advertise_host="127.0.0.1", token=job.token,
                               tls=job.config(mutual=True))
        rp_tls.send_checkpoint([1], 1, sd, TIMEOUT)
    tf0 = TorchftHTTP(TIMEOUT, num_chunks=0)
    tf0.send_checkpoint([1], 1, sd, TIMEOUT)
    tf4 = TorchftHTTP(TIMEOUT, num_chunks=4)
    tf4.send_checkpoint([1], 1, sd, TIMEOUT)
    views = [byte_view(t) for t in sd.values()]
    lsock = socket.create_server(("127.0.0.1", 0))  # socket, socket_inplace, socket4
    threading.Thread(target=serve_socket, args=(lsock, views, TIMEOUT.total_seconds()), daemon=True).start()
    tls_lsock = None
    if tls_dir:
        from rallypoint._net.tls import server_ssl_context

        tls_lsock = socket.create_server(("127.0.0.1", 0))
        sctx = server_ssl_context(job.config(mutual=True))
        assert sctx is not None
        threading.Thread(target=serve_socket, args=(tls_lsock, views, TIMEOUT.total_seconds(), sctx.wrap_socket),
                         daemon=True).start()

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

    for c in pg_contenders:  # only the PG contenders that have a receiver (all, by default)
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
                **{c: _port(lsock) for c in SOCKETS},
                "torch": torch.__version__,
                **({TLS_CONTENDER: rp_tls.metadata()} if rp_tls is not None else {}),
                **({TLS_SOCKET: _port(tls_lsock)} if tls_lsock is not None else {}),
            }
        ),
        flush=True,
    )
    sys.stdin.readline()  # the parent closes stdin (or dies) when done
    lsock.close()
    if tls_lsock is not None:
        tls_lsock.close()
    rp.shutdown()
    if rp_tls is not None:
        rp_tls.shutdown()
    tf0.shutdown()
    tf4.shutdown()


# --------------------------------------------------------------------------- receiver


def run_receiver(case: str, contender: str, addr: str, tls_dir: str | None = None, keep_heap: bool = False) -> None:
    import torch

    from rallypoint.transports._tensors import byte_view

    fast_path: collections.Counter[str] | None = None
    if contender in (TLS_CONTENDER, TLS_INPLACE):
        # Rallypoint over mutual TLS with the job token, receiving into fresh tensors (as
        # "rallypoint") or in place (as "rp_inplace"); it verifies the sender against the
        # job's CA and presents the job's certificate.
        from rallypoint.transports.http import HTTPTransport

        if not (tls_dir and addr.startswith("https://")):
            raise SystemExit(f"{contender}: the sender does not serve TLS ({addr!r}) or no --tls-dir")
        job = _util.TlsJob.from_dir(tls_dir)
        t = HTTPTransport(TIMEOUT, bind="127.0.0.1:0", token=job.token, tls=job.config(mutual=True))
        # Which socket the receiver's connections read the bodies from (an ssl.SSLSocket
        # over TLS). Counted, not changed.
        fast_path = collections.Counter()
        from rallypoint.transports import _http_client

        real_get = _http_client.Connection.get

        def spy(self: Any, *args: Any, **kw: Any) -> Any:
            reply = real_get(self, *args, **kw)
            sock = self._conn.sock if self._conn is not None else None
            fast_path[type(sock).__name__] += 1
            return reply

        _http_client.Connection.get = spy  # type: ignore[method-assign]
        if contender == TLS_INPLACE:
            tls_template = zeros_state(case)
            fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT, into=tls_template, in_place=True)  # noqa: E731
        else:
            fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT)  # noqa: E731
    elif contender == "rallypoint":
        from rallypoint.transports.http import HTTPTransport

        t = HTTPTransport(TIMEOUT, bind="127.0.0.1:0")
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT)  # noqa: E731
    elif contender == "rp_inplace":
        # Healing's real situation: the joiner already holds a model of the same shapes;
        # receive straight into it (its memory is part of the baseline RSS).
        from rallypoint.transports.http import HTTPTransport

        t = HTTPTransport(TIMEOUT, bind="127.0.0.1:0")
        template = zeros_state(case)
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT, into=template, in_place=True)  # noqa: E731
    elif contender in ("rp_into", "rp_into_crc", "rp_into_nosum"):
        # The Manager's heal on the training thread: into the state it holds, nothing written
        # before every byte verified; warm buffers kept between fetches, landed by swapping.
        # rp_into asks for XXH3 inline sums (the default), rp_into_crc for CRC-32,
        # rp_into_nosum for none (checksum="none": torchft's integrity, the connection's).
        from rallypoint.transports.http import HTTPTransport

        checksum = {"rp_into_crc": "crc32", "rp_into_nosum": "none"}.get(contender)
        t = HTTPTransport(TIMEOUT, bind="127.0.0.1:0", checksum=checksum)
        template = zeros_state(case)
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT, into=template)  # noqa: E731
    elif contender.startswith("rp_pg"):
        from rallypoint.process_groups import ProcessGroupGloo
        from rallypoint.transports.pg import PGTransport

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(addr, "bench_receiver", 1, 2, quorum_id=1)
        t = PGTransport(pg, TIMEOUT)
        pg_template = zeros_state(case) if contender == "rp_pg_inplace" else None
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
    elif contender in (BARE_HTTP, BARE_HTTP_TENSORS):
        fetch = bare_http_fetcher(case, contender, addr, TIMEOUT.total_seconds())
    elif contender.startswith("torchft"):
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        t = TorchftHTTP(TIMEOUT, num_chunks=int(contender[-1]))
        fetch = lambda: t.recv_checkpoint(0, addr, 1, TIMEOUT)  # noqa: E731
    else:  # socket, socket_inplace, socket4, socket_tls
        wrap: Any = None
        if contender == TLS_SOCKET:
            from rallypoint._net.tls import client_ssl_context

            if not tls_dir:
                raise SystemExit(f"{TLS_SOCKET} needs --tls-dir")
            cctx = client_ssl_context(_util.TlsJob.from_dir(tls_dir).config(mutual=True))
            wrap = lambda s: cctx.wrap_socket(s, server_hostname="127.0.0.1")  # noqa: E731
        fetch = socket_fetcher(case, contender, int(addr), TIMEOUT.total_seconds(), wrap)

    if keep_heap and not keep_freed_heap():
        raise SystemExit(f"{contender}: --torchft-heap kept needs glibc's mallopt")
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
        print(json.dumps({"t": dt, "cpu": cpu, "minflt": r1.ru_minflt - r0.ru_minflt}), flush=True)
    end: dict[str, Any] = {"base_kb": base, "first_hwm_kb": first_hwm, "hwm_kb": rss_kb("VmHWM")}
    if fast_path is not None:
        end["fast_path_sockets"] = dict(fast_path)
    print(json.dumps(end), flush=True)
    if contender not in (*SOCKETS, TLS_SOCKET, BARE_HTTP, BARE_HTTP_TENSORS):
        t.shutdown()
    if contender in ("rp_pg", "rp_pg_inplace", "torchft_pg"):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


# --------------------------------------------------------------------------- orchestration


def child(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return _child(__file__, args, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="also the 1 GB case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=None, help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--tls", action="store_true",
                    help=f"also the {TLS_CONTENDER} contender: rallypoint HTTP over mutual TLS with a job token")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset of the contenders (default: all; a *_tls* one implies --tls)")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="every fetch by a fresh receiver process (a real healing's memory), whatever the size "
                         "(always from 2 GiB on)")
    ap.add_argument("--torchft-heap", choices=["kept", "glibc"], default="kept",
                    help="torchft's receivers: 'kept' (default) keep the heap a fetch freed for the next "
                         "(mallopt, as the socket ceiling does: warm fetches reuse memory already faulted in, "
                         "torchft's best case); 'glibc': glibc's own choice (warm fetches may fault it in again)")
    ap.add_argument("--keep-heap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", help=argparse.SUPPRESS)
    ap.add_argument("--serve-pg", default=",".join(PG_CONTENDERS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "sender":
        return run_sender(a.case, a.tls_dir, tuple(c for c in a.serve_pg.split(",") if c))
    if a.role == "receiver":
        return run_receiver(a.case, a.contender, a.addr, a.tls_dir, a.keep_heap)

    contenders = list(CONTENDERS)
    if a.contenders:
        contenders = [c for c in a.contenders.split(",") if c]
        unknown = [c for c in contenders if c not in (*CONTENDERS, *TLS_CONTENDERS)]
        if unknown:
            ap.error(f"unknown contender(s) {unknown}")
    use_tls = a.tls or any(c in TLS_CONTENDERS for c in contenders)
    if use_tls and not a.contenders:
        for tc, twin in TLS_CONTENDERS.items():  # each right after the clear-text one it is compared with
            contenders.insert(contenders.index(twin) + 1, tc)
    elif use_tls and not any(c in TLS_CONTENDERS for c in contenders):
        contenders.insert(contenders.index("rallypoint") + 1 if "rallypoint" in contenders else 0, TLS_CONTENDER)
    # Every contender but http_tls runs in clear text, whatever this shell's job settings say.
    env = dict(os.environ)
    _util.clear_job_env(env)
    tls = _util.TlsJob() if use_tls else None  # one PKI + token per run, removed at the end
    tls_args = ["--tls-dir", tls.dir] if tls is not None else []
    cases = a.cases.split(",") if a.cases else [c for c in CASES if c != "4GB" and (c != "1GB" or a.full)]
    if any(c not in CASES for c in cases):
        ap.error(f"unknown case(s) {[c for c in cases if c not in CASES]}")
    results: dict[str, dict[str, Any]] = {}
    load = [os.getloadavg()[0]]
    try:
        _run_cases(a, cases, contenders, env, tls_args, results)
    finally:
        if tls is not None:
            tls.close()
    load.append(os.getloadavg()[0])
    report(a.repeats, results, a.json_only, load, a.torchft_heap)


def _run_cases(a: argparse.Namespace, cases: list[str], contenders: list[str], env: dict[str, str],
               tls_args: list[str], results: dict[str, dict[str, Any]]) -> None:
    for case in cases:
        serve_pg = ",".join(c for c in PG_CONTENDERS if c in contenders)
        sender = child(["--role", "sender", "--case", case, "--serve-pg", serve_pg, *tls_args], env)
        try:
            addrs = read_json_line(sender, 300, f"sender {case}")
            # Below SEQUENTIAL_FROM_BYTES all receivers live at once and take turns round by
            # round; from it on (or with --fresh-processes), one receiver process per fetch.
            if a.fresh_processes or state_bytes(case) >= SEQUENTIAL_FROM_BYTES:
                _run_fresh_rounds(a, case, contenders, sender, addrs, env, tls_args, results)
            else:
                _run_group(a, case, contenders, sender, addrs, env, tls_args, results)
        finally:
            if sender.stdin:
                sender.stdin.close()
            try:
                sender.wait(20)
            except subprocess.TimeoutExpired:
                kill(sender)


def _start_receiver(a: argparse.Namespace, case: str, c: str, addrs: dict[str, Any], env: dict[str, str],
                    tls_args: list[str]) -> subprocess.Popen[str]:
    addr = addrs[{"rp_inplace": "rallypoint", "rp_into": "rallypoint", "rp_into_crc": "rallypoint",
                  "rp_into_nosum": "rallypoint", BARE_HTTP: "rallypoint", BARE_HTTP_TENSORS: "rallypoint",
                  TLS_INPLACE: TLS_CONTENDER}.get(c, c)]
    extra = tls_args if c in TLS_CONTENDERS else []
    if c.startswith("torchft") and a.torchft_heap == "kept":
        extra = [*extra, "--keep-heap"]
    r = child(["--role", "receiver", "--case", case, "--contender", c, "--addr", str(addr), *extra], env)
    read_json_line(r, 300, f"receiver {case}/{c} start")
    return r


def _fetch(case: str, c: str, r: subprocess.Popen[str], sender: subprocess.Popen[str]) -> dict[str, Any]:
    """One fetch by receiver ``r``, with the sender's CPU seconds during it."""
    s0 = proc_cpu(sender.pid)
    assert r.stdin is not None
    r.stdin.write("fetch\n")
    r.stdin.flush()
    out = read_json_line(r, 600, f"receiver {case}/{c}")
    out["sender_cpu"] = proc_cpu(sender.pid) - s0
    return out


def _end(case: str, c: str, r: subprocess.Popen[str]) -> dict[str, Any]:
    assert r.stdin is not None
    r.stdin.write("quit\n")
    r.stdin.flush()
    return read_json_line(r, 60, f"receiver {case}/{c} end")


def _summary(case: str, first: dict[str, Any], runs: list[dict[str, Any]], mem: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median(x["t"] for x in runs)
    out = {
        "median_s": med,
        "first_s": first["t"],
        "gbps": state_bytes(case) / med / 1e9,
        "recv_cpu_s": statistics.median(x["cpu"] for x in runs),
        "send_cpu_s": statistics.median(x["sender_cpu"] for x in runs),
        "first_minor_faults": first["minflt"],
        "minor_faults": statistics.median(x["minflt"] for x in runs),
        "peak_rss_mb": mem["hwm_kb"] / 1024,
        "peak_over_base_x_state": (mem["first_hwm_kb"] - mem["base_kb"]) * 1024 / state_bytes(case),
        "peak_over_base_x_state_all_repeats": (mem["hwm_kb"] - mem["base_kb"]) * 1024 / state_bytes(case),
    }
    if "fast_path_sockets" in mem:
        out["fast_path_sockets"] = mem["fast_path_sockets"]
    return out


def _run_group(a: argparse.Namespace, case: str, group: list[str], sender: subprocess.Popen[str],
               addrs: dict[str, Any], env: dict[str, str], tls_args: list[str],
               results: dict[str, dict[str, Any]]) -> None:
    """All receivers at once, taking turns round by round (round 0: the warm-up)."""
    receivers: dict[str, subprocess.Popen[str]] = {}
    try:
        for c in group:
            receivers[c] = _start_receiver(a, case, c, addrs, env, tls_args)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in group}
        first: dict[str, dict[str, Any]] = {}
        for rnd in range(a.repeats + 1):
            for c, r in receivers.items():
                out = _fetch(case, c, r, sender)
                if rnd:
                    runs[c].append(out)
                else:
                    first[c] = out
        for c, r in receivers.items():
            results.setdefault(case, {})[c] = _summary(case, first[c], runs[c], _end(case, c, r))
    finally:
        for r in receivers.values():
            kill(r)


def _run_fresh_rounds(a: argparse.Namespace, case: str, contenders: list[str], sender: subprocess.Popen[str],
                      addrs: dict[str, Any], env: dict[str, str], tls_args: list[str],
                      results: dict[str, dict[str, Any]]) -> None:
    """One receiver process at a time (memory), one fetch each: every fetch is a real
    healing's (a fresh process, fresh memory; glibc's luck in reusing a previous fetch's
    freed heap plays no part). Round 0 is the warm-up, its fetches the ``first`` column;
    the contenders' order rotates each round, so none is always first after another's
    exit. Peak RSS: the largest of the contender's processes."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    first: dict[str, dict[str, Any]] = {}
    mems: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for rnd in range(a.repeats + 1):
        k = rnd % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            r = _start_receiver(a, case, c, addrs, env, tls_args)
            try:
                out = _fetch(case, c, r, sender)
                mems[c].append(_end(case, c, r))
            finally:
                kill(r)
            if rnd:
                runs[c].append(out)
            else:
                first[c] = out
    for c in contenders:
        worst = max(mems[c], key=lambda m: m["first_hwm_kb"] - m["base_kb"])
        results.setdefault(case, {})[c] = _summary(case, first[c], runs[c], worst)


if __name__ == "__main__":
    main()
