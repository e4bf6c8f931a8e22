"""Kill-and-rejoin demo: real DDP training (examples/train_ddp.py) survives a SIGKILLed replica.

Starts ``rallypoint lighthouse`` (SQLite state in a temp dir, ``--min-replicas 2``, a
5 s heartbeat timeout so that the crash is visibly seen through the liveness stream,
not the timeout), three replica groups of ``examples/train_ddp.py`` (two ranks each by
default), shows a live table, SIGKILLs every process of one group in the middle of a
step, restarts it a second later, watches it heal from a live peer and rejoin, stops all
groups at a common step and compares a sha256 of the parameters of every rank.
Prints the timeline; exits 0 only when the kill and rejoin happened and all replicas
are identical. Stops by itself, loopback and OS-assigned ports only, leaves no process.

Run: ``python examples/demo_training.py`` (``--ranks 1,1,1`` for single-rank groups).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
WAIT_S = 60.0  # bound of every phase's wait


_STORES: list[Any] = []  # the groups' TCPStores, hosted here for the demo's lifetime


def host_store() -> int:
    """Host one replica group's TCPStore here, as torchrun's agent would, on a port the OS
    picks; its ranks connect to it through MASTER_ADDR/MASTER_PORT. A new one for every
    incarnation, so a restarted group never reads its predecessor's keys."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)
    return int(store.port)


