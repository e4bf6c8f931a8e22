"""Shared-memory arena between a process group and its child process.

Why memfd: the segment has no name in /dev/shm, so nothing is left behind when
either side is SIGKILLed -- the memory is freed with the last mapping. The parent
creates it, hands the fd to the child over the control socket (SCM_RIGHTS), and both
map it with ``torch.from_file`` (MAP_SHARED); the fds are closed right after mapping.

Allocation is a bump pointer reset whenever no op is outstanding: ops of one batch
are laid out back to back (8-byte aligned), which lets the child fuse consecutive
small allreduces of one dtype into a single collective over the covering range.
"""

from __future__ import annotations

import os

import torch

ALIGN = 8


def _map(fd: int, nbytes: int) -> torch.Tensor:
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


class Arena:
    """The parent's side: owns the segment, hands out byte ranges."""

    def __init__(self, nbytes: int, generation: int = 0) -> None:
        self.nbytes = nbytes
        self.generation = generation
        self.fd = os.memfd_create(f"rallypoint-baby-{generation}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.buf = _map(self.fd, nbytes)
        self.top = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh range of ``nbytes`` (None when full)."""
        start = (self.top + ALIGN - 1) // ALIGN * ALIGN
        if start + nbytes > self.nbytes:
            return None
        self.top = start + max(nbytes, 0)
        return start

    def reset(self) -> None:
        self.top = 0

    def close_fd(self) -> None:
        """Close our fd once the child holds its own (the mapping stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``buf[offset:]`` (no copy)."""
    itemsize = dtype.itemsize
    n = 1
    for d in shape:
        n *= d
    return buf[offset : offset + n * itemsize].view(dtype).view(shape)


def map_received(fd: int, nbytes: int) -> torch.Tensor:
    """The child's side: map a received fd and close it."""
    try:
        return _map(fd, nbytes)
    finally:
        os.close(fd)
