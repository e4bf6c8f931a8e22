"""The ``rallypoint`` command (also ``python -m rallypoint``).

Subcommands: ``lighthouse`` (run the quorum service; drop-in for ``torchft_lighthouse``,
whose underscore flag spellings are accepted), ``run`` (launch one replica group where
torchrun was, and restart it when a rank fails; ``rallypoint.supervisor``), ``status``
(print the quorum as a table), ``kill`` (ask a replica's manager to exit), ``inject`` (a
fault), ``goodput`` (the goodput ledger as a table). The last four act on one job of the
lighthouse (``--job``, default ``RALLYPOINT_JOB``, else ``default``), name a replica with
``--replica``, and finish within ``--timeout`` (connecting included). The parser is in
:mod:`rallypoint._cli_parser`; a closed stdout (``| head -1``) exits 141 without a
traceback. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Sequence

from rallypoint._cli_budget import Budget, closed_pipe
from rallypoint._cli_parser import (  # re-exported (tests, users)
    DEFAULT_LIGHTHOUSE, DEFAULT_STATE, JOB_HELP, _build_parser, _lighthouse_env, replica_of,
)
from rallypoint._cli_secrets import lighthouse_token, without_token  # re-exported (tests, users)

log = logging.getLogger("rallypoint.cli")


def _job(args: argparse.Namespace) -> str:
    """The job a subcommand acts on (``--job``, else ``RALLYPOINT_JOB``, else ``default``);
    a usage error (exit 2) for a malformed name."""
    from rallypoint._net.job import job_name

    try:
        return job_name(args.job)
    except ValueError as e:
        args.usage_parser.error(str(e))
        raise  # unreachable: error() exits


def _jobs_file(args: argparse.Namespace) -> tuple[dict | None, int]:
    """``--jobs`` parsed and ``--max-jobs`` checked; ValueError naming the file (or the
    flag) when they are unusable, so the lighthouse never starts on half a configuration."""
    from rallypoint.lighthouse.jobs import DEFAULT_MAX_JOBS, load_jobs

    max_jobs = DEFAULT_MAX_JOBS if args.max_jobs is None else args.max_jobs
    if max_jobs < 1:
        raise ValueError(f"--max-jobs must be at least 1, got {max_jobs}")
    if args.jobs is None:
        return None, max_jobs
    try:
        jobs = load_jobs(args.jobs)
    except OSError as e:
        raise ValueError(f"cannot read jobs file {args.jobs}: {e.strerror or e}") from None
    except ValueError as e:  # names the file, except a decoding error
        raise ValueError(str(e) if args.jobs in str(e) else f"jobs file {args.jobs}: {e}") from None
    if len(jobs) > max_jobs:
        raise ValueError(f"jobs file {args.jobs} names {len(jobs)} jobs, more than --max-jobs {max_jobs}")
    return jobs, max_jobs


def _straggler_policy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The ``--stragglers`` options as a policy; a usage error (exit 2) when they do not fit."""
    from rallypoint.lighthouse.stragglers import Policy

    try:
        return Policy(
            mode=args.stragglers,
            threshold=args.straggler_threshold,
            window=args.straggler_window,
            votes=args.straggler_votes,
            cooldown_s=args.straggler_cooldown_s,
        )
    except ValueError as e:
        parser.error(
            f"--stragglers options: {e} (given --straggler-threshold {args.straggler_threshold:g} "
            f"--straggler-window {args.straggler_window} --straggler-votes {args.straggler_votes} "
            f"--straggler-cooldown-s {args.straggler_cooldown_s:g})"
        )


