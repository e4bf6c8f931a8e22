"""Chaos under ``rallypoint run``: SIGKILLs hit the ranks, the supervisor restarts them.

``bench/chaos.py``'s measurement (G replica groups training a small MLP with DDP, gloo on
CPU, a SIGKILL to a random group every 7-13 s) with each framework's own restarts. Ours:
one ``python -m rallypoint --log-level INFO run ... bench/chaos_worker.py PLAN`` per group;
the bench reads each rank's records (with its pid) from the supervisor's prefixed stdout
and the restart events from its stderr, SIGKILLs a RANK (never the supervisor) once the
group's standby is ready (read from ``/proc``), and lets ``rallypoint run`` restart it.
torchft has no supervisor: ``chaos.py``'s outside restart of a pre-imported standby, 1 s
after the kill (``torchft_1s``) or at once (``torchft_0s``). Per kill: kill -> the group's
first participating commit, the survivors' stall, ``restart_s``, and where the time goes
(log and worker timestamps); per run: goodput and the parameters' sha256 at a common stop
step. Goals (issue 14): kill -> first commit <= 0.5 s; goodput >= 0.95 (G=3), >= 0.93
(G=2). What each column means: bench/README.md.

    .venv/bin/python bench/chaos_run.py                # G=2,3, 60 s chaos per variant (~10 min)
    .venv/bin/python bench/chaos_run.py --quick        # G=2, 30 s
    .venv/bin/python bench/chaos_run.py --nproc 2 --variants ours   # 2 ranks per group
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
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
from _util import fmt_ratio, log_time, median, percentile, proc_environ, procs, ratio, table, term_with_parent  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "chaos_worker.py"
VARIANTS = ("ours", "torchft_1s", "torchft_0s")
_PREFIX = re.compile(r"^\[g(\d+) r(\d+)( standby)?\] (.*)$")


# ---------------------------------------------------------------------- one `rallypoint run`
class _Group:
    """One replica group's ``rallypoint run`` process; its lines go to ``sink`` as
    ``(t, gid, rank, obj)``: rank records (rank >= 0) and supervisor events (rank -1)."""

    def __init__(self, gid: int, argv: list[str], env: dict[str, str], sink: "queue.Queue", log_path: str) -> None:
        self.gid, self.sink, self.log_path = gid, sink, log_path
        self._log = open(log_path, "w")
        self._log_lock = threading.Lock()
        self.sup_lines: list[tuple[float, float | None, str]] = []  # (t received, t logged, line)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, cwd=str(REPO), text=True, bufsize=1, preexec_fn=term_with_parent)
        self.pid = self.proc.pid
        self.tmpdir = env.get("TMPDIR", tempfile.gettempdir())  # the supervisor's scratch folder is under it
        for src, fn in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
            threading.Thread(target=self._read, args=(src, fn), name=f"g{gid}-reader", daemon=True).start()

    def _read(self, src: Any, fn: Any) -> None:
        for line in src:
            fn(time.time(), line.rstrip("\n"))
            with self._log_lock:
                self._log.write(line)
        if fn == self._out:
            self.sink.put((time.time(), self.gid, -1, None))  # EOF: the supervisor is gone

    def _out(self, now: float, line: str) -> None:
        m = _PREFIX.match(line)
        if not m:
            return
        try:
            obj = json.loads(m.group(4))
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            self.sink.put((now, self.gid, int(m.group(2)), obj))

    def _err(self, now: float, line: str) -> None:
        if line.startswith("[g"):
            return  # a rank's (or the store's) stderr: only the log file
        self.sup_lines.append((now, log_time(line), line))
        i = line.find('{"event"')
        if i >= 0:
            try:
                ev = json.loads(line[i:])
            except json.JSONDecodeError:
                return
            self.sink.put((now, self.gid, -1, {"sup_event": ev, "t_log": log_time(line)}))

    def standbys(self, rank_pids: set[int]) -> dict[int, bool]:
        """rank -> is its standby ready (imports done)? From /proc: the supervisor's
        children started with ``--standby`` that are not running ranks."""
        out: dict[int, bool] = {}
        for pid, (ppid, cmd) in procs().items():
            if ppid != self.pid:
                continue
            if "--standby" not in cmd or pid in rank_pids:
                continue
            env = proc_environ(pid)
            try:
                rank = int(env.get("RANK", "-1"))
            except ValueError:
                continue
            ready = env.get("RALLYPOINT_STANDBY_READY")
            out[rank] = out.get(rank, False) or bool(ready and os.path.exists(ready))
        # A standby forked from the group's zygote shows the zygote's command line and
        # environment in /proc; it writes its pid into its ready file, standby.<n>.r<rank>.ready,
        # in the supervisor's scratch folder (under our TMPDIR).
        for f in Path(self.tmpdir).glob("rallypoint-run-*/standby.*.r*.ready"):
            try:
                pid, rank = int(f.read_text()), int(f.name.rsplit(".r", 1)[1].split(".")[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid not in rank_pids and procs.get(pid, (None, ""))[0] == self.pid:
                out[rank] = True
        return out

    def tail(self, n: int = 1500) -> str:
        with self._log_lock:
            self._log.flush()
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, wait_s: float) -> int | None:
        """Wait for its own exit, then SIGTERM (it stops its ranks and standbys), then
        SIGKILL as a last resort; always reaps. Its return code."""
        for sig, t in ((None, wait_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            if sig is not None and self.proc.poll() is None:
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                return self.proc.wait(timeout=t)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def close(self) -> None:
        with self._log_lock:
            self._log.close()


class _OursRun:
    """``G`` groups under ``rallypoint run``: their records, the kills, the supervisors' events."""

    def __init__(self, g: int, plan: dict[str, Any], tmp: str) -> None:
        self.g, self.plan, self.tmp = g, plan, tmp
        self.nproc = plan["nproc"]
        self.sink: "queue.Queue[tuple[float, int, int, Any]]" = queue.Queue()
        self.records: list[tuple[float, int, int, dict[str, Any]]] = []
        self.readies: dict[int, dict[str, Any]] = {}  # pid -> its ready record
        self.current: dict[tuple[int, int], int] = {}  # (gid, rank) -> pid of the latest process
        self.timings: dict[int, dict[str, Any]] = {}  # pid -> marks
        self.done: dict[tuple[int, int], dict[str, Any]] = {}
        self.sup_events: list[tuple[float, int, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.exited: set[int] = set()
        self.stop_file = os.path.join(tmp, "stop.json")
        Path(self.stop_file).write_text("{}")
        self.lh = chaos._Lighthouse("ours", plan["join_timeout_ms"], plan["heartbeat_timeout_ms"])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("RUST_LOG", "warn")
        env["TMPDIR"] = tmp  # the supervisor's scratch folder (standby ready files, store host) under ours
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE",
                  "RALLYPOINT_LIGHTHOUSE", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(k, None)
        _util.clear_job_env(env)
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)  # the bench's own setting (see main), not the supervisor's
        wplan = {"framework": "ours", "supervised": True, "stop_file": self.stop_file,
                 "compute_ms": plan["compute_ms"], "op_timeout_s": plan["op_timeout_s"]}
        self.groups = []
        for gid in range(g):
            argv = [sys.executable, "-m", "rallypoint", "--log-level", "INFO", "run", "--nproc-per-node",
                    str(self.nproc), "--replica-group-id", str(gid), "--lighthouse", self.lh.addr(),
                    "--standby-delay", str(plan["standby_delay_s"]),
                    *(["--preload", plan["preload"]] if plan["preload"] else []), str(WORKER), json.dumps(wplan)]
            self.groups.append(_Group(gid, argv, env, self.sink, os.path.join(tmp, f"g{gid}.log")))

    def pump(self, until: float) -> None:
        while True:
            left = until - time.time()
            if left <= 0:
                return
            try:
                t, gid, rank, obj = self.sink.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if obj is None:
                self.exited.add(gid)
                if not self.plan.get("stopping"):
                    self.errors.append(f"g{gid}: rallypoint run exited (rc={self.groups[gid].proc.poll()}): "
                                       f"{self.groups[gid].tail(600)}")
            elif "sup_event" in obj:
                self.sup_events.append((t, gid, dict(obj["sup_event"], t_log=obj["t_log"])))
            elif "s" in obj:
                self.records.append((t, gid, rank, obj))
            elif "ready" in obj:
                self.readies[obj["pid"]] = dict(obj, t_recv=t)
                self.current[(gid, rank)] = obj["pid"]
            elif "timing" in obj:
                self.timings[obj["pid"]] = obj["timing"]
            elif "done" in obj:
                self.done[(gid, rank)] = obj
            elif "error" in obj:
                self.errors.append(f"g{gid} r{rank}: {obj['error']}")

    def wait_for(self, cond: Any, timeout: float) -> bool:
        end = time.time() + timeout
        while not cond():
            if time.time() >= end:
                return False
            self.pump(min(end, time.time() + 0.2))
        return True

    def good(self, t0: float, t1: float) -> int:
        """Committed participating replica-steps (rank 0's records) with a commit in [t0, t1)."""
        return sum(1 for _, _, rank, r in self.records if rank == 0 and r["c"] and r["p"] and t0 <= r["t1"] < t1)

    def up(self, gid: int, since: float = 0.0) -> bool:
        """Every rank of ``gid``'s latest processes has a participating commit (after ``since``)."""
        pids = {self.current.get((gid, r)) for r in range(self.nproc)}
        got = {r["pid"] for _, rg, _, r in self.records if rg == gid and r["pid"] in pids and r["c"] and r["p"]
               and r["t1"] >= since}
        return None not in pids and got == pids

    def standby_ready(self, gid: int) -> bool:
        rank_pids = {p for (rg, _), p in self.current.items() if rg == gid}
        st = self.groups[gid].standbys(rank_pids)
        return all(st.get(r, False) for r in range(self.nproc))

    def kill(self, gid: int, rank: int, ready: bool, waited: float) -> None:
        pid = self.current[(gid, rank)]
        ppid, cmd = procs().get(pid, (None, ""))
        if ppid != self.groups[gid].pid or str(WORKER) not in cmd:  # only ever our own rank
            self.errors.append(f"g{gid} r{rank}: pid {pid} is not a rank of ours any more; not killed")
            return
        old = {p for (rg, _), p in self.current.items() if rg == gid}
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        self.events.append({"type": "kill", "gid": gid, "rank": rank, "pid": pid, "old_pids": sorted(old), "t": t,
                            "standby_ready": ready, "standby_wait_s": round(waited, 2)})

    def close(self) -> list[int]:
        """Exit flag for the ranks, then stop every supervisor; the pids left alive (none)."""
        self.plan["stopping"] = True
        try:
            Path(self.stop_file).write_text(json.dumps({"exit": True}))
        except OSError:
            pass
        left = []
        try:
            for grp in self.groups:
                rc = grp.stop(15.0)
                if rc not in (0, 143):
                    self.errors.append(f"g{grp.gid}: rallypoint run exited {rc}")
        finally:
            self.lh.close()
            for grp in self.groups:
                grp.close()
        time.sleep(0.5)
        for pid, (_, cmd) in procs().items():
            if self.tmp in cmd:  # supervisors, ranks, standbys and store hosts all name our folder
                left.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return left


def _first_commit(run: _OursRun, gid: int, old: set[int], after: float, until: float) -> tuple[float | None, int | None]:
    """When every rank of the group's new processes has committed participating (worker
    clock), and rank 0's pid."""
    firsts: dict[int, tuple[float, int]] = {}
    for _, rg, rank, r in run.records:
        if rg == gid and r["pid"] not in old and r["c"] and r["p"] and after < r["t1"] < until:
            if rank not in firsts or r["t1"] < firsts[rank][0]:
                firsts[rank] = (r["t1"], r["pid"])
    if len(firsts) < run.nproc:
        return None, firsts.get(0, (None, None))[1]
    return max(t for t, _ in firsts.values()), firsts[0][1]


def _sup_line(run: _OursRun, gid: int, after: float, text: str) -> float | None:
    for _, tl, line in run.groups[gid].sup_lines:
        if tl is not None and tl >= after - 0.002 and text in line:
            return tl
    return None


def breakdown(t_kill: float, timing: dict[str, Any] | None, detected: float | None = None,
              started: float | None = None) -> dict[str, float | None]:
    """Phase marks in ms after the kill (None where unknown)."""
    def ms(v: float | None) -> float | None:
        return None if v is None else round((v - t_kill) * 1000, 1)

    tm = timing or {}
    first = lambda k, i: (tm.get(k) or [[None, None]])[0][i]  # noqa: E731
    steps = tm.get("steps") or []
    return {"detected": ms(detected), "ranks_started": ms(started), "script_go": ms(tm.get("go")),
            "model_built": ms(tm.get("model")), "manager_built": ms(tm.get("mgr")), "ddp_built": ms(tm.get("ddp")),
            "quorum_asked": ms(first("quorum", 0)), "quorum_got": ms(first("quorum", 1)),
            "pg_configured": ms(first("configure", 1)), "heal_done": ms(first("heal", 1)),
            "first_step_end": ms(steps[0][1] if steps else None),
            "first_participating_commit": ms(next((s[1] for s in steps if s[2] and s[3]), None)),
            "steps_to_first_commit": len(steps) if steps else None}


def run_ours(g: int, plan: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="bench-chaos-run-")
    res: dict[str, Any] = {"variant": "ours", "groups": g, "nproc": plan["nproc"]}
    run = None
    try:
        run = _OursRun(g, plan, tmp)
        nrec = lambda: len(run.records)  # noqa: E731

        def warm() -> bool:
            full = {gid for _, gid, rk, r in run.records if rk == 0 and r["c"] and r["p"] and r["n"] == g}
            return len(full) == g and sum(1 for _, _, rk, r in run.records if rk == 0 and r["c"] and r["n"] == g) >= 3 * g
        if not run.wait_for(warm, plan["startup_timeout_s"]):
            raise RuntimeError(f"ours G={g}: no fault-free steps within {plan['startup_timeout_s']}s (records: {nrec()}); "
                               f"{run.errors} {[grp.tail(800) for grp in run.groups]}")
        # the standbys' imports (torch) would slow the calibration: wait for them first
        t_w = time.time()
        res["standbys_ready_at_start"] = run.wait_for(lambda: all(run.standby_ready(gid) for gid in range(g)),
                                                      plan["standby_wait_s"] * 3)
        res["standby_import_wait_s"] = round(time.time() - t_w, 1)
        t_cal = time.time()
        run.pump(t_cal + plan["calib_s"])
        rate = run.good(t_cal, t_cal + plan["calib_s"]) / (g * plan["calib_s"])
        res["fault_free_steps_per_s"] = rate

        t0 = time.time()
        t_end = t0 + plan["duration_s"]
        next_kill = t0 + rng.uniform(0.7, 1.3) * plan["kill_every_s"]
        last_kill: dict[int, float] = {}
        skipped = 0
        all_up = lambda: all(run.up(gid, last_kill.get(gid, 0.0)) for gid in range(g))  # noqa: E731
        while True:
            run.pump(min(next_kill, t_end))
            if time.time() >= t_end:
                break
            # Never kill while another group is still restarting (killing the last up-to-date
            # replica loses the job's state: not what is measured here); wait for it, bounded.
            tw = time.time()
            if not run.wait_for(all_up, min(plan["standby_wait_s"], t_end - tw)):
                skipped += 1
            else:
                gid = rng.randrange(g)
                ready = run.wait_for(lambda: run.standby_ready(gid), min(plan["standby_wait_s"], t_end - time.time()))
                if time.time() < t_end:
                    run.kill(gid, rng.randrange(plan["nproc"]), ready, time.time() - tw)
                    last_kill[gid] = time.time()
            next_kill = time.time() + rng.uniform(0.7, 1.3) * plan["kill_every_s"]
        res["skipped_kills"] = skipped  # a group was still down when a kill was due
        # the last kill's restart may finish after the window: look a little further for it
        run.pump(time.time() + 3.0)
        good = run.good(t0, t_end)
        res["committed_replica_steps"] = good
        res["goodput"] = good / (g * rate * plan["duration_s"]) if rate > 0 else None

        per_kill = []
        for e in run.events:
            old = set(e["old_pids"])
            kc, pid0 = _first_commit(run, e["gid"], old, e["t"], t_end + 3.0)
            firsts = []
            for sg in range(g):
                if sg == e["gid"]:
                    continue
                ts = [r["t1"] for _, rg, _, r in run.records if rg == sg and r["t0"] > e["t"] and r["c"] and r["t1"] < t_end]
                firsts.append(min(ts) if ts else None)
            stall = None if not firsts or any(f is None for f in firsts) else max(firsts) - e["t"]
            rs = [ev for _, rg, ev in run.sup_events if rg == e["gid"] and ev.get("event") == "restart"
                  and (ev.get("t_log") or 0) >= e["t"] - 0.002]
            rs0 = rs[0] if rs else {}
            detected = _sup_line(run, e["gid"], e["t"], "failed (")
            per_kill.append({
                "gid": e["gid"], "rank": e["rank"], "at_s": round(e["t"] - t0, 2),
                "kill_to_commit_s": None if kc is None else round(kc - e["t"], 3),
                "survivor_stall_s": None if stall is None else round(stall, 3),
                "standby_ready": e["standby_ready"], "standby_wait_s": e["standby_wait_s"],
                "restart_s": rs0.get("restart_s"), "warm_ranks": rs0.get("warm_ranks"), "backoff_s": rs0.get("backoff_s"),
                "cause": rs0.get("cause"),
                "breakdown_ms": breakdown(e["t"], run.timings.get(pid0) if pid0 else None, detected, rs0.get("t_log")),
            })
        _summarize(res, per_kill)
        res["restart_events"] = sum(1 for _, _, ev in run.sup_events if ev.get("event") == "restart")

        # stop at a common step, once every group's latest processes take part
        run.wait_for(all_up, plan["catchup_timeout_s"])
        live = set(run.current.values())
        top = max((r["s"] for _, _, _, r in run.records if r["pid"] in live), default=0)
        stop = top + plan["stop_margin_steps"]
        Path(run.stop_file).write_text(json.dumps({"stop_at": stop}))
        want = [(gid, r) for gid in range(g) for r in range(plan["nproc"])]
        run.wait_for(lambda: all(k in run.done and run.done[k]["pid"] == run.current.get(k) for k in want),
                     plan["stop_timeout_s"])
        hashes = {f"g{k[0]}r{k[1]}": d["hash"] for k, d in run.done.items() if d["done"] == stop}
        res["stop_step"] = stop
        res["hashes_equal"] = len(hashes) == len(want) and len(set(hashes.values())) == 1
        res["hashes"] = {k: v[:12] for k, v in sorted(hashes.items())}
        return res
    finally:
        if run is not None:
            left = run.close()
            res["left_behind"] = left
            res["errors"] = run.errors[:5]
            if plan.get("logs"):
                Path(plan["logs"]).mkdir(parents=True, exist_ok=True)
                for grp in run.groups:
                    shutil.copy(grp.log_path, Path(plan["logs"], f"ours_g{g}_n{plan['nproc']}_group{grp.gid}.log"))
        shutil.rmtree(tmp, ignore_errors=True)


def _summarize(res: dict[str, Any], per_kill: list[dict[str, Any]]) -> None:
    res["kills"] = per_kill
    kcs = [k["kill_to_commit_s"] for k in per_kill if k["kill_to_commit_s"] is not None]
    stalls = [k["survivor_stall_s"] for k in per_kill if k["survivor_stall_s"] is not None]
    res["median_kill_to_commit_s"] = median(kcs) if kcs else None
    res["max_kill_to_commit_s"] = max(kcs) if kcs else None
    res["never_committed"] = sum(1 for k in per_kill if k["kill_to_commit_s"] is None)
    res["median_stall_s"] = median(stalls) if stalls else None
    res["stalled"] = sum(1 for k in per_kill if k["survivor_stall_s"] is None)
    rss = [k["restart_s"] for k in per_kill if k.get("restart_s") is not None]
    res["median_restart_s"] = median(rss) if rss else None
    res["cold_restarts"] = sum(1 for k in per_kill if k.get("warm_ranks") is not None
                               and len(k["warm_ranks"]) < res.get("nproc", 1))
    res["standby_not_ready"] = sum(1 for k in per_kill if k.get("standby_ready") is False)
    bds = [k["breakdown_ms"] for k in per_kill if k.get("breakdown_ms")]
    res["median_breakdown_ms"] = {key: (median(v) if (v := [b[key] for b in bds if b.get(key) is not None]) else None)
                                  for key in (bds[0] if bds else {})}


def run_torchft(g: int, plan: dict[str, Any], rng: random.Random, after_s: float) -> dict[str, Any]:
    """chaos.py's run with its outside restart ``after_s`` after each kill."""
    cplan = dict(plan, restart_after_s=after_s, standby=True)
    res = chaos.run_one("torchft", g, cplan, rng)
    res.update(variant=f"torchft_{after_s:g}s", nproc=1)
    res.pop("framework", None)
    for k in res.get("kills", []):
        k["breakdown_ms"] = breakdown(k["t_kill"], k.pop("timing", None), None, k.get("t_restart"))
    kills = res.get("kills", [])
    _summarize(res, kills)
    return res


def _fmt(v: float | None, unit: str = " s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def main() -> None:
    # The bench hosts a gRPC lighthouse and forks (preexec_fn) the supervisors: gRPC's fork
    # handlers then run in the child before its exec, and once aborted a child there (epoll_wait:
    # bad file descriptor). The children exec at once, so they need none (not passed on to them).
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="G=2, 30 s per variant")
    ap.add_argument("--duration", type=float, help="chaos seconds per variant per G (default 60, quick 30)")
    ap.add_argument("--groups", help="comma-separated G values (default 2,3; quick 2)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per replica group for ours (torchft: always 1)")
    ap.add_argument("--calib", type=float, help="fault-free calibration seconds (default 8, quick 6)")
    ap.add_argument("--kill-every", type=float, default=10.0, help="mean seconds between kills (uniform +-30%%)")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="simulated compute per step")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--join-timeout-ms", type=int, default=10000)
    ap.add_argument("--op-timeout", type=float, default=10.0, help="manager collective/quorum timeout, s")
    ap.add_argument("--standby-delay", type=float, default=2.0, help="rallypoint run --standby-delay")
    ap.add_argument("--standby-wait", type=float, default=15.0,
                    help="before a kill, wait at most this long for the group's standby to be ready")
    ap.add_argument("--preload", default="",
                    help="rallypoint run --preload: modules the standbys import besides their defaults (none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--logs", help="copy each supervisor's output (and chaos.py's worker logs) into this folder")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    groups = [int(x) for x in (args.groups or ("2" if args.quick else "2,3")).split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    plan = {
        "duration_s": args.duration or (30.0 if args.quick else 60.0), "calib_s": args.calib or (6.0 if args.quick else 8.0),
        "kill_every_s": args.kill_every, "compute_ms": args.compute_ms, "op_timeout_s": args.op_timeout,
        "join_timeout_ms": args.join_timeout_ms, "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "startup_timeout_s": 120.0, "catchup_timeout_s": 15.0, "stop_timeout_s": 15.0, "stop_margin_steps": 10,
        "standby_delay_s": args.standby_delay, "standby_wait_s": args.standby_wait, "preload": args.preload,
        "nproc": args.nproc, "logs": args.logs,
    }
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for g in groups:
        for v in variants:
            rng = random.Random(args.seed * 1000 + g)  # the same kill schedule for every variant
            key = f"{v}_g{g}" + (f"_n{args.nproc}" if v == "ours" and args.nproc > 1 else "")
            try:
                results[key] = (run_ours(g, dict(plan), rng) if v == "ours" else
                                run_torchft(g, dict(plan), rng, 1.0 if v == "torchft_1s" else 0.0))
            except Exception as e:  # noqa: BLE001 - report and go on to the other runs
                results[key] = {"variant": v, "groups": g, "failed": str(e)[:2000]}
    wall = time.monotonic() - t_start
    load1 = os.getloadavg()[0]

    print(f"chaos_run: G replica groups x {args.nproc} rank(s) (torchft: 1), gloo/CPU loopback, torchft "
          f"{_util.torchft_version()}, {plan['compute_ms']:.0f} ms simulated compute/step, a SIGKILL to a rank every "
          f"~{plan['kill_every_s']:.0f} s; ours restarted by `rallypoint run` (warm standby, --standby-delay "
          f"{plan['standby_delay_s']:g}), torchft by an outside restart of a pre-imported standby 1 s / 0 s after the "
          f"kill; {plan['duration_s']:.0f} s chaos + {plan['calib_s']:.0f} s calibration per run; load avg "
          f"{load0:.2f} -> {load1:.2f}; {os.cpu_count()} CPUs; wall {wall:.0f} s")
    rows = []
    for key, r in results.items():
        if "failed" in r:
            rows.append([key, str(r["groups"]), "FAILED"] + ["-"] * 7)
            continue
        nk = len(r["kills"])
        kc = _fmt(r["median_kill_to_commit_s"]) + (f" ({r['never_committed']} never)" if r["never_committed"] else "")
        kcs = [k["kill_to_commit_s"] for k in r["kills"] if k["kill_to_commit_s"] is not None]
        notes = []
        if r.get("standby_not_ready"):
            notes.append(f"{r['standby_not_ready']} standby not ready")
        if r.get("skipped_kills"):
            notes.append(f"{r['skipped_kills']} skipped")
        if r.get("cold_restarts"):
            notes.append(f"{r['cold_restarts']} cold")
        rows.append([key, str(r["groups"]), fmt_ratio(r["goodput"]), f"{r['fault_free_steps_per_s']:.1f}",
                     f"{nk}" + (f" ({', '.join(notes)})" if notes else ""), kc,
                     _fmt(percentile(kcs, 90) if kcs else None),
                     _fmt(r["median_stall_s"]) + (f" ({r['stalled']} stalled)" if r["stalled"] else ""),
                     _fmt(r.get("median_restart_s")), "yes" if r.get("hashes_equal") else "NO"])
    print(table(["variant", "G", "goodput", "ff steps/s", "kills", "kill->1st commit (median)", "p90",
                 "survivor stall", "restart_s", "hashes equal"], rows))
    phases = ["detected", "ranks_started", "script_go", "model_built", "manager_built", "ddp_built", "quorum_asked", "quorum_got",
              "pg_configured", "heal_done", "first_step_end", "first_participating_commit"]
    brows = []
    for key, r in results.items():
        mb = r.get("median_breakdown_ms") or {}
        if mb:
            brows.append([key] + [("-" if mb.get(p) is None else f"{mb[p]:.0f}") for p in phases])
    if brows:
        print("\nwhere a restart's time goes (ms after the SIGKILL, median over kills; torchft: ranks_started = the "
              "outside release):")
        print(table(["variant"] + phases, brows))
    for key, r in results.items():
        if r.get("failed") or r.get("errors") or r.get("left_behind"):
            print(f"{key}: {r.get('failed') or ''} {r.get('errors') or ''} left behind: {r.get('left_behind')}",
                  file=sys.stderr)

    def get(v: str, g: int, k: str) -> Any:
        return results.get(f"{v}_g{g}" + (f"_n{args.nproc}" if v == "ours" and args.nproc > 1 else ""), {}).get(k)

    ratios: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for g in groups:
        for tv in ("torchft_0s", "torchft_1s"):
            ratios[f"kill_to_commit_g{g}_ours_vs_{tv}"] = ratio(get("ours", g, "median_kill_to_commit_s"),
                                                                get(tv, g, "median_kill_to_commit_s"))
            ratios[f"goodput_g{g}_ours_vs_{tv}"] = ratio(get("ours", g, "goodput"), get(tv, g, "goodput"))
            ratios[f"stall_g{g}_ours_vs_{tv}"] = ratio(get("ours", g, "median_stall_s"), get(tv, g, "median_stall_s"))
        kc = get("ours", g, "median_kill_to_commit_s")
        goals[f"ours_kill_to_commit_g{g}<=0.5s"] = _util.goal_met(kc, kc is not None and kc <= 0.5)
        target = {2: 0.93, 3: 0.95}.get(g)
        gp = get("ours", g, "goodput")
        if target is not None:
            goals[f"ours_goodput_g{g}>={target}"] = _util.goal_met(gp, gp is not None and gp >= target)
    _util.report_goals("chaos_run", plan, results, goals, ratios, args.out)
    if any(isinstance(r, dict) and r.get("failed") for r in results.values()):
        sys.exit(1)  # a run that failed is not a measurement


if __name__ == "__main__":
    main()
