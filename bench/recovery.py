"""Recovery after a replica group dies: rallypoint vs torchft 0.2.0, measured in one run.

G replica groups (G = 2 and 3; worker processes, one rank each, gloo on CPU over
loopback, free ports only) run the same loop under each implementation:

- ``ours``: ``rallypoint.manager.Manager`` (async quorum) + our ``ProcessGroupGloo``
  against our ``LighthouseServer``;
- ``torchft``: ``torchft.Manager`` + ``torchft.ProcessGroupGloo`` against torchft's Rust
  ``torchft._torchft.LighthouseServer``.

Per step: ``start_quorum()``, a fixed sleep (simulated compute, overlapping the async
quorum), forward/backward of a small MLP, ``allreduce(p.grad).wait()`` per gradient,
``should_commit()``, ``opt.step()``. Each worker reports one JSON line per step on
stdout (``time.time()`` after ``should_commit``, participants, participating, committed).

For each (implementation, G) the groups are started once; then, repeated ``--reps``
times, for each kill point in turn:

1. the last group SIGKILLs itself at the kill point (``boundary``: after ``opt.step()``,
   before the next ``start_quorum()``; ``mid_allreduce``: right after posting its first
   gradient allreduce, while the survivors are in the collective), writing its wall time
   just before;
2. recovery = kill → the moment EVERY survivor has committed a step in a quorum of G-1;
3. the group is restarted as a fresh process: spawn → ``Manager`` constructed ("ready",
   includes the interpreter and torch import; the constructor alone is also reported),
   and ready → its first committed step in the full quorum in which it participates
   (healing step excluded);
4. the run goes on until every group committed in the full quorum again.

Both lighthouses use the same ``--heartbeat-timeout-ms`` (default 5000, torchft's
default) and ``--join-timeout-ms`` (default 1000), ``min_replicas = G - 1``; both managers
``min_replica_size = G - 1``, collective timeout ``--op-timeout`` s. Medians are reported;
ratios are ours/torchft. Goals: recovery ≤ 250 ms at G = 2 and 3; ready → first
participating commit ≤ 0.4 s. Prints a table and one JSON line
``{"bench": "recovery", "results": ..., "ratios": ...}``.

    .venv/bin/python bench/recovery.py            # full run (G = 2, 3; 3 repeats), ~4 minutes
    .venv/bin/python bench/recovery.py --quick    # 1 repeat, G = 2 only
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ratio, median, ratio, table  # noqa: E402

IMPLS = ("torchft", "ours")
POINTS = ("boundary", "mid_allreduce")
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- worker side
def _worker(plan: dict[str, Any]) -> None:
    t_proc = time.time()
    _util.exit_with_parent()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out_lock = threading.Lock()

    def out(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    import torch
    from torch import nn

    impl = plan["impl"]
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    if impl == "ours":
        from rallypoint.manager.manager import Manager
        from rallypoint.process_groups import ProcessGroupGloo
    else:
        from torch.distributed import TCPStore
        from torchft.manager import Manager  # type: ignore[no-redef]
        from torchft.process_group import ProcessGroupGloo  # type: ignore[no-redef]
    t_imported = time.time()

    torch.set_num_threads(1)
    torch.manual_seed(plan["seed"])
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(plan["seed"])
    x = torch.randn(16, 64, generator=gen)

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    timeout = timedelta(seconds=plan["op_timeout_s"])
    common = dict(
        load_state_dict=load, state_dict=save, min_replica_size=plan["min_replica_size"], use_async_quorum=True,
        rank=0, world_size=1, lighthouse_addr=plan["lighthouse"], replica_id=plan["name"], hostname="127.0.0.1",
        timeout=timeout, quorum_timeout=timedelta(seconds=plan["quorum_timeout_s"]), connect_timeout=timeout,
    )
    t_ctor = time.time()
    if impl == "ours":
        manager = Manager(pg=ProcessGroupGloo(timeout=timeout), store_addr="127.0.0.1", **common)
    else:
        # torchft's Manager needs its replica group's TCPStore to exist already
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        manager = Manager(pg=ProcessGroupGloo(timeout=timeout), store_addr="127.0.0.1", store_port=store.port,
                          **common)
    t_ready = time.time()
    out({"ev": "ready", "t": t_ready, "t_proc": t_proc, "t_imported": t_imported, "t_ctor": t_ctor, "pid": os.getpid()})

    # commands from the parent: {"die": POINT}; EOF = stop
    die_at: list[str | None] = [None]
    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "die" in cmd:
                die_at[0] = cmd["die"]
        stop.set()

    threading.Thread(target=commands, name="commands", daemon=True).start()

    def die(point: str) -> None:
        out({"ev": "dying", "t": time.time(), "point": point, "step": manager.current_step()})
        os.kill(os.getpid(), signal.SIGKILL)

    sleep_s = plan["step_sleep_s"]
    while not stop.is_set():
        try:
            if die_at[0] == "boundary":
                die("boundary")
            t0 = time.time()
            manager.start_quorum()
            time.sleep(sleep_s)  # simulated compute; the async quorum runs meanwhile
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for i, p in enumerate(model.parameters()):
                work = manager.allreduce(p.grad)
                if i == 0 and die_at[0] == "mid_allreduce":
                    die("mid_allreduce")
                work.wait()
            t_ar = time.time()
            n = manager.num_participants()
            part = manager.is_participating()
            ok = manager.should_commit()
            t = time.time()
            if ok:
                opt.step()
            out({"ev": "step", "t0": t0, "t_ar": t_ar, "t": t, "ok": bool(ok), "n": n, "part": bool(part),
                 "step": manager.current_step()})
        except Exception as e:  # noqa: BLE001 - reported; the loop goes on (a quorum timeout, ...)
            out({"ev": "error", "t": time.time(), "error": f"{type(e).__name__}: {e}"[:300]})
    manager.shutdown(wait=False)
    out({"ev": "bye", "t": time.time()})
    os._exit(0)


# ---------------------------------------------------------------------- parent side
class _Worker(Child):
    """A worker whose stdout lines go to one queue shared by all workers of a session,
    so the parent waits on any worker's next event with one deadline."""

    def __init__(self, argv: list[str], name: str, events: "queue.Queue[tuple[str, int, Any]]", **kw: Any) -> None:
        self.events = events
        super().__init__(argv, name, **kw)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.put((self.name, self.pid, obj))
        self.events.put((self.name, self.pid, None))


