"""A failure soon after a (re)start: kill -> participating when the SIGKILL comes 3 s after
the group (re)started, ours (this tree, with the group's zygote) vs ours before (another
checkout, standbys only: ``--before-src``; left out without it) vs torchft 0.2.0 under
torchrun (torchft has no supervisor; torchrun's restart of the worker group is its control).

Two replica groups of one rank each train ``chaos_worker.py``'s MLP (DDP, gloo on CPU,
``--compute-ms`` per step) against one lighthouse (``min_replicas=1``). Group 0 never
fails; group 1 runs under the variant's supervisor:

- ``ours`` / ``ours_before``: ``python -m rallypoint --log-level INFO run`` (standbys on,
  the defaults), rallypoint from this tree / from ``--before-src`` (``PYTHONPATH``);
- ``torchft``: ``python -m torch.distributed.run --nproc-per-node 1 --max-restarts 100
  --monitor-interval 0.1 --standalone`` (each restart a new process that imports torch).

Each run: both groups start; ``start_s`` = group 1's launch -> its first participating
commit (the group's own start, which the zygote must not slow). Then a priming SIGKILL to
group 1's rank, and ``--kills`` measured ones, each ``--after`` s (3) after the previous
restart: the (re)start instant is the supervisor's ``restart`` event (ours; it names the
new pids) or the new worker process's creation (torchrun). A measured kill's
``kill_to_participating_s`` = the kill -> the new rank's first committed step with both
groups participating (the worker's own clock, same host). Variants alternate run by run
(``--rounds``), medians with min/max are reported, then one JSON line.

    .venv/bin/python bench/standby_early.py                 # 2 rounds x 3 kills per variant
    .venv/bin/python bench/standby_early.py --before-src ../rallypoint-0.1   # also a checkout from before
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
import chaos  # noqa: E402
from _util import fmt_ratio, median, ratio, table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "chaos_worker.py"
VARIANTS = ("ours", "ours_before", "torchft")
_PREFIX = re.compile(r"^\[g\d+ r\d+\] (.*)$")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
GOAL_S = 0.5


def _log_time(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


class _Group:
    """One group's supervisor (or torchrun): its stdout records and stderr restart events
    in a queue, ``(kind, wall time, payload)``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
        self.q: queue.Queue[tuple[str, float, Any]] = queue.Queue()
        self.log = open(log, "w")
        self.zygote = False  # did the supervisor say it has a zygote (ours) or not (ours before)?
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     cwd=cwd)  # not the checkout: ``-m rallypoint`` would find it first
        self.started = time.time()
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._err, daemon=True).start()

    def _out(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            m = _PREFIX.match(line)
            body = m.group(1) if m else line
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.q.put(("rec", time.time(), obj))

    def _err(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace")
            self.log.write(line)
            self.zygote = self.zygote or "the zygote (pid" in line
            if '"event": "restart"' in line:
                t = _log_time(line)
                self.q.put(("restart", t if t is not None else time.time(), json.loads(line[line.index("{"):])))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.proc.wait(10)
        self.log.close()


def _argv(variant: str, gid: int, lh: str, wplan: dict[str, Any]) -> list[str]:
    if variant == "torchft":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "100",
                "--monitor-interval", "0.1", "--standalone", str(WORKER), json.dumps(wplan)]
    return [sys.executable, "-m", "rallypoint", "--log-level", "INFO", "run", "--nproc-per-node", "1",
            "--replica-group-id", str(gid), "--lighthouse", lh, *([] if gid == 1 else ["--no-standby"]),
            str(WORKER), json.dumps(wplan)]


def _env(variant: str, gid: int, lh: str, before_src: str | None, tmp: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE",
              "RALLYPOINT_LIGHTHOUSE", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    _util.clear_job_env(env)
    src = before_src if variant == "ours_before" and before_src else REPO
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(REPO / "bench")])
    env.setdefault("RUST_LOG", "warn")
    env["TMPDIR"] = tmp
    if variant == "torchft":
        env.update(TORCHFT_LIGHTHOUSE=lh, REPLICA_GROUP_ID=str(gid))
    return env


