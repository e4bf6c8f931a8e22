"""A cold ``import rallypoint; Manager(...)`` pulls in no web stack: no FastAPI, uvicorn
or httpx, not even to fetch a checkpoint (the checkpoint server and the receiver's client
are the standard library's). Checked in a fresh
interpreter (``sys.modules`` of this pytest process says nothing: other tests import
them), one process for every stage, so the test costs one ``import torch``.
See ``bench/cold_start.py`` for the timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Top-level packages that a Manager which has fetched nothing must not have imported,
#: and the lighthouse's own server modules (FastAPI lives behind them).
WEB = ("fastapi", "uvicorn", "httpx", "starlette")
LIGHTHOUSE_SIDE = ("rallypoint.lighthouse.http", "rallypoint.lighthouse.server")

CHILD = r"""
import json, sys
from datetime import timedelta

WEB = tuple(json.loads(sys.argv[2]))
LIGHTHOUSE_SIDE = tuple(json.loads(sys.argv[3]))
T = timedelta(seconds=20)


def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in WEB or m in LIGHTHOUSE_SIDE)


out = {}
import rallypoint.transports.http as http_mod  # noqa: E402
out["import transports.http"] = loaded()

import rallypoint  # noqa: E402
from rallypoint import Manager, ProcessGroupGloo  # noqa: E402
out["import rallypoint"] = loaded()

m = Manager(ProcessGroupGloo(timeout=T), lambda sd: None, lambda: {"w": 1}, min_replica_size=1, rank=0,
            world_size=1, replica_id="cold", lighthouse_addr=sys.argv[1], hostname="127.0.0.1",
            timeout=T, quorum_timeout=T, connect_timeout=T)
try:
    out["Manager()"] = loaded()

    import torch  # noqa: E402

    src = http_mod.HTTPTransport(T, bind="127.0.0.1:0")
    dst = http_mod.HTTPTransport(T, bind="127.0.0.1:0")
    try:
        src.send_checkpoint([1], 3, {"w": torch.arange(6.0)}, T)
        out["serve"] = loaded()
        got = dst.recv_checkpoint(0, src.metadata(), 3, T)
        out["fetch"] = loaded()
        out["fetched"] = got["w"].tolist()
    finally:
        src.shutdown(wait=False)
        dst.shutdown(wait=False)
finally:
    m.shutdown(wait=False)
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def stages() -> Iterator[dict[str, Any]]:
    """What a fresh interpreter had imported of :data:`WEB` and :data:`LIGHTHOUSE_SIDE`
    after each stage: importing the transport, importing rallypoint, constructing a
    Manager, serving a checkpoint and fetching it."""
    from rallypoint.lighthouse.server import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        env = dict(os.environ)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE",
                  "RALLYPOINT_LIGHTHOUSE", "RALLYPOINT_TOKEN", "RALLYPOINT_TLS_CERT", "RALLYPOINT_TLS_KEY",
                  "RALLYPOINT_TLS_CA", "RALLYPOINT_TLS_CLIENT_CA", "RALLYPOINT_REQUIRE_TLS"):
            env.pop(k, None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        # subprocess.run kills the child (by its pid) when the timeout expires.
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, lh.address(), json.dumps(WEB), json.dumps(LIGHTHOUSE_SIDE)],
            cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, f"child failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
        yield json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        lh.shutdown()


def test_manager_construction_imports_no_web_stack(stages: dict[str, Any]) -> None:
    assert stages["import rallypoint"] == [], stages
    assert stages["Manager()"] == [], "a constructed Manager (which has fetched nothing) imported " + str(stages)


def test_transport_imports_no_web_stack_to_serve_or_fetch(stages: dict[str, Any]) -> None:
    assert stages["import transports.http"] == [], stages
    assert stages["serve"] == [], "serving a checkpoint imported " + str(stages["serve"])
    # The receiver's client is the standard library's http.client: a heal (often a fresh
    # process's first receive) imports no web package either.
    assert not {*WEB, *LIGHTHOUSE_SIDE} & set(stages["fetch"]), stages
    assert stages["fetched"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
