"""One fragment of a (Streaming) DiLoCo model: its global parameters, its outer
optimizer and its in-flight pseudo-gradient exchange.

A fragment keeps a backup of its *global* parameters (the value all replicas agreed on
at the last committed sync). The model's own parameters hold the *local* value that
the inner optimizer moves. A sync is split in two halves so the exchange overlaps
inner steps (Streaming DiLoCo's delay ``tau``):

- :meth:`prepare`: pseudo-gradient ``global - local`` into private buffers, allreduce
  (mean over participating replicas) posted, not awaited;
- :meth:`perform`: await, put the model back on the global value, ask the manager
  whether the round commits; if yes: outer optimizer step with the averaged
  pseudo-gradient as ``.grad``, backup := new global, then mix in the local value
  (``lerp`` by ``alpha``); if no: the model stays on the old global value.

The pseudo-gradient buffers are private copies, so inner steps that run while the
exchange is in flight never race with it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn, optim

from rallypoint.integrations import _buckets
from rallypoint.integrations._protocols import DiLoCoManager, Waitable

log = logging.getLogger("rallypoint.integrations.local_sgd")

try:  # DTensor parameters (FSDP2/TP): the exchange works on the local shards.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without torch.distributed.tensor
    DTensor = None  # type: ignore[assignment,misc]


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (sharing its storage)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` shaped as ``p``: a DTensor with p's placement when p is one."""
    if DTensor is not None and isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


class Fragment:
    """Global state and sync machinery of one model fragment (see the module docstring)."""

    def __init__(
        self,
        manager: DiLoCoManager,
        module: nn.Module,
        index: int,
        outer_optimizer: optim.Optimizer,
        backup_device: torch.device | None,
        pin_memory: bool,
        use_bucketization: bool,
        bucket_cap_bytes: int,
        should_quantize: bool,
        alpha: float,
    ) -> None:
        self.index = index
        self.key = f"StreamingDiLoCoFragment_{index}"  # torchft's key: checkpoints interoperate
        self._manager = manager
        self._module = module
        self._outer = outer_optimizer
        self._use_buckets = use_bucketization
        self._cap = bucket_cap_bytes
        self._quantize = should_quantize
        self._alpha = alpha
        self.named = [(n, p) for n, p in module.named_parameters()]
        if not self.named:
            raise ValueError(f"DiLoCo fragment {index} has no parameters")
        device = backup_device if backup_device is not None else torch.device("cpu")
        # Pinned host memory makes the device<->host copies asynchronous; it only
        # exists where CUDA does (pinning fails on CPU-only builds).
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self.backup: dict[str, torch.Tensor] = {}
        for name, p in self.named:
            lp = local_view(p.detach())
            t = torch.empty(lp.shape, dtype=lp.dtype, device=device)
            self.backup[name] = t.pin_memory() if pin else t
        self._grads: list[torch.Tensor] = []  # averaged pseudo-gradients (local shapes)
        self._flats: list[tuple[_buckets.Bucket, torch.Tensor]] = []
        self._works: list[Waitable] = []

    # ------------------------------------------------------------------ state
    def save_global(self) -> None:
        """backup := the model's current value (the new global parameters)."""
        with torch.no_grad():
            for name, p in self.named:
                self.backup[name].copy_(local_view(p.detach()))

    def restore_global(self) -> None:
        """model := backup (drops local progress since the last committed sync)."""
        with torch.no_grad():
            for name, p in self.named:
                local_view(p.data).copy_(self.backup[name])

    def state_dict(self) -> dict[str, Any]:
        """What a healing replica needs: the global parameters and the outer optimizer
        state. Only mutated after ``should_commit`` (which withdraws the served copy)."""
        return {"original_parameters": dict(self.backup), "outer_optimizer": self._outer.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Adopt a peer's global state and outer optimizer state. The local parameters
        are the model's, healed with the user's state (the sender's local values), so
        the healed replica's pseudo-gradient this round repeats the sender's, as in
        torchft 0.2.0."""
        got = sd["original_parameters"]
        missing = set(self.backup) - set(got)
        if missing:
            raise KeyError(f"healed state of DiLoCo fragment {self.index} lacks {sorted(missing)}")
        with torch.no_grad():
            for name in self.backup:
                self.backup[name].copy_(got[name])
        self._outer.load_state_dict(sd["outer_optimizer"])

    def register(self) -> None:
        self._manager.register_state_dict_fn(self.key, self.load_state_dict, self.state_dict)

    # ------------------------------------------------------------------ sync
    def _allreduce(self, t: torch.Tensor) -> Waitable:
        if self._quantize:
            return self._manager.allreduce(t, should_quantize=True)
        return self._manager.allreduce(t)

    def prepare(self) -> None:
        """Compute ``global - local`` and post its allreduce (not awaited)."""
        if self._works:
            raise RuntimeError(f"DiLoCo fragment {self.index}: a sync is already in flight")
        with torch.no_grad():
            self._grads = [
                self.backup[name].to(local_view(p.detach()).device, non_blocking=True) - local_view(p.detach())
                for name, p in self.named
            ]
        if self._use_buckets:
            self._flats = []
            for b in _buckets.plan_buckets(self._grads, self._cap):
                flat = _buckets.pack(b, self._grads)
                self._flats.append((b, flat))
                self._works.append(self._allreduce(flat))
        else:
            self._works = [self._allreduce(g) for g in self._grads]

    def perform(self) -> bool:
        """Await the exchange and apply the outer step if the round commits; True if so."""
        if not self._works:
            raise RuntimeError(f"DiLoCo fragment {self.index}: perform() without prepare()")
        try:
            for w in self._works:
                w.wait()  # a failure is recorded by the manager; should_commit says no
            for b, flat in self._flats:
                _buckets.unpack(b, flat, self._grads)
            with torch.no_grad():
                local = [local_view(p.detach()).clone() for _, p in self.named] if self._alpha > 0 else []
            self.restore_global()
            committed = bool(self._manager.should_commit())
            if committed:
                with torch.no_grad():
                    self._outer_step()
                    self.save_global()
                    if self._alpha > 0:
                        for (_, p), loc in zip(self.named, local):
                            local_view(p.data).lerp_(loc, self._alpha)
            else:
                log.warning("DiLoCo fragment %d: sync did not commit; restored its global parameters",
                            self.index)
            return committed
        finally:
            self._works, self._flats, self._grads = [], [], []

    def _outer_step(self) -> None:
        """Outer optimizer step with the averaged pseudo-gradients as ``.grad``.

        Every other gradient the outer optimizer could see (the inner gradients still
        on the parameters, other fragments' when one outer optimizer is shared) is set
        aside for the step and put back after, so only this fragment moves and the
        user's gradients are untouched."""
        params: dict[int, torch.Tensor] = {}
        for group in self._outer.param_groups:
            for q in group["params"]:
                params[id(q)] = q
        for _, p in self.named:
            params[id(p)] = p
        stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = [(q, q.grad) for q in params.values()]
        try:
            for q in params.values():
                q.grad = None
            for (_, p), g in zip(self.named, self._grads):
                p.grad = _like_param(p, g)
            self._outer.step()
        finally:
            for q, saved in stashed:
                q.grad = saved
