"""Scenarios of ``tests/test_pg_reconfigure_native.py`` that need torch >= 2.14 and, for
some, torchft-nightly's python modules (no tests here).

Run as ``python tests/pg_reconfigure_next.py SCENARIO`` by the tests, in a subprocess
whose ``PYTHONPATH`` puts torchft-nightly first (its ``torchft`` package shadows torchft
0.2.0); every replica is a thread of this process (gloo groups work across threads), and
the result is one JSON line on stdout. Every wait has a timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

T = timedelta(seconds=20)
LOG = logging.getLogger("pg_reconfigure_next")


def _threads(n: int, fn: Callable[[int], Any], timeout: float = 90.0) -> list[Any]:
    with cf.ThreadPoolExecutor(n) as ex:
        return list(ex.map(fn, range(n), timeout=timeout))


def _quorum(qid: int, handles: list[str]) -> Any:
    """What the Configurer reads of a quorum answer."""
    ids = [f"r{i}" for i in range(len(handles))]
    return SimpleNamespace(quorum_id=qid, replica_ids=ids, reconfigure_handles=handles, replica_rank=0,
                           replica_world_size=len(handles), store_address="", max_step=0)


def _configurers(pgs: list[Any]) -> list[Any]:
    from rallypoint.manager._reconfig import Configurer, adapt

    out = []
    for i, pg in enumerate(pgs):
        held, kind = adapt(pg)
        c = Configurer(held, kind, 0, 1, T, LOG)
        c.set_replica(f"r{i}")
        out.append(c)
    return out


def _generations(cs: list[Any], gens: list[list[int]], base: int = 100) -> list[dict[str, Any]]:
    """Reconfigure the members of each generation (in that order) from their handles, then
    allreduce each member's index + 1 and allgather the indexes: who sits at which rank."""
    from torch.distributed import ReduceOp
    from torch.distributed.distributed_c10d import AllgatherOptions

    out = []
    for g, members in enumerate(gens):
        handles = [cs[m].handle() for m in members]

        def one(k: int) -> dict[str, Any]:
            c = cs[members[k]]
            action = c.apply(_quorum(base + g, handles))
            t = torch.tensor([float(members[k] + 1)])
            c.pg.allreduce([t], ReduceOp.SUM).wait()
            gathered = [torch.zeros(1) for _ in members]  # who sits at which rank
            c.pg.allgather([gathered], [torch.tensor([float(members[k])])], AllgatherOptions()).wait()
            return {"action": action, "size": c.pg.size(), "sum": t.item(), "order": [int(x.item()) for x in gathered],
                    "errored": repr(c.pg.errored())}

        t0 = time.monotonic()
        out.append({"members": members, "results": _threads(len(members), one),
                    "seconds": round(time.monotonic() - t0, 2)})
    return out


