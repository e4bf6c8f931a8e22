"""The torchft 0.3 reconfigure API of our process groups (``reconfigure.py``, ``base.py``).

Pure parts by tables: handles parsed as torchft-nightly does (rank = position of our own
handle, rendezvous on the first handle's store under ``torchft/<uuid>``) and refused with
a message naming the handle when they are not torchft handles; the handle store's
address. Then real processes: 3 Gloo groups reconfigured from each other's handles in a
chosen order (rank order = handle order, checked with an allgather), shrunk to 2 and
grown back to 3; Baby Gloo and the wrappers the same way on 2.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import pytest

from rallypoint.process_groups.reconfigure import (
    MAX_HANDLE_BYTES,
    ReconfigureOptions,
    StoreAddress,
    make_handle,
    make_options,
    rendezvous_of,
    store_address,
)
from test_process_groups_util import STATE, WorkerPool, shared_pool, w_shutdown

# --------------------------------------------------------------------- pure parts

H = [make_handle(f"id{i}", f"host{i}:{100 + i}", i * 2) for i in range(3)]


@pytest.mark.parametrize("handles,own,rank,store,granks", [
    (H, "id0", 0, "host0:100/torchft/7", (0, 2, 4)),
    (H, "id2", 2, "host0:100/torchft/7", (0, 2, 4)),
    ([H[2], H[0]], "id0", 1, "host2:102/torchft/7", (4, 0)),
    ([H[1]], "id1", 0, "host1:101/torchft/7", (2,)),
    ([H[0], make_handle("x", "[fd00::1]:5", None)], "x", 1, "host0:100/torchft/7", None),
])
def test_rank_is_the_position_of_our_handle_and_all_meet_on_the_first_store(
        handles: list[str], own: str, rank: int, store: str, granks: tuple[int, ...] | None) -> None:
    rdv = rendezvous_of(7, handles, own)
    assert (rdv.rank, rdv.world_size, rdv.store_addr, rdv.uuid, rdv.global_ranks) == \
        (rank, len(handles), store, 7, granks)


def test_a_torchft_nightly_handle_is_understood() -> None:
    # The exact text torchft-nightly's get_reconfigure_handle() writes (json.dumps of its dict).
    theirs = json.dumps({"id": "0f" * 16, "store": "node3:41000", "global_rank": 5})
    rdv = rendezvous_of(3, [theirs, H[0]], "id0")
    assert (rdv.rank, rdv.store_addr, rdv.global_ranks) == (1, "node3:41000/torchft/3", (5, 0))
    assert json.loads(H[1]) == {"id": "id1", "store": "host1:101", "global_rank": 2}


@pytest.mark.parametrize("uuid,handles,own,needle", [
    (1, set(H), "id0", "ordered list"),
    (1, [], "id0", "no handles"),
    (1, [H[0], H[0]], "id0", "handle 1 repeats id 'id0'"),
    (1, [H[0], H[1]], "id9", "not among the 2 handles"),
    (1, [H[0], ""], "id0", "handle 1 is empty"),
    (1, ["{not json"], "id0", "handle 0 is not JSON"),
    (1, ["[1, 2]"], "id0", "handle 0 is not a JSON object"),
    (1, [json.dumps({"store": "h:1"})], "id0", "no string 'id'"),
    (1, [json.dumps({"id": "a", "store": "h:1/p"})], "a", "no 'store' host:port"),
    (1, [json.dumps({"id": "a", "store": "h:1", "global_rank": -1})], "a", "bad 'global_rank'"),
    (1, [make_handle("a" * MAX_HANDLE_BYTES, "h:1", None)], "a", "characters long"),
    (1, [7], "id0", "handle 0 is a int"),
    (-1, H, "id0", "uuid -1"),
])
def test_bad_handles_are_refused_naming_the_handle(uuid: int, handles: Any, own: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        rendezvous_of(uuid, handles, own)
    assert needle in str(e.value)


def _resolver(table: dict[str, str]) -> Any:
    return table.get


@pytest.mark.parametrize("value,want", [
    (None, StoreAddress("10.0.0.5", "node5")),            # the host's name, bound to what it resolves to
    ("", StoreAddress("10.0.0.5", "node5")),
    ("10.1.1.1", StoreAddress("10.1.1.1", "10.1.1.1")),   # an IP: bound and advertised
    ("fd00::2", StoreAddress("fd00::2", "fd00::2")),
    ("ib0", StoreAddress("192.168.7.5", "192.168.7.5")),  # an interface: its address
    ("node5-ib", StoreAddress("192.168.7.5", "node5-ib")),
    ("ghost", StoreAddress(None, "ghost")),               # unresolvable: every interface (logged)
])
def test_handle_store_listens_on_the_address_it_advertises(value: str | None, want: StoreAddress) -> None:
    got = store_address(value, "node5", {"ib0": "192.168.7.5", "lo": "127.0.0.1"},
                        _resolver({"node5": "10.0.0.5", "node5-ib": "192.168.7.5"}))
    assert got == want


def test_an_interface_without_an_address_is_an_error_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="RALLYPOINT_PG_HOST=ib1"):
        store_address("ib1", "node5", {"ib1": None}, _resolver({}))


def test_options_have_the_fields_torchft_sets() -> None:
    opts = make_options(9, H, datetime.timedelta(seconds=3))
    assert isinstance(opts, ReconfigureOptions)
    assert (opts.uuid, list(opts.handles), opts.timeout) == (9, H, datetime.timedelta(seconds=3))


# --------------------------------------------------------------------- processes (workers)


def w_handle(kind: str, tag: int, key: str = "rpg", timeout_s: float = 20.0) -> str:
    """Create the group (a fresh one), set its rank info and return its handle."""
    from rallypoint import process_groups as pgs
    from rallypoint.process_groups.reconfigure import PG_HOST_ENV

    os.environ[PG_HOST_ENV] = "127.0.0.1"
    old = STATE.pop(key, None)
    if old is not None:
        old.shutdown()
    t = datetime.timedelta(seconds=timeout_s)
    if kind == "gloo":
        pg: Any = pgs.ProcessGroupGloo(timeout=t)
    elif kind == "babygloo":
        pg = pgs.ProcessGroupBabyGloo(timeout=t)
    elif kind == "swallowing":
        pg = pgs.ErrorSwallowingProcessGroupWrapper(pgs.ProcessGroupGloo(timeout=t))
    elif kind == "fake":
        pg = pgs.FakeProcessGroupWrapper(pgs.ProcessGroupGloo(timeout=t))
    else:
        raise ValueError(kind)
    pg.set_rank_info(f"replica_{tag}", 0, 1, tag)
    STATE[key] = pg
    STATE[key + "_tag"] = tag
    return pg.get_reconfigure_handle()


def w_reconfigure_gather(uuid: int, handles: list[str], key: str = "rpg") -> dict[str, Any]:
    """Reconfigure from ``handles``; allgather every rank's tag (who sits at which rank)."""
    import torch

    from rallypoint.process_groups.reconfigure import make_options

    pg = STATE[key]
    work = pg.reconfigure(make_options(uuid, handles, datetime.timedelta(seconds=20)))
    assert work.wait()
    mine = torch.tensor([float(STATE[key + "_tag"])])
    out = [torch.zeros(1) for _ in range(pg.size())]
    pg.allgather([out], [mine]).wait()
    cfg = pg.config
    return {"rank": pg.rank(), "size": pg.size(), "tags": [int(t.item()) for t in out],
            "store": cfg.store_addr, "global_ranks": list(cfg.global_ranks or ()), "errored": repr(pg.errored())}


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> Any:
    p = shared_pool(request.config)
    yield p
    alive = [i for i in range(3) if p.conns[i] is not None]
    p.run(alive, w_shutdown, lambda r: ("rpg",), 30)


