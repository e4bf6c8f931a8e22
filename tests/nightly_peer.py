"""torchft-nightly's (0.3 API) native peers, run in a subprocess of the interop tests.

torchft-nightly installs the same ``torchft`` package as torchft 0.2.0, so the tests never
import it: this script loads only its native module (``_torchft``, which needs no torch)
from the nightly folder by file, under its own top-level name, and drives it.

Usage (results are one JSON line on stdout)::

    python nightly_peer.py NIGHTLY_DIR lighthouse MIN_REPLICAS
        prints {"address": ...}, serves until stdin closes
    python nightly_peer.py NIGHTLY_DIR groups LIGHTHOUSE_ADDR SPEC_JSON
        SPEC_JSON: [{"replica_id", "world_size", "step", "handles": [one per rank],
        optional "timeout_s"}...];
        starts one ManagerServer per group and asks every rank's quorum at once; prints
        {"replica_id/rank": {result fields} or {"error": ...}}
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

TIMEOUT = timedelta(seconds=20)


def load_native(folder: str) -> ModuleType:
    """torchft-nightly's ``_torchft`` from ``folder`` (the one that contains ``torchft/``)."""
    so = next(iter(sorted((Path(folder) / "torchft").glob("_torchft*.so"))), None)
    if so is None:
        raise FileNotFoundError(f"no torchft/_torchft*.so under {folder}")
    spec = importlib.util.spec_from_file_location("_torchft", so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve_lighthouse(nt: ModuleType, min_replicas: int) -> None:
    lh = nt.LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=10_000)
    try:
        print(json.dumps({"address": lh.address()}), flush=True)
        sys.stdin.read()  # until the test closes our stdin
    finally:
        lh.shutdown()


def run_groups(nt: ModuleType, lighthouse: str, spec: list[dict[str, Any]]) -> dict[str, Any]:
    servers = [nt.ManagerServer(replica_id=g["replica_id"], lighthouse_addr=lighthouse, hostname="127.0.0.1",
                                bind="127.0.0.1:0", store_addr=f"127.0.0.1:{1000 + i}", world_size=g["world_size"],
                                heartbeat_interval=timedelta(milliseconds=100), connect_timeout=TIMEOUT,
                                quorum_retries=0)
               for i, g in enumerate(spec)]
    out: dict[str, Any] = {}

    def ask(server: Any, g: dict[str, Any], rank: int) -> None:
        key = f"{g['replica_id']}/{rank}"
        timeout = timedelta(seconds=g.get("timeout_s", TIMEOUT.total_seconds()))
        try:
            client = nt.ManagerClient(server.address(), connect_timeout=TIMEOUT)
            r = client._quorum(group_rank=rank, step=g["step"], checkpoint_metadata="", shrink_only=False,
                               timeout=timeout, commit_failures=0, reconfigure_handle=g["handles"][rank],
                               init_sync=True)
            out[key] = {"quorum_id": r.quorum_id, "replica_rank": r.replica_rank, "replica_ids": list(r.replica_ids),
                        "reconfigure_handles": list(r.reconfigure_handles), "max_step": r.max_step}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[key] = {"error": f"{type(e).__name__}: {e}"}

    try:
        threads = [threading.Thread(target=ask, args=(s, g, r), daemon=True)
                   for s, g in zip(servers, spec) for r in range(g["world_size"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT.total_seconds() + 5)
    finally:
        for s in servers:
            s.shutdown()
    return out


def main(argv: list[str]) -> int:
    nt = load_native(argv[1])
    if argv[2] == "lighthouse":
        serve_lighthouse(nt, int(argv[3]))
    elif argv[2] == "groups":
        print(json.dumps(run_groups(nt, argv[3], json.loads(argv[4]))), flush=True)
    else:
        raise SystemExit(f"unknown mode {argv[2]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
