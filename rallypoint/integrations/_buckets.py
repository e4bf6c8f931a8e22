"""Flat buckets for averaging many small tensors with few collectives.

Why: one allreduce per parameter costs one round trip each; packing the
pseudo-gradients of a fragment into a few flat buffers of at most ``cap_bytes``
amortises that. Each bucket is unpacked from ITS OWN flat buffer after its work
completed, so every bucket is averaged (torchft 0.2.0 unpacks from a loop variable
captured by a late-running callback, so with several buckets only the last one was
written back; this module has no callbacks and no shared loop state).

Tensors are grouped in their given order; a bucket holds only one dtype and one
device, and a tensor larger than the cap gets a bucket of its own (tensors are never
split). The plan depends only on the shapes and dtypes, so every replica computes the
same plan and the collectives match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """Which tensors (by index into the packed list) live where in one flat buffer."""

    dtype: torch.dtype
    device: torch.device
    indices: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def plan_buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[Bucket]:
    """Group ``tensors`` (in order) into buckets of at most ``cap_bytes`` each."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[Bucket] = []
    open_by_kind: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    for i, t in enumerate(tensors):
        kind = (t.dtype, t.device)
        b = open_by_kind.get(kind)
        size = t.numel() * t.element_size()
        if b is None or (b.numel * t.element_size() + size > cap_bytes and b.numel > 0):
            b = Bucket(dtype=t.dtype, device=t.device)
            buckets.append(b)
            open_by_kind[kind] = b
        b.indices.append(i)
        b.offsets.append(b.numel)
        b.numel += t.numel()
    return buckets


def pack(bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new flat buffer holding the bucket's tensors back to back."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
    for i, off in zip(bucket.indices, bucket.offsets):
        t = tensors[i]
        flat[off : off + t.numel()].copy_(t.reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the (reduced) flat buffer back into the bucket's tensors, in place."""
    for i, off in zip(bucket.indices, bucket.offsets):
        t = tensors[i]
        t.copy_(flat[off : off + t.numel()].view_as(t))