class Group:
    """One replica group: its rank processes (one incarnation at a time) and their progress."""

    def __init__(self, gid: int, ranks: int) -> None:
        self.gid, self.ranks = gid, ranks
        self.procs: list[subprocess.Popen] = []
        self.files: list[Path] = []
        self.offsets: dict[Path, int] = {}
        self.last: dict[int, dict[str, Any]] = {}  # rank -> latest record of this incarnation
        self.incarnation = 0
        self.state = "-"
        self.spare: tuple[list[subprocess.Popen], list[Path]] | None = None

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="rallypoint-train-demo-"))
        self.stop_file = self.dir / "stop"
        self.lighthouse: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []  # everything started, for cleanup by pid
        sizes = [int(n) for n in args.ranks.split(",")]
        self.groups = [Group(g, n) for g, n in enumerate(sizes)]
        self.records: list[dict[str, Any]] = []  # every progress record, in arrival order
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

    def start_lighthouse(self) -> None:
        state = self.dir / "lighthouse.db"
        cmd = [sys.executable, "-m", "rallypoint", "--log-level", "INFO", "lighthouse", "--min-replicas", "2",
               "--join-timeout-ms", "1000", "--heartbeat-timeout-ms", str(self.args.heartbeat_timeout_ms),
               "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--state", str(state)]
        err = open(self.dir / "lighthouse.log", "w")
        self.lighthouse = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        self.procs.append(self.lighthouse)
        deadline = time.time() + WAIT_S
        line = ""
        while time.time() < deadline and not line:
            if self.lighthouse.poll() is not None:
                raise RuntimeError(f"the lighthouse exited: {(self.dir / 'lighthouse.log').read_text()[-2000:]}")
            import select

            if select.select([self.lighthouse.stdout], [], [], 0.2)[0]:
                line = self.lighthouse.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise TimeoutError("the lighthouse did not report its ports in time")
        info = json.loads(line)
        self.lh, self.http = info["local"], info["http"]
        self.say(f"lighthouse up: gRPC {self.lh}, dashboard {self.http}, state {state}")

    def start_group(self, g: Group, standby: bool = False) -> None:
        """Start the group's ranks; ``standby``: a replacement that imports everything now
        and joins when :meth:`release` creates its wait file."""
        inc = g.incarnation + 1
        procs, files = [], []
        wait = ["--wait-file", str(self.dir / f"go.g{g.gid}")] if standby else []
        port = host_store()
        for rank in range(g.ranks):
            env = dict(os.environ, REPLICA_GROUP_ID=str(g.gid), NUM_REPLICA_GROUPS=str(len(self.groups)),
                       RALLYPOINT_LIGHTHOUSE=self.lh, RANK=str(rank), WORLD_SIZE=str(g.ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_CPP_LOG_LEVEL="ERROR",
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            env.pop("TORCHFT_LIGHTHOUSE", None)
            progress = self.dir / f"g{g.gid}.r{rank}.{inc}.jsonl"
            log = open(self.dir / f"g{g.gid}.r{rank}.{inc}.log", "w")
            p = subprocess.Popen(
                [sys.executable, str(TRAIN), "--steps", "100000", "--sleep", str(self.args.sleep),
                 "--batch-size", "32", "--progress", str(progress), "--stop-file", str(self.stop_file),
                 "--max-seconds", "170", "--timeout", "10", "--log-level", "INFO", *wait],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            log.close()
            self.procs.append(p)
            procs.append(p)
            files.append(progress)
        if standby:
            g.spare = (procs, files)
            self.say(f"started a stand-by replacement for group {g.gid} (pids {[p.pid for p in procs]})")
            return
        g.incarnation, g.procs, g.files, g.last, g.state = inc, procs, files, {}, "starting"
        self.say(f"started group {g.gid} ({g.ranks} rank(s), pids {[p.pid for p in procs]}, store port {port})")

    def release(self, g: Group) -> None:
        """Let the stand-by replacement of ``g`` join (its pre-warmed restart)."""
        assert g.spare is not None
        g.incarnation += 1
        (g.procs, g.files), g.spare, g.last, g.state = g.spare, None, {}, "starting"
        (self.dir / f"go.g{g.gid}").touch()
        self.say(f"restarted group {g.gid} from its stand-by processes (pids {[p.pid for p in g.procs]})")

    def kill_group(self, g: Group) -> float:
        for p in g.procs:  # every process of the group, by pid, back to back
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        t = time.time()
        for p in g.procs:
            p.wait(10)
        g.state = "killed"
        return t

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                print(f"warning: pid {p.pid} did not exit", file=sys.stderr)
        if self.args.keep:
            print(f"kept {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ watching
    def poll(self) -> None:
        """Read new progress lines, refresh the lighthouse status and the table."""
        for g in self.groups:
            for f in g.files:
                if not f.exists():
                    continue
                with open(f) as fh:
                    fh.seek(g.offsets.get(f, 0))
                    data = fh.read()
                end = data.rfind("\n") + 1
                g.offsets[f] = g.offsets.get(f, 0) + end
                for line in data[:end].splitlines():
                    rec = json.loads(line)
                    rec["inc"] = g.incarnation
                    self.records.append(rec)
                    g.last[rec["rank"]] = rec
                    if g.state == "starting" and rec["event"] == "step" and rec["committed"]:
                        g.state = "training"
        now = time.time()
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
                if g.state not in ("killed", "stopping") and g.procs and not g.alive():
                    raise RuntimeError(f"group {g.gid} exited unexpectedly; see its log:\n{self.tail(g)}")
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def tail(self, g: Group) -> str:
        out = []
        for r in range(g.ranks):
            p = self.dir / f"g{g.gid}.r{r}.{g.incarnation}.log"
            out.append(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:]) if p.exists() else "")
        return "\n".join(out)

    def quorum_groups(self) -> list[int]:
        q = (self.status or {}).get("quorum") or {}
        return sorted(int(m["replica_id"].split(":")[0]) for m in q.get("members", []))

    def table(self) -> None:
        rows = [f"t={time.time() - self.t0:6.2f}s  quorum {self.status.get('quorum_id', '-')}: groups "
                f"{self.quorum_groups()}",
                "group ranks state     step participants commits(batches) heals sha256"]
        for g in self.groups:
            r = g.last.get(0, {})
            sha = (r.get("sha256") or "")[:12]
            rows.append(f"{g.gid:>5} {g.ranks:>5} {g.state:<9} {r.get('step', '-'):>4} {r.get('participants', '-'):>12} "
                        f"{r.get('batches_committed', '-'):>16} {r.get('heals', '-'):>5} {sha}")
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

    def steps(self, gids: list[int], after: float, participants: int) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == "step" and r["group"] in gids and r["t"] > after
                and r["committed"] and r["participants"] == participants]

    def log_time(self, g: Group, inc: int, pattern: str, after: float) -> float | None:
        """Time of the first line matching ``pattern`` after ``after`` in the group's logs."""
        best = None
        for r in range(g.ranks):
            p = self.dir / f"g{g.gid}.r{r}.{inc}.log"
            for line in p.read_text(errors="replace").splitlines() if p.exists() else []:
                m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
                if m and re.search(pattern, line):
                    t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    if t > after and (best is None or t < best):
                        best = t
        return best

    # ------------------------------------------------------------------ the story
    def run(self) -> int:
        n = len(self.groups)
        self.start_lighthouse()
        victim = next((g for g in reversed(self.groups) if g.ranks == 1), self.groups[-1])
        for g in self.groups:
            self.start_group(g)
        if not self.args.cold_restart:
            self.start_group(victim, standby=True)
        full = lambda: self.steps(list(range(n)), 0, n)  # noqa: E731
        self.wait_for("all groups to train together", lambda: len(full()) >= 3 * sum(x.ranks for x in self.groups),
                      timeout=self.args.startup_timeout)
        self.say(f"all {n} groups committing together at step {max(r['step'] for r in full())}")
        if victim.spare is not None:
            self.wait_for("the stand-by replacement", lambda: all(
                f.exists() and "standby" in f.read_text() for f in victim.spare[1]))  # type: ignore[index]
        survivors = [g.gid for g in self.groups if g is not victim]
        seen = len(self.records)
        self.wait_for("a step of the victim", lambda: any(r["group"] == victim.gid and r["event"] == "step"
                                                         for r in self.records[seen:]))
        time.sleep(self.args.sleep / 2)  # into the next step's simulated compute
        t_kill = self.kill_group(victim)
        self.poll()  # the records the victim wrote before it died
        kill_step = victim.last[0]["step"]  # the step it was in
        self.say(f"SIGKILLed group {victim.gid} (pids {[p.pid for p in victim.procs]}) during step {kill_step}")
        smaller = self.wait_for("the survivors to commit without the victim",
                                lambda: self.steps(survivors, t_kill, n - 1))[0]
        detect_t = min([t for g in self.groups if g is not victim
                        for t in [self.log_time(g, g.incarnation, r"reports replica \S+ down|went down|is down", t_kill)] if t] or [0]) or None
        self.say(f"survivors committed step {smaller['step'] - 1} in a quorum of {n - 1}, "
                 f"{(smaller['t'] - t_kill) * 1000:.0f} ms after the kill")
        self.wait_for("a second", lambda: time.time() > t_kill + 1.0)
        t_restart = time.time()
        self.start_group(victim) if victim.spare is None else self.release(victim)
        inc = victim.incarnation
        ready = self.wait_for("the restarted group's manager", lambda: [
            r for r in self.records if r["group"] == victim.gid and r["inc"] == inc and r["event"] == "ready"])[0]
        heals = self.wait_for("the restarted group to heal", lambda: (lambda h: h if len(h) == victim.ranks else None)(
            [r for r in self.records if r["group"] == victim.gid and r["inc"] == inc and "heal" in r]))
        rejoin = self.wait_for("a commit in the full quorum", lambda: self.steps([victim.gid], t_restart, n))[0]
        self.say(f"group {victim.gid} healed to step {heals[0]['step'] - 1} and committed step {rejoin['step'] - 1} "
                 f"in the full quorum")
        target = max(r["step"] for r in self.records if r["event"] == "step") + self.args.extra_steps
        self.stop_file.write_text(str(target))
        for g in self.groups:
            g.state = "stopping"
        self.say(f"stopping every group at step {target}")
        self.wait_for("every rank to stop", lambda: all(not g.alive() for g in self.groups))
        self.poll()
        finals = [g.last.get(r, {}) for g in self.groups for r in range(g.ranks)]
        ok_steps = all(f.get("event") == "exit" and f.get("step") == target for f in finals)
        hashes = {f.get("sha256") for f in finals}
        identical = ok_steps and len(hashes) == 1
        self.clear_table()

        h = heals[0]["heal"]
        transfer = h.get("transfer_s")
        print("\ntimeline (t = 0 at the kill)")
        print(f"  {0.0:8.3f}s  SIGKILL group {victim.gid} ({victim.ranks} process(es)) during step {kill_step}")
        if detect_t:
            print(f"  {detect_t - t_kill:8.3f}s  survivors told of the death (liveness stream; heartbeat timeout "
                  f"is {self.args.heartbeat_timeout_ms} ms)")
        print(f"  {smaller['t'] - t_kill:8.3f}s  survivors commit step {smaller['step'] - 1} in a quorum of {n - 1} "
              f"({(smaller['t'] - t_kill) * 1000:.0f} ms after the kill)")
        how = "from scratch" if self.args.cold_restart else "(stand-by processes, torch already imported)"
        print(f"  {t_restart - t_kill:8.3f}s  group {victim.gid} restarted {how}")
        print(f"  {ready['t'] - t_kill:8.3f}s  its manager is ready ({ready['t'] - t_restart:.2f} s after the restart)")
        print(f"  {h['t'] - t_kill:8.3f}s  healed to step {heals[0]['step'] - 1} from a live peer: "
              f"{h['bytes'] / 1024:.1f} KiB per rank"
              + (f", transfer {transfer * 1000:.0f} ms" if transfer is not None else "")
              + f", heal step {h['step_s']:.2f} s")
        print(f"  {rejoin['t'] - t_kill:8.3f}s  first commit in the full quorum of {n} (step {rejoin['step'] - 1}, "
              f"{rejoin['t'] - t_restart:.2f} s after the restart)")
        print(f"\nall {len(finals)} ranks stopped at step {target}: " + ", ".join(
            f"g{f.get('group')}r{f.get('rank')}@{f.get('step')}={(f.get('sha256') or '?')[:12]}" for f in finals))
        print(f"replicas identical: {'yes' if identical else 'no'}")
        return 0 if identical else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,2,2", help="ranks of each replica group; all equal (2,2,2)")
    ap.add_argument("--sleep", type=float, default=0.1, help="simulated compute seconds per step (0.1)")
    ap.add_argument("--extra-steps", type=int, default=3, help="steps after the rejoin before stopping (3)")
    ap.add_argument("--startup-timeout", type=float, default=150.0, help="seconds to wait for every group to "
                    "start training (150: importing torch in many processes is slow on a busy machine)")
    ap.add_argument("--cold-restart", action="store_true", help="restart the killed group from scratch "
                    "(importing torch on restart) instead of releasing a pre-warmed stand-by")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, progress files)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    args = ap.parse_args()
    if len(set(args.ranks.split(","))) != 1:
        print("note: replica groups of different sizes: group rank g averages with group rank g of every "
              "group, so the extra ranks have no peers; expect failures", file=sys.stderr)
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
        print("--- lighthouse.log\n" + "\n".join(lh.read_text().splitlines()[-15:]) if lh.exists() else "", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        demo.clear_table()
        print("interrupted; stopping every process", file=sys.stderr)
        rc = 130
    finally:
        demo.close()
    print(f"demo took {time.time() - t:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
