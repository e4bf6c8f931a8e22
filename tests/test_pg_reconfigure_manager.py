"""The Manager's configure step (``rallypoint/manager/_reconfig.py``).

Tables for the pure decisions (which API a group offers; configure or reconfigure for a
quorum answer; the error that names the replicas without a handle), then Managers in
this process against a real lighthouse: groups reconfigured from the handles of the
quorum (rank = replica order) through a shrink and a grow, and the fallback to
``configure()`` when a member sends no handle.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import json
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint.manager._reconfig import Configurer, NativeGroup, PgKind, Plan, adapt, pg_kind, plan, \
    quorum_accepts_handle

BOTH, RECONF, CONF = PgKind(True, True, False), PgKind(True, False, False), PgKind(False, True, False)


class _Reconf:
    supports_reconfigure = True

    def reconfigure(self, opts: Any) -> Any: ...

    def get_reconfigure_handle(self) -> str:
        return '{"id": "x", "store": "h:1"}'


class _Conf:
    def configure(self, *a: Any, **k: Any) -> None: ...


class _Both(_Reconf, _Conf):
    pass


class _SaysNo(_Both):
    supports_reconfigure = False


class _Neither:
    def allreduce(self, *a: Any) -> Any: ...


@pytest.mark.parametrize("pg,want", [
    (_Both(), BOTH), (_Reconf(), RECONF), (_Conf(), CONF), (_SaysNo(), CONF),
])
def test_what_a_group_offers(pg: Any, want: PgKind) -> None:
    assert pg_kind(pg) == want


def test_a_group_with_neither_api_is_refused_when_the_manager_is_built() -> None:
    with pytest.raises(TypeError, match="enable_reconfigure=True"):
        pg_kind(_Neither())
    from rallypoint.manager import Manager

    with pytest.raises(TypeError, match="_Neither can be neither configured"):
        Manager(_Neither(), None, None, min_replica_size=1, lighthouse_addr="127.0.0.1:1")  # type: ignore[arg-type]


def test_our_groups_offer_both_and_are_not_wrapped() -> None:
    from rallypoint.process_groups import ProcessGroupDummy, ProcessGroupGloo

    for pg in (ProcessGroupGloo(), ProcessGroupDummy()):
        held, kind = adapt(pg)
        assert held is pg and kind == BOTH


def test_a_plain_torch_group_without_reconfigure_is_refused() -> None:
    import torch.distributed as dist

    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
    try:  # torch 2.14 raises for a group without a backend (pg_kind treats that as "no")
        says_it_can = bool(getattr(pg, "supports_reconfigure", False))
    except RuntimeError:
        says_it_can = False
    if says_it_can:  # pragma: no cover - torch says it can
        pytest.skip("this torch reports supports_reconfigure on a plain group")
    with pytest.raises(TypeError, match="neither configured"):
        adapt(pg)


IDS = ["a", "b", "c"]
H = ['{"id":"1"}', '{"id":"2"}', '{"id":"3"}']


@pytest.mark.parametrize("kind,handles,want", [
    (BOTH, H, Plan("reconfigure", tuple(H))),
    (RECONF, H, Plan("reconfigure", tuple(H))),
    (CONF, H, Plan("configure")),                  # no reconfigure API: the store as ever
    (BOTH, [H[0], "", H[2]], Plan("configure")),   # a torchft 0.2 peer: everyone configures
    (BOTH, [], Plan("configure")),                 # a server without the field
    (BOTH, H[:2], Plan("configure")),              # a list of the wrong length
    (CONF, [], Plan("configure")),
])
def test_configure_or_reconfigure(kind: PgKind, handles: list[str], want: Plan) -> None:
    assert plan(kind, handles, IDS, "replica a") == want


@pytest.mark.parametrize("handles,needle", [
    ([H[0], "", ""], "replica(s) b, c: they sent no reconfigure handle"),
    ([], "replica(s) a, b, c: the quorum answer carries no reconfigure handles"),
    (H[:2], "carries 2 handles for 3 members"),
])
def test_a_reconfigure_only_group_fails_the_round_naming_who_sent_no_handle(handles: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        plan(RECONF, handles, IDS, "replica a (group rank 0), quorum 4")
    assert needle in str(e.value) and str(e.value).startswith("replica a (group rank 0), quorum 4: ")


def test_the_handle_is_sent_only_to_a_client_that_takes_it() -> None:
    def old(group_rank: int, step: int) -> None: ...

    def new(group_rank: int, step: int, reconfigure_handle: str = "") -> None: ...

    def kw(**kwargs: Any) -> None: ...

    assert [quorum_accepts_handle(f) for f in (old, new, kw)] == [False, True, True]
    import logging

    c = Configurer(_Reconf(), RECONF, 0, 1, timedelta(seconds=1), logging.getLogger("t"))
    assert c.quorum_kwargs(new) == {"reconfigure_handle": '{"id": "x", "store": "h:1"}'}
    assert c.quorum_kwargs(old) == {}
    assert Configurer(_Conf(), CONF, 0, 1, timedelta(seconds=1), logging.getLogger("t")).quorum_kwargs(new) == {}


def test_each_quorum_function_is_inspected_once_however_the_calls_alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    # A refused leased round (rank 0 of a multi-rank group, a quorum of one) is followed by
    # the quorum thread's call on every step: the two must not evict each other's answer.
    import logging

    from rallypoint.manager import _reconfig

    class Client:
        def _quorum(self, group_rank: int, reconfigure_handle: str = "") -> None: ...

        def leased_quorum(self, group_rank: int) -> None: ...

    seen: list[str] = []
    real = _reconfig.quorum_accepts_handle
    monkeypatch.setattr(_reconfig, "quorum_accepts_handle", lambda f: seen.append(f.__name__) or real(f))
    c = Configurer(_Reconf(), RECONF, 0, 1, timedelta(seconds=1), logging.getLogger("t"))
    client = Client()
    for _ in range(50):
        assert c.quorum_kwargs(client.leased_quorum) == {}
        assert c.quorum_kwargs(client._quorum) == {"reconfigure_handle": '{"id": "x", "store": "h:1"}'}
    assert seen == ["leased_quorum", "_quorum"]
    assert c.quorum_kwargs(Client().leased_quorum) == {} and len(seen) == 2  # same class, another client


def test_native_group_adds_errored_and_passes_everything_else() -> None:
    import torch.distributed as dist

    inner = dist.ProcessGroup(dist.HashStore(), 0, 1)
    g = NativeGroup(inner)
    assert g.group is inner and g.size() == 1 and g.errored() is None


# --------------------------------------------------------------------- Managers, real lighthouse

def _client_takes_handles() -> bool:
    from rallypoint.manager.client import ManagerClient

    return "reconfigure_handle" in inspect.signature(ManagerClient._quorum).parameters


needs_handles = pytest.mark.skipif(not _client_takes_handles(),
                                   reason="the ManagerClient has no reconfigure_handle yet (branch `handles`)")


def _manager(lh: Any, pg: Any, name: str, min_size: int, training_thread: bool | None = None) -> Any:
    from rallypoint.manager import Manager

    return Manager(pg, lambda sd: None, dict, min_replica_size=min_size, rank=0, world_size=1,
                   hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                   replica_id=name, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=15),
                   connect_timeout=timedelta(seconds=10), init_sync=False, heal_on_training_thread=training_thread)


def _step(m: Any, value: float) -> tuple[bool, float, str, int, int]:
    m.start_quorum()
    t = torch.tensor([value])
    m.allreduce(t).wait()
    ok = m.should_commit()
    return ok, t.item(), m._configurer.last_action, m._pg.rank(), m._pg.size()


def _until_all(m: Any, value: float, n: int, limit_s: float = 60.0) -> tuple[bool, float, str, int, int]:
    """Step until a committed step had all ``n`` replica groups taking part (a joiner
    heals in its first step and takes part from the next; every member stops at that
    same step, so nobody is left waiting for a quorum)."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        r = _step(m, value)
        if r[0] and r[4] == n and m.num_participants() == n:
            return r
    raise AssertionError(f"{m.replica_id}: no committed step with {n} participants within {limit_s}s")


