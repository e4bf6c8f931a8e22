"""FSDP2 inside a replica group, fault-tolerant averaging across replica groups (HSDP).

Each replica group (one torchrun job of ``W`` ranks) shards its model with torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) over its own ranks, on a 1-D mesh. Group rank
``g`` of every replica group holds the same shard (all groups have the same ``W``; the
manager refuses mixed sizes), so the gradient shards can be averaged across groups
directly: FSDP's reduce-scatter averages inside the group, then an all-reduce hook on
every FSDP module sends the shard through ``manager.allreduce`` (a mean over the replica
groups taking part in this step). So each gradient is the mean over every rank of every
participating group, as with :class:`~rallypoint.integrations.DistributedDataParallel`
(``tests/test_fsdp.py`` checks the result against a reference that averages the 2 x 2
ranks' gradients): nothing inside the group is left to the user. A peer's death mid-backward therefore fails the step
(``should_commit()`` is False), never ``backward()``.

One call sets it up::

    fsdp = fully_shard_replicated(
        model, manager, lambda params: torch.optim.AdamW(params, lr=1e-3),
        shard_submodules=(TransformerBlock,),
    )
    model, optimizer = fsdp.module, fsdp.optimizer
    for batch in batches:
        optimizer.zero_grad(); manager.start_quorum()
        model(batch).loss.backward()          # the hook averages across replica groups
        if manager.should_commit():           # a pending heal is served/applied here
            optimizer.step()

(``rallypoint.integrations.Optimizer(manager, optimizer)`` wraps the last part as with DDP.)

Healing is FSDP-safe. FSDP2's parameters are DTensors whose storage FSDP swaps between
sharded and unsharded around forward and backward; reading the state dict from another
thread while forward runs crashes or reads a half-resharded module (torchtitan#4754, an
async quorum that read it mid-forward). So the helper sets (as the Manager decides by itself for
state holding DTensors when ``heal_on_training_thread`` is left unset)
``manager.heal_on_training_thread = True``: the quorum thread only forms the quorum, and
the sender's state (model and optimizer state, DTensors holding the local shard) is read
and copied inside ``should_commit()`` on the training thread, after backward and before
the optimizer step, when every parameter is sharded. The receiver fetches it there too,
into its current state (the transport rebuilds each DTensor on the receiver's own mesh;
``manager.heal_mesh`` covers optimizer state a freshly restarted replica does not have
yet), and loads it in place into the sharded parameters. As a second guard the state
callbacks refuse to run on any thread but the one that called the helper.

Shard counts: only the same one. Group rank ``g`` receives the shard of group rank ``g``
of the source replica, and every group has the same size, so no resharding is needed or
done; the wire format refuses a DTensor sent from a mesh of another shape. torch's
DTensor redistribution could in principle turn a ``Shard(0)`` tensor on a mesh of ``W``
ranks into one on ``W'`` ranks, but only as a collective over one process group holding
both layouts' ranks; the two replica groups share no such group (the cross-replica group
pairs rank ``g`` with rank ``g`` only), and rebuilding it point-to-point would mean every
receiving rank fetching byte ranges from several senders. Replica groups of different
sizes are refused by the manager before that could matter.

Hook or managed DeviceMesh? torchft also offers a 2-D DeviceMesh whose replicate
dimension is the manager's process group, so FSDP's native HSDP does the cross-group
all-reduce. It is not provided here, on purpose:

* FSDP's native HSDP calls ``dist.all_reduce(..., op=AVG)`` on the replicate group
  itself. A failure then raises inside ``backward()`` (the manager's "never raise, fail
  the step" contract is lost), and AVG divides by the group's size, which counts healing
  replicas that contribute zeros: the mean is wrong for the steps a replica heals in.
* The mesh caches its dimension sizes and coordinates when it is built, but the
  replicate group changes size and rank at every quorum; a mesh (and the DTensors and
  FSDP states built on it) would have to be rebuilt per quorum, or DeviceMesh internals
  patched, which differ between torch releases.

The hook path gives the same numbers (the mean over all ranks of all live groups) with
the manager's failure semantics. Prefer a managed mesh (once one exists) when the model
needs the replicate dimension *as a mesh dimension*: DTensor ops that must see the global
layout (e.g. a tensor-parallel + HSDP 3-D mesh, or distributed checkpointing that writes
one global checkpoint), or to let FSDP overlap the cross-group all-reduce on its own CUDA
stream. Note that the hook blocks the backward thread for each FSDP unit's all-reduce
(communication does not overlap the rest of backward on CPU).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from rallypoint.integrations._protocols import AVG, FSDPManager, GradientManager

log = logging.getLogger("rallypoint.integrations.fsdp")

#: What selects the submodules to shard on their own (besides the root): module
#: instances, module classes, or a predicate ``(qualified_name, module) -> bool``.
ShardSpec = Iterable[nn.Module] | tuple[type, ...] | type | Callable[[str, nn.Module], bool] | None


class GradientAverager:
    """The all-reduce hook installed on every FSDP module: averages a reduce-scatter
    output (this rank's flat gradient shard of one FSDP unit) over the replica groups.

    It must never raise into backward (FSDP's post-backward state would be left
    half-finished); a failure is handed to ``manager.report_error`` so the step does
    not commit. ``calls`` and ``failures`` count shards handled (tests and logs read them).
    """

    def __init__(self, manager: GradientManager) -> None:
        self.manager = manager
        self.calls = 0
        self.failures = 0

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.calls += 1
        try:
            self.manager.allreduce(reduce_output, reduce_op=AVG).wait()
        except Exception as e:  # noqa: BLE001 - Manager.allreduce records its own; this is anything else
            self.failures += 1
            log.warning("cross-replica gradient all-reduce failed: %s", e)
            try:
                self.manager.report_error(e)
            except Exception as re:  # noqa: BLE001
                log.warning("could not report the failure (%s): %s", e, re)


class FSDPState:
    """The model (and optimizer) state a healing replica receives, as the manager's
    ``state_dict``/``load_state_dict`` callbacks.

    ``save`` returns FSDP2's own state dicts: DTensors holding this rank's local shard
    (the manager copies them before serving). ``load`` copies received values into the
    sharded parameters in place (``nn.Module.load_state_dict`` under ``no_grad``), so
    FSDP keeps its registered parameters, and loads the optimizer state; a fresh
    optimizer with no state yet receives DTensors built on ``manager.heal_mesh``.

    Both refuse to run on another thread than ``owner_thread`` (the training thread):
    reading or writing FSDP state concurrently with forward/backward is unsafe.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 owner_thread: threading.Thread | None = None) -> None:
        self.module = module
        self.optimizer = optimizer
        self.owner_thread = owner_thread or threading.current_thread()
        self.saves: list[str] = []  # threads save() was called on, refused ones too (tests, logs)
        self.loads = 0

    def _check_thread(self, what: str) -> None:
        here = threading.current_thread()
        if here is not self.owner_thread:
            raise RuntimeError(
                f"FSDP state {what} on thread {here.name!r}, not the training thread "
                f"{self.owner_thread.name!r}: FSDP reshards parameters during forward/backward, so its "
                "state may only be read or loaded at a safe point on the training thread "
                "(set manager.heal_on_training_thread = True)"
            )

    def save(self) -> dict[str, Any]:
        self.saves.append(threading.current_thread().name)  # before the check: a refused call shows too
        self._check_thread("read")
        state: dict[str, Any] = {"model": self.module.state_dict()}
        if self.optimizer is not None:
            state["optim"] = self.optimizer.state_dict()
        return state

    def load(self, state: dict[str, Any]) -> None:
        self._check_thread("loaded")
        params_before = [id(p) for p in self.module.parameters()]
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            if "optim" not in state:
                raise KeyError("the received FSDP state has no optimizer state, but this replica registered one")
            self.optimizer.load_state_dict(state["optim"])
        if [id(p) for p in self.module.parameters()] != params_before:
            raise RuntimeError("loading the healed state replaced FSDP's sharded parameters")
        self.loads += 1
        log.info("loaded the healed FSDP state (%d tensors)", len(state["model"]))


