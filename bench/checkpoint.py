"""Durable checkpoints: what one costs the training thread, and how long the write takes.

Goals (issue 38): the stall per checkpoint (ours: the staging copy only) is at most 1/5 of
a synchronous DCP save by one group (the torchft/TorchTitan pattern: one replica group
writes the whole state while training waits) for a 1 GB state; with G groups each writes
1/G of the bytes (measured).

One process per replica group (G = each of ``--groups``), each holding the same state of
``--gb`` GB (GB = 2**30 bytes) as float32 tensors of 4 MiB (``{"model": {"0": t0, ...}}``
registered as a Manager's state; on a GPU when one is present, so the staging copy goes to
pinned memory), driven by a stand-in for the Manager (the hooks and records a
``DurableCheckpoint`` reads; no network: the quorum's result is given). In one run, for
each repetition:

- ``sync``: one process calls ``torch.distributed.checkpoint.save`` of the whole state
  (``no_dist``, FileSystemWriter with its defaults: fsync on). Its stall is the whole save.
- ``ours, G``, twice. The stall: the G processes take a checkpoint one after another (the
  next group's "go" once the previous one's share is written: on hosts of their own they
  would not share this machine's cores and disk), each stall being the time
  ``at_boundary()`` (plan + staging copy + hand-off to the writer thread) blocks its
  caller. The write wall time: all G start together ("go" to each), from the first "go"
  until writer 0 has written the commit marker. Staging memory is reused from the
  previous checkpoint, as in training (a warm-up round first, not counted). Bytes per
  group: what each writer reports.

Stall ratio = median(ours stall, worst group) / median(sync stall), per G; the best
(smallest) stalls are printed too, since on a shared machine a copy is sometimes
descheduled for far longer than it takes. On a GPU the
staging copy is a device-to-pinned-host copy; on this CPU-only machine it is a memcpy.
All processes share this machine's cores and disk: the write wall times say how the
writes divide, not what G separate hosts would see. Prints a table and one JSON line.

    .venv/bin/python bench/checkpoint.py                  # 1 GB, G = 1,2,3, 2 repetitions
    .venv/bin/python bench/checkpoint.py --gb 0.25 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TENSOR_MB = 4


# ----------------------------------------------------------------------------- child


def _state(gb: float, device: str) -> dict[str, Any]:
    import torch

    n = max(1, int(gb * 1024 / TENSOR_MB))
    g = torch.Generator().manual_seed(0)
    return {str(i): torch.rand(TENSOR_MB * 2**20 // 4, generator=g).to(device) for i in range(n)}


class StandIn:
    """What DurableCheckpoint reads of a Manager, for replica rank ``rr`` of ``ws``."""

    def __init__(self, state: dict[str, Any], rr: int, ws: int) -> None:
        from rallypoint.manager._state import UserState

        self.step_hooks: list[Any] = []
        self._user_state = UserState()
        self._user_state.register("default", lambda sd: None, lambda: {"model": state})
        self.rr, self.ws, self.step = rr, ws, 0
        self.replica_id, self.group_rank, self.group_world_size = f"g{rr}", 0, 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.ws * self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def step_record(self) -> Any:
        return types.SimpleNamespace(outcome="committed", replica_rank=self.rr, replica_world_size=self.ws,
                                     quorum_id=1, participants=tuple(f"g{i}" for i in range(self.ws)))


def child(args: argparse.Namespace) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = _state(args.gb, device)
    if device == "cuda":
        torch.cuda.synchronize()
    out = sys.stdout
    out.write(json.dumps({"ready": True, "device": device}) + "\n")
    out.flush()
    ours: dict[int, Any] = {}  # G -> (stand-in, checkpointer): its staging memory stays, as in training
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("exit"):
            return 0
        folder = msg["dir"]
        if msg["mode"] == "sync":
            import torch.distributed.checkpoint as dcp

            t_go = time.time()
            dcp.save({"user": {"default": {"model": state}}}, checkpoint_id=folder, no_dist=True)
            t = time.time()
            res = {"t_go": t_go, "t_staged": t, "t_done": t, "bytes": sum(v.numel() * 4 for v in state.values())}
        else:
            from rallypoint.checkpoint import DurableCheckpoint

            if msg["groups"] not in ours:
                m = StandIn(state, args.rank, msg["groups"])
                ck = DurableCheckpoint(m, folder, every=1, keep=1, restore=False)
                ck._started = True  # the first round is behind us: at_boundary saves
                ours[msg["groups"]] = (m, ck)
            m, ck = ours[msg["groups"]]
            m.step = msg["step"]
            t_go = time.time()
            ck.at_boundary()
            t_staged = time.time()
            if msg.get("isolated"):
                ck._writer._idle.wait(1800)  # this group's share written: the next group may start
            out.write(json.dumps({"staged": t_staged}) + "\n")
            out.flush()
            ok = ck.wait(1800)
            t_done = time.time()
            st = ck.stats()
            res = {"t_go": t_go, "t_staged": t_staged, "t_done": t_done, "bytes": st["last_bytes"], "ok": ok,
                   "copy_s": st["last_stall_s"],
                   "failures": st["failures"], "commits": st["commits"]}
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


# ----------------------------------------------------------------------------- parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--groups", default="1,2,3")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (a temporary folder, removed after)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from _util import Child, median, table

    groups = [int(g) for g in args.groups.split(",")]
    root = Path(args.dir or tempfile.mkdtemp(prefix="rp-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    kids = [Child([sys.executable, str(Path(__file__)), "--child", "--gb", str(args.gb), "--rank", str(i)],
                  f"ckpt{i}", env=env) for i in range(max(groups))]
    sync: list[float] = []
    ours: dict[int, list[dict[str, Any]]] = {g: [] for g in groups}
    try:
        device = [k.recv(900)["device"] for k in kids][0]
        for rep in range(-1, args.reps):  # -1: a warm-up (allocations, first writes), not counted
            for mode in ["sync", *groups]:  # interleaved: every repetition runs each once
                folder = root / (f"sync-{rep}" if mode == "sync" else f"g{mode}")
                g = 1 if mode == "sync" else int(mode)
                runs = [None] if mode == "sync" else [True, False]
                got: list[list[dict[str, Any]]] = []
                for isolated in runs:  # the stall, each group alone; then the write wall time, all at once
                    step = 2 * rep + (4 if isolated else 5)
                    for k in kids[:g]:
                        k.send({"mode": "sync" if mode == "sync" else "ours", "groups": g, "dir": str(folder),
                                "step": step, "isolated": isolated})
                        if isolated:
                            k.recv(600)  # staged and its share written
                    if isolated is False:
                        for k in kids[:g]:
                            k.recv(600)
                    got.append([k.recv(1800) for k in kids[:g]])
                    if mode != "sync":
                        assert all(r["ok"] and not r["failures"] for r in got[-1]), got[-1]
                        assert (folder / f"step_{step:08d}" / ".rallypoint-complete").exists(), folder
                if rep < 0:
                    pass
                elif mode == "sync":
                    sync.append(got[0][0]["t_done"] - got[0][0]["t_go"])
                else:
                    ours[g].append({
                        "stall_s": max(r["t_staged"] - r["t_go"] for r in got[0]),
                        "stalls": [round(r["t_staged"] - r["t_go"], 4) for r in got[0]],
                        "copies": [round(r["copy_s"], 4) for r in got[0]],
                        "write_s": max(r["t_done"] for r in got[1]) - min(r["t_go"] for r in got[1]),
                        "bytes": [r["bytes"] for r in got[1]],
                    })
                if mode == "sync":
                    shutil.rmtree(folder, ignore_errors=True)
        for k in kids:
            k.send({"exit": True})
    finally:
        for k in kids:
            k.kill()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    total = int(args.gb * 2**30)
    sync_s = median(sync)
    rows, out = [], {"bench": "checkpoint", "gb": args.gb, "device": device, "reps": args.reps,
                     "sync_stall_s": round(sync_s, 4), "sync_best_s": round(min(sync), 4), "groups": {}}
    rows.append(["sync DCP save, 1 group", f"{sync_s * 1000:.0f}", f"{min(sync) * 1000:.0f}", "1.000", f"{sync_s:.2f}",
                 f"{total / 2**20:.0f}"])
    for g in groups:
        stall = median([r["stall_s"] for r in ours[g]])
        write = median([r["write_s"] for r in ours[g]])
        per = ours[g][-1]["bytes"]
        best = min(r["stall_s"] for r in ours[g])
        rows.append([f"ours, G={g}", f"{stall * 1000:.0f}", f"{best * 1000:.0f}", f"{stall / sync_s:.3f}", f"{write:.2f}",
                     "/".join(f"{b / 2**20:.0f}" for b in per)])
        out["groups"][str(g)] = {"stall_s": round(stall, 4), "stall_ratio": round(stall / sync_s, 4),
                                 "best_stall_s": round(best, 4),
                                 "write_s": round(write, 3), "bytes_per_group": per,
                                 "stalls_per_group": [r["stalls"] for r in ours[g]],
                                 "staging_only": [r["copies"] for r in ours[g]],
                                 "max_share": round(max(per) / max(1, sum(per)), 4)}
    print(f"durable checkpoint of {args.gb:g} GB on {device}, median of {args.reps} (sync and ours interleaved)")
    print(table(["writer", "stall ms (median)", "best", "stall / sync", "write wall s", "MiB per group"], rows))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
