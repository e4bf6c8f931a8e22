"""Pure planning for durable checkpoints: which keys each writer writes, and when.

No I/O, no clock, no torch: tests call these with plain data.

A checkpoint at step ``s`` is written by ``G`` replica groups of ``W`` ranks each: the
``G * W`` writers split the state's leaf keys (DCP's flattened names, such as
``user.default.model.weight``) so that each writes about ``1/(G*W)`` of the bytes. The
split depends only on the keys, their sizes and ``G * W``, so every writer computes the
same plan without talking to the others. A key is the unit: one tensor is never split
(a state dominated by one huge tensor balances poorly; see docs/checkpoint.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The step folder's name: zero-padded so names sort as steps do.
STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``step_00000060`` for step 60."""
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step folder's name, or None for any other name."""
    m = STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def is_due(step: int, every: int, last_written: int | None) -> bool:
    """Whether committed step ``step`` is checkpointed: a positive multiple of
    ``every`` that was not written already (a step reached twice, e.g. after a
    restore, is written once per process)."""
    return every > 0 and step > 0 and step % every == 0 and step != last_written


def writer_index(replica_rank: int, group_rank: int, group_world_size: int) -> int:
    """The writer's index among ``G * W``: groups in replica-rank order, ranks inside."""
    return replica_rank * group_world_size + group_rank


def split_keys(sizes: dict[str, int], writers: int) -> list[list[str]]:
    """Assign every key to one of ``writers`` shares, balancing bytes.

    Largest key first (ties by name), each to the share with the fewest bytes so far
    (ties: the lowest index). Deterministic; each share's keys come back sorted."""
    if writers < 1:
        raise ValueError(f"a checkpoint needs at least one writer, got {writers}")
    shares: list[list[str]] = [[] for _ in range(writers)]
    load = [0] * writers
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        i = min(range(writers), key=lambda j: (load[j], j))
        shares[i].append(key)
        load[i] += sizes[key]
    return [sorted(s) for s in shares]


@dataclass(frozen=True)
class Share:
    """What one writer writes at one step."""

    step: int
    index: int  # this writer's index, 0 .. writers - 1
    writers: int  # G * W
    keys: tuple[str, ...]
    attempt: str  # the same for every writer of this step in this quorum; new after a restart


def plan_share(step: int, sizes: dict[str, int], replica_rank: int, replica_world_size: int,
               group_rank: int, group_world_size: int, attempt: str, sharded: set[str] | frozenset[str] = frozenset()
               ) -> Share:
    """This writer's share of step ``step``'s checkpoint.

    ``sharded``: keys held in shards by the ranks of a group (DTensors of FSDP2/HSDP):
    they are split over the groups only, and every rank of the group that writes one
    writes its own shard; the other keys are split over all ``G * W`` writers."""
    writers = replica_world_size * group_world_size
    index = writer_index(replica_rank, group_rank, group_world_size)
    if not 0 <= index < writers:
        raise ValueError(f"writer {index} is outside {writers} writers")
    plain = {k: v for k, v in sizes.items() if k not in sharded}
    mine = split_keys(plain, writers)[index]
    if sharded:
        mine += split_keys({k: sizes[k] for k in sharded if k in sizes}, replica_world_size)[replica_rank]
    return Share(step, index, writers, tuple(sorted(mine)), attempt)


def prune(complete: list[int], incomplete: list[int], keep: int) -> list[int]:
    """Steps to delete once the newest complete checkpoint exists: complete ones beyond
    the newest ``keep`` (``keep <= 0``: keep all), and incomplete ones older than the
    newest complete one (an incomplete newer one may still be being written)."""
    if not complete:
        return []
    newest = max(complete)
    old = sorted(complete, reverse=True)[keep:] if keep > 0 else []
    return sorted(set(old) | {s for s in incomplete if s < newest})


def first_mismatch(template: dict[str, tuple[int, ...] | None], saved: dict[str, tuple[int, ...] | None],
                   empty_containers: set[str]) -> str | None:
    """Why a checkpoint does not fit this job's state, or None when it does.

    ``template``/``saved``: flattened key -> tensor shape (None: not a tensor).
    A saved key the template lacks is allowed under a container the template has empty
    (an optimizer's ``state`` before its first step); anything else missing, extra or
    of another shape names the first such key in sorted order."""
    for key in sorted(set(template) | set(saved)):
        if key not in saved:
            return f"key {key!r} is missing from the checkpoint"
        if key not in template:
            parts = key.split(".")
            if not any(".".join(parts[:i]) in empty_containers for i in range(1, len(parts))):
                return f"key {key!r} is in the checkpoint but not in this job's state"
            continue
        if template[key] != saved[key]:
            return f"key {key!r} has shape {saved[key]} in the checkpoint but {template[key]} here"
    return None


__all__ = ["Share", "first_mismatch", "is_due", "parse_step_dir", "plan_share", "prune", "split_keys",
           "step_dir_name", "writer_index"]