class BenchError(RuntimeError):
    pass


class Session:
    """One lighthouse and G workers of one implementation."""

    def __init__(self, impl: str, g: int, args: argparse.Namespace) -> None:
        self.impl, self.g, self.args = impl, g, args
        self.events: "queue.Queue[tuple[str, int, Any]]" = queue.Queue()
        self.children: list[_Worker] = []
        self.live: dict[str, _Worker] = {}
        self.steps: dict[str, list[dict[str, Any]]] = {}  # name -> step events of its live process
        self.last: dict[str, dict[str, Any]] = {}  # name -> last non-step event (ready, dying)
        self.lh: Any = None
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
        self.env.setdefault("RUST_LOG", "warn")
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE",
                  "REPLICA_GROUP_ID"):
            self.env.pop(k, None)
        self.errors = 0

    # --- lifecycle
    def start_lighthouse(self) -> str:
        kw = dict(bind="127.0.0.1:0", min_replicas=self.g - 1, join_timeout_ms=self.args.join_timeout_ms,
                  heartbeat_timeout_ms=self.args.heartbeat_timeout_ms)
        if self.impl == "ours":
            from rallypoint.lighthouse.server import LighthouseServer

            self.lh = LighthouseServer(**kw)
        else:
            self.lh = _util.load_torchft_native().LighthouseServer(**kw)
        port = int(self.lh.address().rsplit(":", 1)[1])
        return f"http://127.0.0.1:{port}"

    def spawn(self, name: str, seed: int) -> float:
        plan = {"impl": self.impl, "name": name, "seed": seed, "lighthouse": self.addr,
                "min_replica_size": self.g - 1, "op_timeout_s": self.args.op_timeout,
                "quorum_timeout_s": self.args.quorum_timeout, "step_sleep_s": self.args.step_ms / 1e3}
        self.steps[name] = []
        self.last.pop(name, None)
        t = time.time()
        w = _Worker([sys.executable, __file__, "--worker", json.dumps(plan)], name=f"rec-{self.impl}-{name}",
                    events=self.events, env=self.env, cwd=str(REPO))
        self.children.append(w)
        self.live[name] = w
        return t

    def close(self) -> None:
        close_all(self.children, grace=3.0)
        if self.lh is not None:
            self.lh.shutdown()
            self.lh = None

    # --- events
    def pump(self, deadline: float, what: str) -> None:
        """Take the next event (any worker) or raise at the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{self.impl} G={self.g}: timed out waiting for {what}; {self.tails()}")
        try:
            wname, pid, obj = self.events.get(timeout=left)
        except queue.Empty:
            raise BenchError(f"{self.impl} G={self.g}: timed out waiting for {what}; {self.tails()}") from None
        name = wname.rsplit("-", 1)[1]
        cur = self.live.get(name)
        if cur is None or cur.pid != pid or obj is None:
            return  # a dead incarnation's last lines, or EOF
        ev = obj.get("ev")
        if ev == "step":
            self.steps[name].append(obj)
        elif ev == "error":
            self.errors += 1
        else:
            self.last[name] = obj

    def wait_until(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.pump(deadline, what)

    def tails(self) -> str:
        return " | ".join(f"{w.name}: {w.log_tail(600)}" for w in self.live.values())

    def first(self, name: str, after: float, n: int, need_part: bool = False) -> dict[str, Any] | None:
        for s in self.steps[name]:
            if s["t"] > after and s["ok"] and s["n"] == n and (s["part"] or not need_part):
                return s
        return None

    # --- the measurement
    def run(self, reps: int) -> dict[str, Any]:
        g = self.g
        names = [f"r{i}" for i in range(g)]
        victim, survivors = names[-1], names[:-1]
        self.addr = self.start_lighthouse()
        for i, n in enumerate(names):
            self.spawn(n, seed=i)
        self.wait_until(lambda: all(len([s for s in self.steps[n] if s["ok"] and s["n"] == g]) >= 2 for n in names),
                        self.args.start_timeout, f"all {g} groups committing in a full quorum")
        res: dict[str, Any] = {p: [] for p in POINTS}
        res.update(spawn_ready_ms=[], ctor_ms=[], ready_first_ms=[], errors=0)
        seed = 100
        for _rep in range(reps):
            for point in POINTS:
                w = self.live[victim]
                w.send({"die": point})
                self.wait_until(lambda: self.last.get(victim, {}).get("ev") == "dying", 30, f"{victim} to die")
                t_kill = self.last[victim]["t"]
                w.proc.wait(10)
                del self.live[victim]
                self.wait_until(lambda: all(self.first(s, t_kill, g - 1) for s in survivors),
                                self.args.case_timeout, f"survivors to commit without {victim} ({point})")
                rec = max(self.first(s, t_kill, g - 1)["t"] for s in survivors) - t_kill  # type: ignore[index]
                res[point].append(rec * 1e3)
                # restart the dead group
                seed += 1
                t_spawn = self.spawn(victim, seed)
                self.wait_until(lambda: self.last.get(victim, {}).get("ev") == "ready", 60, f"{victim} ready")
                rd = self.last[victim]
                self.wait_until(lambda: self.first(victim, 0, g, need_part=True) is not None,
                                self.args.case_timeout, f"{victim} participating in a full quorum")
                t_first = self.first(victim, 0, g, need_part=True)["t"]  # type: ignore[index]
                res["spawn_ready_ms"].append((rd["t"] - t_spawn) * 1e3)
                res["ctor_ms"].append((rd["t"] - rd["t_ctor"]) * 1e3)
                res["ready_first_ms"].append((t_first - rd["t"]) * 1e3)
                if "rejoin_trace_ms" not in res:  # the restarted group's steps up to the first participating commit
                    res["rejoin_trace_ms"] = [
                        {"start": round((s["t0"] - rd["t"]) * 1e3), "allreduced": round((s["t_ar"] - rd["t"]) * 1e3),
                         "committed": round((s["t"] - rd["t"]) * 1e3), "ok": s["ok"], "n": s["n"], "part": s["part"]}
                        for s in self.steps[victim] if s["t"] <= t_first]
                self.wait_until(lambda: all(self.first(n, t_first, g) for n in names), self.args.case_timeout,
                                "every group committing in the full quorum again")
                print(f"  {self.impl} G={g} {point}: recovery {rec * 1e3:.0f} ms, spawn->ready "
                      f"{(rd['t'] - t_spawn) * 1e3:.0f} ms, ready->participating commit "
                      f"{(t_first - rd['t']) * 1e3:.0f} ms", flush=True)
        res["errors"] = self.errors
        return res


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": raw}
    for k in (*POINTS, "spawn_ready_ms", "ctor_ms", "ready_first_ms"):
        out[f"{k}_median" if k in POINTS else k.replace("_ms", "_median_ms")] = median(raw.get(k, []))
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, G = 2 only")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--groups", help="comma-separated G values (default 2,3; quick 2)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of torchft,ours")
    ap.add_argument("--reps", type=int, help="repeats of each kill point (default 3, quick 1)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--join-timeout-ms", type=int, default=1000)
    ap.add_argument("--op-timeout", type=float, default=10.0, help="managers' collective/RPC timeout, s")
    ap.add_argument("--quorum-timeout", type=float, default=30.0, help="managers' quorum timeout, s")
    ap.add_argument("--step-ms", type=float, default=20.0, help="simulated compute per step (sleep), ms")
    ap.add_argument("--start-timeout", type=float, default=90.0, help="s for the first full quorum")
    ap.add_argument("--case-timeout", type=float, default=30.0, help="s for one recovery/rejoin")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    groups = [int(x) for x in (args.groups or ("2" if args.quick else "2,3")).split(",") if x]
    impls = [x for x in args.impls.split(",") if x]
    reps = args.reps or (1 if args.quick else 3)

    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for gi, g in enumerate(groups):
        for impl in (impls if gi % 2 == 0 else impls[::-1]):
            key = f"{impl}_G{g}"
            s = Session(impl, g, args)
            try:
                results[key] = summarize(s.run(reps))
            except (BenchError, _util.ChildError) as e:
                failures[key] = str(e)[:2000]
                print(f"  {key} FAILED: {str(e)[:2000]}", flush=True)
            finally:
                s.close()
    wall = time.monotonic() - t_start
    load1 = os.getloadavg()[0]

    def get(impl: str, g: int, k: str) -> float | None:
        v = results.get(f"{impl}_G{g}", {}).get(k)
        return None if v is None or v != v else v

    metrics = [(f"{p}_median", f"kill {p} -> every survivor committed (G-1)") for p in POINTS] + [
        ("spawn_ready_median_ms", "restart: spawn -> Manager ready"),
        ("ctor_median_ms", "  of which Manager() itself"),
        ("ready_first_median_ms", "restart: ready -> first participating commit"),
    ]
    rows, ratios = [], {}
    goals: dict[str, Any] = {}
    for g in groups:
        for k, label in metrics:
            t, o = get("torchft", g, k), get("ours", g, k)
            r = ratio(o, t)
            ratios[f"{k.replace('_median', '').replace('_ms', '')}_G{g}"] = r
            rows.append([label, str(g), _f(t), _f(o), fmt_ratio(r)])
        for p in POINTS:
            o = get("ours", g, f"{p}_median")
            goals[f"recovery_{p}_G{g}_le_250ms"] = None if o is None else o <= 250
        o = get("ours", g, "ready_first_median_ms")
        goals[f"ready_first_commit_G{g}_le_400ms"] = None if o is None else o <= 400

    print(f"recovery: G replica groups x 1 rank, gloo/CPU loopback, torchft {_util.torchft_version()}, "
          f"{reps} repeat(s), heartbeat timeout {args.heartbeat_timeout_ms} ms, join timeout "
          f"{args.join_timeout_ms} ms, op timeout {args.op_timeout:.0f} s, {args.step_ms:.0f} ms sleep/step; "
          f"load {load0:.2f} -> {load1:.2f}; {wall:.0f}s")
    print("medians in ms")
    print(table(["case", "G", "torchft", "ours", "ours/torchft"], rows))
    print()
    print(table(["goal (ours)", "met"], [[k, "-" if v is None else ("met" if v else "NOT met")]
                                         for k, v in goals.items()]))
    print("first restart of each run, ms after ready: step start / allreduces done / committed (n=participants, "
          "p=participating)")
    for k, v in results.items():
        tr = v["samples"].get("rejoin_trace_ms") or []
        print(f"  {k}: " + "; ".join(f"{s['start']}/{s['allreduced']}/{s['committed']} n={s['n']} "
                                     f"{'p' if s['part'] else '-'}{'' if s['ok'] else ' FAIL'}" for s in tr))
    for k, v in results.items():
        if v["samples"].get("errors"):
            print(f"note: {k}: {v['samples']['errors']} step(s) raised in the workers (quorum timeout etc.)")
    line = json.dumps({"bench": "recovery", "quick": args.quick, "reps": reps, "groups": groups,
                       "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "join_timeout_ms": args.join_timeout_ms,
                       "results": results, "failures": failures, "goals": goals, "ratios": ratios})
    _util.emit_line(line, args.out)


def _f(v: float | None) -> str:
    return "-" if v is None or v != v else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


if __name__ == "__main__":
    main()
