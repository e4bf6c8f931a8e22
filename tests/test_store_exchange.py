"""``reconfigure_with_store`` (``rallypoint/process_groups/store_exchange.py``): a process
group reconfigured without a Manager, its peers' handles swapped through a TCPStore, as
torchft-nightly's function of that name does (its ``reconfigure_test.py`` runs it through
the alias too: ``tests/test_torchft_nightly_integ.py``).

The exact store calls (what torchft-nightly's ``test_order_and_timeout`` checks of its own
function, here of ours); a peer that never comes raises and reconfigures nothing; a failed
reconfigure raises and the next call has a new communicator id; two of our Gloo groups in
threads reconfigured twice through a real store, an allreduce after each.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from unittest.mock import Mock, patch

import pytest
import torch
import torch.distributed as dist

from rallypoint.process_groups import ProcessGroupGloo
from rallypoint.process_groups.store_exchange import create_store_client, reconfigure_with_store


@patch("rallypoint.process_groups.store_exchange.create_store_client")
def test_the_store_calls_and_the_options_in_rank_order(create_store: Mock) -> None:
    store = create_store.return_value
    store.multi_get.return_value = [b"42", b"peer", b"self"]
    pg = Mock()
    pg.get_reconfigure_handle.return_value = "self"
    timeout = timedelta(seconds=7)
    reconfigure_with_store(pg, "host:123/prefix", 1, 2, timeout)
    create_store.assert_called_once_with("host:123/prefix", timeout)
    store.set.assert_called_once_with("handle/1", "self")  # rank 1 does not choose the id
    store.wait.assert_called_once_with(["uuid", "handle/0", "handle/1"], timeout)
    (opts,) = pg.reconfigure.call_args.args
    assert (opts.uuid, list(opts.handles), opts.timeout) == (42, ["peer", "self"], timeout)
    pg.reconfigure.return_value.wait.assert_called_once_with()


def test_a_missing_peer_raises_and_nothing_is_reconfigured() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = Mock()
    pg.get_reconfigure_handle.return_value = "self"
    with pytest.raises(dist.DistStoreError):
        reconfigure_with_store(pg, f"127.0.0.1:{store.port}/missing", 0, 2, timedelta(milliseconds=100))
    pg.reconfigure.assert_not_called()


def test_a_failed_reconfigure_raises_and_the_next_call_has_a_new_id() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = Mock()
    pg.get_reconfigure_handle.return_value = "self"
    pg.reconfigure.return_value.wait.side_effect = RuntimeError("failed work")
    for generation in range(2):
        with pytest.raises(RuntimeError, match="failed work"):
            reconfigure_with_store(pg, f"127.0.0.1:{store.port}/{generation}", 0, 1, timedelta(seconds=5))
    ids = [c.args[0].uuid for c in pg.reconfigure.call_args_list]
    assert len(ids) == 2 and ids[0] != ids[1]


@pytest.mark.parametrize("addr, error", [("nohost/prefix", "not host:port/prefix"), ("h:x/p", "not host:port/prefix")])
def test_a_bad_store_address_is_refused(addr: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        create_store_client(addr, timedelta(seconds=1))


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        reconfigure_with_store(Mock(), "127.0.0.1:1/p", 2, 2)


def test_two_gloo_groups_reconfigure_through_a_store_twice() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    pgs = [ProcessGroupGloo(timeout=timeout) for _ in range(2)]
    out: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            for generation in range(2):
                reconfigure_with_store(pgs[rank], f"127.0.0.1:{store.port}/g/{generation}", rank, 2, timeout)
                t = torch.tensor([float(rank + 1)])
                pgs[rank].allreduce([t], dist.ReduceOp.SUM).wait()
                out.setdefault(rank, []).append(float(t.item()))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert out == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    finally:
        for pg in pgs:
            pg.shutdown()
