"""Per-step cost of replica groups of two ranks: the next round handed out with the commit
vote, against every rank asking for every round, torchft 0.2.0 and plain torch.distributed,
measured in one run.

Two replica groups of two ranks each (four worker processes, gloo on CPU over loopback,
free ports only; each group's TCPStore hosted here, as torchrun's agent would). Every
variant runs the same loop on a tiny model (``nn.Linear(4, 2)``: the step is almost only the
framework's fixed cost), in a fresh set of processes:

- ``plain``: the managed variants' communication without a manager: group rank r of
  each group in one gloo group of two (``init_process_group``); per step zero_grad,
  forward, backward, ``dist.all_reduce`` of every grad, divide by 2, step. The floor.
- ``plain_vote``: ``plain`` plus what committing only when every rank of the group
  succeeded needs at least: after the allreduces, the group's two ranks agree through one
  1-element allreduce (MIN of their success flags) over a gloo group of their own. Its cost
  over ``plain`` is the price of coupling the group's ranks every step, which no design of
  the vote avoids (``fixed_ours_over_plain_vote`` is ours against it).
- ``plain_ping``: the same agreement the way our vote socket makes it, without a framework:
  rank 1 sends its flag over a TCP connection to rank 0, which answers with both flags'
  AND once it has its own (one round trip per step, ``TCP_NODELAY``). The floor of our
  design on this machine (``fixed_ours_over_plain_ping``).
- ``ours``: ``rallypoint.manager.Manager`` (``world_size=2`` per group, leases on); on a
  lease each rank starts its next round from the answer to its vote (one call to group
  rank 0 per step on rank 1, none on rank 0).
- ``ours_grpc``: ``ours`` with ``RALLYPOINT_VOTE_SOCKET=0``: rank 1 votes over gRPC, as
  before the vote socket (``rallypoint/manager/_vote_socket.py``).
- ``ours_ask``: the same with ``RALLYPOINT_NEXT_ROUND=0``: every rank asks group rank 0
  for every round (two calls per step on rank 1), as before the hand-out.
- ``torchft``: ``torchft.Manager`` + ``torchft.ProcessGroupGloo`` (``world_size=2`` per
  group) against torchft's Rust lighthouse; the same loop.

The variants run in alternating order over ``--rounds`` rounds. Per variant: the median and
p90 ms/step (mean of the four ranks per step), and on group 0's rank 1 the median of
``should_commit()`` (``start_quorum()`` returns at once with the async quorum every variant
uses; its wait shows in the first allreduce), and every variant's phases per step (medians
over the four ranks). ``--profile`` also times the parts of each commit vote of ours inside
group rank 0's server (how far apart the ranks voted, each call's way to the vote, the
decision, the way back). And each variant's CPU per step, the four workers together, by
kind of thread (from ``/proc/self/task``), with the share of the machine's cores they kept
busy: where that is near 1, the machine, not a wait, sets the step. Fixed cost = median
minus plain's. Ratios:
``fixed_ours_vs_ours_grpc``, ``fixed_ours_vs_ours_ask``, ``fixed_ours_vs_torchft`` (goal <= 1/3),
``fixed_ours_over_plain_vote`` and ``fixed_ours_over_plain_ping`` (ours against the floors),
``beyond_ping_ours_vs_torchft`` (what each framework costs beyond ``plain_ping``'s step) and
the whole steps'. A table and one JSON line ``{"bench": "group_rounds", ...}``.

    .venv/bin/python bench/group_rounds.py            # ~1-2 minutes on 2 cores
    .venv/bin/python bench/group_rounds.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ms, fmt_ratio, median, percentile, ratio, table  # noqa: E402
from rallypoint.transports._http_util import usable_cpus  # noqa: E402

VARIANTS = ("plain", "plain_vote", "plain_ping", "ours", "ours_grpc", "ours_ask", "torchft")
OURS = ("ours", "ours_grpc", "ours_ask")
PLAIN = ("plain", "plain_vote", "plain_ping")
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- worker side
def _worker(plan: dict[str, Any]) -> None:
    import logging

    _util.exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    variant, group, rank = plan["variant"], plan["group"], plan["rank"]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2 * group + rank))
    timeout = timedelta(seconds=plan["op_timeout_s"])
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    manager: Any = None
    vote_pg: Any = None
    link: Any = None
    if variant in PLAIN:
        store = dist.TCPStore("127.0.0.1", plan["store_ports"][0], is_master=False, wait_for_workers=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{plan['run_id']}/plain/{rank}", store),
                                rank=group, world_size=2, timeout=timeout)
        if variant == "plain_vote":  # the group's own two ranks, on the group's store
            gstore = dist.TCPStore("127.0.0.1", plan["store_ports"][group], is_master=False, wait_for_workers=False,
                                   timeout=timeout)
            vote_pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{plan['run_id']}/vote/{group}", gstore), rank, 2,
                                            timeout)
        if variant == "plain_ping":
            link = _ping_link(plan, group, rank, timeout)
    else:
        common = dict(load_state_dict=model.load_state_dict, state_dict=model.state_dict, min_replica_size=2,
                      use_async_quorum=True, rank=rank, world_size=2, lighthouse_addr=plan["lighthouse"],
                      replica_id=f"group{group}-{plan['run_id']}", hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout, store_addr="127.0.0.1",
                      store_port=plan["store_ports"][group])
        if variant == "torchft":
            from torchft.manager import Manager as TFManager
            from torchft.process_group import ProcessGroupGloo as TFGloo

            manager = TFManager(pg=TFGloo(timeout=timeout), **common)
        else:
            from rallypoint.manager.manager import Manager
            from rallypoint.process_groups import ProcessGroupGloo

            manager = Manager(pg=ProcessGroupGloo(timeout=timeout), **common)
    votes = _watch_votes(manager, rank) if plan.get("profile") and variant in OURS else None
    if vote_pg is not None:
        min_opts = dist.AllreduceOptions()
        min_opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # torch stubs: RedOpType
        flag = torch.ones(1)
    pc = time.perf_counter

    def step() -> list[float]:
        t0 = pc()
        if manager is not None:
            manager.start_quorum()
        t1 = pc()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            if manager is None:
                dist.all_reduce(g)
                g.div_(2)
            else:
                manager.allreduce(g).wait()
        t2 = pc()
        if manager is not None:
            ok = manager.should_commit()
        elif link is not None:
            ok = _ping_vote(link, rank, True)
        elif vote_pg is not None:
            flag.fill_(1.0)
            vote_pg.allreduce([flag], min_opts).wait()
            ok = bool(flag.item() == 1.0)
        else:
            ok = True
        t3 = pc()
        if ok:
            opt.step()
        t4 = pc()
        # total, should_commit, committed, start_quorum, compute + allreduces, optimizer step
        return [t4 - t0, t3 - t2, float(ok), t1 - t0, t2 - t1, t4 - t3]

    for _ in range(plan["warmup"]):
        step()
    cpu0 = thread_cpu()
    samples = [step() for _ in range(plan["steps"])]
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu().items()}
    client = getattr(manager, "_client", None)
    taken = getattr(client, "taken", None)
    sys.stdout.write(json.dumps({"result": {"group": group, "rank": rank, "samples": samples, "cpu_s": cpu,
                                            "taken": taken, "votes": votes[-4 * plan["steps"]:] if votes else None}})
                     + "\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the parent's go: no peer is left mid-step
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        dist.destroy_process_group()
    os._exit(0)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used so far, by kind of
    thread: Python threads by their name without a trailing number ("rallypoint-quorum",
    "MainThread"), native ones (gRPC's, gloo's) by their kernel name; threads of one kind
    summed. Linux only (``/proc/self/task``); elsewhere the process's total under "all"."""
    import re
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {"all": time.process_time()}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        secs = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        name = names.get(int(tid), comm)
        name = re.sub(r"-group\d+-r\d+.*$", "", name)  # a rallypoint thread's replica id
        name = re.sub(r"[-_ ]?\d+$", "", name) or comm
        out[name] = out.get(name, 0.0) + secs
    return out


