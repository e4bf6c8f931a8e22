"""Bytes and wall time of DDP-style vs (Streaming, quantized) DiLoCo synchronisation:
rallypoint vs torchft 0.2.0, measured in one run.

Two replica groups (two worker processes per framework, one rank each, gloo on CPU over
loopback, real lighthouses on free ports: ``rallypoint.lighthouse.server.LighthouseServer``
for ours, torchft's Rust ``LighthouseServer`` for torchft, a fresh one per mode) train
the same 4-layer MLP (4 x Linear(512, 512), 1,050,624 parameters, 4.2 MB fp32) on
synthetic data, in four modes:

- ``ddp``: every inner step ``start_quorum()`` (async), forward/backward,
  ``manager.allreduce(grad)`` for every parameter, ``should_commit()``, ``opt.step()``;
- ``diloco``: ``DiLoCo(manager, [model], inner, outer, sync_every=20)`` (sync quorum);
- ``streaming``: the same with 4 fragments (one Linear each) and ``fragment_sync_delay=1``;
- ``diloco_q``: ``diloco`` with ``should_quantize=True``. torchft's quantized path
  needs Triton and a GPU (on CPU its Manager silently sends full precision), so its
  column is "n/a".

Each mode: ``--warmup`` inner steps (first quorum, init-sync heal, first sync), then
``--steps`` timed inner steps; both are multiples of 20, so the timed window holds whole
sync rounds. Reported per 100 inner steps: wall time (mean of the two ranks) and bytes
sent per rank, counted AT THE PROCESS-GROUP LEVEL: the cross-replica group is a subclass
of the framework's ``ProcessGroupGloo`` that adds up the bytes of the tensors each rank
hands to ``allreduce`` / ``allgather`` / ``broadcast`` / ``alltoall`` (with 2 ranks that
is what each rank puts on the wire for gloo's ring allreduce and allgather, TCP/IP
headers aside; lighthouse/manager RPCs and heal transfers are not counted). Loopback
``/proc/net/dev`` counters are not used: the whole machine shares them.

Prints a table and ONE JSON line ``{"bench": "diloco", ..., "ratios": {...}}`` with
ours/torchft per mode (wall, bytes) and DiLoCo/DDP byte ratios.

    .venv/bin/python bench/diloco.py            # full run: 100 timed steps, 2 rounds
    .venv/bin/python bench/diloco.py --quick    # 40 timed steps, 1 round, well under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ratio, median, ratio, table  # noqa: E402

FRAMEWORKS = ("ours", "torchft")
MODES = ("ddp", "diloco", "streaming", "diloco_q")
SYNC_EVERY = 20
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- worker side
def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _counting(base: type) -> type:
    """``base`` (a ProcessGroupGloo class) counting the bytes of the tensors each rank sends."""

    def nbytes(ts: Any) -> int:
        import torch

        if isinstance(ts, torch.Tensor):
            return ts.numel() * ts.element_size()
        return sum(nbytes(t) for t in ts)

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.sent: dict[str, int] = {}

        def _count(self, op: str, ts: Any) -> None:
            self.sent[op] = self.sent.get(op, 0) + nbytes(ts)

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            self._count("allreduce", tensors)
            return super().allreduce(tensors, opts)

        def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
            self._count("allreduce", tensors)
            return super().allreduce_coalesced(tensors, opts)

        def allgather(self, outs: Any, ins: Any, opts: Any = None) -> Any:
            self._count("allgather", ins)
            return super().allgather(outs, ins, opts)

        def allgather_into_tensor_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> Any:
            self._count("allgather", ins)
            return super().allgather_into_tensor_coalesced(outs, ins, opts)

        def broadcast(self, tensors: Any, opts: Any = None) -> Any:
            self._count("broadcast", tensors)
            return super().broadcast(tensors, opts)

        def alltoall_base(self, out: Any, inp: Any, osz: Any, isz: Any, opts: Any = None) -> Any:
            self._count("alltoall", inp)
            return super().alltoall_base(out, inp, osz, isz, opts)

    return Counting


def _run_mode(fw: str, rank: int, plan: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    import torch
    from torch import nn

    mode = plan["mode"]
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 512, generator=gen), torch.randn(32, 512, generator=gen)) for _ in range(4)]
    timeout = timedelta(seconds=plan["op_timeout_s"])

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    common = dict(load_state_dict=load, state_dict=save, min_replica_size=2, use_async_quorum=mode == "ddp",
                  rank=0, world_size=1, lighthouse_addr=plan["lighthouse"],
                  replica_id=f"{mode}-{plan['run_id']}-{rank}", hostname="127.0.0.1", timeout=timeout,
                  quorum_timeout=timeout, connect_timeout=timeout)
    keep: list[Any] = []
    if fw == "ours":
        from rallypoint.integrations.local_sgd import DiLoCo
        from rallypoint.manager.manager import Manager
        from rallypoint.process_groups import ProcessGroupGloo

        pg = _counting(ProcessGroupGloo)(timeout=timeout)
        manager = Manager(pg=pg, store_addr="127.0.0.1", **common)
    else:
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo  # type: ignore[no-redef]
        from torchft.manager import Manager as TFManager
        from torchft.process_group import ProcessGroupGloo as TFGloo

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        keep.append(store)  # torchft's Manager needs its group's store to exist
        pg = _counting(TFGloo)(timeout=timeout)
        manager = TFManager(pg=pg, store_addr="127.0.0.1", store_port=store.port, **common)

    def batch(i: int) -> Any:
        x, y = batches[i % len(batches)]
        return nn.functional.mse_loss(model(x), y)

    def ddp_step(i: int) -> None:
        manager.start_quorum()
        inner.zero_grad()
        batch(i).backward()
        for w in [manager.allreduce(p.grad) for p in model.parameters()]:
            w.wait()
        if manager.should_commit():
            inner.step()

    def local_step(i: int) -> None:
        inner.zero_grad()
        batch(i).backward()
        inner.step()  # DiLoCo's hook syncs when a fragment's turn comes

    diloco: Any = None
    if mode != "ddp":
        linears = [m for m in model if isinstance(m, nn.Linear)]
        frags = [model] if mode in ("diloco", "diloco_q") else linears
        outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in frags]
        diloco = DiLoCo(manager, frags, inner, outers if len(outers) > 1 else outers[0], sync_every=SYNC_EVERY,
                        should_quantize=mode == "diloco_q", fragment_sync_delay=1 if mode == "streaming" else 0)
        diloco.__enter__()
    step = ddp_step if diloco is None else local_step
    t_setup = time.perf_counter()
    for i in range(plan["warmup"]):
        step(i)
    warm_s = time.perf_counter() - t_setup
    pg.sent.clear()
    s0 = manager.current_step()
    t0 = time.perf_counter()
    c0 = time.process_time()
    durations = []
    for i in range(plan["steps"]):
        t = time.perf_counter()
        step(plan["warmup"] + i)
        durations.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    commits = manager.current_step() - s0
    if diloco is not None:
        diloco.__exit__(None, None, None)
    res = {"rank": rank, "wall_s": wall, "cpu_s": cpu, "warmup_s": warm_s, "sent": dict(pg.sent),
           "bytes": sum(pg.sent.values()), "commits": commits, "steps": plan["steps"],
           "durations": durations,
           "errored": repr(manager.errored()) if manager.errored() is not None else None}
    return res, (manager, pg, keep)


def _teardown(handles: Any) -> None:
    manager, pg, keep = handles
    for fn in (lambda: manager.shutdown(wait=False), pg.shutdown):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best effort between modes
            print(f"teardown: {e}", file=sys.stderr)
    keep.clear()


def _worker(fw: str, rank: int) -> None:
    import logging

    _util.exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(1)
    import importlib

    # pay the import cost before "ready", outside every measurement
    for mod in (("rallypoint.integrations.local_sgd", "rallypoint.manager.manager") if fw == "ours"
                else ("torchft.local_sgd", "torchft.manager")):
        importlib.import_module(mod)
    _out({"ready": rank})
    handles: Any = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if handles is not None:  # the peer has finished too (the parent saw both results)
            _teardown(handles)
            handles = None
        if cmd.get("cmd") == "teardown":
            _out({"torn": rank})
            continue
        if cmd.get("cmd") != "run":
            break
        try:
            res, handles = _run_mode(fw, rank, cmd)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            import traceback

            res = {"rank": rank, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        _out({"result": res})
    _out({"bye": rank})
    os._exit(0)


# ---------------------------------------------------------------------- parent side
def _lighthouse(fw: str) -> Any:
    kw = dict(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=5_000)
    if fw == "ours":
        from rallypoint.lighthouse.server import LighthouseServer

        return LighthouseServer(**kw)
    return _util.load_torchft_native().LighthouseServer(**kw)


def _addr(server: Any) -> str:
    return f"http://127.0.0.1:{int(server.address().rsplit(':', 1)[1])}"


def _result(c: Child, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise _util.ChildError(f"{c.name} (pid {c.pid}) gave no result within {timeout:.0f}s; log: {c.log_tail()}")
        obj = c.recv(left)
        if isinstance(obj, dict) and ("result" in obj or "ready" in obj or "torn" in obj):
            return obj


def run_mode(fw: str, mode: str, workers: list[Child], plan: dict[str, Any], servers: list[Any],
             timeout: float) -> list[dict[str, Any]]:
    lh = _lighthouse(fw)
    servers.append(lh)  # closed at the end: the managers heartbeat to it until torn down
    for c in workers:
        c.send(dict(plan, cmd="run", mode=mode, lighthouse=_addr(lh), run_id=uuid.uuid4().hex[:6]))
    results = [_result(c, timeout)["result"] for c in workers]
    # Both ranks are done: stop this mode's managers now, so that their background
    # threads do not run during the other framework's measurement.
    for c in workers:
        c.send({"cmd": "teardown"})
    for c in workers:
        _result(c, 60)
    for r in results:
        if "error" in r:
            raise RuntimeError(f"{fw} {mode} rank {r['rank']}: {r['error']}\n{r.get('trace', '')}")
    return results


def summarize(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per 100 inner steps: wall (mean over ranks and rounds), bytes per rank (mean)."""
    flat = [r for run in runs for r in run]
    per = 100.0 / flat[0]["steps"]
    ops: dict[str, float] = {}
    for r in flat:
        for k, v in r["sent"].items():
            ops[k] = ops.get(k, 0.0) + v * per / len(flat)
    # The time steps spend above the median step: for DiLoCo, what the sync rounds add
    # to plain local steps (for DDP every step syncs, so this is only the jitter).
    med = [median(r["durations"]) for r in flat]
    extra = [sum(max(0.0, d - m) for d in r["durations"]) for r, m in zip(flat, med)]
    return {
        "wall_s_per_100": sum(r["wall_s"] for r in flat) / len(flat) * per,
        "median_step_ms": sum(med) / len(med) * 1e3,
        "above_median_s_per_100": sum(extra) / len(extra) * per,
        "cpu_s_per_100": sum(r["cpu_s"] for r in flat) / len(flat) * per,
        "bytes_per_100": sum(r["bytes"] for r in flat) / len(flat) * per,
        "bytes_by_op_per_100": ops,
        "commits_per_100": sum(r["commits"] for r in flat) / len(flat) * per,
        "errored": [r["errored"] for r in flat if r["errored"]],
        "warmup_s": max(r["warmup_s"] for r in flat),
    }


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 timed steps, 1 round")
    ap.add_argument("--steps", type=int, help="timed inner steps per mode, a multiple of 20 (100; quick 40)")
    ap.add_argument("--warmup", type=int, default=SYNC_EVERY, help="untimed inner steps first (20)")
    ap.add_argument("--rounds", type=int, help="rounds, framework order alternating (2; quick 1)")
    ap.add_argument("--modes", default=",".join(MODES), help="subset of " + ",".join(MODES))
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="subset of ours,torchft")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a mode may take")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    steps = args.steps or (40 if args.quick else 100)
    if steps % SYNC_EVERY or args.warmup % SYNC_EVERY or args.warmup < SYNC_EVERY:
        raise SystemExit(f"--steps and --warmup must be positive multiples of {SYNC_EVERY}")
    rounds = args.rounds or (1 if args.quick else 2)
    modes = [m for m in args.modes.split(",") if m]
    fws = [f for f in args.frameworks.split(",") if f]
    os.environ.setdefault("RUST_LOG", "warn")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE",
              "REPLICA_GROUP_ID"):
        env.pop(k, None)
    plan = {"steps": steps, "warmup": args.warmup, "op_timeout_s": 30}
    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    workers: dict[str, list[Child]] = {}
    servers: list[Any] = []
    raw: dict[str, dict[str, list[list[dict[str, Any]]]]] = {f: {m: [] for m in modes} for f in fws}
    try:
        for fw in fws:  # all start at once: their imports overlap
            workers[fw] = [Child([sys.executable, __file__, "--worker", fw, str(r)], name=f"diloco-{fw}-{r}",
                                 env=env, cwd=str(REPO)) for r in range(2)]
        for fw in fws:
            for c in workers[fw]:
                _result(c, args.timeout)  # ready
        # Interleaved (mode by mode, the framework order alternating), so that the two
        # frameworks' figures for a mode are measured close in time, under the same load.
        for rnd in range(rounds):
            for i, mode in enumerate(modes):
                for fw in (fws if (rnd + i) % 2 == 0 else fws[::-1]):
                    if fw == "torchft" and mode == "diloco_q":
                        continue  # needs Triton + GPU; on CPU torchft silently sends fp32
                    raw[fw][mode].append(run_mode(fw, mode, workers[fw], plan, servers, args.timeout))
        for fw in fws:
            for c in workers[fw]:
                c.send({"cmd": "exit"})
    finally:
        close_all([c for cs in workers.values() for c in cs], grace=10.0)
        for s in servers:
            try:
                s.shutdown()
            except Exception as e:  # noqa: BLE001
                print(f"warning: lighthouse shutdown: {e}", file=sys.stderr)
    wall = time.monotonic() - t_start
    res = {f: {m: summarize(runs) for m, runs in per.items() if runs} for f, per in raw.items()}

    def get(f: str, m: str, k: str) -> float | None:
        return res.get(f, {}).get(m, {}).get(k)

    ratios: dict[str, Any] = {"ours_vs_torchft": {}, "diloco_vs_ddp_bytes": {}, "streaming_vs_ddp_bytes": {},
                              "quantized_vs_diloco_bytes": {}}
    for m in modes:
        ratios["ours_vs_torchft"][m] = {
            "wall": ratio(get("ours", m, "wall_s_per_100"), get("torchft", m, "wall_s_per_100")),
            "bytes": ratio(get("ours", m, "bytes_per_100"), get("torchft", m, "bytes_per_100")),
        }
    for f in fws:
        ratios["diloco_vs_ddp_bytes"][f] = ratio(get(f, "diloco", "bytes_per_100"), get(f, "ddp", "bytes_per_100"))
        ratios["streaming_vs_ddp_bytes"][f] = ratio(get(f, "streaming", "bytes_per_100"),
                                                    get(f, "ddp", "bytes_per_100"))
        ratios["quantized_vs_diloco_bytes"][f] = ratio(get(f, "diloco_q", "bytes_per_100"),
                                                       get(f, "diloco", "bytes_per_100"))

    print(f"DiLoCo bench: 2 replica groups x 1 rank, gloo/CPU loopback, MLP 1,050,624 params, sync_every "
          f"{SYNC_EVERY}, {steps} timed + {args.warmup} warm-up inner steps per mode, {rounds} round(s), torchft "
          f"{_util.torchft_version()}; load {load0:.2f} -> {os.getloadavg()[0]:.2f}; {wall:.0f}s")
    print("bytes: tensor bytes each rank hands to the cross-replica process group's collectives (counted in a "
          "ProcessGroupGloo subclass), per rank; wall: mean of the 2 ranks; both per 100 inner steps")
    rows = []
    for m in modes:
        row = [m]
        for f in ("ours", "torchft"):
            if f == "torchft" and m == "diloco_q" and f in fws:
                row += ["n/a"] * 5
            elif m in res.get(f, {}):
                d = res[f][m]
                row += [f"{d['wall_s_per_100']:.2f}", f"{d['median_step_ms']:.1f}",
                        f"{d['above_median_s_per_100']:.2f}", _mb(d["bytes_per_100"]), f"{d['commits_per_100']:.0f}"]
            else:
                row += ["-"] * 5
        r = ratios["ours_vs_torchft"][m]
        row += [fmt_ratio(r["wall"]), fmt_ratio(r["bytes"])]
        rows.append(row)
    print("step ms: median inner step; >med s: time steps spent above the median (for DiLoCo: what the syncs add)")
    print(table(["mode", "ours s/100", "step ms", ">med s", "MB/100", "commits", "torchft s/100", "step ms",
                 ">med s", "MB/100", "commits", "wall o/t", "bytes o/t"], rows))
    for f in fws:
        print(f"{f}: DiLoCo/DDP bytes {fmt_ratio(ratios['diloco_vs_ddp_bytes'][f])}, Streaming/DDP bytes "
              f"{fmt_ratio(ratios['streaming_vs_ddp_bytes'][f])}, quantized/DiLoCo bytes "
              f"{fmt_ratio(ratios['quantized_vs_diloco_bytes'][f]) if f == 'ours' else 'n/a'}")
    errs = {f"{f} {m}": d["errored"] for f, per in res.items() for m, d in per.items() if d["errored"]}
    if errs:
        print(f"WARNING: steps with errors: {errs}")
    line = json.dumps({"bench": "diloco", "quick": args.quick, "rounds": rounds, "bytes_counted": "process_group",
                       "results": res, "ratios": ratios, "torchft_diloco_q": "n/a (needs Triton/GPU)"})
    _util.emit_line(line, args.out)


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


if __name__ == "__main__":
    main()