@pytest.fixture
def pg_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")


@needs_handles
@pytest.mark.parametrize("training_thread", [None, True], ids=["default", "training_thread"])
def test_managers_reconfigure_from_handles_through_a_shrink_and_a_grow(lighthouse: Any, monkeypatch: pytest.MonkeyPatch,
                                                                     training_thread: bool | None) -> None:
    """The grow's joiner heals a state with no data bytes; on the training thread the
    sender's freeze once withdrew it before the joiner asked (HTTP 410 every round)."""
    monkeypatch.delenv("RALLYPOINT_PG_HOST", raising=False)  # the Manager's hostname is the default
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=2, join_timeout_ms=3000)
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(3)]
    ms: list[Any] = []
    try:
        with cf.ThreadPoolExecutor(3) as ex:
            ms.extend(ex.map(lambda i: _manager(lh, pgs[i], f"r{i}", 2, training_thread), range(3)))
            res = list(ex.map(lambda i: _step(ms[i], float(i + 1)), range(3), timeout=90))
            assert [r[0] for r in res] == [True] * 3, res
            assert all(r[1] == pytest.approx(2.0) and r[2] == "reconfigure" for r in res), res  # mean of 1, 2, 3
            assert all(json.loads(pg.get_reconfigure_handle())["store"].startswith("127.0.0.1:") for pg in pgs)
            assert sorted(r[3] for r in res) == [0, 1, 2] and {r[4] for r in res} == {3}
            order = sorted(range(3), key=lambda i: ms[i].replica_id)
            assert [res[i][3] for i in order] == [0, 1, 2]  # rank = replica order = handle order

            ms[2].shutdown()  # shrink: the two left meet on the handles of two
            res = list(ex.map(lambda i: _until_all(ms[i], float(i + 1), 2), range(2), timeout=90))
            assert all(r[1] == pytest.approx(1.5) and r[2] == "reconfigure" for r in res), res

            ms[2] = _manager(lh, pgs[2], "r2b", 2, training_thread)  # grow: the same group object joins again
            res = list(ex.map(lambda i: _until_all(ms[i], float(i + 1), 3), range(3), timeout=90))
            assert all(r[1] == pytest.approx(2.0) and r[2] == "reconfigure" for r in res), res
            order = sorted(range(3), key=lambda i: ms[i].replica_id)
            assert [res[i][3] for i in order] == [0, 1, 2]
    finally:
        for m in ms:
            m.shutdown(wait=False)
        for pg in pgs:
            pg.shutdown()