def _proc_start(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _rank_child(parent: int, victim: int) -> int | None:
    """The group's rank among ``parent``'s children running the worker: the earliest started
    one (a standby taken at the restart was started before it; new standbys come after),
    not ``victim``, not a zombie."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == victim:
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] not in (b"Z", b"X") and WORKER.name.encode() in cmd:
            found.append((int(fields[19]), int(d)))
    return min(found)[1] if found else None


def _run(variant: str, plan: dict[str, Any], tmp: str) -> dict[str, Any]:
    """One run of ``variant``: the group's start, a priming kill, then the measured kills."""
    lh = chaos._Lighthouse("torchft" if variant == "torchft" else "ours", 10_000, 5_000)
    stop_file = os.path.join(tmp, f"stop.{variant}.json")
    Path(stop_file).write_text("{}")
    wplan = {"framework": "torchft" if variant == "torchft" else "ours", "supervised": True, "stop_file": stop_file,
             "compute_ms": plan["compute_ms"], "op_timeout_s": plan["op_timeout_s"]}
    groups: list[_Group] = []
    res: dict[str, Any] = {"variant": variant, "kills": []}
    try:
        for gid in range(2):
            groups.append(_Group(_argv(variant, gid, lh.addr(), wplan),
                                 _env(variant, gid, lh.addr(), plan["before_src"], tmp),
                                 os.path.join(tmp, f"{variant}.g{gid}.log"), tmp))
            if gid == 0:
                time.sleep(0.5)  # group 0 first: group 1 joins a running job
        g1 = groups[1]
        pids: dict[int, float] = {}  # group 1's pids seen -> the time of their first record
        state: dict[str, Any] = {"restart": None, "participating": {}}

        def pump(until: float, pred: Any = None) -> Any:
            while True:
                if pred is not None and (v := pred()):
                    return v
                left = until - time.time()
                if left <= 0:
                    return None
                if g1.proc.poll() is not None:
                    raise RuntimeError(f"group 1's supervisor exited ({g1.proc.returncode}); see {g1.log.name}")
                try:
                    kind, t, obj = g1.q.get(timeout=min(left, 0.05))
                except queue.Empty:
                    continue
                if kind == "restart":
                    state["restart"] = (t, obj)
                    continue
                pid = obj.get("pid")
                if isinstance(pid, int):
                    pids.setdefault(pid, t)
                if "s" in obj and obj.get("c") and obj.get("p") and obj.get("n") == 2:
                    state["participating"].setdefault(pid, obj["t1"])

        deadline = time.time() + plan["start_timeout_s"]
        first = pump(deadline, lambda: next(iter(state["participating"].items()), None))
        if first is None:
            raise RuntimeError(f"{variant}: group 1 did not participate within {plan['start_timeout_s']}s")
        res["start_s"] = round(first[1] - g1.started, 3)
        victim = first[0]
        schedule = [a for _ in range(plan["kills"]) for a in plan["after_s"]]  # the delay before kill k+1
        for k in range(len(schedule) + 1):
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            state["restart"] = None
            ev: dict[str, Any] = {}
            if variant != "torchft":
                got = pump(time.time() + 60, lambda: state["restart"])
                if got is None:
                    raise RuntimeError(f"{variant}: no restart event within 60 s")
                restarted, ev = got
            new = ev["pids"][0] if ev.get("pids") else pump(time.time() + 60, lambda: _rank_child(g1.proc.pid, victim))
            if new is None:
                raise RuntimeError(f"{variant}: no new rank within 60 s")
            if variant == "torchft":
                restarted = _proc_start(new) or time.time()
            done = pump(time.time() + 60, lambda: state["participating"].get(new))
            if k > 0:
                res["kills"].append({"after_s": schedule[k - 1],
                                     "after_restart_s": round(killed - res["kills_prev_restart"], 3),
                                     "kill_to_participating_s": None if done is None else round(done - killed, 3),
                                     "restart": None if variant == "torchft" else {
                                         x: ev.get(x) for x in ("restart_s", "warm_ranks", "forked_ranks",
                                                                "importing_ranks")}})
            if done is None:
                raise RuntimeError(f"{variant}: the restarted rank did not participate within 60 s")
            res["kills_prev_restart"] = restarted
            victim = new
            if k < len(schedule):
                time.sleep(max(0.0, restarted + schedule[k] - time.time()))
        res.pop("kills_prev_restart", None)
        if g1.zygote != (variant == "ours"):
            raise RuntimeError(f"{variant}: the supervisor {'did not say' if g1.zygote else 'said'} it has a zygote: "
                               "not the rallypoint meant")
        return res
    finally:
        Path(stop_file).write_text(json.dumps({"exit": True}))
        for g in groups:
            g.stop()
        lh.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant, alternating (default 2)")
    ap.add_argument("--kills", type=int, default=3, help="measured kills per run (default 3)")
    ap.add_argument("--after", default="3,1",
                    help="seconds after the (re)start the kills come, in turn (default 3,1: the goal's 3 s, and 1 s)")
    ap.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute per step")
    ap.add_argument("--before-src", type=Path, default=None,
                    help="another checkout whose rallypoint is 'ours_before' (e.g. one from before the zygote); "
                         "without it that variant is left out")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant in {variants}")
    if args.before_src is None and "ours_before" in variants:
        variants.remove("ours_before")
        print("# standby_early: no --before-src, so no 'ours_before' variant", file=sys.stderr)
    elif args.before_src is not None and not (args.before_src / "rallypoint" / "__init__.py").is_file():
        ap.error(f"--before-src {args.before_src}: no rallypoint/__init__.py there")
    afters = [float(a) for a in args.after.split(",") if a]
    plan = {"kills": args.kills, "after_s": afters, "compute_ms": args.compute_ms, "op_timeout_s": 10.0,
            "before_src": str(args.before_src.resolve()) if args.before_src else None, "start_timeout_s": 120.0}
    tmp = tempfile.mkdtemp(prefix="bench-standby-early-")
    load0 = os.getloadavg()[0]
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse, in this process
    print(f"# standby_early: kills {args.after} s after a (re)start; {args.rounds} round(s) x {args.kills} kills each; "
          f"ours_before from {plan['before_src']}; torchft {_util.torchft_version()}; {os.cpu_count()} CPUs, "
          f"load {load0:.2f}; logs in {tmp}", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    errors: list[str] = []
    for i in range(args.rounds):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            try:
                runs[v].append(_run(v, plan, tmp))
            except Exception as e:  # noqa: BLE001 - reported, the other variants still run
                errors.append(f"{v} round {i}: {e}")
                print(f"error: {v} round {i}: {e}", file=sys.stderr)
    summary: dict[str, Any] = {}
    for v in variants:
        summary[v] = {"start_s": _stats([r["start_s"] for r in runs[v]])}
        for a in afters:
            kills = [k for r in runs[v] for k in r["kills"] if k["after_s"] == a]
            summary[v][f"after_{a:g}s"] = {
                "kill_to_participating_s": _stats([k["kill_to_participating_s"] for k in kills
                                                   if k["kill_to_participating_s"] is not None]),
                "kill_after_restart_s": _stats([k["after_restart_s"] for k in kills]),
                "samples": [k["kill_to_participating_s"] for k in kills], "sources": [k["restart"] for k in kills]}

    def med(v: str, a: float) -> float | None:
        return summary.get(v, {}).get(f"after_{a:g}s", {}).get("kill_to_participating_s", {}).get("median")

    ratios: dict[str, float | None] = {}
    for a in afters:
        ratios[f"ours/torchft after {a:g}s"] = ratio(med("ours", a), med("torchft", a))
        ratios[f"ours/ours_before after {a:g}s"] = ratio(med("ours", a), med("ours_before", a))
    ratios["start ours/ours_before"] = ratio(summary.get("ours", {}).get("start_s", {}).get("median"),
                                             summary.get("ours_before", {}).get("start_s", {}).get("median"))
    rows = []
    for v in variants:
        for a in afters:
            s = summary[v][f"after_{a:g}s"]
            rows.append([v, f"{a:g}", _fmt(s["kill_to_participating_s"]), str(s["kill_to_participating_s"].get("n", 0)),
                         _fmt(s["kill_after_restart_s"]), _sources(s["sources"]), _fmt(summary[v]["start_s"])])
    print(table(["variant", "kill after s", "kill -> participating s median [min-max]", "kills",
                 "kill came after restart s", "rank from", "group start s"], rows))
    print("ratios: " + ", ".join(f"{k} {fmt_ratio(r)}" for k, r in ratios.items()))
    goal = med("ours", 3.0) is not None and med("ours", 3.0) <= GOAL_S  # type: ignore[operator]
    print(f"goal: ours kill -> participating <= {GOAL_S} s with the kill 3 s after a restart: "
          f"{'met' if goal else 'NOT met'}")
    line = json.dumps({"bench": "standby_early", "plan": plan, "rounds": args.rounds, "cpus": os.cpu_count(),
                       "load_start": load0, "load_end": os.getloadavg()[0], "torchft_version": _util.torchft_version(),
                       "results": summary, "ratios": ratios, "goal_s": GOAL_S, "goal_met": goal, "errors": errors})
    _util.emit_line(line, args.out)


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def _sources(sources: list[dict[str, Any] | None]) -> str:
    """How many restarts took a ready standby / a fork / an importing standby / a new process."""
    if not sources or sources[0] is None:
        return "new process"
    count = {"standby": 0, "fork": 0, "importing": 0, "new": 0}
    for s in sources:
        assert s is not None
        key = "standby" if s.get("warm_ranks") else "fork" if s.get("forked_ranks") else \
            "importing" if s.get("importing_ranks") else "new"
        count[key] += 1
    return " ".join(f"{k} {n}" for k, n in count.items() if n)


def _fmt(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "-"
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


if __name__ == "__main__":
    main()
