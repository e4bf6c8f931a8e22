#!/usr/bin/env python
"""Quorum-lease benchmark: what leases cost and save on rallypoint's lighthouse, with
torchft 0.2.0's native lighthouse (every group asks every step) in the same run.

    .venv/bin/python bench/leases.py               # N = 2, 64, 256, 1024 (~2 minutes)
    .venv/bin/python bench/leases.py --quick       # N = 2, 64, 256
    .venv/bin/python bench/leases.py --groups 2,512 --duration 5 --rounds 5 --out leases.json

Each lighthouse runs in THIS process, which does nothing else while it is measured, so
``time.process_time()`` deltas are its CPU (every thread: grpc's, torchft's Rust runtime).
N simulated replica groups live in ONE child process on one ``grpc.aio`` loop (a channel,
and a connection, per 64 groups). Per N, against ``LighthouseServer(leases=True)``:

1. Lease formation: every group opens an Attach stream (hello ``leases=True``), reads the
   welcome, then all N ask for a quorum at once: the N-way quorum's time; every answer must
   carry a lease grant (``parse_grant``) for the one quorum_id.
2. Revoke fan-out (goal: max <= 100 ms at N=1024): a joiner asks; the child times, from
   just before it sends the joiner's request, until each stream has read a ``lease_revoke``
   naming the lease (quorum_id >= the granted one): median/p99/max over the N streams,
   pooled over ``--revokes`` repeats (the joiner's call is cancelled, then the N ask again,
   step + 1, for a new lease). Also: the first stream's time, and the CPU each side spent.
3. Steady state on the lease: one ``StepReport`` (the ManagerServer's ``data`` JSON) per
   group per step at 10 steps/s for ``--duration`` s: lighthouse CPU per group-step, reports
   sent vs counted (``rallypoint_step_reports_total`` after a short drain), the step rate the
   child achieved. Then the same window with only ``LivenessStream``'s 1/s pings: the idle
   cost of N attached streams.
4. Every step asks (torchft's way): ``--rounds`` all-N rounds of unary Quorum calls (no
   streams; paced at 10/s when a round is that fast), against ours with ``leases=False``
   and against torchft's lighthouse: CPU per group-step and round time. torchft logs every
   request (every quorum in full) on fd 2: its cost as shipped, counted, sent to a temp file.

Output: a table (a row per N), then ONE JSON line {"bench": "leases", "quick", "results",
"ratios"} (ratios at the largest N; CPU ratios < 1: the lease costs the lighthouse less).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _util  # noqa: E402
from _util import Child, fmt_ms, median, percentile, ratio  # noqa: E402

log = logging.getLogger("bench.leases")
QUORUM = "/torchft.LighthouseService/Quorum"
ATTACH = "/rallypoint.RallypointLighthouse/Attach"
PER_CHANNEL = 64
RATE = 10.0  # simulated steps per second
SENTINEL = 987654321


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def data_template(i: int) -> str:
    """The group's Quorum/StepReport ``data`` (rules.aggregate_requests), ``% (step, step)``."""
    doc = {"step": SENTINEL, "group_world_size": 1, "gather_s": 0.0004, "shrink_only_ranks": [], "commit_failures": 0,
           "step_stats": {"step": SENTINEL, "round": 0, "outcome": "committed", "step_s": 0.1,
                          "compute_s": round(0.08 + (i % 7) * 0.001, 4), "quorum_wait_s": 0.0, "comm_s": 0.01,
                          "heal_s": 0.0, "commit_s": 0.001, "configure_s": 0.0, "rank": 0}}
    return json.dumps(doc).replace(str(SENTINEL), "%d")