@needs_handles
def test_a_member_without_a_handle_makes_everyone_configure(lighthouse: Any, pg_host: None) -> None:
    from rallypoint.process_groups import ProcessGroupGloo

    class NoHandle(ProcessGroupGloo):  # a torchft 0.2-style group: configure() only
        supports_reconfigure = False  # type: ignore[assignment]

    lh = lighthouse(min_replicas=2, join_timeout_ms=3000)
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)), NoHandle(timeout=timedelta(seconds=10))]
    ms: list[Any] = []
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            ms.extend(ex.map(lambda i: _manager(lh, pgs[i], f"m{i}", 2), range(2)))
            res = list(ex.map(lambda i: _step(ms[i], float(i + 1)), range(2), timeout=90))
        assert all(r[0] and r[1] == pytest.approx(1.5) and r[2] == "configure" for r in res), res
    finally:
        for m in ms:
            m.shutdown(wait=False)
        for pg in pgs:
            pg.shutdown()


def test_the_handle_store_opens_when_the_manager_starts_not_in_the_first_step(lighthouse: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first quorum request carries the group's handle, whose store (a TCPStore server)
    can take seconds to open on a loaded host: it is opened while the Manager is built, so
    the first ``start_quorum`` (torchft's test bounds one with a 0.01 s quorum timeout by
    1 s) opens nothing."""
    from rallypoint.process_groups import ProcessGroupGloo
    from rallypoint.process_groups.reconfigure import HandleStore

    opened: list[str] = []
    real_open = HandleStore._open

    def counting(self: HandleStore) -> Any:
        opened.append("open")
        return real_open(self)

    monkeypatch.setattr(HandleStore, "_open", counting)
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    m = _manager(lh, pg, "early_handle", 1)
    try:
        assert opened == ["open"]
        m.start_quorum()
        m.wait_quorum()
        assert opened == ["open"] and m.errored() is None
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
