#!/usr/bin/env python
"""The child processes of ``bench/lighthouse.py``: a lighthouse (``--_serve``, ours or
torchft's, in its own process as in production), a worker of client threads
(``--_clients``) and a looping replica (``--_replica``). Each reads its settings as one
JSON argument, answers on stdout one JSON line per command, and exits with its parent."""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _util  # noqa: E402


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def serve_main(cfg: dict) -> None:
    """A lighthouse in its own process; stdin commands: cpu, or EOF to stop."""
    impl = cfg["impl"]
    kwargs = dict(
        min_replicas=cfg["min_replicas"],
        join_timeout_ms=cfg["join_timeout_ms"],
        heartbeat_timeout_ms=cfg["heartbeat_timeout_ms"],
    )
    if impl == "torchft":
        native = _util.load_torchft_native()
        server = native.LighthouseServer(bind="127.0.0.1:0", **kwargs)
    else:
        from rallypoint.lighthouse.server import LighthouseServer

        server = LighthouseServer(bind="127.0.0.1:0", **kwargs)
    # torchft's address() names the host; both bound loopback, so dial 127.0.0.1.
    port = int(server.address().rsplit(":", 1)[1])
    _out({"addr": f"http://127.0.0.1:{port}", "pid": os.getpid(), "advertised": server.address()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "cpu":
                _out({"cpu": _cpu_seconds()})
    finally:
        server.shutdown()


def clients_main(cfg: dict) -> None:
    """Worker: one thread (and one LighthouseClient) per replica id; each round releases
    every thread at the monotonic instant t0 given by the parent."""
    native = _util.load_torchft_native()
    threading.stack_size(512 * 1024)
    addr = cfg["addr"]
    ids: list[str] = cfg["ids"]
    call_timeout = timedelta(seconds=cfg["timeout_s"])
    n = len(ids)
    clients: list[Any] = [None] * n
    results: list[Any] = [None] * n
    cmd: dict = {}
    go = threading.Barrier(n + 1)
    done = threading.Barrier(n + 1)
    init_errors: list[str] = []

    def run(i: int) -> None:
        rid = ids[i]
        try:
            clients[i] = native.LighthouseClient(addr, connect_timeout=timedelta(seconds=30))
        except Exception as e:
            init_errors.append(f"{rid}: {e}")
        go.wait()
        client = clients[i]
        while True:
            if cmd["cmd"] == "quit":
                return
            try:
                results[i] = one(i, rid, client, cmd)
            except BaseException as e:  # never leave the others stuck at the barrier
                results[i] = (0, f"{type(e).__name__}: {e}") if cmd["cmd"] == "hammer" else (
                    time.monotonic(), time.monotonic(), None, None, f"{type(e).__name__}: {e}")
            done.wait()
            go.wait()

    def one(i: int, rid: str, client: Any, cmd: dict) -> tuple:
        t0 = cmd["t0"]
        d = t0 - time.monotonic()
        if d > 0:
            time.sleep(d)
        if cmd["cmd"] == "hammer":
            count, err = 0, None
            end_at = t0 + cmd["duration"]
            try:
                while time.monotonic() < end_at:
                    client.heartbeat(rid)
                    count += 1
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            return (count, err)
        start = time.monotonic()
        qid = size = err = None
        try:
            if cmd["op"] == "quorum":
                q = client.quorum(
                    replica_id=rid,
                    timeout=call_timeout,
                    address=f"127.0.0.1:{20000 + i}",
                    store_address=f"127.0.0.1:{40000 + i}",
                    step=cmd["step"],
                    world_size=1,
                )
                qid, size = q.quorum_id, len(q.participants)
            else:
                client.heartbeat(rid)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        return (start, time.monotonic(), qid, size, err)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    # Wait for every client to connect (they do it in parallel).
    deadline = time.monotonic() + 60
    while sum(c is not None for c in clients) + len(init_errors) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    _out({"ready": True, "errors": init_errors[:3], "n_errors": len(init_errors)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        go.wait()
        done.wait()
        if cmd["cmd"] == "hammer":
            errs = [r[1] for r in results if r[1]]
            _out({"cpu": _cpu_seconds(), "count": sum(r[0] for r in results), "n_errors": len(errs), "errors": errs[:3]})
        else:
            errs = [r[4] for r in results if r[4]]
            _out(
                {
                    "cpu": _cpu_seconds(),
                    "max_start": max(r[0] for r in results),
                    "max_end": max(r[1] for r in results),
                    "min_end": min(r[1] for r in results),
                    "qids": sorted({r[2] for r in results if r[2] is not None}),
                    "sizes": sorted({r[3] for r in results if r[3] is not None}),
                    "n_errors": len(errs),
                    "errors": errs[:3],
                }
            )
    cmd = {"cmd": "quit"}
    try:
        go.wait(timeout=5)
    except threading.BrokenBarrierError:
        pass
    os._exit(0)  # don't wait on the Rust runtimes' teardown


def replica_main(cfg: dict) -> None:
    """A replica for the kill scenario: heartbeat every 100 ms, optionally hold the
    liveness stream, and ask for quorums in a loop, printing each one it gets."""
    addr, rid = cfg["addr"], cfg["replica_id"]
    stream = None
    if cfg.get("stream"):
        # The stream and the quorum calls must come from one caller: the lighthouse binds a
        # live replica id to the session that registered it (lighthouse/owners.py), and
        # torchft's client sends no session. So this variant uses rallypoint's client,
        # which speaks the same protocol and shares the process's session with the stream.
        from rallypoint.lighthouse.client import LighthouseClient, LivenessStream

        client: Any = LighthouseClient(addr, connect_timeout=timedelta(seconds=30))
        stream = LivenessStream(addr, rid)
        if not stream.start(timeout=10):
            _out({"error": "liveness stream not welcomed within 10s"})
    else:
        client = _util.load_torchft_native().LighthouseClient(addr, connect_timeout=timedelta(seconds=30))

    def heartbeats() -> None:
        while True:
            try:
                client.heartbeat(rid)
            except Exception:
                pass
            time.sleep(0.1)

    threading.Thread(target=heartbeats, daemon=True).start()
    step = 0
    while True:
        try:
            q = client.quorum(
                replica_id=rid,
                timeout=timedelta(seconds=60),
                address=f"127.0.0.1:{20000 + step % 1000}",
                store_address="127.0.0.1:1",
                step=step,
                world_size=1,
            )
            _out({"t": time.time(), "qid": q.quorum_id, "members": [p.replica_id for p in q.participants]})
            step += 1
        except Exception as e:
            _out({"t": time.time(), "error": f"{type(e).__name__}: {e}"})
            time.sleep(0.05)
        time.sleep(cfg.get("step_s", 0.002))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("--_serve", "--_clients", "--_replica"):
        sys.exit("usage: _lighthouse_children.py --_serve|--_clients|--_replica JSON (started by bench/lighthouse.py)")
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    _util.exit_with_parent(cfg.get("parent"))
    {"--_serve": serve_main, "--_clients": clients_main, "--_replica": replica_main}[mode](cfg)
    sys.exit(0)