def _run_lighthouse(args: argparse.Namespace) -> int:
    from rallypoint.lighthouse.server import LighthouseServer
    from rallypoint.lighthouse.etcd_auth import etcd_security
    from rallypoint.lighthouse.etcd_state import EtcdUnavailable, is_etcd
    from rallypoint.lighthouse.state import StateFileError

    from rallypoint._net.tls import tls_config

    try:
        token = lighthouse_token(args.token, args.token_file)
        tls = tls_config(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_ca, args.require_tls)
        jobs, max_jobs = _jobs_file(args)
        etcd = etcd_security(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user,
                             args.etcd_password_file) if is_etcd(str(args.state)) else None
    except ValueError as e:
        print(f"rallypoint lighthouse: {e}", file=sys.stderr)
        return 2
    http_bind = None if str(args.http_bind).lower() in ("off", "none", "") else args.http_bind
    stragglers = _straggler_policy(args, args.usage_parser)  # a usage error (exit 2) before anything starts
    restart = threading.Event()  # a `lighthouse-restart` injection
    try:
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            http_bind=http_bind,
            state=args.state,
            token=token,
            forget_after_ms=args.forget_after_ms,
            tls=tls,
            stragglers=stragglers,
            leases=args.leases == "on",
            ha_ttl_s=args.etcd_ttl_s,
            jobs=jobs,
            max_jobs=max_jobs,
            allow_inject=args.allow_inject,
            etcd=etcd,
            # A restart from an in-memory state would hand out quorum ids again: refused then.
            on_restart=restart.set if args.state != ":memory:" else None,
        )
    except (StateFileError, OSError, ValueError, EtcdUnavailable, ImportError) as e:
        # StateFileError (locked, corrupt, newer schema, read-only, disk full) is one complete
        # line naming the file and what to do; an OSError is e.g. a port already in use.
        print(f"rallypoint lighthouse: {e}", file=sys.stderr)
        return 2
    # One machine-readable line so scripts can find ports chosen with :0.
    print(json.dumps({"lighthouse": server.address(), "local": server.local_address(), "http": server.http_address()}), flush=True)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(0.5) and not restart.is_set():
        if server.wait(0):
            print("rallypoint lighthouse: the service stopped unexpectedly (see the log above)", file=sys.stderr)
            return 1
    server.shutdown()
    if restart.is_set():
        _restart_lighthouse(args.argv, server.address(), server.http_address(), token)
    return 0


def pin_ports(argv: list[str], flags: dict[str, tuple[str | None, str]]) -> list[str]:
    """``argv`` with each ``--flag HOST:PORT`` (or ``--flag=``, or the ``--flag_name``
    spelling) rebound to the port the server actually got, keeping its host; a flag not
    given is added with its default host. ``flags``: flag -> (the bound address, or None
    when off; the default host)."""
    from rallypoint._net.addr import join_host_port, split_host_port

    out = list(argv)
    for flag, (addr, default_host) in flags.items():
        if addr is None:
            continue
        port = split_host_port(addr.split("://")[-1])[1]
        spellings = (flag, "--" + flag[2:].replace("-", "_"))
        for i, a in enumerate(out):
            name, eq, value = a.partition("=")
            if name in spellings and eq:
                out[i] = f"{name}={join_host_port(split_host_port(value)[0], port)}"
                break
            if a in spellings and i + 1 < len(out):
                out[i + 1] = join_host_port(split_host_port(out[i + 1])[0], port)
                break
        else:
            out += [flag, join_host_port(default_host.strip("[]"), port)]
    return out


def _restart_lighthouse(given: list[str], grpc_addr: str, http_addr: str | None, token: str | None) -> None:
    """A `lighthouse-restart` injection: start this command again in this process (the
    same pid, so a supervisor sees no exit), on the ports it had (a ``:0`` bind would move
    it), from its state file. Clients see it go and come back, as after a real restart.
    A ``--token`` of the command line moves to ``RALLYPOINT_TOKEN`` (the new command line
    holds no token); nothing of the command line is logged."""
    from rallypoint._net.auth import TOKEN_ENV

    argv = pin_ports(without_token(given), {"--bind": (grpc_addr, "[::]"), "--http-bind": (http_addr, "[::]")})
    if token is not None:
        os.environ[TOKEN_ENV] = token  # a --token of the command line, now out of it (a --token-file still wins)
    log.warning("restarting the lighthouse (injected) on %s%s", grpc_addr, f" and {http_addr}" if http_addr else "")
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "rallypoint", *argv])