# ================================================================ child: N groups, one loop
class Groups:
    def __init__(self, target: str, n: int) -> None:
        import grpc

        from rallypoint._net.rpc import channel_options
        from rallypoint._proto import rallypoint_pb2 as rpb
        from rallypoint._proto import torchft_pb2 as pb

        self.grpc, self.rpb, self.pb, self.n = grpc, rpb, pb, n
        opts = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]  # a connection each
        chans = [grpc.aio.insecure_channel(target, options=opts) for _ in range(-(-n // PER_CHANNEL))]
        self.quorum = [c.unary_unary(QUORUM, request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                                     response_deserializer=pb.LighthouseQuorumResponse.FromString) for c in chans]
        self.attach_stubs = [c.stream_stream(ATTACH, request_serializer=rpb.AttachRequest.SerializeToString,
                                             response_deserializer=rpb.AttachResponse.FromString) for c in chans]
        self.templates = [data_template(i) for i in range(n + 1)]  # + the joiner
        self.every = 1  # the grant's report_every
        self.calls: list[Any] = []
        self.readers: list[asyncio.Future] = []
        self.target: int | None = None  # the lease whose revoke is being timed
        self.revoked_at: dict[int, float] = {}
        self.all_revoked = asyncio.Event()
        self.other: dict[str, int] = {"other_revokes": 0, "peer_down": 0, "stream_errors": 0, "cancelled_retried": 0}

    def request(self, rid: str, i: int, step: int) -> Any:
        return self.pb.LighthouseQuorumRequest(requester=self.pb.QuorumMember(
            replica_id=rid, address=f"127.0.0.1:{20000 + i}", store_address=f"127.0.0.1:{40000 + i}", step=step,
            world_size=1, data=self.templates[i] % (step, step)))

    async def attach(self) -> dict:
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> Any:
            async with sem:
                call = self.attach_stubs[i // PER_CHANNEL]()
                hello = self.rpb.AttachHello(replica_id=f"g{i}", address=f"127.0.0.1:{20000 + i}", leases=True)
                await call.write(self.rpb.AttachRequest(hello=hello))
                first = await asyncio.wait_for(call.read(), 30)
                if first is self.grpc.aio.EOF or not first.HasField("welcome"):
                    raise RuntimeError(f"g{i}: no welcome on the Attach stream (got {first!r})")
                return call

        t0 = time.perf_counter()
        self.calls = list(await asyncio.gather(*(one(i) for i in range(self.n))))
        self.readers = [asyncio.ensure_future(self._read(i, c)) for i, c in enumerate(self.calls)]
        return {"ms": (time.perf_counter() - t0) * 1000}

    async def _read(self, i: int, call: Any) -> None:
        try:
            while (msg := await call.read()) is not self.grpc.aio.EOF:
                now = time.perf_counter()
                if msg.HasField("lease_revoke"):
                    tgt = self.target
                    if tgt is not None and msg.lease_revoke.quorum_id >= tgt and i not in self.revoked_at:
                        self.revoked_at[i] = now
                        if len(self.revoked_at) == self.n:
                            self.all_revoked.set()
                    else:
                        self.other["other_revokes"] += 1  # e.g. the first re-asker's left notice
                elif msg.HasField("peer_down"):
                    self.other["peer_down"] += 1
        except Exception:  # the lighthouse shut down, or the stream broke: counted, not fatal
            self.other["stream_errors"] += 1

    async def ask(self, rid: str, i: int, step: int, timeout: float) -> tuple[int | None, int, int | None, str | None]:
        from rallypoint._net.lease import parse_lease

        t0 = time.perf_counter()
        while True:
            left = timeout - (time.perf_counter() - t0)
            call = self.quorum[i // PER_CHANNEL](self.request(rid, i, step), timeout=left)
            try:
                resp = await call
                grant = parse_lease(await call.trailing_metadata())
                if grant is not None:  # the members report step stats every report_every steps, as a ManagerServer does
                    self.every = grant.report_every
                return resp.quorum.quorum_id, len(resp.quorum.participants), grant.quorum_id if grant else None, None
            except self.grpc.aio.AioRpcError as e:
                # Seen at N=1024 after a revoke: a call CANCELLED before it reaches the lighthouse's
                # handler (no metadata, "CANCELLED:CANCELLED"). Asked again, and counted.
                if e.code() == self.grpc.StatusCode.CANCELLED and left > 1:
                    self.other["cancelled_retried"] += 1
                    continue
                err: Exception = e
            except Exception as e:
                err = e
            return None, 0, None, f"{rid} after {time.perf_counter() - t0:.3f}s: {type(err).__name__}: {str(err)[:300]}"

    async def quorum_all(self, step: int, timeout: float = 60) -> dict:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(self.ask(f"g{i}", i, step, timeout) for i in range(self.n)))
        errs = sorted((r[3] for r in res if r[3]), key=lambda e: "DEADLINE_EXCEEDED" in e)  # the odd ones first
        return {"ms": (time.perf_counter() - t0) * 1000, "qids": sorted({r[0] for r in res if r[0] is not None}),
                "sizes": sorted({r[1] for r in res if r[0] is not None}), "grants": sorted({r[2] for r in res if r[2]}),
                "n_grants": sum(1 for r in res if r[2]), "n_errors": len(errs), "errors": errs[:3]}

    async def revoke(self, joiner: str, target: int, timeout: float = 30) -> dict:
        self.revoked_at.clear()
        self.all_revoked.clear()
        self.target = target
        c0, t0 = time.process_time(), time.perf_counter()
        jcall = self.quorum[0](self.request(joiner, self.n, 0), timeout=120)
        try:
            await asyncio.wait_for(self.all_revoked.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self.target = None
            jcall.cancel()  # the lighthouse drops the joiner's request; the N then ask again
        lat = sorted((t - t0) * 1000 for t in self.revoked_at.values())
        return {"got": len(lat), "lat_ms": lat, "child_cpu_ms": (time.process_time() - c0) * 1000}

    async def steady(self, duration: float, mode: str, step0: int) -> dict:
        rpb, ticks, sent = self.rpb, 0, 0
        ping = rpb.AttachRequest(ping=rpb.AttachPing())
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration:
            if (wait := t0 + ticks / RATE - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            step = step0 + ticks
            if mode == "reports":
                msgs = [(c, rpb.AttachRequest(step_report=rpb.StepReport(data=self.templates[i] % (step, step), step=step)))
                        for i, c in enumerate(self.calls)] if step % self.every == 0 else []
            else:  # LivenessStream pings an idle stream once a second: a tenth of them per tick
                msgs = [(c, ping) for i, c in enumerate(self.calls) if i % 10 == ticks % 10]
            await asyncio.gather(*(c.write(m) for c, m in msgs))
            sent, ticks = sent + len(msgs), ticks + 1
        elapsed = time.perf_counter() - t0
        return {"ticks": ticks, "sent": sent, "elapsed_s": elapsed, "steps_per_s": ticks / elapsed, "report_every": self.every}

    async def rounds(self, rounds: int, step0: int) -> dict:
        out: list[dict] = []
        t0 = time.perf_counter()
        for r in range(rounds):
            if (wait := t0 + r / RATE - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            out.append(await self.quorum_all(step0 + r))
        return {"ms": [o["ms"] for o in out], "qids": sorted({q for o in out for q in o["qids"]}),
                "sizes": sorted({s for o in out for s in o["sizes"]}), "n_errors": sum(o["n_errors"] for o in out),
                "errors": [e for o in out for e in o["errors"]][:3]}


async def child_main(cfg: dict) -> None:
    g = Groups(cfg["target"], cfg["n"])
    loop = asyncio.get_running_loop()
    _out({"ready": True})
    while (line := await loop.run_in_executor(None, sys.stdin.readline)):
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            res = await getattr(g, name)(**cmd)
        except Exception as e:
            res = {"error": f"{name}: {type(e).__name__}: {e}"[:2000]}
        _out({**res, "other": dict(g.other)})
    os._exit(0)  # EOF on stdin: do not wait on grpc's teardown of N streams


# ================================================================ parent
_OTHER: dict[str, dict] = {}  # child name -> its latest counters (Groups.other)


def _ask(child: Child, cmd: dict, timeout: float) -> dict:
    child.send(cmd)
    res = child.recv(timeout=timeout)
    _OTHER[child.name] = res.get("other", {})
    if "error" in res:
        raise RuntimeError(f"{child.name}: {res['error']}")
    return res


def _start_child(target: str, n: int, name: str) -> Child:
    cfg = json.dumps({"target": target, "n": n, "parent": os.getpid()})
    child = Child([sys.executable, os.path.abspath(__file__), "--_groups", cfg], name=name)
    try:
        child.recv(timeout=60)  # {"ready": true}
    except Exception:
        child.close(grace=0.1)
        raise
    return child


def _reports_counted(lh: Any) -> float:
    lines = lh.core.metrics.render().decode().splitlines()
    return next((float(x.split()[1]) for x in lines if x.startswith("rallypoint_step_reports_total ")), 0.0)


def _check_lease(q: dict, n: int, what: str) -> int:
    if q["n_errors"] or q["sizes"] != [n] or len(q["qids"]) != 1:
        raise RuntimeError(f"{what}: expected one quorum of {n}, got qids {q['qids']} sizes {q['sizes']}, "
                           f"{q['n_errors']} errors {q['errors']}")
    if q["n_grants"] != n or q["grants"] != q["qids"]:
        raise RuntimeError(f"{what}: {q['n_grants']}/{n} answers carry a lease grant (grants {q['grants']}, quorum {q['qids']})")
    return q["grants"][0]


def _wait_withdrawn(lh: Any, rid: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(r["replica_id"] == rid and r["participating"] for r in lh.status(timeout=10)["replicas"]):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the lighthouse still lists {rid}'s cancelled Quorum request after {timeout:.0f}s")


def _shutdown(lh: Any) -> int:
    """Stop the lighthouse BEFORE its groups: their streams then end as a shutdown, not as
    N crashes (each would push a PeerDown to every other stream: N^2 pushes). grpc.aio logs,
    and prints, a CancelledError traceback per stream still open after the grace period
    (grpc/grpc#37239): kept off the terminal, counted (returned)."""
    grpc_log, old_stderr, sink = logging.getLogger("grpc._cython.cygrpc"), sys.stderr, io.StringIO()
    level = grpc_log.level
    grpc_log.setLevel(logging.CRITICAL)
    sys.stderr = sink
    try:
        lh.shutdown()
    finally:
        sys.stderr = old_stderr
        grpc_log.setLevel(level)
    return sink.getvalue().count("CancelledError")


def bench_leased(n: int, revokes: int, duration: float) -> dict:
    from rallypoint.lighthouse.server import LighthouseServer

    res: dict[str, Any] = {k: [] for k in ("revoke_first_ms", "revoke_max_ms", "revoke_lh_cpu_ms",
                                           "revoke_child_cpu_ms", "reform_ms")}
    lh = child = None
    try:
        lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=30_000,
                              heartbeat_timeout_ms=30_000, leases=True)
        child = _start_child(lh.local_address().split("://", 1)[1], n, f"groups-lease-{n}")
        res["attach_ms"] = _ask(child, {"cmd": "attach"}, 120)["ms"]
        q = _ask(child, {"cmd": "quorum_all", "step": 1}, 120)
        lease, res["quorum_ms"], step = _check_lease(q, n, "lease formation"), q["ms"], 1
        lats: list[float] = []
        for rep in range(revokes):
            cpu0 = time.process_time()
            r = _ask(child, {"cmd": "revoke", "joiner": f"g_join{rep}", "target": lease}, 60)
            res["revoke_lh_cpu_ms"].append((time.process_time() - cpu0) * 1000)
            if r["got"] < n:
                raise RuntimeError(f"revoke #{rep}: only {r['got']}/{n} streams read the revoke of lease {lease} in 30 s")
            lats += r["lat_ms"]
            res["revoke_first_ms"].append(r["lat_ms"][0])
            res["revoke_max_ms"].append(r["lat_ms"][-1])
            res["revoke_child_cpu_ms"].append(r["child_cpu_ms"])
            _wait_withdrawn(lh, f"g_join{rep}")
            step += 1
            q = _ask(child, {"cmd": "quorum_all", "step": step}, 120)
            new = _check_lease(q, n, f"lease re-formed after revoke #{rep}")
            if new <= lease:
                raise RuntimeError(f"re-formed lease {new} is not above the revoked {lease}")
            lease = new
            res["reform_ms"].append(q["ms"])
        res.update(fanout_median_ms=median(lats), fanout_p99_ms=percentile(lats, 99), fanout_max_ms=max(lats, default=None))
        for mode in ("reports", "pings"):
            c0, cpu0, w0 = _reports_counted(lh), time.process_time(), time.monotonic()
            s = _ask(child, {"cmd": "steady", "duration": duration, "mode": mode, "step0": step + 1}, duration + 120)
            counted = 0.0
            if mode == "reports":
                deadline = time.monotonic() + 5.0  # drain: reports written but not yet read
                while (counted := _reports_counted(lh) - c0) < s["sent"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                step += s["ticks"]
            cpu, wall = time.process_time() - cpu0, time.monotonic() - w0
            res[mode] = {**s, "counted": counted, "kept_up": mode != "reports" or counted >= s["sent"],
                         "cpu_s": cpu, "cores": cpu / wall, "cpu_ms_per_group_step": cpu * 1000 / max(1, n * s["ticks"])}
        res["lease_held_at_end"] = lh.status(timeout=30)["lease"]["quorum_id"] == lease
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        log.error("N=%d leased: %s", n, res["error"])
    finally:
        if lh is not None:
            res["shutdown_tracebacks"] = _shutdown(lh)
        if child is not None:
            res["child"] = _OTHER.get(child.name)
            child.close(grace=2)
    return res


def bench_rounds(impl: str, n: int, rounds: int) -> dict:
    """R all-N unary quorum rounds (after a warm-up round that forms the quorum)."""
    res: dict[str, Any] = {}
    srv: Any = None
    child = saved_fd = sink = None
    try:
        if impl == "torchft":
            native = _util.load_torchft_native()
            sink = tempfile.TemporaryFile(prefix="bench-leases-torchft-")
            sys.stderr.flush()
            saved_fd = os.dup(2)
            os.dup2(sink.fileno(), 2)
            srv = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=30_000,
                                          heartbeat_timeout_ms=30_000)
            target = "127.0.0.1:" + srv.address().rsplit(":", 1)[1]  # address() names the host
        else:
            from rallypoint.lighthouse.server import LighthouseServer

            srv = LighthouseServer(bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=30_000,
                                   heartbeat_timeout_ms=30_000, leases=False)
            target = srv.local_address().split("://", 1)[1]
        child = _start_child(target, n, f"groups-{impl}-{n}")
        for what, r0, k in (("warm-up round", 0, 1), ("rounds", 1, rounds)):
            cpu0, w0 = time.process_time(), time.monotonic()
            r = _ask(child, {"cmd": "rounds", "rounds": k, "step0": r0}, 60 + k * 60)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - w0
            if r["n_errors"] or r["sizes"] != [n]:
                raise RuntimeError(f"{what}: sizes {r['sizes']}, {r['n_errors']} errors {r['errors']}")
        res.update(round_median_ms=median(r["ms"]), round_max_ms=max(r["ms"]), rounds=rounds, cpu_s=cpu,
                   cores=cpu / wall, cpu_ms_per_group_step=cpu * 1000 / (n * rounds), qids=r["qids"])
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        if srv is not None:
            srv.shutdown()
        if child is not None:
            res["child"] = _OTHER.get(child.name)
            child.close(grace=2)
        if saved_fd is not None and sink is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            res["log_bytes"] = os.fstat(sink.fileno()).st_size
            sink.close()
    if "error" in res:
        log.error("N=%d %s: %s", n, impl, res["error"])
    return res


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 4) if o == o and abs(o) != float("inf") else None
    if isinstance(o, (dict, list, tuple)):
        return {str(k): _clean(v) for k, v in o.items()} if isinstance(o, dict) else [_clean(v) for v in o]
    return o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 2, 64, 256 and shorter windows")
    ap.add_argument("--groups", help="comma-separated N (default 2,64,256,1024; quick 2,64,256)")
    ap.add_argument("--duration", type=float, help="steady window per mode, s (default 5; quick 3)")
    ap.add_argument("--rounds", type=int, help="unary rounds per lighthouse (default 10; quick 3)")
    ap.add_argument("--revokes", type=int, help="revoke repetitions (default 5; quick 3)")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    quick = args.quick
    ns = [int(x) for x in args.groups.split(",")] if args.groups else ([2, 64, 256] if quick else [2, 64, 256, 1024])
    duration, rounds = args.duration or (3.0 if quick else 5.0), args.rounds or (3 if quick else 10)
    revokes = args.revokes or (3 if quick else 5)
    env = {"cpus": os.cpu_count(), "torchft": _util.torchft_version(), "loadavg_1m_at_start": os.getloadavg()[0],
           "duration_s": duration, "rounds": rounds, "revokes": revokes}
    results: dict[str, Any] = {"env": env}
    t_all = time.monotonic()
    for n in ns:
        log.info("N=%d: leased lighthouse (formation, %d revokes, %.0fs reports + %.0fs pings)", n, revokes, duration, duration)
        results[str(n)] = {"leases": bench_leased(n, revokes, duration)}
        for impl in ("ours_no_lease", "torchft"):
            log.info("N=%d: %s, %d unary rounds", n, impl, rounds)
            results[str(n)][impl] = bench_rounds(impl, n, rounds)
    env.update(wall_s=time.monotonic() - t_all, loadavg_1m_at_end=os.getloadavg()[0])

    rows, notes = [], []
    for n in ns:
        le, no, tf = (results[str(n)][k] for k in ("leases", "ours_no_lease", "torchft"))
        rep, pi = le.get("reports", {}), le.get("pings", {})
        kept = "-" if not rep else ("yes" if rep["kept_up"] else f"NO {rep['counted']:.0f}/{rep['sent']}")
        rate = "-" if not rep else f"{rep['steps_per_s']:.1f}" + ("" if rep["steps_per_s"] >= 0.95 * RATE else " (<10!)")
        rows.append([str(n), fmt_ms(le.get("quorum_ms")),
                     "/".join(_f(le.get(k), 1) for k in ("fanout_median_ms", "fanout_p99_ms", "fanout_max_ms")),
                     _f(rep.get("cpu_ms_per_group_step")), _f(pi.get("cpu_ms_per_group_step")),
                     _f(no.get("cpu_ms_per_group_step")), _f(tf.get("cpu_ms_per_group_step")),
                     fmt_ms(no.get("round_median_ms")), fmt_ms(tf.get("round_median_ms")), rate, kept])
        if le.get("revoke_lh_cpu_ms"):
            notes.append(f"N={n} revoke: first stream at {_f(median(le['revoke_first_ms']), 1)} ms (median of repeats); "
                         f"CPU per revoke: lighthouse {_f(median(le['revoke_lh_cpu_ms']), 1)} ms, groups' process "
                         f"{_f(median(le['revoke_child_cpu_ms']), 1)} ms; lighthouse busy {_f(rep.get('cores'), 2)} cores "
                         f"with reports, {_f(pi.get('cores'), 3)} idle")
        notes += [f"N={n} {k}: {v['error'][:400]}" for k, v in results[str(n)].items() if "error" in v]
        notes += [f"N={n} {k}: {v['child']['cancelled_retried']} Quorum call(s) CANCELLED before reaching the "
                  "lighthouse, asked again" for k, v in results[str(n)].items() if (v.get("child") or {}).get("cancelled_retried")]
    print()
    print(f"quorum leases: rallypoint's lighthouse vs torchft {env['torchft']}; {env['cpus']} CPUs; wall {env['wall_s']:.0f} s; "
          f"load {env['loadavg_1m_at_start']:.2f} -> {env['loadavg_1m_at_end']:.2f}; CPU = lighthouse CPU ms per group-step")
    print(_util.table(["N", "lease quorum", "revoke fan-out med/p99/max ms", "CPU lease", "CPU idle streams",
                       "CPU no-lease", "CPU torchft", "no-lease round", "torchft round", "steps/s", "kept up"], rows))
    for note in notes:
        print(f"note: {note}")
    big = str(max(ns))
    le, no, tf = (results[big][k] for k in ("leases", "ours_no_lease", "torchft"))
    lease_cpu = le.get("reports", {}).get("cpu_ms_per_group_step")
    ratios = {"n": int(big), "fanout_max_ms_at_1024": results.get("1024", {}).get("leases", {}).get("fanout_max_ms"),
              "fanout_max_ms_at_largest_n": le.get("fanout_max_ms"),
              "lease_cpu_vs_nolease": ratio(lease_cpu, no.get("cpu_ms_per_group_step")),
              "lease_cpu_vs_torchft": ratio(lease_cpu, tf.get("cpu_ms_per_group_step"))}
    line = json.dumps(_clean({"bench": "leases", "quick": quick, "results": results, "ratios": ratios}), allow_nan=False)
    _util.emit_line(line, args.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_groups":
        cfg = json.loads(sys.argv[2])
        _util.exit_with_parent(cfg.get("parent"))
        asyncio.run(child_main(cfg))
        sys.exit(0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: blocks still stop what they started
    sys.exit(main())
