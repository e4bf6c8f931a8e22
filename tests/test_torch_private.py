"""The torch-private names rallypoint leans on still mean what it assumes, on whichever
torch runs the suite (2.13.0 in ``make test``, 2.14.1 in ``make test-newest``; users may be
on newer). Each patch degrades to doing nothing when its name is gone, so without these
checks a torch release that moved them would only show as a slower restart.

- ``rallypoint/supervisor/_rendezvous.py``: torch's dynamic rendezvous sleeps
  ``_delay(seconds=1)`` between polls of the shared state in its join loop (replaced by
  ``_shorten_sync_poll``), and its handler's ``_state_holder`` serves the state from a
  cache of ``_cache_duration`` = 1 second (set to 0 by ``NodeRendezvous``).
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from rallypoint.supervisor import _rendezvous


def test_the_join_loop_polls_through_the_module_delay_of_one_second() -> None:
    assert callable(getattr(dr, "_delay", None)) or callable(getattr(dr, "_rallypoint_original_delay", None))
    src = inspect.getsource(dr._DistributedRendezvousOpExecutor.run)
    assert "_delay(seconds=1)" in src, "torch's join loop no longer sleeps _delay(seconds=1): _shorten_sync_poll is a no-op"


def test_shorten_sync_poll_replaces_the_one_second_sleep_only(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[object] = []
    monkeypatch.setattr(dr, "_delay", lambda seconds: slept.append(seconds), raising=True)
    monkeypatch.setattr(dr, "_rallypoint_original_delay", None, raising=False)  # restored after
    monkeypatch.setattr(_rendezvous, "_JOINED", _rendezvous.threading.Event())
    _rendezvous._shorten_sync_poll(0.02)
    dr._delay(seconds=1)
    dr._delay(seconds=(0, 0.3))  # the start-up skew stays before the first join
    _rendezvous._JOINED.set()
    dr._delay(seconds=(0, 0.3))  # and is gone after it
    dr._delay(seconds=5)
    assert slept == [0.02, (0, 0.3), 5]


def test_the_handler_caches_the_state_for_one_second_in_its_state_holder() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id="private", min_nodes=1, max_nodes=1)
    handler = dr.create_handler(store, C10dRendezvousBackend(store, "private"), params)
    holder = getattr(handler, "_state_holder", None)
    assert getattr(holder, "_cache_duration", None) == 1, (
        "torch's rendezvous handler has no _state_holder._cache_duration of 1: NodeRendezvous's zeroing is a no-op")
