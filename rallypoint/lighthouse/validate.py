"""Validation of what arrives over the wire, before it can touch lighthouse state.

Each check raises :class:`InvalidRequest` with a message naming the field, so the
server answers INVALID_ARGUMENT and the caller knows exactly what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from rallypoint._net import handles as _handles
from rallypoint._net.limits import MAX_ADDRESS_BYTES, MAX_DATA_BYTES, MAX_REASON_BYTES, MAX_REPLICA_ID_BYTES, utf8_len
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.quorum import Member, Pending
# Steps and counters beyond 2**62 are certainly garbage (and break JSON consumers).
MAX_COUNTER = 2**62


class InvalidRequest(ValueError):
    """A request field is malformed; the message names the field."""


def replica_id(value: str, field: str = "replica_id") -> str:
    """A replica id is 1..256 bytes of printable text (it appears in logs and URLs)."""
    if not value:
        raise InvalidRequest(f"{field} is empty: every replica needs a stable, non-empty id")
    size = utf8_len(value)
    if size > MAX_REPLICA_ID_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes long; the limit is {MAX_REPLICA_ID_BYTES}")
    if not value.isprintable():
        raise InvalidRequest(f"{field} {value!r} contains non-printable characters")
    return value


def _counter(value: int, field: str) -> int:
    if value < 0:
        raise InvalidRequest(f"{field} must be >= 0, got {value}")
    if value > MAX_COUNTER:
        raise InvalidRequest(f"{field} is implausibly large: {value}")
    return value


def address(value: str, field: str) -> str:
    """An address (``host:port``, a URL) of at most 1 KiB of printable text."""
    if utf8_len(value) > MAX_ADDRESS_BYTES:
        raise InvalidRequest(f"{field} is longer than {MAX_ADDRESS_BYTES} bytes")
    if value and not value.isprintable():
        raise InvalidRequest(f"{field} {value[:80]!r} contains non-printable characters")
    return value


_address = address


def reason(value: str, field: str = "reason") -> str:
    """A kill reason: at most 1 KiB (it is logged, recorded and forwarded)."""
    size = utf8_len(value)
    if size > MAX_REASON_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes; the limit is {MAX_REASON_BYTES}")
    return value


def data_size(value: str, field: str) -> str:
    """``value`` is at most 64 KiB (its content is checked by whoever reads it)."""
    size = utf8_len(value)
    if size > MAX_DATA_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes; the limit is {MAX_DATA_BYTES} (64 KiB)")
    return value


def data(value: str, field: str = "requester.data") -> str:
    """``data`` is empty or a JSON document of at most 64 KiB."""
    if not value:
        return value
    data_size(value, field)
    try:
        json.loads(value)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise InvalidRequest(f"{field} is not valid JSON: {str(e)[:200]}") from None
    return value


def reconfigure_handles(values: list[str], world_size: int,
                        field: str = "requester.reconfigure_handles") -> tuple[str, ...]:
    """torchft 0.3's handles of one member: none, or one per group rank, each ``''`` or a
    JSON object of at most 4 KiB, none twice (:mod:`rallypoint._net.handles`)."""
    try:
        return _handles.check_group_handles(values, world_size, field)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def handle_collision(member: Member, pending: Mapping[str, Pending]) -> None:
    """``InvalidRequest`` when one of ``member``'s reconfigure handles is also another
    pending member's (they would form one quorum, and two ranks would claim one process
    group); the member's own earlier request does not count."""
    if not member.reconfigure_handles:
        return
    others = {rid: p.member.reconfigure_handles for rid, p in pending.items()
              if rid != member.replica_id and p.member.reconfigure_handles}
    hit = _handles.collision(member.reconfigure_handles, others)
    if hit is not None:
        i, rid = hit
        raise InvalidRequest(f"requester.reconfigure_handles[{i}] ({member.reconfigure_handles[i][:80]!r}) is also "
                             f"replica {rid}'s: every rank's process group has its own handle")


def quorum_request(request: pb.LighthouseQuorumRequest) -> Member:
    """Check a LighthouseQuorumRequest and convert its requester to a :class:`Member`."""
    if not request.HasField("requester"):
        raise InvalidRequest("requester is missing: a Quorum request must say who is asking")
    r = request.requester
    world_size = _counter(r.world_size, "requester.world_size")
    return Member(
        replica_id=replica_id(r.replica_id, "requester.replica_id"),
        address=_address(r.address, "requester.address"),
        store_address=_address(r.store_address, "requester.store_address"),
        step=_counter(r.step, "requester.step"),
        world_size=world_size,
        shrink_only=r.shrink_only,
        commit_failures=_counter(r.commit_failures, "requester.commit_failures"),
        data=data(r.data),
        reconfigure_handles=reconfigure_handles(list(r.reconfigure_handles), world_size),
    )


def member_to_pb(m: Member) -> pb.QuorumMember:
    """``m`` on the wire, every field (torchft 0.3's reconfigure handles included)."""
    return pb.QuorumMember(
        replica_id=m.replica_id,
        address=m.address,
        store_address=m.store_address,
        step=m.step,
        world_size=m.world_size,
        shrink_only=m.shrink_only,
        commit_failures=m.commit_failures,
        data=m.data,
        reconfigure_handles=m.reconfigure_handles,
    )


def member_from_pb(p: pb.QuorumMember) -> Member:
    """A member as another lighthouse sent it (not checked: see :func:`quorum_request`)."""
    return Member(
        replica_id=p.replica_id,
        address=p.address,
        store_address=p.store_address,
        step=p.step,
        world_size=p.world_size,
        shrink_only=p.shrink_only,
        commit_failures=p.commit_failures,
        data=p.data,
        reconfigure_handles=tuple(p.reconfigure_handles),
    )
