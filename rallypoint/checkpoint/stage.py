"""Staging: the training thread's only cost of a durable checkpoint.

The Manager's state (what heals send: ``{"user": {key: state}, "torchft": counters}``) is
flattened the way DCP flattens it (``user.default.model.weight``), and only this
writer's keys are copied: tensors to CPU (into pinned memory when they live on a GPU,
so the copy runs at full bandwidth), other values deep-copied. After the copy the
training step may change the live state; the background writer reads the copy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

#: The size a non-tensor value counts for in the split (they are small: counters, hyper-parameters).
OBJECT_SIZE = 64


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], set[str], set[str]]:
    """``(flat, paths, empty, int_keyed)``: DCP's flattened keys and values, each key's
    path in the nested state, the flattened names of empty dicts/lists (an optimizer's
    ``state`` before its first step: a checkpoint may hold keys under them), and of dicts
    with integer keys (an optimizer's ``state``: DCP stores its keys as text, and
    :func:`int_keys_back` turns them back on restore)."""
    flat, paths = flatten_state_dict(state)
    empty: set[str] = set()
    int_keyed: set[str] = set()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            if not value:
                empty.add(prefix)
            if any(isinstance(k, int) for k in value):
                int_keyed.add(prefix)
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and not value:
            empty.add(prefix)

    walk("", state)
    return flat, dict(paths), empty, int_keyed


def int_keys_back(state: dict[str, Any], int_keyed: list[str] | set[str]) -> None:
    """Turn the text keys of the dicts named in ``int_keyed`` back into integers, in place."""
    for name in int_keyed:
        node: Any = state
        for part in name.split(".") if name else []:
            if not isinstance(node, dict) or part not in node:
                node = None
                break
            node = node[part]
        if isinstance(node, dict):
            items = list(node.items())
            node.clear()
            node.update({int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in items})


def is_dtensor(v: Any) -> bool:
    """A DTensor (FSDP2/HSDP sharded state), without importing torch.distributed.tensor."""
    return isinstance(v, torch.Tensor) and type(v) is not torch.Tensor and hasattr(v, "to_local") \
        and hasattr(v, "device_mesh")


def sharded_keys(flat: dict[str, Any]) -> set[str]:
    """The keys whose values are DTensors: every rank of the group that writes them
    writes its own shard."""
    return {k for k, v in flat.items() if is_dtensor(v)}


def sizes_of(flat: dict[str, Any]) -> dict[str, int]:
    """Bytes per key (a DTensor's whole size), for the split."""
    return {k: v.numel() * v.element_size() if isinstance(v, torch.Tensor) else OBJECT_SIZE for k, v in flat.items()}


def shapes_of(flat: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Tensor shape per key (None: not a tensor), for the model check on restore."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def stage(flat: dict[str, Any], keys: tuple[str, ...] | list[str],
          buffers: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], int]:
    """Copy ``keys`` of ``flat`` off the live state: ``(copies, tensor bytes)``.

    ``buffers``: the previous staging's tensors by key, reused when shape and dtype
    match (no allocation, no page faults: the copy runs at memory speed) and updated in
    place; keys that left this writer's share are dropped. The caller must not stage
    again while a write still reads them (the writer skips an interval instead)."""
    out: dict[str, Any] = {}
    nbytes = 0
    on_gpu = False
    keep = set(keys)
    if buffers is not None:
        for k in [k for k in buffers if k not in keep]:
            del buffers[k]
    for k in keys:
        v = flat[k]
        if isinstance(v, torch.Tensor):
            dt: Any = v if is_dtensor(v) else None
            t = (dt.to_local() if dt is not None else v).detach()
            gpu = t.device.type != "cpu"
            c = buffers.get(k) if buffers is not None else None
            if c is None or c.shape != t.shape or c.dtype != t.dtype:
                c = torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu and torch.cuda.is_available())
                if buffers is not None:
                    buffers[k] = c
            c.copy_(t, non_blocking=gpu)
            on_gpu = on_gpu or gpu
            out[k] = c if dt is None else _like(dt, c)
            nbytes += c.numel() * c.element_size()
        else:
            out[k] = copy.deepcopy(v)
    if on_gpu and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, nbytes


def _like(dt: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``dt``'s mesh, placements and global shape around the staged local
    shard: DCP then writes this rank's chunk at its offset (no communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                              stride=dt.stride())


__all__ = ["OBJECT_SIZE", "flatten", "int_keys_back", "is_dtensor", "sharded_keys", "shapes_of", "sizes_of", "stage"]
