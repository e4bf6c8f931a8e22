"""torchft 0.3's reconfigure handles, as pure functions over plain data.

A reconfigurable process group (torchft-nightly's, or torch >= 2.14's native one)
describes itself with a *handle*: a JSON object such as ``{"id": "<uuid>", "store":
"host:port", "global_rank": 3}``. Each rank sends its handle with its ``Quorum`` request
(``ManagerQuorumRequest.reconfigure_handle``); the group's ManagerServer sends the group's
handles up to the lighthouse as ``QuorumMember.reconfigure_handles`` (index = group rank);
the lighthouse keeps them with the member; and each group rank ``r`` gets back the handle
at index ``r`` of every member, in replica order (``ManagerQuorumResponse.
reconfigure_handles``, ``''`` where a member sent none). A process group then rebuilds
itself from that list, its rank being the index of its own handle.

The rules, one table for the lighthouse and the managers (``ValueError`` naming the field;
the servers answer INVALID_ARGUMENT and change nothing):

* a handle is ``''`` (the rank has no reconfigurable process group), a JSON object (torchft's
  and rallypoint's process groups) or torch's native form ``backend:...`` (torch >= 2.14's
  ``ProcessGroup.get_reconfigure_handle()``, e.g. ``gloo:0:-1:0:10.0.0.5:34275``: a backend
  name, a colon, then printable ASCII without spaces), of at most
  ``MAX_RECONFIGURE_HANDLE_BYTES`` (4 KiB);
* a member sends no handles at all (torchft 0.2 and rallypoint's own process groups), or
  exactly one per group rank, ``''`` for a rank without one, as torchft-nightly's
  ManagerServer does: a list of another length is refused, since the answer to a group
  rank whose handle is missing would silently be ``''`` and its process group would build
  a smaller group than its peers';
* at most ``MAX_GROUP_HANDLES`` handles and ``MAX_GROUP_HANDLES_BYTES`` in one member;
* a non-empty handle appears once in a quorum: two ranks (of one group or of two) that
  claim the same process group would both take the same rank in it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence

from rallypoint._net.limits import MAX_GROUP_HANDLES, MAX_GROUP_HANDLES_BYTES, MAX_RECONFIGURE_HANDLE_BYTES, utf8_len


#: torch's native handle: a backend name, a colon, printable ASCII without spaces.
_NATIVE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}:[!-~]+")


def check_handle(value: str, field: str = "reconfigure_handle") -> str:
    """``value`` if it is ``''``, a JSON object or torch's native ``backend:...`` handle, of
    at most 4 KiB; else ``ValueError`` naming ``field``."""
    if not value:
        return value
    size = utf8_len(value)
    if size > MAX_RECONFIGURE_HANDLE_BYTES:
        raise ValueError(f"{field} is {size} bytes; the limit is {MAX_RECONFIGURE_HANDLE_BYTES}")
    if not value.startswith("{") and _NATIVE.fullmatch(value):
        return value
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        raise ValueError(f"{field} is not JSON: {value[:80]!r}; a reconfigure handle is a JSON object "
                         "or torch's native 'backend:...' (ProcessGroup.get_reconfigure_handle()), or '' for none") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{field} is JSON but not an object: {value[:80]!r}")
    return value


def first_duplicate(handles: Iterable[str]) -> tuple[int, int] | None:
    """The indexes ``(i, j)``, ``i < j``, of the first non-empty handle seen twice, or None."""
    seen: dict[str, int] = {}
    for j, h in enumerate(handles):
        if not h:
            continue
        if h in seen:
            return seen[h], j
        seen[h] = j
    return None


def check_group_handles(handles: Sequence[str], world_size: int,
                        field: str = "requester.reconfigure_handles") -> tuple[str, ...]:
    """One member's handles, checked (see the module's rules): none, or one per group rank."""
    if not handles:
        return ()
    if len(handles) > MAX_GROUP_HANDLES:
        raise ValueError(f"{field} has {len(handles)} handles; the limit is {MAX_GROUP_HANDLES}")
    if len(handles) != world_size:
        raise ValueError(f"{field} has {len(handles)} handles for a replica group of world_size {world_size}: "
                         "send one per group rank ('' for a rank without one) or none")
    total = 0
    for i, h in enumerate(handles):
        check_handle(h, f"{field}[{i}]")
        total += utf8_len(h)
    if total > MAX_GROUP_HANDLES_BYTES:
        raise ValueError(f"{field} are {total} bytes together; the limit is {MAX_GROUP_HANDLES_BYTES}")
    dup = first_duplicate(handles)
    if dup is not None:
        raise ValueError(f"{field}[{dup[1]}] repeats {field}[{dup[0]}] ({handles[dup[0]][:80]!r}): "
                         "every rank's process group has its own handle")
    return tuple(handles)


def collision(mine: Sequence[str], others: Mapping[str, Sequence[str]]) -> tuple[int, str] | None:
    """``(index in mine, other replica)`` of the first non-empty handle of ``mine`` that
    another member (``others``: replica id -> its handles) also sent, or None."""
    owner: dict[str, str] = {}
    for rid, hs in others.items():
        for h in hs:
            if h:
                owner.setdefault(h, rid)
    for i, h in enumerate(mine):
        if h and h in owner:
            return i, owner[h]
    return None


def rank_handle_refusal(handle: str, rank: int, by_rank: Mapping[int, str],
                        field: str = "reconfigure_handle") -> str | None:
    """Why group rank ``rank``'s ``handle`` is refused in a round where the other ranks sent
    ``by_rank`` (group rank -> handle; ``rank``'s own earlier request does not count), or
    None: it must pass :func:`check_handle` and be no other rank's."""
    try:
        check_handle(handle, field)
    except ValueError as e:
        return str(e)
    if handle:
        for other, h in sorted(by_rank.items()):
            if other != rank and h == handle:
                return (f"{field} of group rank {rank} is also group rank {other}'s ({handle[:80]!r}): "
                        "every rank's process group has its own handle")
    return None


def group_handles(by_rank: Mapping[int, str], world_size: int) -> tuple[str, ...]:
    """What a ManagerServer sends up for its group: ``()`` when no rank sent a handle
    (torchft 0.2's and our own process groups), else one per group rank, ``''`` for a
    rank that sent none."""
    if not any(by_rank.values()):
        return ()
    return tuple(by_rank.get(g, "") for g in range(world_size))


def handles_for_rank(members: Iterable[Sequence[str]], group_rank: int) -> list[str]:
    """The answer to group rank ``group_rank``: its handle in each member (members in
    replica order), ``''`` where a member sent none (or fewer: another lighthouse may)."""
    return [hs[group_rank] if 0 <= group_rank < len(hs) else "" for hs in members]


__all__ = ["check_group_handles", "check_handle", "collision", "first_duplicate", "group_handles",
           "handles_for_rank", "rank_handle_refusal"]