def test_three_gloo_groups_reconfigure_from_handles_shrink_and_grow(pool: WorkerPool) -> None:
    handles = pool.run([0, 1, 2], w_handle, lambda r: ("gloo", r), 30)
    for h in handles:
        assert json.loads(h)["store"].startswith("127.0.0.1:")  # bound where it is advertised
    order = [handles[2], handles[0], handles[1]]
    res = pool.run([0, 1, 2], w_reconfigure_gather, lambda r: (11, order), 60)
    assert [r["rank"] for r in res] == [1, 2, 0]  # worker w sits at the position of its handle
    assert all(r["tags"] == [2, 0, 1] and r["size"] == 3 for r in res), res
    first = json.loads(handles[2])["store"]
    assert all(r["store"] == f"{first}/torchft/11" and r["global_ranks"] == [2, 0, 1] for r in res)

    # Shrink: worker 2 is gone from the quorum; the first handle (whose store they meet on) changes.
    res = pool.run([0, 1], w_reconfigure_gather, lambda r: (12, [handles[1], handles[0]]), 60)
    assert [r["rank"] for r in res] == [1, 0] and all(r["tags"] == [1, 0] for r in res), res

    # Grow back to 3 in replica order.
    res = pool.run([0, 1, 2], w_reconfigure_gather, lambda r: (13, handles), 60)
    assert [r["rank"] for r in res] == [0, 1, 2] and all(r["tags"] == [0, 1, 2] for r in res), res
    assert all(r["errored"] == "None" for r in res)


