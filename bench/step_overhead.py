"""Per-step overhead of a fault-tolerant training loop: rallypoint vs torchft 0.2.0 vs
plain torch.distributed, measured in one run.

Two replica groups (two worker processes, one rank each, gloo on CPU over loopback,
free ports only) run the same loop in three variants, one variant at a time (each in a
fresh pair of processes, so no other variant's background threads are running):

- ``plain``: ``init_process_group("gloo")`` on a TCPStore hosted here; per step
  zero_grad, forward, backward, ``dist.all_reduce`` of every grad, divide by 2,
  ``opt.step()``. The floor.
- ``ours``: ``rallypoint.manager.Manager`` (``use_async_quorum=True``) with
  ``rallypoint.process_groups.ProcessGroupGloo`` against our ``LighthouseServer``;
  per step ``start_quorum()``, forward, backward, ``allreduce(g).wait()`` per grad,
  ``if should_commit(): opt.step()``.
- ``torchft``: ``torchft.Manager`` + ``torchft.ProcessGroupGloo`` against torchft's Rust
  ``LighthouseServer``; the same loop.
- ``ours_tls`` (with ``--tls``): ``ours`` with a job token and mutual TLS on every
  rallypoint socket (lighthouse, manager server, checkpoint server): the workers get
  ``RALLYPOINT_TOKEN``, ``RALLYPOINT_TLS_CERT/KEY/CA/CLIENT_CA`` and
  ``RALLYPOINT_REQUIRE_TLS=1`` in their environment (as a job would), the lighthouse the
  same settings as arguments. The certificates (a CA and one leaf for this host, made
  with ``trustme``) live in a temporary directory for the run.

Two models: ``tiny`` (``nn.Linear(4, 2)``: the step is almost only the framework's
fixed cost) and ``mlp`` (3 Linear layers, ~1.3 M parameters). After a warm-up (which
includes the first quorum and, for the managers, the step-0 init-sync heal) the two
models are timed in alternating blocks of steps in the same processes. Per variant
and model: median and p90 ms/step and the median of each phase of the step
(start_quorum, forward+backward, allreduce waits, should_commit, optimizer step).

Fixed cost per step = tiny-model median minus plain's tiny-model median. Ratios:
``fixed_ours_vs_torchft`` (goal <= 1/3), ``mlp_ours_vs_plain`` (goal <= 1.05, issue 39),
``mlp_torchft_vs_plain``; with ``--tls`` also ``fixed_ours_tls_vs_ours`` (goal <= 1.10),
``tiny_ours_tls_vs_ours`` and ``mlp_ours_tls_vs_ours``. Prints a table and one JSON line
``{"bench": "step_overhead", "results": ..., "ratios": ...}``.

    .venv/bin/python bench/step_overhead.py            # full run, ~1-2 minutes
    .venv/bin/python bench/step_overhead.py --quick    # smoke run
    .venv/bin/python bench/step_overhead.py --tls      # also ours over mutual TLS + token
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ratio, median, percentile, ratio, table  # noqa: E402

VARIANTS = ("plain", "ours", "ours_nolease", "torchft")
#: Ours with quorum leases off at the lighthouse (every step asks it, as torchft's do).
NOLEASE = "ours_nolease"
TLS_VARIANT = "ours_tls"
MODELS = ("tiny", "mlp")
PHASES = ("quorum", "fwd_bwd", "allreduce", "commit", "opt")
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- worker side
def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _models() -> dict[str, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    tiny = nn.Linear(4, 2)
    # 512*1024+1024 + 1024*512+512 + 512*512+512 = 1,312,768 parameters
    mlp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 512))
    return {"tiny": tiny, "mlp": mlp}


def _worker(plan: dict[str, Any]) -> None:
    import logging

    _util.exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    variant, rank = plan["variant"], plan["rank"]
    models = _models()
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    batches = {"tiny": torch.randn(8, 4, generator=gen), "mlp": torch.randn(32, 512, generator=gen)}

    def save() -> dict[str, Any]:
        return {"models": {k: m.state_dict() for k, m in models.items()},
                "opts": {k: o.state_dict() for k, o in opts.items()}}

    def load(sd: dict[str, Any]) -> None:
        for k, m in models.items():
            m.load_state_dict(sd["models"][k])
        for k, o in opts.items():
            o.load_state_dict(sd["opts"][k])

    t_setup = time.perf_counter()
    timeout = timedelta(seconds=plan["op_timeout_s"])
    manager: Any = None
    if variant == "plain":
        store = dist.PrefixStore(
            f"{plan['run_id']}/plain",
            dist.TCPStore("127.0.0.1", plan["store_port"], is_master=False, wait_for_workers=False, timeout=timeout),
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    else:
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
        common = dict(
            load_state_dict=load, state_dict=save, min_replica_size=2, use_async_quorum=True,
            rank=0, world_size=1, lighthouse_addr=plan["lighthouse"], replica_id=f"replica{rank}",
            hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        )
        if variant in ("ours", NOLEASE, TLS_VARIANT):
            from rallypoint.manager.manager import Manager
            from rallypoint.process_groups import ProcessGroupGloo

            if variant == TLS_VARIANT:
                _check_tls_plan(plan)
            manager = Manager(pg=ProcessGroupGloo(timeout=timeout), store_addr="127.0.0.1", **common)
            if variant == TLS_VARIANT:
                _check_tls_manager(manager)
        else:
            from torch.distributed import TCPStore
            from torchft.manager import Manager as TFManager
            from torchft.process_group import ProcessGroupGloo as TFGloo

            # torchft's Manager needs its replica group's TCPStore to exist already
            tf_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
            manager = TFManager(pg=TFGloo(timeout=timeout), store_addr="127.0.0.1", store_port=tf_store.port, **common)
    setup_s = time.perf_counter() - t_setup

    pc = time.perf_counter
    commits = 0

    def step(name: str) -> list[float]:
        nonlocal commits
        model, opt, x = models[name], opts[name], batches[name]
        t0 = pc()
        if manager is not None:
            manager.start_quorum()
        t1 = pc()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        t2 = pc()
        grads = [p.grad for p in model.parameters()]
        if manager is None:
            for g in grads:
                dist.all_reduce(g)
                g.div_(2)
        else:
            for g in grads:
                manager.allreduce(g).wait()
        t3 = pc()
        ok = manager.should_commit() if manager is not None else True
        t4 = pc()
        if ok:
            opt.step()
            commits += 1
        t5 = pc()
        return [t5 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4]

    samples: dict[str, list[list[float]]] = {m: [] for m in MODELS}
    for _ in range(plan["warmup"]):
        for name in MODELS:
            step(name)
    warm_commits = commits
    import gc

    gc.collect()
    cpu = {m: 0.0 for m in MODELS}  # this process's CPU (all its threads) in the timed steps
    for b in range(plan["blocks"]):
        for name in MODELS:
            n = plan["steps"][name] // plan["blocks"] + (1 if b < plan["steps"][name] % plan["blocks"] else 0)
            c0 = time.process_time()
            for _ in range(n):
                samples[name].append(step(name))
            cpu[name] += time.process_time() - c0
    measured = sum(len(v) for v in samples.values())
    _out({"result": {"rank": rank, "setup_s": setup_s, "samples": samples, "cpu_s": cpu,
                     "commits": commits - warm_commits, "steps": measured}})
    # wait for the parent's go before tearing down, so the peer is never left mid-step
    sys.stdin.readline()
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        dist.destroy_process_group()
    _out({"bye": rank})
    sys.stdout.flush()
    os._exit(0)


def _check_tls_plan(plan: dict[str, Any]) -> None:
    """In an ``ours_tls`` worker, before the Manager exists: the job's token and TLS
    settings are in this process's environment and the lighthouse address is https."""
    missing = [k for k in _util.JOB_ENV_KEYS if not os.environ.get(k)]
    if missing or not plan["lighthouse"].startswith("https://"):
        raise SystemExit(f"{TLS_VARIANT} worker: not a TLS job (lighthouse {plan['lighthouse']!r}, "
                         f"missing {missing}): refusing to measure clear text as TLS")
    from rallypoint._net.tls import tls_config

    cfg = tls_config()  # what every rallypoint server and client here reads
    if not (cfg.serving and cfg.mutual and cfg.require and cfg.client_tls(plan["lighthouse"])):
        raise SystemExit(f"{TLS_VARIANT} worker: the environment does not configure mutual TLS: {cfg}")


