"""GPU benchmark (``make gpu-check`` runs it): NCCL, Baby NCCL and a device heal,
rallypoint vs torchft 0.2.0 vs the machine's ceiling, measured in one run.

Sections (:func:`plan` says which run with how many GPUs):

- **allreduce**: plain ``torch.distributed`` NCCL (the ceiling), rallypoint's
  ``ProcessGroupNCCL`` and ``ProcessGroupBabyNCCL``, torchft's two; one rank process
  per GPU, each op timed as allreduce + wait + ``cuda.synchronize`` at 4 KB, 1 MB and
  64 MB, implementations interleaved round by round, medians. NCCL refuses two ranks on
  one device (``ncclInvalidUsage: Duplicate GPU detected``; pytorch/pytorch#68666), so
  with one GPU the world size is 1: the
  numbers are then each implementation's per-op overhead over a one-rank NCCL
  communicator, not network bandwidth; with 2 GPUs it is a real 2-rank allreduce.
- **heal**: 1 GB of CUDA tensors (4 MiB float32 each) sent by one process and received
  by another into CUDA tensors of the same shapes (a healing replica's situation):
  rallypoint's ``HTTPTransport`` vs torchft's (``num_chunks=0``, its Manager's default;
  it returns host tensors, copied into the CUDA state, as its Manager's load does),
  and each one's ``PGTransport`` over a 2-rank group: Gloo with one GPU (tensors staged
  through the host), NCCL between two GPUs with two. Time: from asking the sender to
  serve until the receiver's CUDA tensors hold the data (checked by checksum). Ceiling:
  ``cudaMemcpy`` of the same bytes device to pinned host plus host to device (the least
  a heal through host memory can take); with 2 GPUs also a peer copy GPU to GPU.

torchft's columns say "not installed" where ``torchft`` does not import.
``--device cpu`` runs the same code with Gloo and host tensors (tests use it; the
numbers then mean nothing). Prints a table and one JSON line ``{"bench": "gpu", ...}``.

    python bench/gpu.py [--quick] [--heal-mb 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import emit_line, fmt_ratio, ratio, table  # noqa: E402

T = datetime.timedelta
SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
NOT_INSTALLED = "not installed"


def plan(gpus: int, torchft: bool, device: str = "cuda", heal_mb: int = 1024) -> dict[str, Any]:
    """What runs with ``gpus`` GPUs (pure): world size, backends, contenders, and why.

    With no GPU (and ``device="cuda"``) nothing runs. ``device="cpu"`` plans as for
    ``gpus`` GPUs with Gloo in place of NCCL (the harness's own tests)."""
    if device == "cuda" and gpus < 1:
        return {"runs": False, "why": "no CUDA GPU: nothing to measure", "gpus": gpus}
    world = 2 if gpus >= 2 else 1
    backend = "nccl" if device == "cuda" else "gloo"
    pg_backend = backend if world == 2 else "gloo"
    theirs = ["torchft", "torchft-baby"] if torchft else []
    heal = ["ours-http", *(["torchft-http"] if torchft else []), "ours-pg", *(["torchft-pg"] if torchft else [])]
    return {
        "runs": True,
        "gpus": gpus,
        "device": device,
        "backend": backend,
        "world": world,
        "why_world": ("one rank per GPU, 2 GPUs: a real 2-rank allreduce" if world == 2 else
                      "one GPU: NCCL allows one rank per device, so world size 1 (per-op overhead, no network)"),
        "impls": ["plain", "ours", "ours-baby", *theirs],
        "torchft": torchft,
        "heal_bytes": heal_mb << 20,
        "heal": heal,
        "pg_backend": pg_backend,
        "why_pg": ("PG heal over NCCL, GPU to GPU" if pg_backend == "nccl" else
                   "PG heal over Gloo: CUDA tensors staged through host memory (NCCL needs a GPU per rank)"),
        "sender_index": 0,
        "receiver_index": 1 if world == 2 else 0,
    }


# ----------------------------------------------------------------------- running


def _kill(procs: list[Any]) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def run_allreduce(p: dict[str, Any], quick: bool, timeout_s: float) -> dict[str, Any]:
    """The allreduce section: one rank process per GPU (spawned), results of rank 0."""
    import torch.distributed as dist

    from _gpu_workers import allreduce_rank

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=timeout_s))
    cfg = {
        "device": p["device"], "world": p["world"], "backend": p["backend"], "impls": p["impls"],
        "run_id": uuid.uuid4().hex[:8], "timeout_s": min(timeout_s, 120.0), "sizes": SIZES,
        "iters": {"4KB": 20 if quick else 100, "1MB": 10 if quick else 50, "64MB": 2 if quick else 10},
        "rounds": 2 if quick else 5,
    }
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=allreduce_rank, args=(r, store.port, cfg, child), name=f"gpu-bench-rank{r}")
             for r in range(p["world"])]
    for pr in procs:
        pr.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            return {"error": f"the allreduce ranks gave no result within {timeout_s:.0f}s"}
        return dict(parent.recv())
    except EOFError:
        return {"error": f"the allreduce ranks exited without a result (exit codes {[pr.exitcode for pr in procs]})"}
    finally:
        _kill(procs)