def _ping_link(plan: dict[str, Any], group: int, rank: int, timeout: timedelta) -> Any:
    """``plain_ping``: a TCP connection between the group's two ranks (rank 0 listens on a
    free port and names it in the group's store)."""
    import socket

    import torch.distributed as dist

    gstore = dist.TCPStore("127.0.0.1", plan["store_ports"][group], is_master=False, wait_for_workers=False,
                           timeout=timeout)
    key = f"{plan['run_id']}/ping/{group}"
    secs = timeout.total_seconds()
    if rank == 0:
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            lsock.settimeout(secs)
            gstore.set(key, str(lsock.getsockname()[1]))
            conn, _ = lsock.accept()
    else:
        conn = socket.create_connection(("127.0.0.1", int(gstore.get(key))), timeout=secs)
    conn.settimeout(secs)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _ping_vote(conn: Any, rank: int, mine: bool) -> bool:
    """One agreement over ``plain_ping``'s link: rank 1 sends its flag and reads the
    decision; rank 0 reads rank 1's flag and answers with the AND."""
    if rank == 0:
        theirs = conn.recv(1)
        if not theirs:
            raise ConnectionError("plain_ping: rank 1 closed the link")
        ok = mine and theirs == b"1"
        conn.sendall(b"1" if ok else b"0")
        return ok
    conn.sendall(b"1" if mine else b"0")
    answer = conn.recv(1)
    if not answer:
        raise ConnectionError("plain_ping: rank 0 closed the link")
    return answer == b"1"


