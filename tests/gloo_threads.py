"""A real gloo group of several ranks inside one test process: one rank per thread, on a
TCPStore that picked its own port. ``test_guards.py`` and ``test_ride.py`` use it to run
collectives among real ranks in a few milliseconds; every wait has a timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def on_ranks(fn: Callable[[int], Any], n: int, timeout: float = 15.0) -> dict[int, Any]:
    """Run ``fn(rank)`` on ``n`` threads at once; return rank -> result, re-raise a failure."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish in time"
    if errors:
        raise next(iter(errors.values()))
    return results


def gloo_group(n: int, prefix: str, timeout: timedelta) -> Iterator[dict[int, Any]]:
    """Yield rank -> a rank of an ``n``-rank gloo group (for a fixture), each made on its
    own thread as real ranks are; ``prefix`` keeps two groups' keys apart."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def make(r: int) -> Any:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), r, n, opts)

    pgs = on_ranks(make, n)
    yield pgs
    del pgs