def _fetch_status(address: str, timeout: float, job: str | None = None) -> dict:
    """Status of ``job`` (default: ``RALLYPOINT_JOB``, else ``default``) from a lighthouse
    given its gRPC address (what users configure) or its dashboard address: a quick HTTP
    probe first (a gRPC port refuses it at once; ``?job=``), then the gRPC ``Status`` call
    (the job in its metadata). All of it within ``timeout`` seconds, connecting included."""
    import httpx

    from rallypoint._net.auth import job_token
    from rallypoint._net.job import DEFAULT_JOB, job_name
    from rallypoint._net.tls import client_ssl_context, tls_config
    from rallypoint.lighthouse.client import LighthouseClient

    job = job_name(job)
    budget = Budget(timeout)
    if "," in address:  # an HA set: the leader's status (a standby shows only that it stands by)
        from rallypoint.lighthouse.client import split_addresses

        docs: list[dict] = []
        errors: list[str] = []
        members = split_addresses(address)
        for i, one in enumerate(members):
            try:
                doc = _fetch_status(one, budget.share(len(members) - i), job)
            except Exception as e:  # noqa: BLE001 - a dead member of the set: try the next
                errors.append(f"{one}: {e}")
                continue
            if (doc.get("lighthouse") or {}).get("role") == "leader":
                return doc
            docs.append(doc)
        if docs:
            return docs[0]
        raise ConnectionError("no lighthouse of " + address + " answered: " + "; ".join(errors))
    tls = tls_config()
    url = address if "://" in address else f"http://{address}"
    verify: Any = False
    if tls.client_tls(url):
        verify = client_ssl_context(tls)
        url = "https://" + url.split("://", 1)[1]
    token = job_token()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    # The default job's probe is what it was before jobs (no query), so older lighthouses see nothing new.
    params = {} if job == DEFAULT_JOB else {"job": job}
    try:
        r = httpx.get(url.rstrip("/") + "/status", params=params, timeout=min(1.0, budget.left()), headers=headers,
                      verify=verify)
        if r.status_code == 404 and job != DEFAULT_JOB and "no such job" in r.text:
            raise LookupError(r.json().get("detail") or r.text)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
            doc = r.json()
            # a lighthouse from before jobs ignores ?job= and answers for its one job: not this one
            if isinstance(doc, dict) and doc.get("job", DEFAULT_JOB) == job:
                return doc
    except (httpx.HTTPError, ValueError):
        pass
    with LighthouseClient(address, connect_timeout=budget.left(), job=job) as c:
        return c.status(timeout=budget.left())


