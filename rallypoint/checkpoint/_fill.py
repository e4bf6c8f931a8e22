"""Room for the keys a checkpoint holds and the live sharded state lacks yet.

``dcp.load`` into a state with DTensors fills what is there, in place: it cannot create a
key. An optimizer before its first step has no state (Adam's ``exp_avg``), so a whole-job
restore into fresh FSDP2/HSDP state would drop it. Here each such key gets a zero value
of the checkpoint's shape and dtype, at the path the checkpoint recorded for it (DCP's
``planner_data``: the original keys, integers included), before the load fills it:

* a key that was saved in shards gets a DTensor laid out like a live DTensor of the same
  global shape (an optimizer's moments follow their parameter's mesh and placements; DCP
  reads whatever chunks that layout needs);
* a key saved whole (Adam's ``step``) gets a plain tensor; a non-tensor value ``None``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from rallypoint.checkpoint.stage import is_dtensor


def _was_sharded(meta: TensorStorageMetadata) -> bool:
    return len(meta.chunks) > 1 or any(tuple(c.sizes) != tuple(meta.size) for c in meta.chunks)


def _put(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> bool:
    """Set ``state[path...] = value``, creating dicts on the way; False when the path runs
    through something that is not a dict, or the key is already there."""
    node: Any = state
    for part in path[:-1]:
        if not isinstance(node, dict):
            return False
        node = node.setdefault(part, {})
    if not isinstance(node, dict) or path[-1] in node:
        return False
    node[path[-1]] = value
    return True


def fill_missing(state: dict[str, Any], live: dict[str, Any], md: Metadata, keys: list[str]) -> list[str]:
    """Give each of ``keys`` (in the checkpoint ``md``, not in ``state``; ``live``:
    ``state`` flattened) a zero value in ``state``, in place; returns the keys it could
    not place (no recorded path, or a sharded key with no live DTensor of its shape)."""
    like: dict[tuple[int, ...], Any] = {}
    for v in live.values():
        if is_dtensor(v):
            like.setdefault(tuple(v.shape), v)
    left: list[str] = []
    for key in keys:
        path = (md.planner_data or {}).get(key)
        meta = md.state_dict_metadata.get(key)
        value: Any = None
        if isinstance(meta, TensorStorageMetadata):
            size, dtype = tuple(meta.size), meta.properties.dtype
            if _was_sharded(meta):
                d = like.get(size)
                if d is None:
                    left.append(key)
                    continue
                from torch.distributed.tensor import zeros

                value = zeros(size, dtype=dtype, device_mesh=d.device_mesh, placements=d.placements)
            else:
                value = torch.zeros(size, dtype=dtype)
        if not path or not _put(state, tuple(path), value):
            left.append(key)
    return left


__all__ = ["fill_missing"]
