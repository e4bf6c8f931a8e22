"""The watch two nodes of one group keep on each other (``supervisor/_rendezvous.py``),
with torch's real c10d dynamic rendezvous over loopback, two ``NodeRendezvous`` in this
process: a node beats from the moment its round forms, so a node whose ranks take longer
to start than the lost-node timeout (its zygote still importing on a loaded host) is not
taken for a lost one; a node that ends the incarnation before the other's ranks even
started still restarts that other node, once."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import pytest

from rallypoint.supervisor import _rendezvous
from rallypoint.supervisor._rendezvous import NodeRendezvous, RdzvConfig
from rallypoint.supervisor.nodes import NodeInfo

LOST_AFTER_S = 2.0  # keep_alive_interval 1 s x 2 attempts below


class Node:
    """One node's rendezvous and the events it posts to its supervisor."""

    def __init__(self, node_rank: int, endpoint: str, run_id: str) -> None:
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        conf = {"is_host": "1" if node_rank == 0 else "0", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
        self.rdzv = NodeRendezvous(RdzvConfig("c10d", endpoint, run_id, 2, 30.0, "127.0.0.1", conf),
                                   lambda *ev: self.events.put(ev))
        self.plan: Any = None  # the round's plan, once met
        self.info = NodeInfo(nnodes=2, nproc=1, node_rank=node_rank, addr="127.0.0.1", store_port=1000 + node_rank,
                             last_incarnation=-1, hostname="test")

    def next_event(self, timeout: float) -> tuple[Any, ...] | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


@pytest.fixture
def nodes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two nodes meeting in this process. ``NodeRendezvous`` sets two environment variables
    and shortens torch's rendezvous poll for its whole process (a supervisor hosts nothing
    else); here all three are restored afterwards, or later tests that start torchrun would
    inherit ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and find no store at MASTER_PORT."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"))
    monkeypatch.setattr(dr, "_delay", dr._delay)
    monkeypatch.setattr(dr, "_rallypoint_original_delay", getattr(dr, "_rallypoint_original_delay", None),
                        raising=False)
    monkeypatch.setattr(_rendezvous, "_JOINED", threading.Event())
    made: list[Node] = []

    def meet() -> tuple[Node, Node]:
        a = Node(0, "127.0.0.1:0", request.node.name[:40])
        made.append(a)
        a.rdzv.join(a.info)
        deadline = time.monotonic() + 20
        while a.rdzv.endpoint.endswith(":0"):  # the host reports the port its store took
            assert time.monotonic() < deadline, "the rendezvous host never reported its port"
            time.sleep(0.01)
        b = Node(1, a.rdzv.endpoint, request.node.name[:40])
        made.append(b)
        b.rdzv.join(b.info)
        for n in (a, b):
            ev = n.next_event(30)
            assert ev is not None and ev[0] == "round", ev
            n.plan = ev[1]
        return a, b

    yield meet
    for n in reversed(made):
        n.rdzv.close()


def test_a_node_slow_to_start_its_ranks_is_not_taken_for_lost(nodes) -> None:
    a, b = nodes()
    a.rdzv.watch()  # node 0's ranks started at once; node 1's take longer than the lost-node timeout
    ev = a.next_event(LOST_AFTER_S + 1.5)
    assert ev is None, f"node 0 restarted the group while node 1 was still starting its ranks: {ev}"
    b.rdzv.watch()
    assert a.next_event(0.5) is None and b.next_event(0.5) is None


def test_an_incarnation_ended_before_the_other_node_started_restarts_it_once(nodes) -> None:
    a, b = nodes()
    a.rdzv.watch()
    a.rdzv.end("node 0 rank 0 failed (exit 1)")  # before node 1's supervisor even started its ranks
    ev = b.next_event(10)
    assert ev == ("peer", "node 0 rank 0 failed (exit 1)", b.plan.incarnation), ev  # names its round
    b.rdzv.watch()  # the supervisor's own call once its ranks run: no second restart
    assert b.next_event(1.0) is None


def test_a_node_that_is_really_gone_is_still_lost(nodes) -> None:
    a, b = nodes()
    b.rdzv.stop_watch()  # node 1's supervisor is gone: nothing beats for it
    a.rdzv.watch()
    t0 = time.monotonic()
    ev = a.next_event(LOST_AFTER_S + 5)
    assert ev is not None and ev[0] == "peer" and "node 1 of the group stopped beating" in ev[1], ev
    assert time.monotonic() - t0 >= LOST_AFTER_S - 0.2