def format_status(s: dict) -> str:
    """The status document as a human table."""
    lines = []
    q = s.get("quorum")
    opts = s.get("options", {})
    lines.append(f"quorum_id {s.get('quorum_id')}   min_replicas {opts.get('min_replicas')}   "
                 f"heartbeat_timeout {opts.get('heartbeat_timeout_ms')} ms   join_timeout {opts.get('join_timeout_ms')} ms")
    members = {m["replica_id"] for m in (q or {}).get("members", [])}
    if q:
        age = time.time() - q.get("created", time.time())
        lines.append(f"last quorum: {len(members)} member(s), formed {age:.1f}s ago")
    else:
        lines.append("last quorum: none yet")
    d = s.get("last_decision")
    if d:
        lines.append(f"last decision: {d.get('rule')}: {d.get('reason')}")
    strag = s.get("stragglers")
    if strag:
        lines.append(f"stragglers: {strag.get('policy')} (threshold {strag.get('threshold')}, "
                     f"{strag.get('votes')} of {strag.get('window')} steps); "
                     f"{len(strag.get('excluded') or [])} excluded, {strag.get('evictions_total', 0)} eviction(s)")
    lease = s.get("lease")
    if lease:
        held = (f"quorum {lease['quorum_id']} leased to {len(lease.get('members') or [])} member(s)"
                if lease.get("quorum_id") is not None else "none in force" if lease.get("enabled") else "off")
        lines.append(f"lease: {held}; {lease.get('granted_total', 0)} granted, {lease.get('revoked_total', 0)} revoked")
    role = (s.get("lighthouse") or {}).get("role")
    if role and role != "single":
        lines.append(f"this lighthouse: {role} (HA, state {(s.get('lighthouse') or {}).get('state_path')})")
    rows = [("REPLICA", "IN QUORUM", "STEP", "HEARTBEAT AGE", "STATE", "STRAGGLER", "MANAGER")]
    for r in s.get("replicas", []):
        age = r.get("heartbeat_age_s")
        state = "dead" if r.get("dead") else ("asking" if r.get("participating") else ("attached" if r.get("attached") else "-"))
        rows.append((
            r["replica_id"],
            "yes" if r["replica_id"] in members else "no",
            "" if r.get("step") is None else str(r["step"]),
            "-" if age is None else f"{age:.2f}s",
            state,
            _straggler_cell(r.get("straggler")),
            r.get("address", ""),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _straggler_cell(st: Any) -> str:
    """``1.02``, ``3.10 slow`` (flagged) or ``3.10 excluded 4s`` (evicted); ``-`` without a score."""
    if not isinstance(st, dict) or st.get("score") is None:
        return "-"
    cell = f"{st['score']:.2f}"
    until = st.get("excluded_until")
    if until is not None:
        cell += f" excluded {max(0.0, until - time.time()):.0f}s"
    elif st.get("flagged"):
        cell += " slow"
    return cell


def _run_status(args: argparse.Namespace) -> int:
    address = args.lighthouse or _lighthouse_env()
    job = _job(args)
    try:
        s = _fetch_status(address, args.timeout, job)
    except Exception as e:
        print(f"rallypoint status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2) if args.json else format_status(s))
    return 0


def _run_goodput(args: argparse.Namespace) -> int:
    if (args.tau is not None and not args.tau > 0) or (args.delta is not None and not args.delta >= 0):
        args.usage_parser.error(f"--tau must be > 0 and --delta >= 0 seconds, got {args.tau} and {args.delta}")
    address = args.lighthouse or _lighthouse_env()
    job = _job(args)
    try:
        doc = _fetch_status(address, args.timeout, job).get("goodput")
    except Exception as e:
        print(f"rallypoint goodput: {e}", file=sys.stderr)
        return 1
    if not isinstance(doc, dict):
        print(f"rallypoint goodput: the lighthouse at {address} keeps no goodput ledger (torchft's, or an older "
              "rallypoint)", file=sys.stderr)
        return 1
    if args.tau is not None or args.delta is not None:
        doc["model"] = remodel(doc, args.tau, args.delta)
    print(json.dumps(doc, indent=2) if args.json else format_goodput(doc))
    return 0


def remodel(doc: dict, tau: float | None, delta: float | None) -> dict:
    """The ledger document's goodput model evaluated again for another ``tau``/``delta``."""
    from rallypoint.lighthouse.ledger import model_report

    total = doc.get("total") or {}
    params = (doc.get("model") or {}).get("parameters") or {}
    tau_s = tau if tau is not None else params.get("tau_s")
    out = model_report(total.get("buckets") or {}, int(total.get("failures") or 0), 0, 0.0, tau_s,
                       delta if delta is not None else params.get("delta_s"))
    if tau is None:
        out["parameters"]["tau_source"] = params.get("tau_source")
    return out


def _secs(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.1f}s"


def _ratio(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.3f}"


def format_goodput(doc: dict) -> str:
    """The goodput ledger as a human table: the job's goodput, the model, one row per group."""
    from rallypoint.lighthouse.ledger import BUCKETS, UNREPORTED

    total = doc.get("total") or {}
    tb = total.get("buckets") or {}
    settled = sum(float(tb.get(b, 0.0)) for b in BUCKETS)
    lines = [f"goodput {_ratio(doc.get('goodput'))}: productive {_secs(tb.get('productive'))} of {_secs(settled)} "
             f"settled group-time, {total.get('groups', 0)} group(s), {_secs(tb.get(UNREPORTED))} not reported yet"]
    model = doc.get("model") or {}
    p = model.get("parameters") or {}
    lines.append(f"model {_ratio(model.get('goodput'))}: MTBF {_secs(p.get('mtbf_s')) if p.get('mtbf_s') else 'none'} "
                 f"({p.get('failures', 0)} failure(s)), T_detect {_secs(p.get('t_detect_s'))}, "
                 f"T_restart {_secs(p.get('t_restart_s'))}, T_load {_secs(p.get('t_load_s'))}, "
                 f"tau {_secs(p.get('tau_s'))} ({p.get('tau_source')}), delta {_secs(p.get('delta_s'))}")
    if model.get("what_if"):
        lines.append("  what if: " + ", ".join(f"{k.replace('_', ' ')} {_ratio(v)}" for k, v in model["what_if"].items()))
    cols = (*BUCKETS, UNREPORTED)
    rows = [("GROUP", "STATE", "WALL", "GOODPUT", *(c.upper() for c in cols))]
    for g in doc.get("groups") or ():
        b = g.get("buckets") or {}
        rows.append((str(g.get("group")), str(g.get("state")), _secs(g.get("wall_s")), _ratio(g.get("goodput")),
                     *(_secs(b.get(c)) for c in cols)))
    rows.append(("TOTAL", "", _secs(total.get("wall_s")), _ratio(doc.get("goodput")), *(_secs(tb.get(c)) for c in cols)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    hidden = int(total.get("groups") or 0) - int(total.get("listed", total.get("groups")) or 0)
    if hidden > 0:
        lines.append(f"({hidden} more group(s) not listed: GET /goodput on the lighthouse's HTTP address lists all)")
    causes = total.get("failed_by_cause") or {}
    if causes:
        lines.append("failed rounds by cause: " + ", ".join(f"{k} {_secs(v)}" for k, v in causes.items()))
    return "\n".join(lines)


def _run_kill(args: argparse.Namespace) -> int:
    from rallypoint.lighthouse.client import LighthouseClient

    address = args.lighthouse or _lighthouse_env()
    replica = replica_of(args)
    job = _job(args)
    budget = Budget(args.timeout)
    try:
        with LighthouseClient(address, connect_timeout=budget.left(), job=job) as c:
            target = c.kill(replica, args.reason, timeout=budget.left())
    except KeyError:
        of_job = "" if job == "default" else f" in job {job!r}"
        print(f"rallypoint kill: the lighthouse at {address} knows no replica {replica!r}{of_job}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"rallypoint kill: {e}", file=sys.stderr)
        return 1
    print(f"sent Kill to replica {replica} at {target}")
    return 0


def _run_inject(args: argparse.Namespace) -> int:
    from rallypoint.lighthouse.client import LighthouseClient

    address = args.lighthouse or _lighthouse_env()
    request = {"kind": args.kind, "replica": args.replica, "at_step": args.at_step, "for_s": args.for_s,
               "factor": args.factor, "bit": args.bit}
    job = _job(args)
    budget = Budget(args.timeout)
    try:
        with LighthouseClient(address, connect_timeout=budget.left(), job=job) as c:
            ident, rid = c.inject({k: v for k, v in request.items() if v is not None}, timeout=budget.left())
    except (KeyError, ValueError) as e:
        print(f"rallypoint inject: refused by the lighthouse at {address}: {str(e).strip(chr(39))}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"rallypoint inject: {e}", file=sys.stderr)
        return 1
    where = f"replica {rid} (at its next step boundary" + (f" at or after step {args.at_step})" if args.at_step
                                                             is not None else ")") if rid else "the lighthouse"
    print(f"injection {ident}: {args.kind} into {where}")
    return 0


def _run_group(args: argparse.Namespace) -> int:
    from rallypoint.supervisor.supervisor import main as run_main

    rc = run_main(args)
    _exit_past_native_threads(rc)
    return rc


def _exit_past_native_threads(rc: int) -> None:
    """End ``rallypoint run`` with ``rc`` at once when a daemon thread may still be
    blocked inside torch's C++ code (the rendezvous join waiting in its store, a store
    client's beat). Left to the interpreter's shutdown, such a thread is unwound when it
    wakes, and C++ turns that into ``std::terminate`` ("terminate called without an
    active exception", SIGABRT) instead of the exit status the supervisor chose. The
    supervisor has stopped every rank and removed its run directory by now; only the
    logs and standard streams need flushing."""
    if all(t is threading.main_thread() or not t.is_alive() for t in threading.enumerate()):
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        rc = closed_pipe()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``rallypoint`` command; its exit status. A reader that closes stdout early
    (``rallypoint status | head -1``) ends it quietly with 141 (128 + SIGPIPE, as ``cat``)."""
    try:
        args = _build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a restart runs again
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        handlers = {"lighthouse": _run_lighthouse, "run": _run_group, "status": _run_status, "kill": _run_kill,
                    "inject": _run_inject, "goodput": _run_goodput}
        rc = handlers[args.command](args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
        return rc
    except BrokenPipeError:
        return closed_pipe()


if __name__ == "__main__":
    raise SystemExit(main())