def _watch_votes(manager: Any, rank: int) -> list[tuple[str, int, int, float, float]]:
    """``--profile``: timestamps (monotonic, the same clock in every process here) of this
    rank's commit vote call, and on group rank 0 of each rank's vote inside its
    ManagerServer (from the vote's arrival to its decision). A bench's instrumentation of
    the Manager's internals, not an API."""
    events: list[tuple[str, int, int, float, float]] = []
    client = manager._client
    real_call = client.should_commit

    def call(group_rank: int, step: int, vote: bool, timeout: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return real_call(group_rank, step, vote, timeout, *a, **kw)
        finally:
            events.append(("call", rank, step, t0, time.monotonic()))

    client.should_commit = call
    server = manager._server
    if server is not None:
        real_vote = server._vote

        async def vote(group_rank: int, step: int, v: bool, asks_next: bool = False, stats: Any = None) -> bool:
            t0 = time.monotonic()
            try:
                return await real_vote(group_rank, step, v, asks_next, stats)
            finally:
                events.append(("server", group_rank, step, t0, time.monotonic()))

        server._vote = vote
    return events


def vote_profile(runs: list[list[dict[str, Any]]]) -> dict[str, float] | None:
    """Medians (ms) over every group's voted steps: how far apart the group's two ranks
    called, how long rank 1's call took to reach the vote in group rank 0's server and rank
    0's in-process call likewise, from the later arrival to the decision, and from the
    decision back to each rank's caller."""
    parts: dict[str, list[float]] = {k: [] for k in ("ranks_apart", "rank1_to_server", "rank0_to_server",
                                                      "decision", "back_to_rank0", "back_to_rank1")}
    for results in runs:
        for group in (0, 1):
            by_step: dict[int, dict[tuple[str, int], tuple[float, float]]] = {}
            for r in results:
                if r["group"] == group:
                    for kind, rk, step, t0, t1 in r.get("votes") or ():
                        by_step.setdefault(step, {})[(kind, rk)] = (t0, t1)
            for d in by_step.values():
                need = [("call", 0), ("call", 1), ("server", 0), ("server", 1)]
                if not all(k in d for k in need):
                    continue
                c0, c1, s0, s1 = (d[k] for k in need)
                decided = max(s0[1], s1[1])
                for k, v in (("ranks_apart", abs(c0[0] - c1[0])), ("rank1_to_server", s1[0] - c1[0]),
                             ("rank0_to_server", s0[0] - c0[0]), ("decision", decided - max(s0[0], s1[0])),
                             ("back_to_rank0", c0[1] - decided), ("back_to_rank1", c1[1] - decided)):
                    parts[k].append(v * 1e3)
    if not parts["decision"]:
        return None
    return {k: median(v) for k, v in parts.items()} | {"steps": float(len(parts["decision"]))}


# ---------------------------------------------------------------------- parent side
def _lighthouse(variant: str) -> Any:
    if variant in OURS:
        from rallypoint.lighthouse.server import LighthouseServer

        return LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000,
                                heartbeat_timeout_ms=5_000)
    if variant == "torchft":
        return _util.load_torchft_native().LighthouseServer(bind="127.0.0.1:0", min_replicas=2,
                                                             join_timeout_ms=10_000, heartbeat_timeout_ms=5_000)
    return None


