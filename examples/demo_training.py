"""Kill-and-rejoin demo: kill a rank; ``rallypoint run`` brings its replica group back on its own.

Starts ``rallypoint lighthouse`` (SQLite state in a temp dir, a 5 s heartbeat timeout so
that the crash is visibly seen through the liveness stream, not the timeout) and three
replica groups of ``examples/train_ddp.py`` (two ranks each by default), each one
``rallypoint run --nproc-per-node N --replica-group-id G`` process: the supervisor hosts the
group's store, starts its ranks and restarts the whole group when one of them dies. The
demo shows a live table, SIGKILLs ONE rank process of one group in the middle of a step
and does nothing else: the survivors commit without that group, its ``rallypoint run``
notices, stops the group's other ranks and starts the group again, and the new ranks heal
from a live peer and rejoin. When ``rallypoint run`` keeps warm standbys (processes with
torch already imported that take a dead group's place), the demo waits until the victim
group's are ready before the kill, so the restart shows them at work (``--cold-restart``:
``rallypoint run --no-standby``, new processes). Then every rank stops at a common step
(``--stop-file``), every ``rallypoint run`` exits 0, and a sha256 of every rank's
parameters is compared.
Prints the timeline; exits 0 only when the kill, the restart by the supervisor and the
rejoin happened, every process exited 0 and all replicas are identical. Stops by itself,
loopback and OS-assigned ports only, leaves no process behind.

Run: ``python examples/demo_training.py`` (``--ranks 1,1,1`` for single-rank groups;
``--keep`` keeps each group's log, its supervisor's lines and its ranks' prefixed ones).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_ddp.py"
INSTRUMENTED = HERE / "demo" / "instrumented.py"
WAIT_S = 60.0  # bound of every phase's wait
STOP_S = 20.0  # SIGTERM to a process at the end, then this long before SIGKILL
PROGRESS_RE = re.compile(r"g(\d+)\.r(\d+)\.i(\d+)\.jsonl$")
# a log line's time: the supervisor's own lines start with it, a rank's after its "[g2 r1] " prefix
STAMP_RE = re.compile(r"^(?:\[g\S+ \S+\] )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # resolved here, not in the forked child


def _die_with_demo() -> None:
    """``preexec_fn`` of the supervisors and the lighthouse (Linux): SIGTERM when the demo
    dies, even by SIGKILL, so a supervisor stops its ranks instead of training on."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def alive(pid: int, start: int | None = None) -> bool:
    """Running (not a zombie), and the same process as the one that started at ``start``."""
    st = proc_stat(pid)
    return st is not None and st[0] != "Z" and (start is None or st[2] == start)