class _Side:
    """One side of the heal: a spawned process and its command pipe."""

    def __init__(self, ctx: Any, target: Any, cfg: dict[str, Any], name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, cfg), name=name)
        self.proc.start()
        child.close()
        self.name = name

    def send(self, cmd: dict[str, Any]) -> None:
        self.conn.send(cmd)

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            if not self.conn.poll(timeout_s):
                raise TimeoutError(f"{self.name} answered nothing within {timeout_s:.0f}s")
            return dict(self.conn.recv())
        except EOFError:
            raise RuntimeError(f"{self.name} exited (exit code {self.proc.exitcode})") from None

    def ask(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(cmd)
        return self.recv(timeout_s)


def run_heal(p: dict[str, Any], quick: bool, timeout_s: float) -> dict[str, Any]:
    """The heal section: a sender and a receiver process, the contenders round by round
    (one warm-up round, then ``rounds``), and the memcpy ceiling."""
    import torch.distributed as dist

    from _gpu_workers import heal_receiver, heal_sender

    deadline = time.monotonic() + timeout_s
    op_s = min(120.0, timeout_s)
    rounds = 2 if quick else 3
    cfg = {k: p[k] for k in ("device", "heal_bytes", "pg_backend", "sender_index", "receiver_index")}
    cfg.update(contenders=p["heal"], timeout_s=op_s, peer_index=p["sender_index"])
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    sender = _Side(ctx, heal_sender, cfg, "heal-sender")
    receiver = _Side(ctx, heal_receiver, cfg, "heal-receiver")
    try:
        ready = sender.recv(op_s + 60)
        receiver.recv(op_s + 60)
        want = ready["sum"]
        errors: dict[str, str] = dict(ready.get("errors", {}))
        out["memcpy"] = receiver.ask({"op": "memcpy", "rounds": rounds}, op_s)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=op_s))
        for c in p["heal"]:
            if c.endswith("-pg") and c not in errors:
                cmd = {"op": "pg_setup", "contender": c, "addr": f"127.0.0.1:{store.port}/{c}"}
                sender.send(cmd)
                receiver.send(cmd)
                got = [sender.recv(op_s), receiver.recv(op_s)]
                bad = [g["error"] for g in got if "error" in g]
                if bad:
                    errors[c] = f"configure: {bad[0]}"
        samples: dict[str, list[float]] = {c: [] for c in p["heal"]}
        step = 0
        for rnd in range(rounds + 1):
            for c in p["heal"]:
                if c in errors:
                    continue
                if time.monotonic() > deadline:
                    errors[c] = f"not measured: the section's {timeout_s:.0f}s ran out"
                    continue
                step += 1
                t0 = time.perf_counter()
                if c.endswith("-http"):
                    s = sender.ask({"op": "serve", "contender": c, "step": step}, op_s)
                    r = s if "error" in s else receiver.ask(
                        {"op": "fetch", "contender": c, "step": step, "addr": ready["addrs"][c]}, op_s)
                else:
                    sender.send({"op": "pg_send", "contender": c, "step": step})
                    receiver.send({"op": "pg_recv", "contender": c, "step": step})
                    r = receiver.recv(op_s)
                    s = sender.recv(op_s)
                    r = r if "error" in r else s if "error" in s else r
                dt = time.perf_counter() - t0
                if "error" in r:
                    errors[c] = r["error"]
                elif abs(r["sum"] - want) > 1e-6 * max(1.0, abs(want)):
                    errors[c] = f"wrong data: checksum {r['sum']!r}, sent {want!r}"
                elif rnd == 0:
                    out.setdefault(c, {})["first_s"] = dt
                else:
                    samples[c].append(dt)
        for c, vals in samples.items():
            if c in errors:
                out[c] = {"error": errors[c]}
            elif vals:
                med = statistics.median(vals)
                out.setdefault(c, {}).update(median_s=med, GBps=p["heal_bytes"] / med / 1e9, rounds=len(vals))
        for side in (sender, receiver):
            try:
                side.ask({"op": "stop"}, 30)
            except Exception:  # noqa: BLE001
                pass
    except Exception as e:  # noqa: BLE001 - a side died or hung: the section says so
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        _kill([sender.proc, receiver.proc])
    return out


# ----------------------------------------------------------------------- report