class ReplicatedFSDP(NamedTuple):
    """What :func:`fully_shard_replicated` set up."""

    module: nn.Module  #: the root, now an ``FSDPModule``
    optimizer: torch.optim.Optimizer | None  #: built by ``optimizer_fn`` on the sharded parameters
    mesh: Any  #: the 1-D DeviceMesh of this replica group
    averager: GradientAverager  #: the hook installed on every FSDP module
    state: FSDPState | None  #: the registered heal callbacks (None without an optimizer_fn)


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _default_mesh(module: nn.Module) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fully_shard_replicated needs the replica group's own process group: call "
            "torch.distributed.init_process_group over this group's ranks first (env:// joins the store "
            "`rallypoint run` and torchrun host at MASTER_ADDR/MASTER_PORT), or pass mesh="
        )
    devices = {p.device.type for p in module.parameters()} or {"cpu"}
    device_type = "cuda" if "cuda" in devices else next(iter(devices))
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _select(module: nn.Module, spec: ShardSpec) -> list[nn.Module]:
    """Submodules (not the root) chosen by ``spec``, descendants before ancestors (the
    order ``fully_shard`` must be applied in)."""
    if spec is None:
        return []
    named = [(n, m) for n, m in module.named_modules() if m is not module]
    if isinstance(spec, type) or (isinstance(spec, tuple) and all(isinstance(t, type) for t in spec)):
        chosen = [m for _, m in named if isinstance(m, spec)]  # type: ignore[arg-type]
    elif callable(spec) and not isinstance(spec, nn.Module):
        chosen = [m for n, m in named if spec(n, m)]  # type: ignore[operator]
    else:
        wanted = {id(m) for m in spec}  # type: ignore[union-attr]
        chosen = [m for _, m in named if id(m) in wanted]
        if len(chosen) != len(wanted):
            raise ValueError("shard_submodules holds modules that are not submodules of the module")
    return list(reversed(chosen))


