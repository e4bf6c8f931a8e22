"""The training-thread half of a heal (``Manager._heal_here``), kept out of ``manager.py``:
serve and/or fetch this round's heal when it runs on the training thread, then apply a
received state there — after placing received DTensors on this replica's own meshes
(:mod:`rallypoint.transports._rebuild`), which needs this replica's current state, read
here, where reading it is safe."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rallypoint.manager.manager import Manager


def heal_here(m: "Manager") -> None:
    """Serve and/or fetch ``m``'s planned heal on the calling (training) thread, then apply
    a received state. The sender serves its state even when its step failed (that state is
    still the step's state) so the healing peer is not left waiting for a publication that
    never comes."""
    rnd = m._cur
    q, rnd.heal_plan = rnd.heal_plan, None
    t0 = time.monotonic()
    if q is not None:
        m._ff.heal_busy = True
        try:
            if m._healer.serves(q):
                m._healer.serve(q, m._manager_state_dict())
                rnd.served_here = True
            if q.heal:
                rnd.pending = m._healer.fetch(q, into=m._manager_state_dict(), mesh=m.heal_mesh)
        except Exception as e:  # noqa: BLE001
            m._log.warning("recovery failed: %s", e)
            m.report_error(e)
        finally:
            m._ff.heal_busy = False
    if rnd.apply_due:  # a received state: applied here, on the training thread
        pending, rnd.pending, rnd.apply_due = rnd.pending, None, False
        try:
            if pending is None:  # the fetch failed (and counted toward the heal backoff)
                raise RuntimeError("healing was required but no state was received")
            pending = land(pending)
            m._user_state.apply(place_dtensors(pending, m._manager_state_dict, m.heal_mesh), m.load_state_dict)
            m._healer.failed_heals = 0  # a heal is done once applied: the backoff starts over
            m._log.info("applied healed state: step %d", m._step)
        except Exception as e:  # noqa: BLE001
            if pending is not None:
                m._healer.failed_heals += 1  # a state that cannot be applied: back off as for a failed fetch
                m._log.warning("applying the healed state failed: %s", e)
            m.report_error(e)
    if q is not None or rnd.rec.healing:
        dt = time.monotonic() - t0
        rnd.rec.heal_s += dt
        if rnd.rec.first_collective is None:
            rnd.rec.heal_before_s += dt


def land(received: Any) -> Any:
    """A state the quorum thread received and verified but left for this thread to put in
    place (:class:`~rallypoint.transports.wire.Landing`: its buffers swap into our own
    tensors, microseconds rather than a copy of the state); anything else as it is."""
    from rallypoint.transports.wire import Landing

    return received.land() if isinstance(received, Landing) else received


def place_dtensors(received: Any, current: Any, heal_mesh: Any) -> Any:
    """``received`` with its deferred DTensors placed on this replica's meshes; ``current``
    (a callable returning the current state) is called only when there are any."""
    from rallypoint.transports._rebuild import has_sent_dtensors, rebuild_dtensors

    if not has_sent_dtensors(received):
        return received
    return rebuild_dtensors(received, current(), fallback_mesh=heal_mesh)


__all__ = ["heal_here", "place_dtensors"]