def _check_tls_manager(manager: Any) -> None:
    """In an ``ours_tls`` worker: the manager server and the checkpoint server it made
    advertise https (they serve TLS)."""
    server = getattr(manager, "_server", None)
    transport = getattr(manager, "_transport", None)
    addrs = {"manager server": server.address() if server is not None else None,
             "checkpoint server": transport.metadata() if transport is not None else None}
    bad = {k: v for k, v in addrs.items() if not (isinstance(v, str) and v.startswith("https://"))}
    if bad:
        raise SystemExit(f"{TLS_VARIANT} worker: not serving TLS: {bad}")


# ---------------------------------------------------------------------- parent side
class _Lighthouse:
    def __init__(self, variant: str, join_ms: int, hb_ms: int, tls: _util.TlsJob | None = None) -> None:
        self.server: Any = None
        self.scheme = "http"
        if variant in ("ours", NOLEASE):
            from rallypoint.lighthouse.server import LighthouseServer

            self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=join_ms,
                                           heartbeat_timeout_ms=hb_ms, leases=variant == "ours")
        elif variant == TLS_VARIANT:
            from rallypoint.lighthouse.server import LighthouseServer

            assert tls is not None, "ours_tls needs the run's TlsJob"
            self.server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=join_ms,
                                           heartbeat_timeout_ms=hb_ms, token=tls.token, tls=tls.config())
            self.scheme = "https"
            if not self.server.address().startswith("https://"):
                raise RuntimeError(f"the {TLS_VARIANT} lighthouse does not serve TLS: {self.server.address()}")
        elif variant == "torchft":
            native = _util.load_torchft_native()
            self.server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=join_ms,
                                                  heartbeat_timeout_ms=hb_ms)

    def addr(self) -> str:
        if self.server is None:
            return ""
        port = int(self.server.address().rsplit(":", 1)[1])
        return f"{self.scheme}://127.0.0.1:{port}"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def _check_tls_lighthouse(lh: _Lighthouse, tls: _util.TlsJob) -> dict[str, str]:
    """The ``ours_tls`` lighthouse refuses what is not the job's mutual TLS: a
    clear-text client, and a TLS client without a client certificate (each would fail
    to connect); a client with the job's settings connects. What each attempt got."""
    from rallypoint._net.tls import tls_config
    from rallypoint.lighthouse.client import LighthouseClient

    addr = lh.addr()
    attempts = {
        "clear text": (addr.replace("https://", "http://", 1), tls_config(environ={}), False),
        "TLS without a client certificate": (addr, tls_config(ca=tls.ca, environ={}), False),
        "the job's mutual TLS": (addr, tls.config(), True),
    }
    seen: dict[str, str] = {}
    for what, (a, cfg, ok) in attempts.items():
        try:
            LighthouseClient(a, connect_timeout=1.0, token=tls.token, tls=cfg).close()
            got = "connected"
        except ConnectionError as e:
            got = f"refused ({type(e).__name__})"
        seen[what] = got
        if (got == "connected") != ok:
            raise RuntimeError(f"{TLS_VARIANT} lighthouse at {addr}: {what}: {got}; expected "
                               f"{'to connect' if ok else 'a refusal'}")
    return seen