def descendants(roots: list[int]) -> list[int]:
    """Every live process below ``roots`` (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st[0] != "Z":
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def standbys(sup: int) -> dict[int, bool | None]:
    """The warm standby processes ``rallypoint run`` (pid ``sup``) keeps, if any: pid ->
    whether it says it is ready (the file it creates once its imports are done; None when
    it does not say)."""
    out: dict[int, bool | None] = {}
    for pid in descendants([sup]):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--standby" not in argv:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        ready = env.get(b"RALLYPOINT_STANDBY_READY")
        out[pid] = os.path.exists(ready) if ready else None
    return out


def log_time(line: str) -> float | None:
    m = STAMP_RE.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


class Group:
    """One replica group: its ``rallypoint run`` process, its log, the records of its ranks."""

    def __init__(self, gid: int, ranks: int, log: Path) -> None:
        self.gid, self.ranks, self.log = gid, ranks, log
        self.sup: subprocess.Popen | None = None
        self.log_offset = 0
        self.lines: list[str] = []  # its log so far: the supervisor's lines and its ranks', prefixed
        self.events: list[tuple[float, dict[str, Any]]] = []  # the supervisor's JSON events, with their time
        self.last: dict[tuple[int, int], dict[str, Any]] = {}  # (incarnation, rank) -> latest record
        self.incarnation = 0  # the newest one whose records were seen
        self.state = "starting"

    def latest(self, rank: int = 0) -> dict[str, Any]:
        return self.last.get((self.incarnation, rank), {})


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="rallypoint-train-demo-"))
        self.stop_file = self.dir / "stop"  # the step every rank stops at
        self.lighthouse: subprocess.Popen | None = None
        sizes = [int(n) for n in args.ranks.split(",")]
        self.groups = [Group(g, n, self.dir / f"g{g}.log") for g, n in enumerate(sizes)]
        self.offsets: dict[Path, int] = {}
        self.records: list[dict[str, Any]] = []  # every progress record, in arrival order
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, what) of every process started
        self.last_scan = 0.0
        self.t0 = time.time()
        self.tty = sys.stdout.isatty()
        self.table_lines = 0
        self.last_plain = 0.0
        self.status: dict[str, Any] = {}
        self.last_status = 0.0
        self.http = ""
        self.lh = ""

    # ------------------------------------------------------------------ processes
    def say(self, msg: str) -> None:
        self.clear_table()
        print(f"[{time.time() - self.t0:6.2f}s] {msg}", flush=True)

    def track(self, pid: int, what: str) -> None:
        st = proc_stat(pid)
        if st is not None and pid not in self.seen:
            self.seen[pid] = (st[2], what)

    def start_lighthouse(self) -> None:
        state = self.dir / "lighthouse.db"
        min_replicas = min(2, len(self.groups) - 1) or 1  # the survivors of one death still form a quorum
        cmd = [sys.executable, "-m", "rallypoint", "--log-level", "INFO", "lighthouse",
               "--min-replicas", str(min_replicas), "--join-timeout-ms", "1000",
               "--heartbeat-timeout-ms", str(self.args.heartbeat_timeout_ms),
               "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--state", str(state)]
        with open(self.dir / "lighthouse.log", "w") as err:
            self.lighthouse = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                               text=True, preexec_fn=_die_with_demo)
        self.track(self.lighthouse.pid, "lighthouse")
        deadline = time.time() + WAIT_S
        line = ""
        out = self.lighthouse.stdout
        assert out is not None
        while time.time() < deadline and not line:
            if self.lighthouse.poll() is not None:
                raise RuntimeError(f"the lighthouse exited: {(self.dir / 'lighthouse.log').read_text()[-2000:]}")
            if select.select([out], [], [], 0.2)[0]:
                line = out.readline()
        if not line:
            raise TimeoutError("the lighthouse did not report its ports in time")
        info = json.loads(line)
        self.lh, self.http = info["local"], info["http"]
        self.say(f"lighthouse up: gRPC {self.lh}, dashboard {self.http}, --min-replicas {min_replicas}")

    def run_command(self, g: Group) -> list[str]:
        progress = self.dir / "g{group}.r{rank}.i{restart}.jsonl"  # filled in by each rank (demo/instrumented.py)
        # The example runs under demo/instrumented.py, which records each step and stops it at the stop file.
        return [sys.executable, "-m", "rallypoint", "--log-level", "INFO", "run",
                "--nproc-per-node", str(g.ranks), "--replica-group-id", str(g.gid), "--lighthouse", self.lh,
                *(["--no-standby"] if self.args.cold_restart else []),
                str(INSTRUMENTED), "--progress", str(progress), "--stop-file", str(self.stop_file),
                str(TRAIN), "--steps", "100000", "--sleep", str(self.args.sleep), "--batch-size", "32",
                "--timeout", "10", "--log-level", "INFO"]

    def start_group(self, g: Group) -> None:
        env = dict(os.environ, NUM_REPLICA_GROUPS=str(len(self.groups)), TORCH_CPP_LOG_LEVEL="ERROR",
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        for k in ("TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE", "REPLICA_GROUP_ID", "RANK", "LOCAL_RANK",
                  "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(k, None)
        cmd = self.run_command(g)
        with open(g.log, "w") as log:
            g.sup = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_demo)
        self.track(g.sup.pid, f"rallypoint run of group {g.gid}")
        self.say(f"started group {g.gid}: `rallypoint run --nproc-per-node {g.ranks} --replica-group-id {g.gid} "
                 f"... train_ddp.py ...` (pid {g.sup.pid})")

    def kill_rank(self, g: Group, rank: int) -> tuple[float, int]:
        """SIGKILL one rank process of ``g`` by the pid its progress records carry: (time, pid)."""
        rec = g.latest(rank)
        pid = int(rec["pid"])
        assert g.sup is not None
        if g.sup.pid not in self.ancestors(pid):
            raise RuntimeError(f"pid {pid} (rank {rank} of group {g.gid}) is not a process of its rallypoint run")
        os.kill(pid, signal.SIGKILL)
        t = time.time()
        g.state = "killed"
        deadline = time.time() + 10
        while alive(pid) and time.time() < deadline:  # not our child: its supervisor reaps it
            time.sleep(0.01)
        if alive(pid):
            raise RuntimeError(f"pid {pid} survived SIGKILL")
        return t, pid

    @staticmethod
    def ancestors(pid: int) -> list[int]:
        out: list[int] = []
        while (st := proc_stat(pid)) is not None and st[1] > 1 and len(out) < 64:
            pid = st[1]
            out.append(pid)
        return out

    @staticmethod
    def stop_processes(procs: list[tuple[subprocess.Popen, str]]) -> None:
        """SIGTERM to each that still runs (a supervisor stops its ranks, the lighthouse shuts
        down), then SIGKILL to any still running STOP_S later."""
        running = [(p, what) for p, what in procs if p.poll() is None]
        for p, _ in running:
            p.send_signal(signal.SIGTERM)
        deadline = time.time() + STOP_S
        for p, what in running:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                print(f"warning: {what} (pid {p.pid}) ignored SIGTERM for {STOP_S:.0f}s; SIGKILL", file=sys.stderr)
                p.kill()
                p.wait(10)

    def close(self) -> list[str]:
        """Stop whatever still runs, by pid; the processes left behind (killed here), if any."""
        self.scan()
        self.stop_processes([(g.sup, f"rallypoint run of group {g.gid}") for g in self.groups if g.sup is not None])
        if self.lighthouse is not None:
            self.stop_processes([(self.lighthouse, "the lighthouse")])
        deadline = time.time() + 5.0  # a rank or standby notices its supervisor's exit within milliseconds
        while time.time() < deadline and any(alive(pid, start) for pid, (start, _) in self.seen.items()):
            time.sleep(0.05)
        left = []
        for pid, (start, what) in self.seen.items():
            if alive(pid, start):
                left.append(f"{what} (pid {pid})")
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.args.keep:
            print(f"kept {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left

    # ------------------------------------------------------------------ watching
    def scan(self) -> None:
        """Note every process below the supervisors (store hosts, ranks), for the final check."""
        sups = [g.sup.pid for g in self.groups if g.sup is not None and g.sup.poll() is None]
        for pid in descendants(sups):
            self.track(pid, "a process of rallypoint run")
        self.last_scan = time.time()

    def poll(self) -> None:
        """Read new progress and log lines, refresh the lighthouse status and the table."""
        for f in sorted(self.dir.glob("g*.r*.i*.jsonl")):
            m = PROGRESS_RE.search(f.name)
            if not m:
                continue
            gid, rank, inc = map(int, m.groups())
            with open(f) as fh:
                fh.seek(self.offsets.get(f, 0))
                data = fh.read()
            end = data.rfind("\n") + 1
            self.offsets[f] = self.offsets.get(f, 0) + end
            g = self.groups[gid]
            for line in data[:end].splitlines():
                rec = json.loads(line)
                rec["inc"] = inc
                self.records.append(rec)
                g.last[(inc, rank)] = rec
                self.track(int(rec["pid"]), f"rank {rank} of group {gid}")
                if inc > g.incarnation:
                    g.incarnation, g.state = inc, "restarted"
                if g.state in ("starting", "restarted") and inc == g.incarnation and rec["event"] == "step" \
                        and rec["committed"]:
                    g.state = "training"
        for g in self.groups:
            if not g.log.exists():
                continue
            with open(g.log, "rb") as fb:
                fb.seek(g.log_offset)
                raw = fb.read()
            end = raw.rfind(b"\n") + 1
            g.log_offset += end
            for line in raw[:end].decode("utf-8", "replace").splitlines():
                g.lines.append(line)
                if " rallypoint.run: {" in line and (t := log_time(line)) is not None:
                    try:
                        g.events.append((t, json.loads(line.split(" rallypoint.run: ", 1)[1])))
                    except ValueError:
                        pass
        now = time.time()
        if now - self.last_scan > 1.0:
            self.scan()
        if now - self.last_status > 0.3:
            self.last_status = now
            try:
                with urllib.request.urlopen(self.http + "/status", timeout=1.0) as r:
                    self.status = json.loads(r.read())
            except Exception:  # noqa: BLE001 - the table just shows the previous status
                pass
        self.table()

    def wait_for(self, what: str, cond: Any, timeout: float = WAIT_S) -> Any:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.poll()
            got = cond()
            if got:
                return got
            for g in self.groups:
                if g.state != "stopping" and g.sup is not None and g.sup.poll() is not None:
                    raise RuntimeError(f"rallypoint run of group {g.gid} exited (code {g.sup.returncode}) "
                                       f"unexpectedly; see its log below")
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def tail(self, g: Group, n: int = 25) -> str:
        lines = g.log.read_text(errors="replace").splitlines() if g.log.exists() else []
        return f"--- group {g.gid}: {g.log.name} (last {n} lines)\n" + "\n".join(lines[-n:])

    def quorum_groups(self) -> list[int]:
        q = (self.status or {}).get("quorum") or {}
        return sorted(int(m["replica_id"].split(":")[0]) for m in q.get("members", []))

    def table(self) -> None:
        rows = [f"t={time.time() - self.t0:6.2f}s  quorum {self.status.get('quorum_id', '-')}: groups "
                f"{self.quorum_groups()}",
                "group ranks  run pid restarts state      step participants commits(batches) heals sha256"]
        for g in self.groups:
            r = g.latest(0)
            sha = (r.get("sha256") or "")[:12]
            pid = g.sup.pid if g.sup is not None else "-"
            rows.append(f"{g.gid:>5} {g.ranks:>5} {pid:>8} {g.incarnation:>8} {g.state:<10} {r.get('step', '-'):>4} "
                        f"{r.get('participants', '-'):>12} {r.get('batches_committed', '-'):>16} "
                        f"{r.get('heals', '-'):>5} {sha}")
        if self.tty:
            self.clear_table()
            print("\n".join(rows), flush=True)
            self.table_lines = len(rows)
        elif time.time() - self.last_plain > 3.0:  # not a terminal: a plain reprint now and then
            self.last_plain = time.time()
            print("\n".join(rows), flush=True)

    def clear_table(self) -> None:
        if self.tty and self.table_lines:
            sys.stdout.write(f"\x1b[{self.table_lines}F\x1b[J")
            self.table_lines = 0

    def steps(self, gids: list[int], after: float, participants: int, inc: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == "step" and r["group"] in gids and r["t"] > after
                and r["committed"] and r["participants"] == participants and (inc is None or r["inc"] == inc)]

    def first_line(self, groups: list[Group], pattern: str, after: float) -> float | None:
        """Time of the first log line matching ``pattern`` after ``after`` in the groups' logs."""
        times = [t for g in groups for line in g.lines
                 if re.search(pattern, line) and (t := log_time(line)) is not None and t > after]
        return min(times) if times else None

    # ------------------------------------------------------------------ the story
    def run(self) -> int:
        n = len(self.groups)
        self.start_lighthouse()
        for g in self.groups:
            self.start_group(g)
        full = lambda: self.steps(list(range(n)), 0, n)  # noqa: E731
        self.wait_for("all groups to train together", lambda: len(full()) >= 3 * sum(x.ranks for x in self.groups),
                      timeout=self.args.startup_timeout)
        self.say(f"all {n} groups committing together at step {max(r['step'] for r in full())}")

        # Kill one rank of the last group, halfway into a step's simulated compute.
        victim = self.groups[-1]
        assert victim.sup is not None
        spares = standbys(victim.sup.pid)
        if spares and all(v is not None for v in spares.values()):  # rallypoint run keeps warm standbys
            t_spares = time.time()
            try:
                self.wait_for("the victim's warm standbys", lambda: all(standbys(victim.sup.pid).values()))
                self.say(f"group {victim.gid}'s warm standbys are ready ({time.time() - t_spares:.1f} s wait): "
                         f"pids {sorted(spares)}")
            except TimeoutError:
                self.say(f"group {victim.gid}'s warm standbys are not ready after {WAIT_S:.0f} s; killing anyway")
        vrank = victim.ranks - 1  # with several ranks, not the one hosting the group's ManagerServer
        survivors = [g for g in self.groups if g is not victim]
        old_inc = victim.incarnation
        self.poll()
        f = self.dir / f"g{victim.gid}.r{vrank}.i{old_inc}.jsonl"
        size, deadline = f.stat().st_size, time.time() + WAIT_S
        while f.stat().st_size == size and time.time() < deadline:  # the end of a step, seen within ms
            time.sleep(0.005)
        self.poll()
        end = victim.latest(vrank).get("t", time.time())
        time.sleep(max(0.0, end + self.args.sleep / 2 - time.time()))  # into the next step's simulated compute
        t_kill, pid = self.kill_rank(victim, vrank)
        self.poll()
        kill_step = victim.last[(old_inc, vrank)]["step"]  # its last record: the step it was in
        self.say(f"SIGKILLed rank {vrank} of group {victim.gid} (pid {pid}) during step {kill_step}; "
                 f"from now on the demo only watches")

        smaller = self.wait_for("the survivors to commit without the victim", lambda: self.steps(
            [g.gid for g in survivors], t_kill, n - 1))[0]
        self.say(f"survivors committed step {smaller['step'] - 1} in a quorum of {n - 1}, "
                 f"{(smaller['t'] - t_kill) * 1000:.0f} ms after the kill")
        t_restart, restart = self.wait_for("rallypoint run to restart the group", lambda: next(
            ((t, e) for t, e in victim.events if e.get("event") == "restart" and t > t_kill - 1), None))
        inc = int(restart["incarnation"])
        self.say(f"rallypoint run restarted group {victim.gid} ({restart.get('cause')} of rank {restart.get('rank')}; "
                 f"new ranks started {restart.get('restart_s')} s after it noticed)")
        ready = self.wait_for("the restarted group's manager", lambda: [
            r for r in self.records if r["group"] == victim.gid and r["inc"] == inc and r["event"] == "ready"])[0]
        heals = self.wait_for("the restarted group to heal", lambda: (lambda h: h if len(h) == victim.ranks else None)(
            [r for r in self.records if r["group"] == victim.gid and r["inc"] == inc and "heal" in r]))
        rejoin = self.wait_for("a commit in the full quorum", lambda: self.steps([victim.gid], t_kill, n, inc))[0]
        self.say(f"group {victim.gid} healed to step {heals[0]['step'] - 1} and committed step {rejoin['step'] - 1} "
                 f"in the full quorum")

        # Stop every rank at a common step; every rallypoint run then exits 0 by itself.
        target = max(r["step"] for r in self.records if r["event"] == "step") + self.args.extra_steps
        self.stop_file.write_text(str(target))
        for g in self.groups:
            g.state = "stopping"
        self.say(f"stopping every rank at step {target} (--stop-file)")
        t_stop = time.time()
        # Ranks leave as they reach it: a replica that says goodbye while a slower peer is
        # still in the last step's collectives gives them time to finish (the Manager's
        # goodbye grace), so nothing here holds the faster ones back.
        self.wait_for("every rank to reach the stop step", lambda: all(
            g.latest(r).get("event") == "exit" for g in self.groups for r in range(g.ranks)))
        self.wait_for("every rallypoint run to exit", lambda: all(
            g.sup is not None and g.sup.poll() is not None for g in self.groups))
        t_exit = time.time()
        self.poll()
        codes = {g.gid: g.sup.returncode for g in self.groups if g.sup is not None}
        for g in self.groups:
            g.state = f"exit {codes[g.gid]}"
        finals = [g.last.get((g.incarnation, r), {}) for g in self.groups for r in range(g.ranks)]
        ok_exit = all(c == 0 for c in codes.values()) and all(
            f.get("event") == "exit" and f.get("rc") == 0 and f.get("step") == target for f in finals)
        hashes = {f.get("sha256") for f in finals}
        identical = ok_exit and len(hashes) == 1
        restarts = [e for g in self.groups for _, e in g.events if e.get("event") == "restart"]
        self.clear_table()

        noticed = self.first_line([victim], rf"rallypoint\.run: .*rank {vrank} failed", t_kill - 1)
        told = self.first_line(survivors, r"reports replica \S+ down|went down|is down", t_kill)
        h = heals[0]["heal"]
        transfer = h.get("transfer_s")
        warm = restart.get("warm_ranks")
        how = (f"warm standbys for rank(s) {warm}" if warm else "new processes, cold") if warm is not None else ""
        rs = restart.get("restart_s")
        events = [
            (0.0, f"SIGKILL rank {vrank} of group {victim.gid} (pid {pid}, incarnation {old_inc}) during step "
                  f"{kill_step}; nothing else is done to the group"),
            (smaller["t"] - t_kill, f"survivors commit step {smaller['step'] - 1} in a quorum of {n - 1}"),
            (t_restart - t_kill, f"rallypoint run of group {victim.gid} starts the group again as incarnation {inc}"
                                 + (f" ({how})" if how else "") + f": restart event cause={restart.get('cause')!r}, "
                                 f"rank {restart.get('rank')}, backoff {restart.get('backoff_s')} s, restart_s {rs}"),
            (ready["t"] - t_kill, f"its manager is ready ({ready['t'] - t_restart:.2f} s after the restart)"),
            (h["t"] - t_kill, f"healed to step {heals[0]['step'] - 1} from a live peer: {h['bytes'] / 1024:.1f} KiB "
                              f"per rank" + (f", transfer {transfer * 1000:.0f} ms" if transfer is not None else "")
                              + f", heal step {h['step_s']:.2f} s"),
            (rejoin["t"] - t_kill, f"first commit in the full quorum of {n} (step {rejoin['step'] - 1}, "
                                   f"{rejoin['t'] - t_restart:.2f} s after the restart)"),
            (t_exit - t_kill, f"every rank stopped at step {target} and exited 0, every rallypoint run exited "
                              f"({t_exit - t_stop:.2f} s after the stop file)" if ok_exit else
                              f"every rallypoint run exited ({t_exit - t_stop:.2f} s after the stop file)"),
        ]
        if told:
            events.append((told - t_kill, f"survivors told of the death by the lighthouse (liveness stream; the "
                                          f"heartbeat timeout is {self.args.heartbeat_timeout_ms} ms)"))
        if noticed:
            events.append((noticed - t_kill, f"rallypoint run of group {victim.gid} sees rank {vrank} die "
                                             f"({restart.get('cause')})"
                                             + (" and stops the group's other rank(s)" if victim.ranks > 1 else "")))
        print("\ntimeline (t = 0 at the kill)")
        for dt, what in sorted(events, key=lambda e: e[0]):
            print(f"  {dt:8.3f}s  {what}")
        print(f"\nrestarts by rallypoint run: {len(restarts)}; exit codes of rallypoint run: "
              + ", ".join(f"group {gid}: {c}" for gid, c in codes.items()))
        print(f"all {len(finals)} ranks stopped at step {target}: " + ", ".join(
            f"g{f.get('group')}r{f.get('rank')}@{f.get('step')}={(f.get('sha256') or '?')[:12]}" for f in finals))
        print(f"replicas identical: {'yes' if identical else 'no'}")
        return 0 if identical and len(restarts) == 1 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,2,2", help="ranks of each replica group; all equal (2,2,2)")
    ap.add_argument("--sleep", type=float, default=0.1, help="simulated compute seconds per step (0.1)")
    ap.add_argument("--extra-steps", type=int, default=3, help="steps after the rejoin before stopping (3)")
    ap.add_argument("--startup-timeout", type=float, default=150.0, help="seconds to wait for every group to "
                    "start training (150: importing torch in many processes is slow on a busy machine)")
    ap.add_argument("--cold-restart", action="store_true", help="rallypoint run --no-standby: the killed group "
                    "restarts as new processes (importing torch) instead of taking over warm standbys")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, progress files)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    args = ap.parse_args()
    sizes = args.ranks.split(",")
    if len(sizes) < 2:
        ap.error("--ranks: at least two replica groups (one is killed, the others carry on)")
    if len(set(sizes)) != 1:
        print("note: replica groups of different sizes: group rank g averages with group rank g of every "
              "group, so the extra ranks have no peers; expect failures", file=sys.stderr)
    if args.cold_restart and "--no-standby" not in subprocess.run(
            [sys.executable, "-m", "rallypoint", "run", "--help"], capture_output=True, text=True, timeout=60).stdout:
        args.cold_restart = False  # this rallypoint run keeps no standbys: every restart is cold anyway
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    demo = Demo(args)
    t = time.time()
    try:
        rc = demo.run()
    except (TimeoutError, RuntimeError) as e:
        demo.clear_table()
        print(f"demo failed: {e}", file=sys.stderr)
        for g in demo.groups:
            print(demo.tail(g), file=sys.stderr)
        lh = demo.dir / "lighthouse.log"
        print("--- lighthouse.log\n" + "\n".join(lh.read_text().splitlines()[-15:]) if lh.exists() else "",
              file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        demo.clear_table()
        print("interrupted; stopping every process", file=sys.stderr)
        rc = 130
    finally:
        left = demo.close()
    pids = " ".join(str(p) for p in sorted(demo.seen))
    print(f"processes: {len(demo.seen)} started, {len(left)} left behind{': ' + ', '.join(left) if left else ''} "
          f"(pids {pids})")
    print(f"demo took {time.time() - t:.1f} s")
    return rc if not left else (rc or 1)


if __name__ == "__main__":
    raise SystemExit(main())
