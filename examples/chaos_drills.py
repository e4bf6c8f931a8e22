"""Chaos drills: the faults the field sees, injected into a running job, with what each one cost.

Runs, one after the other, against a live job (``--lighthouse``/``--http`` of a running
``rallypoint lighthouse``) or a job it starts itself (the default: a lighthouse with
``--stragglers evict`` and three replica groups of ``examples/train_ddp.py``, each under its
own ``rallypoint run``, with the corruption checks on):

- ``kill``: SIGKILL one group in the middle of a step (as its first collective is posted);
- ``hang``: stop one group's training thread (its heartbeats go on, as in a real hang; its
  ``rallypoint run`` hang watchdog restarts it);
- ``slow``: make one group 3x slower for 12 s (scored a straggler, evicted, readmitted);
- ``corrupt``: flip one bit of one gradient element on one group (the gradient check);
- ``lighthouse``: restart the lighthouse in place.

Every fault goes through the lighthouse's authenticated API (``rallypoint inject``), and
everything is measured from what the lighthouse records (``/events``, ``/goodput``), as an
operator would: time to detect (injection -> the event that shows the fault was seen), time
to recover (injection -> the group back in a quorum, or the job committing again), the
rounds that failed, whether a corrupt step was committed anywhere, and the job's goodput
over the drill from the lighthouse's ledger. Prints a table and one JSON line.

Fault injection is off unless turned on: a live job's lighthouse must run with ``--allow-inject``
and its groups with ``RALLYPOINT_ALLOW_INJECT=1`` (the job this script starts has both), and
``--token`` must be the job's token or the operator's (``lighthouse``: the operator's).

Run: ``python examples/chaos_drills.py`` (about two minutes; ``--drills kill,slow`` for some).
Loopback and OS-assigned ports only; stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_ddp.py"
WAIT_S = 90.0
DRILLS = ("kill", "hang", "slow", "corrupt", "lighthouse")
SLOW_S = 12.0  # how long the slow drill's group stays 3x slower


class Job:
    """What the drills talk to: the lighthouse's gRPC (injections) and HTTP (observations)."""

    def __init__(self, lighthouse: str, http: str, token: str | None, groups: list[str]) -> None:
        self.lighthouse, self.http, self.token, self.groups = lighthouse, http.rstrip("/"), token, groups

    def get(self, path: str) -> Any:
        req = urllib.request.Request(self.http + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        for attempt in range(100):  # the lighthouse may be restarting (the lighthouse drill)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return json.loads(r.read())
            except OSError:
                if attempt == 99:
                    raise
                time.sleep(0.1)

    def events(self, after: int) -> list[dict[str, Any]]:
        return [e for e in self.get(f"/events?limit=1000&since_id={after}") if e["id"] > after]

    def last_event_id(self) -> int:
        return max((e["id"] for e in self.get("/events?limit=50")), default=0)

    def inject(self, **request: Any) -> str:
        from rallypoint.lighthouse.client import LighthouseClient

        with LighthouseClient(self.lighthouse, token=self.token, connect_timeout=10) as c:
            return c.inject(request)[0]

    def members(self) -> list[str]:
        q = self.get("/status").get("quorum") or {}
        return [m.get("replica_id", "") for m in q.get("members", q.get("participants", []))]

    def ledger(self) -> dict[str, Any]:
        return self.get("/goodput?series=false")


def group_of(replica_id: str | None) -> str:
    return (replica_id or "").split(":")[0]


def wait_for(what: str, cond: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Poll ``cond`` (the lighthouse's HTTP API has no push) until it returns something true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def first(events: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    return next((e for e in events if pred(e)), None)


def steady(job: Job) -> None:
    """Every group in the quorum, none excluded, and the job committing again."""
    wait_for("every group in the quorum", lambda: {group_of(m) for m in job.members()} >= set(job.groups)
             and not job.get("/status").get("stragglers", {}).get("excluded"))
    rounds = job.ledger()["total"]["rounds"].get("committed", 0)
    wait_for("the job committing", lambda: job.ledger()["total"]["rounds"].get("committed", 0) >= rounds + 6)


def run_drill(job: Job, name: str, victim: str) -> dict[str, Any]:
    steady(job)
    before, since = job.ledger()["total"], job.last_event_id()
    spec: dict[str, Any] = {"kill": {"kind": "kill"}, "hang": {"kind": "hang"},
                            "slow": {"kind": "slow", "factor": 3.0, "for_s": SLOW_S},
                            "corrupt": {"kind": "bitflip-grad"}, "lighthouse": {"kind": "lighthouse-restart"}}[name]
    job.inject(**spec, **({} if name == "lighthouse" else {"replica": victim}))
    injected = wait_for("the injection event", lambda: first(job.events(since), lambda e: e["kind"] == "inject"))
    t0 = injected["time"]
    is_victim: Callable[[dict[str, Any]], bool] = lambda e: group_of(e.get("replica_id")) == victim  # noqa: E731
    detect_kind: dict[str, Callable[[dict[str, Any]], bool]] = {
        "kill": lambda e: e["kind"] in ("crash", "leave") and is_victim(e),
        "hang": lambda e: e["kind"] == "quorum" and victim not in {group_of(m) for m in e["detail"]["members"]},
        "slow": lambda e: e["kind"] == "straggler" and is_victim(e),
        "corrupt": lambda e: e["kind"] == "sdc" and victim in {group_of(b) for b in e["detail"].get("bad", [])},
        "lighthouse": lambda e: e["kind"] == "start",
    }
    seen = wait_for(f"{name}: detection", lambda: first(job.events(since), detect_kind[name]))
    if name in ("kill", "hang", "slow"):  # back in a quorum, after the fault (a new incarnation for kill/hang)
        not_before = t0 + (SLOW_S if name == "slow" else 0.0)  # a straggler is back for good once it is fast again
        back = wait_for(f"{name}: {victim} back in a quorum", lambda: first(job.events(seen["id"]), lambda e: (
            e["kind"] == "quorum" and e["time"] >= not_before
            and victim in {group_of(m) for m in e["detail"]["members"]})), 120)
        recovered = back["time"]
    else:  # the job commits again after the fault was seen
        rounds = job.ledger()["total"]["rounds"].get("committed", 0)
        wait_for(f"{name}: the job committing again",
                 lambda: job.ledger()["total"]["rounds"].get("committed", 0) > rounds + len(job.groups))
        recovered = time.time()
    steady(job)
    after = job.ledger()["total"]
    spent = {k: after["buckets"].get(k, 0.0) - before["buckets"].get(k, 0.0) for k in after["buckets"]}
    spent.pop("unreported", None)
    total = sum(spent.values())
    bad_committed: str = "-"
    if name == "corrupt":  # every group failed that round (cause sdc): nobody committed the bad gradient
        groups_failed = [g for g in job.ledger()["groups"] if g["group"] in job.groups and
                         g["failed_by_cause"].get("sdc", 0.0) > 0]
        bad_committed = "no" if len(groups_failed) == len(job.groups) else "YES"
    failed = after["rounds"].get("failed", 0) - before["rounds"].get("failed", 0)
    return {"drill": name, "victim": victim if name != "lighthouse" else "-", "detect_s": round(seen["time"] - t0, 2),
            "recover_s": round(recovered - t0, 2), "failed_rounds": failed, "bad_step_committed": bad_committed,
            "goodput": round(spent.get("productive", 0.0) / total, 3) if total > 0 else None,
            "lost_s": {k: round(v, 1) for k, v in spent.items() if k != "productive" and v >= 0.05}}


# ------------------------------------------------------------------ a job of our own
class OwnJob:
    """A lighthouse and three `rallypoint run` groups, all stopped by :meth:`stop`."""

    def __init__(self, groups: int, keep: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rallypoint-drills-"))
        self.keep = keep
        self.procs: list[subprocess.Popen] = []
        self.groups = [str(i) for i in range(groups)]  # train_ddp.py's REPLICA_GROUP_ID is a group index

    def start(self) -> Job:
        cmd = [sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "2", "--join-timeout-ms", "2000",
               "--heartbeat-timeout-ms", "3000", "--stragglers", "evict", "--straggler-cooldown-s", "5",
               "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--state", str(self.dir / "lighthouse.db"),
               "--allow-inject"]  # fault injection is off unless turned on, here and in every group
        lh = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.dir / "lighthouse.log", "w"), text=True,
                              start_new_session=True)
        self.procs.append(lh)
        assert lh.stdout is not None
        if not select.select([lh.stdout], [], [], 60)[0]:
            raise TimeoutError("the lighthouse did not report its ports")
        info = json.loads(lh.stdout.readline())
        env = dict(os.environ, RALLYPOINT_ALLOW_INJECT="1", RALLYPOINT_SDC_CHECK="1", RALLYPOINT_SDC_CHECK_EVERY="20", OMP_NUM_THREADS="1",
                   NUM_REPLICA_GROUPS=str(len(self.groups)), TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
        for k in ("TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE", "REPLICA_GROUP_ID", "RANK", "WORLD_SIZE",
                  "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        for g in self.groups:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "rallypoint", "run", "--replica-group-id", g, "--lighthouse", info["local"],
                 "--hang-timeout", "8", str(TRAIN), "--steps", "1000000", "--sleep", "0.05", "--timeout", "5",
                 "--min-replicas", "2"],
                env=env, stdout=open(self.dir / f"{g}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True))
        return Job(info["local"], info["http"], None, self.groups)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        if self.keep:
            print(f"logs kept in {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drills", default=",".join(DRILLS), help=f"comma-separated, of {', '.join(DRILLS)}")
    ap.add_argument("--lighthouse", default=None, help="gRPC address of a running job's lighthouse")
    ap.add_argument("--http", default=None, help="its HTTP address (http://host:port)")
    ap.add_argument("--groups", default=None, help="the running job's REPLICA_GROUP_IDs (comma-separated)")
    ap.add_argument("--token", default=os.environ.get("RALLYPOINT_TOKEN"), help="the job's token ($RALLYPOINT_TOKEN)")
    ap.add_argument("--keep", action="store_true", help="keep the logs of the job this script starts")
    args = ap.parse_args()
    drills = [d for d in args.drills.split(",") if d]
    unknown = sorted(set(drills) - set(DRILLS))
    if unknown:
        ap.error(f"unknown drill(s) {unknown}; the drills are {', '.join(DRILLS)}")
    own = None
    if args.lighthouse:
        if not (args.http and args.groups):
            ap.error("--lighthouse needs --http and --groups")
        job = Job(args.lighthouse, args.http, args.token, args.groups.split(","))
    else:
        own = OwnJob(3, args.keep)
        job = own.start()
    results: list[dict[str, Any]] = []
    try:
        for i, name in enumerate(drills):
            victim = job.groups[(i + 1) % len(job.groups)]
            try:
                results.append(run_drill(job, name, victim))
            except TimeoutError as e:
                results.append({"drill": name, "victim": victim, "error": str(e)})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        overall = job.ledger()
    finally:
        if own is not None:
            own.stop()
    head = f"{'drill':<12}{'victim':<8}{'detect s':>10}{'recover s':>11}{'failed rounds':>15}{'bad step committed':>20}" \
           f"{'goodput':>9}  lost to"
    print(head)
    for r in results:
        if "error" in r:
            print(f"{r['drill']:<12}{r['victim']:<8}  {r['error']}")
            continue
        lost = ", ".join(f"{k} {v}s" for k, v in sorted(r["lost_s"].items(), key=lambda kv: -kv[1]))
        print(f"{r['drill']:<12}{r['victim']:<8}{r['detect_s']:>10.2f}{r['recover_s']:>11.2f}{r['failed_rounds']:>15}"
              f"{r['bad_step_committed']:>20}{r['goodput'] if r['goodput'] is not None else '-':>9}  {lost}")
    model = overall.get("model") or {}
    print(f"job goodput (ledger, whole run): {overall.get('goodput')}; model: {model.get('goodput')} "
          f"(what if the restart took half as long: {(model.get('what_if') or {}).get('restart_halved')})")
    print(json.dumps({"example": "chaos_drills", "results": results, "goodput": overall.get("goodput"),
                      "model": model}))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
