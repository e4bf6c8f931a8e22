"""Placing received DTensors (FSDP2 state) on the receiver's meshes, after the bytes arrived.

Why later: a healing replica may receive its peer's state on the quorum thread while its
own forward pass runs, when reading its own (FSDP2) state is not safe. The wire format then
hands over each DTensor as a :class:`~rallypoint.transports.wire.SentDTensor` (the
sender's local shard and layout), and :func:`rebuild_dtensors` places them where it is
safe, on the training thread, just before the state is loaded:

* the receiver has a DTensor at the same key (its ``state_dict()`` now): rebuilt on that
  DTensor's mesh, then redistributed to that DTensor's placements if the sender's differ
  (a mesh of another shape is refused: each rank received its own shard);
* the receiver has none there (optimizer state a fresh replica does not have yet, such
  as DiLoCo's outer ``momentum_buffer``): built on the sender's placements, on a mesh of
  the sender's shape taken from the receiver's own state (the first DTensor whose mesh
  has that shape), else ``fallback_mesh`` (the manager's ``heal_mesh``), else one over
  the default process group when its size matches; else an error naming the key.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from rallypoint.transports import _tensors as T
from rallypoint.transports.wire import SentDTensor


def has_sent_dtensors(tree: Any) -> bool:
    """Whether ``tree`` (dicts, lists, tuples) holds a :class:`SentDTensor`."""
    if isinstance(tree, SentDTensor):
        return True
    if isinstance(tree, dict):
        return any(has_sent_dtensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(has_sent_dtensors(v) for v in tree)
    return False


def _meshes(tree: Any) -> list[Any]:
    """The distinct device meshes of the DTensors in ``tree``, in order."""
    out: list[Any] = []
    stack = [tree]
    while stack:
        x = stack.pop(0)
        if T.is_dtensor(x):
            if not any(m is x.device_mesh for m in out):
                out.append(x.device_mesh)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def default_group_mesh(shape: list[int]) -> Any:
    """A mesh of ``shape`` over the default process group when it has exactly that many
    ranks (a replica group's own ranks), else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() != math.prod(shape):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, tuple(shape))


class MeshFinder:
    """Finds the mesh a DTensor the receiver lacks is built on (see the module docstring)."""

    def __init__(self, current: Any, fallback_mesh: Any = None,
                 default_mesh: Callable[[list[int]], Any] = default_group_mesh) -> None:
        self._own = _meshes(current)
        self._fallback = fallback_mesh
        self._default = default_mesh
        self._made: dict[tuple[int, ...], Any] = {}

    def __call__(self, key: str, shape: list[int]) -> Any:
        for m in self._own + ([self._fallback] if self._fallback is not None else []):
            if list(m.shape) == list(shape):
                return m
        k = tuple(shape)
        if k not in self._made:
            self._made[k] = self._default(list(shape))
        if self._made[k] is None:
            raise ValueError(
                f"{key}: the healed state holds a DTensor (sent from a mesh of shape {list(shape)}) that this "
                "replica's state lacks, and no mesh of that shape was found (none in its state, no heal_mesh, "
                "and the default process group's size differs): set manager.heal_mesh to the mesh it belongs on")
        return self._made[k]


def _place(sent: SentDTensor, target: Any, find_mesh: MeshFinder) -> Any:
    from torch.distributed.tensor import DTensor

    meta = sent.meta
    placements = T.placements_from_json(meta["placements"])
    if T.is_dtensor(target):
        mesh = target.device_mesh
        if list(mesh.shape) != list(meta["mesh_shape"]):
            raise ValueError(f"{sent.key}: sent from a mesh of shape {meta['mesh_shape']}, the receiver's is "
                             f"{list(mesh.shape)}; resharding across mesh shapes is not supported")
    else:
        mesh = find_mesh(sent.key, list(meta["mesh_shape"]))
    local = sent.local
    if local.device.type != mesh.device_type:
        local = local.to(mesh.device_type)
    out = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(meta["shape"]),
                             stride=tuple(meta["stride"]))
    if T.is_dtensor(target) and tuple(target.placements) != tuple(out.placements):
        out = out.redistribute(mesh, target.placements)  # the receiver's own layout
    if sent.param:
        return torch.nn.Parameter(out, requires_grad=True)
    return out


def rebuild_dtensors(received: Any, current: Any, fallback_mesh: Any = None,
                     default_mesh: Callable[[list[int]], Any] = default_group_mesh) -> Any:
    """``received`` with every :class:`SentDTensor` turned into a DTensor on the
    receiver's meshes (``current``: the receiver's state now, same tree layout). Raises
    ``ValueError`` naming the key when a DTensor has no mesh to go on."""
    finder = MeshFinder(current, fallback_mesh, default_mesh)

    def walk(r: Any, c: Any) -> Any:
        if isinstance(r, SentDTensor):
            return _place(r, c, finder)
        if isinstance(r, dict):
            out = type(r)() if type(r) is not dict else {}
            for k, v in r.items():
                out[k] = walk(v, c.get(k) if isinstance(c, dict) else None)
            if hasattr(r, "_metadata"):
                out._metadata = r._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(r, (list, tuple)):
            cs = list(c) if isinstance(c, (list, tuple)) and len(c) == len(r) else [None] * len(r)
            items = [walk(v, cv) for v, cv in zip(r, cs)]
            return items if isinstance(r, list) else type(r)(items)
        return r

    return walk(received, current)


__all__ = ["MeshFinder", "default_group_mesh", "has_sent_dtensors", "rebuild_dtensors"]