def native_groups() -> dict[str, Any]:
    """torch's own ProcessGroup + ProcessGroupGloo(enable_reconfigure=True), as
    torchft-nightly's integration tests make them (shared bootstrap store, distinct
    initial ranks), reconfigured by our Manager's configure step: 3, shrunk to 2 in
    another order, grown back to 3, then once more after an abort."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    pgs = []
    for i in range(3):
        store = dist.PrefixStore("native/0", dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                           wait_for_workers=False, timeout=T))
        pg = dist.ProcessGroup(store, i, 3)
        backend = dist.ProcessGroupGloo(store, i, 3, enable_reconfigure=True)  # type: ignore[call-arg]  # 2.13 stubs
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pgs.append(pg)
    cs = _configurers(pgs)
    kinds = [type(c.pg).__name__ for c in cs]
    gens = _generations(cs, [[0, 1, 2], [2, 0], [1, 2, 0]])
    for c in cs:
        c.pg.abort()
    after_abort = _generations(cs, [[0, 1, 2]], base=200)
    for pg in pgs:
        pg.shutdown()
    return {"held_as": kinds, "generations": gens + after_abort}


def nightly_groups() -> dict[str, Any]:
    """torchft-nightly's ProcessGroupGloo reconfigured by our Manager's configure step,
    and one of ours in the same communicator as two of theirs (handles interoperate)."""
    import torchft
    from torchft.process_group import ProcessGroupGloo as TheirGloo

    from rallypoint.process_groups import ProcessGroupGloo as OurGloo

    os.environ["RALLYPOINT_PG_HOST"] = "127.0.0.1"
    theirs = [TheirGloo(timeout=T) for _ in range(3)]
    cs = _configurers(theirs)
    gens = _generations(cs, [[0, 1, 2], [1, 0], [0, 1, 2]])
    mixed_pgs = [TheirGloo(timeout=T), OurGloo(timeout=T), TheirGloo(timeout=T)]
    mixed = _generations(_configurers(mixed_pgs), [[1, 0, 2], [0, 1]], base=300)
    for pg in [*theirs, *mixed_pgs]:
        pg.shutdown()
    return {"torchft": torchft.__file__, "generations": gens, "mixed": mixed}


def ours_in_their_manager() -> dict[str, Any]:
    """Two replica groups of torchft-nightly's Manager (and lighthouse) holding our
    ProcessGroupGloo: their Manager accepts it, sends its handle and reconfigures it."""
    from torchft._torchft import LighthouseServer
    from torchft.manager import Manager

    from rallypoint.process_groups import ProcessGroupGloo

    os.environ["RALLYPOINT_PG_HOST"] = "127.0.0.1"
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T) for _ in range(2)]
    pgs = [ProcessGroupGloo(timeout=T) for _ in range(2)]

    def run(i: int) -> dict[str, Any]:
        m = Manager(pg=pgs[i], load_state_dict=lambda sd: None, state_dict=lambda: {}, min_replica_size=2,
                    replica_id=f"ours_{i}", store_addr="127.0.0.1", store_port=stores[i].port, rank=0,
                    world_size=1, lighthouse_addr=lh.address(), timeout=T, quorum_timeout=T,
                    connect_timeout=T, init_sync=False, hostname="127.0.0.1")
        sums, commits = [], []
        try:
            for _ in range(3):
                m.start_quorum()
                t = torch.tensor([float(i + 1)])
                m.allreduce(t).wait()
                commits.append(m.should_commit())
                sums.append(t.item())
            return {"commits": commits, "means": sums, "rank": pgs[i].rank(), "size": pgs[i].size(),
                    "exact_prefix": bool(cfg.exact_prefix) if (cfg := pgs[i].config) is not None else False}
        finally:
            m.shutdown(wait=False)

    try:
        return {"replicas": _threads(2, run, 120)}
    finally:
        lh.shutdown()
        for pg in pgs:
            pg.shutdown()


def _our_lighthouse() -> Any:
    from rallypoint.lighthouse.server import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000)


def _our_managers(pgs: list[Any], steps: int = 4) -> dict[str, Any]:
    from rallypoint.manager import Manager

    lh = _our_lighthouse()

    def run(i: int) -> dict[str, Any]:
        m = Manager(pgs[i], lambda sd: None, dict, min_replica_size=2, rank=0, world_size=1,
                    hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                    replica_id=f"n{i}", timeout=T, quorum_timeout=T, connect_timeout=T, init_sync=False)
        out: dict[str, Any] = {"commits": [], "means": []}
        try:
            for _ in range(steps):
                m.start_quorum()
                t = torch.tensor([float(i + 1)])
                m.allreduce(t).wait()
                out["commits"].append(m.should_commit())
                out["means"].append(t.item())
            out["action"] = m._configurer.last_action
            out["rebuilds"] = m._configurer.applied
            out["error"] = repr(m.errored())
            return out
        finally:
            m.shutdown(wait=False)

    try:
        return {"replicas": _threads(2, run, 120)}
    finally:
        lh.shutdown()


def native_in_our_manager() -> dict[str, Any]:
    """Our Manager (and lighthouse) given torch's own reconfigurable gloo groups."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    pgs = []
    for i in range(2):
        store = dist.PrefixStore("native/0", dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                                           wait_for_workers=False, timeout=T))
        pg = dist.ProcessGroup(store, i, 2)
        backend = dist.ProcessGroupGloo(store, i, 2, enable_reconfigure=True)  # type: ignore[call-arg]  # 2.13 stubs
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pgs.append(pg)
    try:
        return _our_managers(pgs)
    finally:
        for pg in pgs:
            pg.shutdown()


def theirs_in_our_manager() -> dict[str, Any]:
    """Our Manager (and lighthouse) given torchft-nightly's ProcessGroupGloo."""
    from torchft.process_group import ProcessGroupGloo as TheirGloo

    pgs = [TheirGloo(timeout=T) for _ in range(2)]
    try:
        return _our_managers(pgs)
    finally:
        for pg in pgs:
            pg.shutdown()


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (native_groups, nightly_groups, ours_in_their_manager, native_in_our_manager,
                            theirs_in_our_manager)
}

if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("RALLYPOINT_TEST_LOG", "WARNING"), stream=sys.stderr)
    result = SCENARIOS[sys.argv[1]]()
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # threads of torchft's servers must not hold the exit
