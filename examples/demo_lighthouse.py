"""Kill-and-rejoin demo of the lighthouse, with simulated replicas (no training yet).

Starts ``rallypoint lighthouse`` (SQLite state in a temp dir), three simulated replica
groups that ask for a quorum before every "step", SIGKILLs one mid-run, restarts it,
and prints the quorum timeline: how fast the survivors got a quorum without it (the
crash is seen through its liveness stream, not a heartbeat timeout) and how the
returning replica rejoins on the fast path. Stops by itself and leaves no process.

Run: ``make demo`` (or ``python examples/demo_lighthouse.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPLICA_CODE = r"""
import json, logging, sys, time
import rallypoint
logging.basicConfig(level=logging.ERROR)  # the demo's parent prints the story
addr, rid, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = rallypoint.LighthouseClient(addr, connect_timeout=10)
stream = rallypoint.LivenessStream(addr, rid, address="sim://" + rid)
stream.start(timeout=10)
step = 0
while True:
    q = client.quorum(rid, timeout=60, step=step, address="sim://" + rid, world_size=1)
    max_step = max(m.step for m in q.members)
    healed = step < max_step
    step = max_step if healed else step
    print(json.dumps({"t": time.time(), "rid": rid, "quorum_id": q.quorum_id,
                      "members": [m.replica_id for m in q.members], "step": step, "healed": healed}), flush=True)
    time.sleep(step_s)  # the "forward/backward" of this simulated step
    step += 1
"""


class Demo:
    def __init__(self, step_s: float, heartbeat_timeout_ms: int) -> None:
        self.step_s = step_s
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.tmp = tempfile.TemporaryDirectory(prefix="rallypoint-demo-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.lighthouse: subprocess.Popen | None = None
        self.lines: "queue.Queue[dict]" = queue.Queue()
        self.t0 = time.time()

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.3f}s] {msg}", flush=True)

    def start_lighthouse(self) -> str:
        state = os.path.join(self.tmp.name, "lighthouse.db")
        cmd = [
            sys.executable, "-m", "rallypoint", "--log-level", "WARNING", "lighthouse",
            "--min-replicas", "2", "--join-timeout-ms", "1000",
            "--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms),
            "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--state", state,
        ]
        self.lighthouse = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self._readline(self.lighthouse, 20.0)
        info = json.loads(line)
        self.log(f"lighthouse up: gRPC {info['local']}, dashboard {info['http']}, state {state}")
        return info["local"]

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout: float) -> str:
        box: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=lambda: box.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        try:
            line = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("the lighthouse did not report ready in time") from None
        if not line:
            raise RuntimeError("the lighthouse exited before it was ready")
        return line

    def start_replica(self, addr: str, rid: str) -> None:
        p = subprocess.Popen(
            [sys.executable, "-c", REPLICA_CODE, addr, rid, str(self.step_s)], stdout=subprocess.PIPE, text=True
        )
        self.procs[rid] = p

        def pump() -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                try:
                    self.lines.put(json.loads(line))
                except ValueError:
                    pass

        threading.Thread(target=pump, daemon=True).start()
        self.log(f"started replica {rid} (pid {p.pid})")

    def follow(self, until: float, stop_when=None) -> dict | None:
        """Print quorum changes until ``until`` (time.time()) or ``stop_when(rec)``."""
        last_qid = getattr(self, "_last_qid", None)
        while time.time() < until:
            try:
                rec = self.lines.get(timeout=max(0.01, min(0.2, until - time.time())))
            except queue.Empty:
                continue
            if rec["quorum_id"] != last_qid:
                last_qid = rec["quorum_id"]
                self.log(f"quorum {rec['quorum_id']}: members {rec['members']} at step {rec['step']}")
            if rec.get("healed"):
                self.log(f"replica {rec['rid']} was behind and caught up to step {rec['step']} (would heal from a peer)")
            if stop_when is not None and stop_when(rec):
                self._last_qid = last_qid
                return rec
        self._last_qid = last_qid
        return None

    def run(self) -> int:
        addr = self.start_lighthouse()
        for rid in ("replica_a", "replica_b", "replica_c"):
            self.start_replica(addr, rid)
        full = lambda r: len(r["members"]) == 3  # noqa: E731
        if self.follow(time.time() + 30, full) is None:
            self.log("no full quorum within 30 s; giving up")
            return 1
        self.follow(time.time() + 1.5)

        victim = "replica_c"
        t_kill = time.time()
        os.kill(self.procs[victim].pid, signal.SIGKILL)
        self.procs[victim].wait(10)
        self.log(f"SIGKILLed {victim} (heartbeat timeout is {self.heartbeat_timeout_ms} ms)")
        rec = self.follow(time.time() + 30, lambda r: victim not in r["members"])
        if rec is None:
            self.log("survivors did not reform within 30 s")
            return 1
        detect_ms = (rec["t"] - t_kill) * 1000
        self.log(f"survivors formed quorum {rec['quorum_id']} without {victim} {detect_ms:.0f} ms after the kill")
        self.follow(time.time() + 1.5)

        t_restart = time.time()
        self.start_replica(addr, victim)
        rec = self.follow(time.time() + 30, lambda r: victim in r["members"])
        if rec is None:
            self.log(f"{victim} did not rejoin within 30 s")
            return 1
        rejoin_ms = (rec["t"] - t_restart) * 1000
        self.log(f"{victim} rejoined in quorum {rec['quorum_id']} {rejoin_ms:.0f} ms after its restart (incl. Python start-up)")
        self.follow(time.time() + 1.5)
        print()
        print("timeline")
        print(f"  kill -> survivors' new quorum : {detect_ms:8.0f} ms  (torchft waits for the {self.heartbeat_timeout_ms} ms heartbeat timeout)")
        print(f"  restart -> back in the quorum : {rejoin_ms:8.0f} ms")
        return 0

    def close(self) -> None:
        # The lighthouse goes first, so it does not log the replicas' exits as crashes.
        for p in ([self.lighthouse] if self.lighthouse else []) + list(self.procs.values()):
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.tmp.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-s", type=float, default=0.2, help="simulated seconds per step (0.2)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    args = ap.parse_args()
    demo = Demo(args.step_s, args.heartbeat_timeout_ms)
    try:
        return demo.run()
    finally:
        demo.close()


if __name__ == "__main__":
    raise SystemExit(main())
