"""The corruption checks' cost inside a real training step: ``Manager`` + rallypoint's
``DistributedDataParallel``, checks on vs off, in the same processes.

Two replica groups (two worker processes, one rank each, gloo on CPU over loopback, our
``LighthouseServer`` in this process with quorum leases) train the 1.3 M-parameter MLP of
``bench/step_overhead.py`` (batch 32x512, SGD, one torch thread) with the loop a user
writes: ``start_quorum``, forward, backward (DDP hands its buckets to the manager),
``if should_commit(): opt.step()``. The checks' mode changes step by step, the same on
both groups, rotated every round so each mode sees the same load:

- ``off``: no checks (``sdc_check=False``, ``sdc_check_every=0``);
- ``ride``: the gradient-norm check every step and the parameter hash every
  ``--check-every`` committed steps, the rows riding in the last gradient bucket's own
  collective (``Manager.allreduce_last``, what the DDP wrapper does: no collective of
  their own);
- ``behind``: the same checks with the rows' exchange a collective of its own, posted
  right behind the last gradient bucket (``Manager.gradients_posted``; the DDP wrapper's
  way before the ride, and still its way for bf16/fp16 gradients);
- ``commit``: the same checks with the exchange posted in ``should_commit`` (what a loop
  without rallypoint's DDP gets): the extra round trip the other two remove.

The mode is switched by setting the manager's guard attributes between steps (a bench
only; a job sets ``sdc_check``/``sdc_check_every`` once). Marginal cost of a mode = the
median over rounds of (its step time - the ``off`` step next to it); the goal (issue 39:
the checks cost <= 2% of the MLP step) is ``(ride marginal + param_hash / check_every) /
off``, with ``param_hash`` the hash of the model measured in the worker (the median step
hides the one hashed step in ``check_every``). torchft has no such checks: nothing to
compare against. Prints a table and one JSON line ``{"bench": "sdc_step", ...}``.

    .venv/bin/python bench/sdc_step.py            # ~1 minute
    .venv/bin/python bench/sdc_step.py --quick    # smoke run
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
from _util import Child, close_all, median, percentile, ratio, table  # noqa: E402

MODES = ("off", "ride", "behind", "commit")
CHECKED = MODES[1:]
#: A step's phases, as the worker times them.
PHASES = ("start_quorum + forward", "backward (DDP's hook: the norms)", "should_commit", "optimizer step")
REPO = Path(__file__).resolve().parent.parent


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker(plan: dict[str, Any]) -> None:
    import logging

    _util.exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    from torch import nn

    from rallypoint.integrations import DistributedDataParallel
    from rallypoint.manager import Manager
    from rallypoint.manager._sdc import param_hash, start_exchange
    from rallypoint.process_groups import ProcessGroupGloo

    torch.set_num_threads(1)
    rank = plan["rank"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(rank))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    timeout = timedelta(seconds=plan["op_timeout_s"])
    m = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda sd: model.load_state_dict(sd),
                state_dict=model.state_dict, min_replica_size=2, rank=0, world_size=1,
                lighthouse_addr=plan["lighthouse"], replica_id=f"replica{rank}", store_addr="127.0.0.1",
                hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                sdc_check=True, sdc_check_every=plan["check_every"])
    ddp = DistributedDataParallel(m, model)
    guard, averager = m._guard, ddp._averager
    posted, last = averager._posted, averager._last
    # The profile: the guard's own calls timed where they run (the norms on DDP's helper
    # thread, the exchange's posting behind the last bucket, the check in should_commit),
    # summed per step of each mode.
    mode_now = ["off"]
    spent: dict[str, dict[str, list[float]]] = {mode: {"observe": [], "post": [], "check": []} for mode in MODES}
    acc: dict[str, float] = {"observe": 0.0, "post": 0.0, "check": 0.0}

    def timed(part: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[part] += time.perf_counter() - t0
        return call

    guard.observe = timed("observe", guard.observe)
    guard.post_early = timed("post", guard.post_early)
    guard.post_riding = timed("post", guard.post_riding)
    guard.check = timed("check", guard.check)

    def set_mode(mode: str) -> None:
        mode_now[0] = mode
        guard.grad_check = mode != "off"
        guard.check_every = 0 if mode == "off" else plan["check_every"]
        averager._posted = posted if mode in ("ride", "behind") else None
        averager._last = last if mode == "ride" else None

    # Each step's phases, per mode: where a mode's extra time shows (the checks' own calls
    # are timed above; a phase can also slow down by what they leave behind, e.g. the cache).
    phases: dict[str, dict[str, list[float]]] = {mode: {ph: [] for ph in PHASES} for mode in MODES}
    # --thread-cpu: each thread's CPU per step of each mode (training thread, gloo's, DDP's
    # helpers): where a mode's extra CPU goes, including threads the timers above miss.
    cpu_ns: dict[str, dict[int, int]] = {mode: {} for mode in MODES}
    cpu_steps = {mode: 0 for mode in MODES}
    sample_cpu = bool(plan.get("thread_cpu"))

    def step() -> float:
        for part in acc:
            acc[part] = 0.0
        before = _util.thread_cpu_ns() if sample_cpu else {}
        t0 = time.perf_counter()
        m.start_quorum()
        opt.zero_grad()
        out = ddp(x).pow(2).mean()
        t1 = time.perf_counter()
        out.backward()
        t2 = time.perf_counter()
        ok = m.should_commit()
        t3 = time.perf_counter()
        if ok:
            opt.step()
        t4 = time.perf_counter()
        if sample_cpu:
            per, cpu_steps[mode_now[0]] = cpu_ns[mode_now[0]], cpu_steps[mode_now[0]] + 1
            for tid, ns in _util.thread_cpu_ns().items():
                per[tid] = per.get(tid, 0) + ns - before.get(tid, ns)
        for part, v in acc.items():
            spent[mode_now[0]][part].append(v)
        for ph, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[mode_now[0]][ph].append(v)
        return t4 - t0

    for i in range(plan["warmup"]):
        set_mode(MODES[i % len(MODES)])
        step()
    for parts in (*spent.values(), *phases.values()):
        for v in parts.values():
            v.clear()
    for mode in MODES:
        cpu_ns[mode].clear()
        cpu_steps[mode] = 0
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    early0, riding0, commits0 = guard.early_exchanges, guard.riding_exchanges, m.current_step()
    for r in range(plan["rounds"]):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for _ in range(plan["per_round"]):
            for mode in order:
                set_mode(mode)
                samples[mode].append(step())
    # The exchange alone, between steps: the same 2 x 5 float64 SUM allreduce on the same
    # process group, both workers in lockstep (each makes the same count).
    q = m._last_quorum
    raw = []
    for _ in range(40):
        t0 = time.perf_counter()
        start_exchange(m._pg, q.replica_rank, q.replica_world_size, [1.0, 2.0, 0.0, 0.0, 0.0]).wait(30.0)
        raw.append(time.perf_counter() - t0)
    params = list(model.parameters())
    hashes = []
    for _ in range(9):
        t0 = time.perf_counter()
        param_hash(params)
        hashes.append(time.perf_counter() - t0)
    # The machine's part: one pass over the gradients' bytes for their norm, as the check
    # does it (one dot per flat bucket), once the bytes left the cache and while they are hot.
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    evict = torch.empty(16 * 2**20)  # 64 MiB: larger than this machine's caches
    cold, hot = [], []
    for _ in range(9):
        evict.fill_(1.0)
        t0 = time.perf_counter()
        torch.dot(flat, flat)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.dot(flat, flat)
        hot.append(time.perf_counter() - t0)
    kinds = _util.thread_kinds()
    thread_ms: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    for mode in MODES:
        for tid, ns in cpu_ns[mode].items():
            kind = kinds.get(tid, "ended threads")
            thread_ms[mode][kind] = thread_ms[mode].get(kind, 0.0) + ns / 1e6 / max(cpu_steps[mode], 1)
    _out({"result": {"rank": rank, "samples": samples, "thread_cpu_ms": thread_ms if sample_cpu else None,
                     "param_hash_s": median(hashes),
                     "norm_cold_s": median(cold), "norm_hot_s": median(hot),
                     "early_exchanges": guard.early_exchanges - early0,
                     "riding_exchanges": guard.riding_exchanges - riding0, "committed": m.current_step() - commits0,
                     "steps": sum(len(v) for v in samples.values()),
                     "parts_s": {mode: {part: median(v) for part, v in parts.items() if v}
                                 for mode, parts in spent.items()},
                     "phases_s": {mode: {ph: median(v) for ph, v in ps.items()} for mode, ps in phases.items()},
                     "exchange_alone_s": median(raw)}})
    sys.stdin.readline()  # the parent's go: never leave the peer mid-step
    ddp.shutdown()
    m.shutdown(wait=False)
    _out({"bye": rank})
    os._exit(0)


def _thread_table(results: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Each kind of thread's CPU per step of each mode, the mean of the workers (threads of
    one kind summed in a worker); None when not sampled."""
    per = [r["thread_cpu_ms"] for r in results if r.get("thread_cpu_ms")]
    if not per:
        return None
    return {mode: {kind: sum(p[mode].get(kind, 0.0) for p in per) / len(per)
                   for kind in set().union(*(p[mode].keys() for p in per))} for mode in MODES}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--rounds", type=int, help="rounds, each mode first in turn (default 12, quick 3)")
    ap.add_argument("--per-round", type=int, default=10, help="steps of each mode per round (default 10)")
    ap.add_argument("--check-every", type=int, default=100, help="sdc_check_every (default 100)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the workers may take")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="also each thread's CPU per step of each mode (reads /proc per step: adds ~0.1 ms to every "
                         "mode alike)")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    from rallypoint.lighthouse.server import LighthouseServer

    plan = {"rounds": args.rounds or (3 if args.quick else 12), "per_round": args.per_round, "warmup": 15,
            "check_every": args.check_every, "op_timeout_s": 30.0, "thread_cpu": args.thread_cpu}
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, heartbeat_timeout_ms=5000)
    port = int(lh.address().rsplit(":", 1)[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "RALLYPOINT_LIGHTHOUSE", "RALLYPOINT_SDC_CHECK",
              "RALLYPOINT_SDC_CHECK_EVERY"):
        env.pop(k, None)
    children: list[Child] = []
    t_start = time.perf_counter()
    try:
        for rank in range(2):
            wplan = dict(plan, rank=rank, lighthouse=f"http://127.0.0.1:{port}")
            children.append(Child([sys.executable, __file__, "--worker", json.dumps(wplan)], name=f"sdc-step-{rank}",
                                  env=env, cwd=str(REPO)))
        results = []
        for c in children:
            end = time.monotonic() + args.timeout
            while True:
                obj = c.recv(max(1.0, end - time.monotonic()))
                if isinstance(obj, dict) and "result" in obj:
                    results.append(obj["result"])
                    break
        for c in children:
            c.send({"cmd": "exit"})
    finally:
        close_all(children)
        lh.shutdown()
    wall = time.perf_counter() - t_start

    # A step's time: the mean of the two ranks' (they wait for each other in the allreduce).
    steps = {mode: [(a + b) / 2 * 1e3 for a, b in zip(*(r["samples"][mode] for r in results))] for mode in MODES}
    med = {mode: median(v) for mode, v in steps.items()}
    p90 = {mode: percentile(v, 90) for mode, v in steps.items()}
    per = plan["per_round"]
    marginal = {mode: median([median(steps[mode][i:i + per]) - median(steps["off"][i:i + per])
                              for i in range(0, len(steps["off"]), per)]) for mode in CHECKED}
    hash_ms = max(r["param_hash_s"] for r in results) * 1e3
    norm_cold_ms = median([r["norm_cold_s"] for r in results]) * 1e3
    norm_hot_ms = median([r["norm_hot_s"] for r in results]) * 1e3
    off = med["off"]
    ratios: dict[str, float | None] = {
        "ride_marginal_vs_off": ratio(marginal["ride"], off),
        "behind_marginal_vs_off": ratio(marginal["behind"], off),
        "commit_marginal_vs_off": ratio(marginal["commit"], off),
        "param_hash_vs_off": ratio(hash_ms, off),
        "norm_pass_cold_vs_off": ratio(norm_cold_ms, off),
        f"checks_every_{args.check_every}_ride_vs_off": ratio(max(marginal["ride"], 0.0) + hash_ms / args.check_every,
                                                              off),
        f"checks_every_{args.check_every}_commit_vs_off": ratio(
            max(marginal["commit"], 0.0) + hash_ms / args.check_every, off),
    }
    # Where the ride's time goes (medians per step, mean of the two workers).
    parts = {mode: {part: sum(r["parts_s"][mode].get(part, 0.0) for r in results) / len(results) * 1e3
                    for part in ("observe", "post", "check")} for mode in CHECKED}
    exchange_ms = median([r["exchange_alone_s"] for r in results]) * 1e3
    phase_ms = {mode: {ph: sum(r["phases_s"][mode][ph] for r in results) / len(results) * 1e3 for ph in PHASES}
                for mode in MODES}
    thread_ms = _thread_table(results)
    goal_key = f"checks_every_{args.check_every}_ride_vs_off"
    goal = ratios[goal_key]
    out = {"plan": plan, "median_ms": med, "p90_ms": p90, "marginal_ms": marginal, "param_hash_ms": hash_ms,
           "norm_pass_ms": {"cold": norm_cold_ms, "hot": norm_hot_ms},
           "early_exchanges": [r["early_exchanges"] for r in results],
           "riding_exchanges": [r["riding_exchanges"] for r in results], "committed": [r["committed"] for r in results],
           "steps": [r["steps"] for r in results], "thread_cpu_ms": thread_ms, "parts_ms": parts,
           "exchange_alone_ms": exchange_ms, "phases_ms": phase_ms,
           "goals": {goal_key: goal is not None and goal <= 0.02}}
    print(f"SDC checks in a real step: Manager + rallypoint DDP, MLP 1,312,768 params, batch 32x512, SGD, 1 torch "
          f"thread, 2 replica groups on gloo loopback; {plan['rounds']} rounds x {per} steps per mode, rotated; "
          f"load {os.getloadavg()[0]:.2f}; {wall:.1f} s")
    rows = [[mode, f"{med[mode]:.3f}", f"{p90[mode]:.3f}",
             "" if mode == "off" else f"{marginal[mode]:+.3f}",
             "" if mode == "off" else f"{marginal[mode] / off * 100:+.2f}%"] for mode in MODES]
    rows.append(["param_hash", f"{hash_ms:.3f}", "", f"/{args.check_every}", f"{hash_ms / args.check_every / off * 100:.2f}%"])
    rows.append(["norm pass", f"{norm_cold_ms:.3f}", "", "cold", f"{norm_cold_ms / off * 100:.2f}%"])
    rows.append(["norm pass", f"{norm_hot_ms:.3f}", "", "hot", f"{norm_hot_ms / off * 100:.2f}%"])
    print(table(["mode", "median ms/step", "p90 ms", "marginal ms", "% of off"], rows))
    print("norm pass: one dot over all 5 MiB of gradients, alone, after a 64 MiB write (cold) and again (hot): "
          "the machine's memory bandwidth, the floor of a check that reads every gradient byte once")
    ride = parts["ride"]
    print(table(["ride: where the time goes (per step)", "ms", "% of off"], [
        [name, f"{v:.3f}", f"{v / off * 100:.2f}%"] for name, v in (
            ("norms of the buckets (comm hook, backward pass)", ride["observe"]),
            ("the row, the bucket's staging copy, posting both", ride["post"]),
            ("the row and posting the exchange (behind mode)", parts["behind"]["post"]),
            ("should_commit's check (wait + verdict)", ride["check"]),
            ("should_commit's check, behind mode", parts["behind"]["check"]),
            ("the exchange alone, between steps", exchange_ms))]))
    print(table(["phase (medians, mean of the two workers)", *(f"{mode} ms" for mode in MODES), "ride - off"], [
        [ph, *(f"{phase_ms[mode][ph]:.3f}" for mode in MODES), f"{phase_ms['ride'][ph] - phase_ms['off'][ph]:+.3f}"]
        for ph in PHASES]))
    if thread_ms:
        kinds = sorted(thread_ms["off"].keys() | thread_ms["ride"].keys(),
                       key=lambda k: -(thread_ms["off"].get(k, 0.0) + thread_ms["ride"].get(k, 0.0)))
        kinds = [k for k in kinds if max(thread_ms[m].get(k, 0.0) for m in MODES) >= 0.005]
        rows_t = [[k, *(f"{thread_ms[m].get(k, 0.0):.3f}" for m in MODES),
                   f"{thread_ms['ride'].get(k, 0.0) - thread_ms['off'].get(k, 0.0):+.3f}"] for k in kinds]
        total = {m: sum(thread_ms[m].values()) for m in MODES}
        rows_t.append(["all threads", *(f"{total[m]:.3f}" for m in MODES), f"{total['ride'] - total['off']:+.3f}"])
        print(table(["CPU per step by thread (mean of the two workers)", *(f"{m} ms" for m in MODES), "ride - off"],
                    rows_t))
    print(f"exchanges that rode behind the gradients or in them: {out['early_exchanges']} (ride and behind steps: "
          f"{2 * plan['rounds'] * per}); in the last bucket's collective: {out['riding_exchanges']} (ride steps: "
          f"{plan['rounds'] * per}); committed steps {out['committed']} of {out['steps']}")
    print(f"goal: {goal_key} <= 0.02: {'met' if out['goals'][goal_key] else 'NOT met'} "
          f"({'-' if goal is None else f'{goal:.4f}'})"
          + ("; a --quick smoke run: 3 rounds are too few to measure a marginal" if args.quick else ""))
    line = json.dumps({"bench": "sdc_step", "quick": args.quick, "results": out, "ratios": ratios})
    _util.emit_line(line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