def run_variant(variant: str, plan: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """One run of ``variant``: four fresh worker processes; their results."""
    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
              for _ in range(2)]
    lh = _lighthouse(variant)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RUST_LOG", "warn")
    env["RALLYPOINT_NEXT_ROUND"] = "0" if variant == "ours_ask" else "1"
    env["RALLYPOINT_VOTE_SOCKET"] = "0" if variant == "ours_grpc" else "1"
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
        env.pop(k, None)
    children: list[Child] = []
    try:
        addr = "" if lh is None else f"http://127.0.0.1:{int(lh.address().rsplit(':', 1)[1])}"
        for group in range(2):
            for rank in range(2):
                wplan = dict(plan, variant=variant, group=group, rank=rank, lighthouse=addr,
                             store_ports=[s.port for s in stores])
                children.append(Child([sys.executable, __file__, "--worker", json.dumps(wplan)],
                                      name=f"group-{variant}-{group}.{rank}", env=env, cwd=str(REPO)))
        results = [_util.recv_result(c, timeout_s) for c in children]
        for c in children:
            c.send({"cmd": "exit"})
        return results
    finally:
        close_all(children, grace=5.0)
        if lh is not None:
            lh.shutdown()


def summarize(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A step's time is the mean of the four ranks' times for it; the phases are group 0's rank 1's."""
    total: list[float] = []
    commit: list[float] = []
    commits = steps = 0
    taken: list[int] = []
    for results in runs:
        for row in zip(*(r["samples"] for r in results)):
            total.append(sum(s[0] for s in row) / len(row) * 1e3)
        r1 = next(r for r in results if r["group"] == 0 and r["rank"] == 1)
        commit += [s[1] * 1e3 for s in r1["samples"]]
        commits += sum(int(s[2]) for r in results for s in r["samples"])
        steps += sum(len(r["samples"]) for r in results)
        if r1.get("taken") is not None:
            taken.append(r1["taken"])
    phases = {name: median([s[i] * 1e3 for results in runs for r in results for s in r["samples"]])
              for i, name in ((3, "start_quorum_ms"), (4, "compute_allreduce_ms"), (1, "should_commit_ms"),
                              (5, "optimizer_ms"))}
    # CPU per step, all four workers together, by kind of thread (medians over the runs).
    kinds = sorted({k for results in runs for r in results for k in r.get("cpu_s", {})})
    cpu = {k: median([sum(r.get("cpu_s", {}).get(k, 0.0) / len(r["samples"]) for r in results) * 1e3
                      for results in runs]) for k in kinds}
    return {"median_ms": median(total), "p90_ms": percentile(total, 90), "steps": len(total),
            "cpu_ms": median([sum(sum(r.get("cpu_s", {}).values()) / len(r["samples"]) for r in results) * 1e3
                              for results in runs]), "cpu_by_thread_ms": cpu,
            "busy": median([busy_share(results) for results in runs]),
            "rank1_commit_ms": median(commit), "phases_ms": phases, "votes_ms": vote_profile(runs),
            "commit_fraction": commits / max(1, steps), "rank1_rounds_handed_out": sum(taken) if taken else None}


def busy_share(results: list[dict[str, Any]]) -> float:
    """How much of the machine's CPU time the four workers used while they stepped: their
    CPU seconds over (the cores this process may use x the run's timed wall time, the mean of the ranks' sums of
    step times). Near 1, every CPU-second anything adds is a second of wall time too."""
    wall = sum(sum(s[0] for s in r["samples"]) for r in results) / len(results)
    cpu = sum(sum(r.get("cpu_s", {}).values()) for r in results)
    return cpu / (usable_cpus() * wall) if wall > 0 else float("nan")


def _beyond(res: dict[str, Any], variant: str, floor: str) -> float | None:
    """``variant``'s median step minus ``floor``'s (ms): its cost beyond that floor."""
    a, b = res.get(variant, {}).get("median_ms"), res.get(floor, {}).get("median_ms")
    return None if a is None or b is None else a - b


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and one round")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, help="variant sequences run (alternating order); default 2, quick 1")
    ap.add_argument("--steps", type=int, help="timed steps per run (default 200, quick 40)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a variant's workers may take")
    ap.add_argument("--profile", action="store_true",
                    help="also time each commit vote's parts inside group rank 0's server (ours)")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}")
    _util.clear_job_env(os.environ)
    rounds = args.rounds or (1 if args.quick else 2)
    plan = {"warmup": 10 if args.quick else 30, "steps": args.steps or (40 if args.quick else 200),
            "op_timeout_s": 30, "profile": args.profile}
    load0, t0 = os.getloadavg()[0], time.monotonic()
    raw: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            raw[v].append(run_variant(v, dict(plan, run_id=f"r{r}"), args.timeout))
    res = {v: summarize(runs) for v, runs in raw.items()}
    plain = res.get("plain", {}).get("median_ms")
    for v in (*PLAIN[1:], *OURS, "torchft"):
        if v in res and plain is not None:
            res[v]["fixed_ms"] = res[v]["median_ms"] - plain
    ratios = {
        "fixed_ours_vs_ours_grpc": ratio(res.get("ours", {}).get("fixed_ms"),
                                         res.get("ours_grpc", {}).get("fixed_ms")),
        "fixed_ours_vs_ours_ask": ratio(res.get("ours", {}).get("fixed_ms"), res.get("ours_ask", {}).get("fixed_ms")),
        "fixed_ours_vs_torchft": ratio(res.get("ours", {}).get("fixed_ms"), res.get("torchft", {}).get("fixed_ms")),
        "fixed_ours_over_plain_vote": ratio(res.get("ours", {}).get("fixed_ms"),
                                            res.get("plain_vote", {}).get("fixed_ms")),
        "fixed_torchft_over_plain_vote": ratio(res.get("torchft", {}).get("fixed_ms"),
                                               res.get("plain_vote", {}).get("fixed_ms")),
        "fixed_ours_over_plain_ping": ratio(res.get("ours", {}).get("fixed_ms"),
                                           res.get("plain_ping", {}).get("fixed_ms")),
        "beyond_ping_ours_vs_torchft": ratio(_beyond(res, "ours", "plain_ping"), _beyond(res, "torchft", "plain_ping")),
        "step_ours_vs_ours_ask": ratio(res.get("ours", {}).get("median_ms"), res.get("ours_ask", {}).get("median_ms")),
        "step_ours_vs_torchft": ratio(res.get("ours", {}).get("median_ms"), res.get("torchft", {}).get("median_ms")),
    }
    print(f"group rounds: 2 replica groups x 2 ranks, tiny model, gloo/CPU loopback, torchft "
          f"{_util.torchft_version()}, {rounds} round(s) of {plan['steps']} timed steps; "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; {time.monotonic() - t0:.0f}s")
    def _f(v: float | None) -> str:
        return fmt_ms(v, 3)

    rows = [[v, _f(d["median_ms"]), _f(d["p90_ms"]), _f(d.get("fixed_ms")), _f(d["rank1_commit_ms"]),
             f"{d['commit_fraction']:.2f}",
             "-" if d["rank1_rounds_handed_out"] is None else str(d["rank1_rounds_handed_out"])]
            for v, d in res.items()]
    print(table(["variant", "median", "p90", "fixed", "rank 1 should_commit",
                 "committed", "rank 1 rounds handed out"], rows))
    print(table(["variant", "start_quorum", "compute + allreduces", "should_commit", "optimizer step"],
                [[v, *(_f(d["phases_ms"][k]) for k in ("start_quorum_ms", "compute_allreduce_ms", "should_commit_ms",
                                                       "optimizer_ms"))] for v, d in res.items()]))
    print(f"CPU per step, the four workers together (this process may use {usable_cpus()} cores), "
          "by kind of thread (>= 0.05 ms):")
    for v, d in res.items():
        parts = sorted(((ms, k) for k, ms in d["cpu_by_thread_ms"].items() if ms >= 0.05), reverse=True)
        print(f"  {v}: {_f(d['cpu_ms'])} ({d['busy']:.0%} of the cores' time) = "
              + ", ".join(f"{k} {_f(ms)}" for ms, k in parts))
    for v, d in res.items():
        if d.get("votes_ms"):
            vp = d["votes_ms"]
            print(f"{v}: a commit vote's parts (medians of {vp['steps']:.0f} votes): the group's ranks "
                  f"{_f(vp['ranks_apart'])} apart; rank 1's call reaches the vote in {_f(vp['rank1_to_server'])}, "
                  f"rank 0's in {_f(vp['rank0_to_server'])}; the decision {_f(vp['decision'])} after the later "
                  f"one; back to rank 0 in {_f(vp['back_to_rank0'])}, to rank 1 in {_f(vp['back_to_rank1'])}")
    print(table(["ratio", "value"], [[k, fmt_ratio(v)] for k, v in ratios.items()]))
    _util.emit_line(json.dumps({"bench": "group_rounds", "quick": args.quick, "rounds": rounds, "results": res,
                                "ratios": ratios}), args.out)


if __name__ == "__main__":
    main()