def rows(p: dict[str, Any], res: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows (pure): per metric, rallypoint's, torchft's and the ceiling's
    value (lower is better: ms or s), the ratios, and an error where one happened."""
    out: list[dict[str, Any]] = []
    theirs_missing = NOT_INSTALLED if not p.get("torchft") else None

    def row(metric: str, unit: str, ours: Any, theirs: Any, ceiling: Any, ceiling_name: str) -> None:
        def val(x: Any) -> tuple[float | None, str | None]:
            if isinstance(x, dict):
                return x.get("value"), x.get("error")
            return x, None

        o, oe = val(ours)
        t, te = val(theirs) if theirs != NOT_INSTALLED else (None, NOT_INSTALLED)
        c, ce = val(ceiling)
        out.append({
            "metric": metric, "unit": unit, "ours": o, "torchft": t, "ceiling": c, "ceiling_name": ceiling_name,
            "ours_vs_torchft": ratio(o, t), "ours_vs_ceiling": ratio(o, c),
            "error": "; ".join(f"{who}: {e}" for who, e in (("rallypoint", oe), ("torchft", te), (ceiling_name, ce))
                               if e and e != NOT_INSTALLED) or None,
            **({"torchft_note": NOT_INSTALLED} if te == NOT_INSTALLED else {}),
        })

    ar = res.get("allreduce", {})
    backend = p["backend"].upper()

    def lat(impl: str, label: str) -> Any:
        if "error" in ar:
            return {"error": ar["error"]}
        r = ar.get(impl)
        if r is None:
            return {"error": "no result"}
        if "error" in r:
            return {"error": r["error"]}
        if r.get("correct") is False:
            return {"error": "wrong allreduce result"}
        return {"value": r.get(label, {}).get("latency_ms")}

    for kind, ours_impl, theirs_impl in (("", "ours", "torchft"), ("Baby ", "ours-baby", "torchft-baby")):
        for label in SIZES if "allreduce" in res else ():
            row(f"allreduce {kind}{backend} {label} ws{p['world']} ms", "ms", lat(ours_impl, label),
                theirs_missing or lat(theirs_impl, label), lat("plain", label), f"plain {backend}")
    if "heal" not in res:
        return out
    heal = res["heal"]
    size = f"{p['heal_bytes'] / (1 << 30):g} GB" if p["heal_bytes"] >= 1 << 30 else f"{p['heal_bytes'] >> 20} MB"
    where = "CUDA to CUDA" if p["device"] == "cuda" else "host to host"
    mem = heal.get("memcpy", {"error": heal.get("error", "no result")})
    ceiling = {"error": mem["error"]} if "error" in mem else {"value": mem.get("heal_s")}

    def heal_s(c: str) -> Any:
        if "error" in heal:
            return {"error": heal["error"]}
        r = heal.get(c, {"error": "no result"})
        return {"error": r["error"]} if "error" in r else {"value": r.get("median_s")}

    row(f"heal {size} HTTP, {where} s", "s", heal_s("ours-http"), theirs_missing or heal_s("torchft-http"),
        ceiling, "memcpy D2H+H2D")
    pg_ceiling = ceiling
    if p["pg_backend"] == "nccl":
        pg_ceiling = {"error": mem["error"]} if "error" in mem else {"value": mem.get("peer_s")}
    row(f"heal {size} PG over {p['pg_backend']} s", "s", heal_s("ours-pg"), theirs_missing or heal_s("torchft-pg"),
        pg_ceiling, "memcpy D2H+H2D" if p["pg_backend"] != "nccl" else "peer copy")
    return out


def _f(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if v < 1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def render(rs: list[dict[str, Any]]) -> str:
    """The rows as a table (lower is better everywhere; ratios < 1: rallypoint faster)."""
    body = []
    for r in rs:
        theirs = r.get("torchft_note") or _f(r["torchft"])
        body.append([r["metric"], _f(r["ours"]), theirs, _f(r["ceiling"]), fmt_ratio(r["ours_vs_torchft"]),
                     fmt_ratio(r["ours_vs_ceiling"]), r["error"] or ""])
    return table(["metric", "rallypoint", "torchft 0.2.0", "ceiling", "ours/torchft", "ours/ceiling", "error"], body)


def torchft_importable() -> bool:
    """Whether torchft imports here (in a child: its import is slow and pulls torch)."""
    import subprocess

    try:
        return subprocess.run([sys.executable, "-c", "import torchft.process_group"], capture_output=True,
                              timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and rounds")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same code on Gloo and host tensors (tests of the harness)")
    ap.add_argument("--gpus", type=int, help="plan for this many GPUs (default: as many as CUDA sees, at most 2)")
    ap.add_argument("--heal-mb", type=int, default=1024, help="size of the healed state (MiB)")
    ap.add_argument("--no-torchft", action="store_true", help="leave torchft's columns out")
    ap.add_argument("--sections", default="allreduce,heal", help="comma-separated subset of allreduce,heal")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per section")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args(argv)
    gpus = args.gpus
    if gpus is None:
        if args.device == "cpu":
            gpus = 1
        else:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tf = not args.no_torchft and torchft_importable()
    p = plan(gpus, tf, args.device, args.heal_mb)
    res: dict[str, Any] = {}
    if p["runs"]:
        sections = args.sections.split(",")
        if "allreduce" in sections:
            res["allreduce"] = run_allreduce(p, args.quick, args.timeout)
        if "heal" in sections:
            res["heal"] = run_heal(p, args.quick, args.timeout)
        rs = rows(p, res)
        print(render(rs))
    else:
        rs = []
        print(f"bench/gpu.py: {p['why']}", file=sys.stderr)
    line = json.dumps({"bench": "gpu", "quick": args.quick, "plan": p, "results": res, "rows": rs})
    emit_line(line, args.out)
    if not p["runs"]:
        return 2
    return 1 if any(r["error"] for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
