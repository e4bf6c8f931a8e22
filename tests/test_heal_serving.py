"""The state being served is never read while the training thread changes it (issue 41;
torchtitan#4754's race crashed a serving process). A sender serves on its training thread
between backward and the optimizer step, and the served state is frozen after the vote
(``Healer.after_vote``), before the optimizer changes it in place. Here the training
thread steps an optimizer in a loop, serving each committed step, while a healer thread
pulls the served state again and again: no crash, and every state pulled is exactly one
committed step's (its checksum matches that step's snapshot): never torn."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch

from rallypoint.manager._heal import Healer
from rallypoint.transports.http import HTTPTransport


def _crc(t: torch.Tensor) -> int:
    """A checksum of the tensor's bytes."""
    from rallypoint.transports._crc import crc32
    from rallypoint.transports._tensors import byte_view

    c = t.detach().contiguous().clone()
    return crc32(byte_view(c))


def test_served_state_is_one_committed_steps_while_the_optimizer_steps() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)  # 2 MiB weight: served live (no copy at send)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr = HTTPTransport(timeout=timedelta(seconds=10), bind="127.0.0.1:0", advertise_host="127.0.0.1")
    healer = Healer(tr, 0, timedelta(seconds=10), timedelta(seconds=5), logging.LoggerAdapter(logging.getLogger("t")))
    snapshots: dict[int, dict[str, int]] = {}
    current = [-1]
    stop = threading.Event()
    pulled: list[int] = []
    errors: list[str] = []
    torn: list[str] = []

    def pull() -> None:
        while not stop.is_set():
            k = current[0]
            if k < 0:
                time.sleep(0.001)
                continue
            try:
                got = tr.recv_checkpoint(src_rank=0, metadata=tr.metadata(), step=k, timeout=timedelta(seconds=10))
            except Exception as e:  # noqa: BLE001 - a withdrawn step: ask for the next one
                errors.append(f"{type(e).__name__}: {e}")
                continue
            sums = {n: _crc(t) for n, t in got["model"].items()}
            if sums != snapshots[k]:
                torn.append(f"step {k}: {sums} != {snapshots[k]}")
            pulled.append(k)

    t = threading.Thread(target=pull, name="healer")
    t.start()
    try:
        for step in range(40):
            # should_commit on the training thread: serve (live), vote, freeze after the vote.
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            snapshots[step] = {n: _crc(v) for n, v in state["model"].items()}
            q = SimpleNamespace(max_step=step, recover_dst_replica_ranks=list(range(1, 100)),
                                stripe_dst_replica_ranks=[])
            healer.serve(q, state)  # type: ignore[arg-type]
            current[0] = step
            deadline = time.monotonic() + 5
            while len(pulled) < step // 2 and time.monotonic() < deadline:  # let pulls overlap the step
                time.sleep(0.002)
            healer.after_vote(True)
            # ... then the optimizer changes every parameter in place, as the next forward will read it.
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
    finally:
        stop.set()
        t.join(30)
        tr.shutdown()
    assert not t.is_alive()
    assert torn == [], torn[:3]
    assert len(set(pulled)) >= 10, (pulled, errors[:5])  # pulls really overlapped many steps