def run_variant(variant: str, plan: dict[str, Any], store_port: int, timeout_s: float,
                tls: _util.TlsJob | None = None, checks: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    lh = _Lighthouse(variant, plan["join_timeout_ms"], plan["heartbeat_timeout_ms"], tls)
    children: list[Child] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RUST_LOG", "warn")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
        env.pop(k, None)
    if variant == TLS_VARIANT:
        assert tls is not None
        env.update(tls.env(mutual=True, require=True))
    try:
        if variant == TLS_VARIANT and checks is not None and "lighthouse_refuses" not in checks:
            checks["lighthouse_refuses"] = _check_tls_lighthouse(lh, tls)  # type: ignore[arg-type]
        # The lighthouse runs in this process, which does nothing else meanwhile: its CPU
        # from the workers' start to their results is the lighthouse's cost of the run
        # (setup, warm-up and timed steps, heartbeats and liveness streams included).
        cpu0 = time.process_time()
        for rank in range(2):
            wplan = dict(plan, variant=variant, rank=rank, store_port=store_port, lighthouse=lh.addr())
            children.append(Child([sys.executable, __file__, "--worker", json.dumps(wplan)],
                                  name=f"step-{variant}-{rank}", env=env, cwd=str(REPO)))
        results = [_util.recv_result(c, timeout_s) for c in children]
        results[0]["lh_cpu_s"] = time.process_time() - cpu0 if lh.server is not None else None
        results[0]["group_steps"] = 2 * (plan["warmup"] * len(MODELS) + sum(plan["steps"].values()))
        for c in children:
            c.send({"cmd": "exit"})
        for c in children:
            try:
                c.recv(15)
            except _util.ChildError:
                pass
        return results
    finally:
        close_all(children, grace=5.0)
        lh.close()


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 and rank 1 time the same steps (they wait for each other in the
    allreduce); a step's time is the mean of the two ranks' times for it."""
    out: dict[str, Any] = {}
    for name in MODELS:
        rows = list(zip(*(r["samples"][name] for r in results)))
        total = [sum(s[0] for s in pair) / len(pair) * 1e3 for pair in rows]
        phases = {ph: median([s[i + 1] * 1e3 for s in results[0]["samples"][name]]) for i, ph in enumerate(PHASES)}
        cpu = sum(r["cpu_s"][name] for r in results) / max(1, sum(len(r["samples"][name]) for r in results))
        out[name] = {"median_ms": median(total), "p90_ms": percentile(total, 90), "steps": len(total),
                     "cpu_ms_per_step": cpu * 1e3, "phases_ms_rank0": phases}
    out["setup_s"] = max(r["setup_s"] for r in results)
    lh_cpu = results[0].get("lh_cpu_s")
    out["lighthouse_cpu_ms_per_step"] = None if lh_cpu is None else lh_cpu * 1e3 / max(1, results[0]["group_steps"])
    out["commit_fraction"] = sum(r["commits"] for r in results) / max(1, sum(r["steps"] for r in results))
    return out


def _pool(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Concatenate the samples of several rounds of one variant (per rank)."""
    pooled = []
    for rank in range(2):
        rs = [run[rank] for run in runs]
        pooled.append({
            "rank": rank,
            "setup_s": max(r["setup_s"] for r in rs),
            "samples": {m: [s for r in rs for s in r["samples"][m]] for m in MODELS},
            "cpu_s": {m: sum(r["cpu_s"][m] for r in rs) for m in MODELS},
            "commits": sum(r["commits"] for r in rs),
            "steps": sum(r["steps"] for r in rs),
            **({"lh_cpu_s": None if any(r.get("lh_cpu_s") is None for r in rs) else sum(r["lh_cpu_s"] for r in rs),
                "group_steps": sum(r["group_steps"] for r in rs)} if rank == 0 else {}),
        })
    return pooled


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and one round")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of plain,ours,ours_nolease,torchft (and ours_tls, which implies --tls)")
    ap.add_argument("--tls", action="store_true",
                    help="also run ours_tls: ours with a job token and mutual TLS on every rallypoint socket")
    ap.add_argument("--rounds", type=int, help="variant sequences run (alternating order); default 2, quick 1")
    ap.add_argument("--tiny-steps", type=int, help="timed tiny-model steps per round (default 50, quick 15)")
    ap.add_argument("--mlp-steps", type=int, help="timed MLP steps per round (default 30, quick 10)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a variant's workers may take")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's native lighthouse logs every quorum at info
    quick = args.quick
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in (*VARIANTS, TLS_VARIANT)]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}")
    use_tls = args.tls or TLS_VARIANT in variants
    if use_tls and TLS_VARIANT not in variants:
        # measured next to ours (and in reversed order in the second round)
        variants.insert(variants.index("ours") + 1 if "ours" in variants else len(variants), TLS_VARIANT)
    # The clear-text variants must not pick up a job's token or TLS settings from here.
    cleared = _util.clear_job_env(os.environ)
    if cleared:
        print(f"note: ignoring {', '.join(cleared)} from the environment (the ours_tls variant sets its own)",
              file=sys.stderr)
    rounds = args.rounds or (1 if quick else 2)
    plan = {
        "run_id": uuid.uuid4().hex[:8],
        "warmup": 3 if quick else 8,
        "steps": {"tiny": args.tiny_steps or (15 if quick else 50), "mlp": args.mlp_steps or (10 if quick else 30)},
        "blocks": 3 if quick else 5,
        "op_timeout_s": 30,
        "join_timeout_ms": 10_000,
        "heartbeat_timeout_ms": 5_000,
    }
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if use_tls:
        # gRPC core logs each refused handshake of the clear-text check at INFO
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    tls = _util.TlsJob() if use_tls else None  # one PKI + token per run, removed at the end
    tls_checks: dict[str, Any] = {}
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    raw: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    try:
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                plan_r = dict(plan, run_id=f"{plan['run_id']}-{r}")
                raw[v].append(run_variant(v, plan_r, store.port, args.timeout, tls, tls_checks))
    finally:
        if tls is not None:
            tls.close()
    wall = time.monotonic() - t_start
    load1 = os.getloadavg()[0]
    res = {v: summarize(_pool(runs)) for v, runs in raw.items()}

    def med(v: str, m: str) -> float | None:
        return res.get(v, {}).get(m, {}).get("median_ms")

    plain_tiny = med("plain", "tiny")
    for v in ("ours", NOLEASE, "torchft", TLS_VARIANT):
        if v in res and plain_tiny is not None and med(v, "tiny") is not None:
            res[v]["fixed_ms"] = med(v, "tiny") - plain_tiny
    ratios = {
        "fixed_ours_vs_torchft": ratio(res.get("ours", {}).get("fixed_ms"), res.get("torchft", {}).get("fixed_ms")),
        "mlp_ours_vs_plain": ratio(med("ours", "mlp"), med("plain", "mlp")),
        "mlp_torchft_vs_plain": ratio(med("torchft", "mlp"), med("plain", "mlp")),
        "tiny_ours_vs_torchft": ratio(med("ours", "tiny"), med("torchft", "tiny")),
        "mlp_ours_vs_torchft": ratio(med("ours", "mlp"), med("torchft", "mlp")),
        "fixed_ours_nolease_vs_torchft": ratio(res.get(NOLEASE, {}).get("fixed_ms"), res.get("torchft", {}).get("fixed_ms")),
        "lighthouse_cpu_ours_vs_nolease": ratio(res.get("ours", {}).get("lighthouse_cpu_ms_per_step"),
                                                res.get(NOLEASE, {}).get("lighthouse_cpu_ms_per_step")),
        "lighthouse_cpu_ours_vs_torchft": ratio(res.get("ours", {}).get("lighthouse_cpu_ms_per_step"),
                                                res.get("torchft", {}).get("lighthouse_cpu_ms_per_step")),
    }
    if use_tls:
        ratios["fixed_ours_tls_vs_ours"] = ratio(res.get(TLS_VARIANT, {}).get("fixed_ms"),
                                                 res.get("ours", {}).get("fixed_ms"))
        ratios["tiny_ours_tls_vs_ours"] = ratio(med(TLS_VARIANT, "tiny"), med("ours", "tiny"))
        ratios["mlp_ours_tls_vs_ours"] = ratio(med(TLS_VARIANT, "mlp"), med("ours", "mlp"))
        res[TLS_VARIANT]["tls"] = {"mutual": True, "token": True, "require_tls": True, **tls_checks}

    print(f"step overhead: 2 replica groups x 1 rank, gloo/CPU loopback, torchft {_util.torchft_version()}, "
          f"{rounds} round(s), {plan['steps']['tiny']}+{plan['steps']['mlp']} timed steps/round; "
          f"load {load0:.2f} -> {load1:.2f}; {wall:.0f}s")
    rows = []
    for v in variants:
        for m in MODELS:
            d = res[v][m]
            ph = d["phases_ms_rank0"]
            rows.append([f"{v} {m}", _f(d["median_ms"]), _f(d["p90_ms"]), _f(d["cpu_ms_per_step"]),
                         *(_f(ph[p]) for p in PHASES), str(d["steps"])])
    print("phases: medians on rank 0 of start_quorum() / zero_grad+forward+backward / allreduce waits (the first "
          "also waits for the async quorum) / should_commit() / opt.step(); CPU: worker process CPU (all threads) "
          "per step")
    print(table(["variant model", "median ms", "p90 ms", "CPU ms", "quorum", "fwd+bwd", "allreduce", "commit", "opt",
                 "steps"], rows))
    print()
    rows2 = []
    for v in ("ours", NOLEASE, "torchft", TLS_VARIANT):
        if v in res:
            rows2.append([f"{v} fixed cost/step ms (tiny - plain tiny)", _f(res[v].get("fixed_ms"))])
    for v in ("ours", NOLEASE, "torchft"):
        if v in res and res[v].get("lighthouse_cpu_ms_per_step") is not None:
            rows2.append([f"{v} lighthouse CPU ms per group-step", f"{res[v]['lighthouse_cpu_ms_per_step']:.4f}"])
    rows2 += [
        ["fixed ours / torchft (goal <= 0.33)", fmt_ratio(ratios["fixed_ours_vs_torchft"])],
        ["fixed ours without leases / torchft", fmt_ratio(ratios["fixed_ours_nolease_vs_torchft"])],
        ["lighthouse CPU/step ours / ours without leases (goal ~0)", fmt_ratio(ratios["lighthouse_cpu_ours_vs_nolease"])],
        ["lighthouse CPU/step ours / torchft", fmt_ratio(ratios["lighthouse_cpu_ours_vs_torchft"])],
        ["MLP ours / plain (goal <= 1.05)", fmt_ratio(ratios["mlp_ours_vs_plain"])],
        ["MLP torchft / plain", fmt_ratio(ratios["mlp_torchft_vs_plain"])],
        ["tiny ours / torchft", fmt_ratio(ratios["tiny_ours_vs_torchft"])],
        ["MLP ours / torchft", fmt_ratio(ratios["mlp_ours_vs_torchft"])],
    ]
    if use_tls:
        rows2 += [
            ["fixed ours_tls / ours (goal <= 1.10)", fmt_ratio(ratios["fixed_ours_tls_vs_ours"])],
            ["tiny ours_tls / ours", fmt_ratio(ratios["tiny_ours_tls_vs_ours"])],
            ["MLP ours_tls / ours", fmt_ratio(ratios["mlp_ours_tls_vs_ours"])],
        ]
    for v in variants:
        rows2.append([f"{v}: setup s / commit fraction", f"{res[v]['setup_s']:.2f} / {res[v]['commit_fraction']:.2f}"])
    print(table(["summary", "value"], rows2))
    line = json.dumps({"bench": "step_overhead", "quick": quick, "rounds": rounds, "results": res, "ratios": ratios})
    _util.emit_line(line, args.out)


def _f(v: float | None) -> str:
    return "-" if v is None or v != v else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


if __name__ == "__main__":
    main()