@pytest.mark.parametrize("kind", ["babygloo", "swallowing", "fake"])
def test_baby_gloo_and_the_wrappers_reconfigure_from_handles(pool: WorkerPool, kind: str) -> None:
    handles = pool.run([0, 1], w_handle, lambda r: (kind, r + 5), 30)
    res = pool.run([0, 1], w_reconfigure_gather, lambda r: (21, [handles[1], handles[0]]), 90)
    assert [r["rank"] for r in res] == [1, 0] and all(r["tags"] == [6, 5] for r in res), res
    res = pool.run([0, 1], w_reconfigure_gather, lambda r: (22, handles), 90)
    assert [r["rank"] for r in res] == [0, 1] and all(r["tags"] == [5, 6] for r in res), res


def test_a_wrapper_shares_its_inner_groups_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint import process_groups as pgs

    inner = pgs.ProcessGroupDummy()
    wrapped = pgs.ErrorSwallowingProcessGroupWrapper(inner)
    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    try:
        assert wrapped.get_reconfigure_handle() == inner.get_reconfigure_handle()
        assert wrapped.supports_reconfigure
        wrapped.reconfigure(make_options(4, [wrapped.get_reconfigure_handle()], None)).wait()
        assert inner.config is not None and inner.config.store_addr.endswith("/torchft/4")

        class Comm:
            def allreduce(self, tensor: Any) -> Any: ...
            def num_participants(self) -> int: return 1

        managed = pgs.ManagedProcessGroup(Comm())
        assert not managed.supports_reconfigure  # its manager reconfigures the group below it
        with pytest.raises(NotImplementedError):
            managed.reconfigure(make_options(1, [], None))
    finally:
        wrapped.shutdown()


def test_the_handle_store_listens_only_where_it_advertises() -> None:
    import socket

    from rallypoint._net.heal_host import interface_addresses
    from rallypoint.process_groups.reconfigure import HandleStore

    hs = HandleStore(environ={}, hostname="127.0.0.1")  # the Manager's hostname, no RALLYPOINT_PG_HOST
    try:
        host, port = hs.address().rsplit(":", 1)
        assert host == "127.0.0.1"
        socket.create_connection((host, int(port)), timeout=5).close()
        others = [a for a in interface_addresses().values() if a and not a.startswith("127.")]
        for a in others:  # another address of this host: nothing listens there
            with pytest.raises(OSError):
                socket.create_connection((a, int(port)), timeout=5).close()
    finally:
        hs.close()
    env_wins = HandleStore(environ={"RALLYPOINT_PG_HOST": "127.0.0.1"}, hostname="ghost.invalid")
    try:
        assert env_wins.address().startswith("127.0.0.1:")
    finally:
        env_wins.close()