def _validate(manager: FSDPManager, mesh: Any) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"the mesh has {mesh.ndim} dimensions; pass the replica group's own 1-D mesh: the "
            "replicate dimension is the manager (see the module docstring for why it is not a mesh dimension)"
        )
    if not hasattr(manager, "heal_on_training_thread"):
        raise TypeError("this manager cannot heal on the training thread (no heal_on_training_thread); "
                        "FSDP needs it: use rallypoint.Manager")
    group_size = getattr(manager, "group_world_size", None)
    if group_size is not None and int(group_size) != mesh.size():
        raise ValueError(
            f"the manager was built for a replica group of {group_size} ranks, the FSDP mesh has {mesh.size()}: "
            "group rank g averages its shard with group rank g of every other group, so the manager's "
            "world_size must be the number of ranks FSDP shards over"
        )
    group_rank = getattr(manager, "group_rank", None)
    local = mesh.get_local_rank()
    if group_rank is not None and int(group_rank) != local:
        raise ValueError(
            f"the manager's group rank is {group_rank} but this rank holds shard {local} of the mesh: the "
            "shard of group rank g is averaged with group rank g of the other groups, so they must match"
        )


def register_state(manager: FSDPManager, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   key: str = "fsdp", mesh: Any = None) -> FSDPState:
    """Register the FSDP-safe heal callbacks of ``module`` (and ``optimizer``, which must
    have been built on the *sharded* parameters) with ``manager`` under ``key``, and
    switch the manager to healing on the training thread. Call it from the training
    thread. ``mesh``: for optimizer state a fresh replica lacks (default: the mesh of
    the module's first parameter)."""
    if optimizer is not None:
        sharded = {id(p) for p in module.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in sharded:
                    raise ValueError(
                        "the optimizer holds a parameter that is not one of the module's sharded parameters: "
                        "fully_shard replaces the parameters, so build the optimizer after sharding "
                        "(or pass optimizer_fn to fully_shard_replicated)"
                    )
    if mesh is None:
        first = next(module.parameters(), None)
        mesh = getattr(first, "device_mesh", None)
    state = FSDPState(module, optimizer)
    manager.register_state_dict_fn(key, state.load, state.save)
    manager.heal_on_training_thread = True
    if mesh is not None and getattr(manager, "heal_mesh", None) is None:
        manager.heal_mesh = mesh
    return state


def fully_shard_replicated(
    module: nn.Module,
    manager: FSDPManager,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    *,
    mesh: Any = None,
    shard_submodules: ShardSpec = None,
    state_key: str = "fsdp",
    **fully_shard_kwargs: Any,
) -> ReplicatedFSDP:
    """Shard ``module`` with FSDP2 over this replica group and average its gradients
    across replica groups through ``manager``.

    - ``mesh``: the replica group's 1-D mesh (default: ``init_device_mesh`` over the
      default process group, which must span exactly this group's ranks). Its size must
      be the manager's ``world_size`` and this rank's mesh coordinate its ``rank``.
    - ``shard_submodules``: submodules sharded as their own FSDP units before the root
      (classes, instances, or a ``(name, module) -> bool`` predicate); default: only the
      root. A module that is already an ``FSDPModule`` is not sharded again, only hooked.
    - ``optimizer_fn``: builds the optimizer from the sharded parameters; when given, the
      model and optimizer state are registered as the heal state under ``state_key``
      (otherwise call :func:`register_state` yourself after building the optimizer).
    - ``fully_shard_kwargs`` go to every ``fully_shard`` call (``reshard_after_forward``,
      ``mp_policy``, ...; not ``mesh``).

    Sets ``manager.heal_on_training_thread = True`` and ``manager.heal_mesh`` (see the
    module docstring for why). Returns a :class:`ReplicatedFSDP`.
    """
    from torch.distributed.fsdp import fully_shard

    if "mesh" in fully_shard_kwargs:
        raise ValueError("pass mesh= as the helper's own keyword")
    already = _is_fsdp(module)
    if mesh is None:
        if already:
            mesh = getattr(next(module.parameters()), "device_mesh", None)
        mesh = mesh if mesh is not None else _default_mesh(module)
    _validate(manager, mesh)
    if not already:
        for sub in _select(module, shard_submodules):
            if not _is_fsdp(sub):
                fully_shard(sub, mesh=mesh, **fully_shard_kwargs)
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    averager = GradientAverager(manager)
    hooked = 0
    for sub in module.modules():
        if _is_fsdp(sub):
            sub.set_all_reduce_hook(averager)  # type: ignore[operator]
            hooked += 1
    manager.heal_on_training_thread = True
    manager.heal_mesh = mesh
    optimizer = optimizer_fn(module.parameters()) if optimizer_fn is not None else None
    state = register_state(manager, module, optimizer, key=state_key, mesh=mesh) if optimizer is not None else None
    log.info("FSDP over a mesh of %d rank(s), %d FSDP unit(s) averaged across replica groups", mesh.size(), hooked)
    return ReplicatedFSDP(module, optimizer, mesh, averager, state)


__all__ = ["FSDPState", "GradientAverager", "ReplicatedFSDP", "fully_shard_replicated", "register_state"]
