"""``DistributedSampler``: each replica group (and each rank in it) reads its own share
of the dataset, and its position in the dataset heals with the rest of the state.

Why a global rank: with fault-tolerant data parallelism there are two levels of
parallelism, replica groups (which come and go) and ranks inside a group (FSDP/TP). A
plain ``torch.utils.data.DistributedSampler`` over the group's ranks would make every
replica group read the same samples; this one shards over the global rank
``replica_rank * num_replicas + group_rank`` of ``num_replica_groups * num_replicas``, so
no two (group, rank) pairs read the same sample in an epoch. The shards are torch's own
(same permutation, padding and ``drop_last`` rules), so a job switching from torch's
sampler keeps its data order.

Why a position: a replica that dies and heals gets its peers' model and optimizer; if it
also restarted its sampler at sample 0 of epoch 0, it would train on data its group
already consumed, and its ``epoch`` (so its shuffle) would differ from its peers'. The
sampler's ``state_dict()`` is ``{"epoch", "consumed", "num_samples"}``: the same numbers
on every replica group in lockstep (the rank is not part of it, so a group loads a
peer's position into its own shard). Register it with the manager::

    sampler = DistributedSampler(ds, replica_rank=r, num_replica_groups=n)
    loader = DataLoader(ds, batch_size=b, sampler=sampler)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)

and fetch each step's batch *before* ``optimizer.zero_grad()`` / ``manager.start_quorum()``:
a replica that serves a heal reads its state on the manager's quorum thread, which runs
concurrently with the training thread from ``start_quorum()`` to ``should_commit()``. A
batch fetched in that window moves the position while it is being read, and the healed
replica may end up one batch off. Fetched before, the served position is "after this
step's batch" on every replica, which is what the healed replica needs: it applies the
state in ``should_commit()`` and reads the next step's batch from there.

Iteration follows the live position: ``load_state_dict()`` takes effect at the next
index even for an iterator (a ``DataLoader`` pass) already under way, so a healed
replica needs no new ``DataLoader``. An exhausted epoch moves the sampler to the next
epoch by itself (torch's sampler repeats the same epoch until ``set_epoch``), so a
position is never ambiguous between "end of epoch e" and "start of epoch e + 1";
``set_epoch(e)`` with the current epoch keeps the position, so the usual
``for e in range(start, n): sampler.set_epoch(e)`` loop resumes where it was.

Positions count indices handed to the ``DataLoader``: exact with ``num_workers=0``; with
worker processes the batches they prefetch count as consumed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler


class DistributedSampler(_TorchDistributedSampler):
    """torch's ``DistributedSampler`` over the global rank
    ``replica_rank * num_replicas + group_rank`` of ``num_replica_groups * num_replicas``,
    with a position that can be saved, restored and healed.

    As in torch, ``self.num_replicas`` and ``self.rank`` are the *global* world size and
    rank after construction; the per-level values are ``replica_rank``,
    ``num_replica_groups``, ``group_rank`` and ``group_world_size``.
    """

    def __init__(
        self,
        dataset: Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int = 0,
        num_replicas: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replica_groups < 1 or not 0 <= replica_rank < num_replica_groups:
            raise ValueError(f"replica_rank {replica_rank} is not in [0, num_replica_groups={num_replica_groups})")
        if num_replicas < 1 or not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank {group_rank} is not in [0, num_replicas={num_replicas})")
        # Before super().__init__, which assigns self.epoch (our property).
        self._lock = threading.Lock()
        self._epoch = 0
        self._consumed = 0
        self._cache: tuple[int, list[int]] | None = None
        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.group_world_size = num_replicas
        super().__init__(
            dataset,
            num_replicas=num_replica_groups * num_replicas,
            rank=replica_rank * num_replicas + group_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    # ------------------------------------------------------------------ position
    @property  # type: ignore[override]
    def epoch(self) -> int:
        """The current epoch (setting it is :meth:`set_epoch`)."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def consumed(self) -> int:
        """Indices of the current epoch handed out so far."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` at its first sample; a no-op when already in ``epoch``, so a
        resumed loop that calls it keeps the restored position."""
        with self._lock:
            if int(epoch) != self._epoch:
                self._epoch = int(epoch)
                self._consumed = 0

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and samples of it consumed (plus ``num_samples``, so a
        position from a differently sharded job is refused rather than misread)."""
        with self._lock:
            return {"epoch": self._epoch, "consumed": self._consumed, "num_samples": self.num_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s position, including in an iteration under way."""
        epoch, consumed = int(state_dict["epoch"]), int(state_dict["consumed"])
        theirs = state_dict.get("num_samples")
        if theirs is not None and int(theirs) != self.num_samples:
            raise ValueError(
                f"sampler position from a shard of {theirs} samples per epoch, this one has {self.num_samples}: "
                "the dataset size, num_replica_groups, num_replicas or drop_last differ"
            )
        if not 0 <= consumed <= self.num_samples or epoch < 0:
            raise ValueError(f"bad sampler position: epoch {epoch}, consumed {consumed} of {self.num_samples}")
        with self._lock:
            self._epoch, self._consumed = epoch, consumed

    # ------------------------------------------------------------------ iteration
    def _indices(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``: torch's own sharding, computed once per epoch."""
        cached = self._cache
        if cached is not None and cached[0] == epoch:
            return cached[1]
        # torch's __iter__ on a view with this epoch: self is not touched, so a position
        # read from another thread (a heal being served) never sees a borrowed epoch.
        view = SimpleNamespace(
            dataset=self.dataset, shuffle=self.shuffle, seed=self.seed, epoch=epoch, drop_last=self.drop_last,
            total_size=self.total_size, rank=self.rank, num_replicas=self.num_replicas, num_samples=self.num_samples,
        )
        indices: list[int] = list(_TorchDistributedSampler.__iter__(view))  # type: ignore[arg-type]
        self._cache = (epoch, indices)
        return indices

    def _next(self) -> int | None:
        """The next index and advance, or None at the end of the epoch (which moves the
        sampler to the next epoch)."""
        with self._lock:
            epoch, pos = self._epoch, self._consumed
            if pos >= self.num_samples:
                self._epoch, self._consumed = epoch + 1, 0
                return None
            self._consumed = pos + 1
        return self._indices(epoch)[pos]

    def __iter__(self) -> Iterator[int]:
        """One pass to the end of the current epoch, from the current position, reading
        the position at every step (see the module docstring)."""
        with self._lock:
            if self._consumed >= self.num_samples:  # an exhausted epoch: start the next one
                self._epoch, self._consumed = self._epoch + 1, 0
        while True:
            idx = self._next()
            if idx is None:
                return
            yield idx

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]  # locks do not pickle (DataLoader workers may pickle a sampler)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


__all__ = ["DistributedSampler"]
