"""The reconfigurable process group contract.

:class:`ProcessGroup` subclasses torch's C++ ``ProcessGroup`` binding, so DDP, FSDP's
hooks, ``torch.distributed`` calls and (after :meth:`ProcessGroup.register`) a
DeviceMesh accept it. Unlike a torch group its membership changes at runtime:
``configure()`` tears the old communicator down and builds a new one for the next
quorum. ``rank()``/``size()`` always report the configured values (the C++ base is
built as a 1-rank group because the real size is only known at configure time).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup as _TorchProcessGroup
from torch.distributed import Store
from torch.distributed.distributed_c10d import Work

from .errors import NotConfiguredError, ProcessGroupAborted, ProcessGroupError
from .reconfigure import HandleStore, ReconfigureOptions, make_handle, new_handle_id, rendezvous_of
from .work import CompletedWork, OpInfo

logger = logging.getLogger("rallypoint.process_groups.base")

DEFAULT_TIMEOUT = timedelta(seconds=60)
_register_ids = itertools.count()


@dataclass(frozen=True)
class GroupConfig:
    """One configure call's arguments (the group's membership for one quorum)."""

    store_addr: str
    replica_id: str
    rank: int
    world_size: int
    quorum_id: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    global_ranks: tuple[int, ...] | None = None
    #: The store prefix is used as given (a ``reconfigure()``: all ranks meet under
    #: ``torchft/<uuid>`` exactly as torchft-nightly's groups do, so theirs and ours can
    #: share a communicator); else each configure draws a fresh sub-prefix (``_store.py``).
    exact_prefix: bool = False

    def group_name(self) -> str:
        """A name torch can show in logs / flight records; unique per quorum and group rank."""
        return f"rallypoint_q{self.quorum_id}_g{self.group_rank}"


class ProcessGroup(_TorchProcessGroup):
    """Base of every rallypoint process group.

    Subclasses implement ``_configure(cfg)`` (build the communicator; may block until
    all peers arrive, bounded by the timeout), ``_teardown()`` (drop it without
    blocking on peers) and the collectives they support. Errors seen by any Work are
    recorded here: ``errored()`` returns the first one until the next configure.
    """

    backend_name = "rallypoint"

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        # The C++ base stores a fixed rank/size; we report the configured ones instead.
        super().__init__(0, 1)  # type: ignore[call-arg]  # torch's stubs list only the store overload
        self._timeout = timeout
        self._config: GroupConfig | None = None
        self._error: Exception | None = None
        self._error_lock = threading.Lock()
        self._configures = 0
        self._registered_name: str | None = None
        self._group_name: str | None = None
        # torchft 0.3's reconfigure API (see reconfigure.py): who we are, our handle's store.
        self._reconfigure_id = new_handle_id()
        self._handle_store: HandleStore | None = None
        self._handle_made: tuple[tuple[str, str, int | None], str] | None = None
        self._rank_info: tuple[str, int | None, int | None, int | None] = ("0", None, None, None)

    # ------------------------------------------------------------------ contract

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Replace the communicator with one for ``world_size`` ranks of ``quorum_id``.

        Blocks until every peer has configured too (bounded by the timeout) and raises
        a ProcessGroupError if they do not arrive. ``store_addr`` is
        ``host:port/prefix`` of the replica group's TCPStore (``[v6]:port/prefix``).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"configure: rank {rank} is not in a group of {world_size}")
        self._apply_config(GroupConfig(
            store_addr=store_addr,
            replica_id=replica_id,
            rank=rank,
            world_size=world_size,
            quorum_id=quorum_id,
            group_rank=group_rank,
            group_world_size=group_world_size,
            global_ranks=tuple(global_ranks) if global_ranks else None,
        ))

    def _apply_config(self, cfg: GroupConfig) -> None:
        """Tear down the old communicator and build the one ``cfg`` describes (what
        ``configure()`` and ``reconfigure()`` share; wrappers delegate it)."""
        replica_id, rank, world_size, quorum_id = cfg.replica_id, cfg.rank, cfg.world_size, cfg.quorum_id
        group_rank = cfg.group_rank
        self._teardown()
        with self._error_lock:
            self._error = None
        self._config = cfg
        self._configures += 1
        logger.info(
            "%s configure #%d: replica %s rank %d/%d quorum %s group_rank %s",
            type(self).__name__, self._configures, replica_id, rank, world_size, quorum_id, group_rank,
        )
        try:
            self._configure(cfg)
        except Exception as e:
            err = ProcessGroupError(
                f"configure of {type(self).__name__} (rank {rank} of {world_size}, quorum {quorum_id}, "
                f"replica {replica_id}) failed: {e}. Check that every peer configured with the same "
                "quorum and that the store is reachable.",
                op="configure", world_size=world_size, quorum_id=quorum_id,
            )
            self._record_error(err)
            self._teardown()
            raise err from e

    # ------------------------------------------------------------------ torchft 0.3 / torch 2.14 API

    @property
    def supports_reconfigure(self) -> bool:  # type: ignore[override]
        """True: this group has the reconfigure API (torchft 0.3, torch >= 2.14)."""
        return True

    def set_rank_info(self, replica_id: str, group_rank: int, group_world_size: int,
                      global_rank: int | None = None) -> None:
        """This rank's identity, used by the next ``reconfigure()`` (``global_rank``
        travels in the handle, as torchft's)."""
        self._rank_info = (str(replica_id), int(group_rank), int(group_world_size),
                           None if global_rank is None else int(global_rank))

    def _handle_id(self) -> str:
        return self._reconfigure_id

    def set_handle_host(self, host: str) -> None:
        """The address this group's handle store advertises when ``RALLYPOINT_PG_HOST`` is
        unset (the Manager passes its ``hostname``); used when the store opens."""
        if self._handle_store is None:
            self._handle_store = HandleStore()
        self._handle_store.hostname = host

    def get_reconfigure_handle(self) -> str:  # type: ignore[override]
        """This group's handle (torchft-nightly's JSON shape): its id, the address of the
        store it hosts for the reconfigures it leads, its global rank. The store opens on
        the first call (``RALLYPOINT_PG_HOST``, else :meth:`set_handle_host`, else the
        host's name chooses its network; see reconfigure.py)."""
        if self._handle_store is None:
            self._handle_store = HandleStore()
        key = (self._handle_id(), self._handle_store.address(), self._rank_info[3])
        if self._handle_made is None or self._handle_made[0] != key:  # asked every step: made once
            self._handle_made = (key, make_handle(*key))
        return self._handle_made[1]

    def reconfigure(self, opts: ReconfigureOptions) -> Work:  # type: ignore[override]
        """Build the communicator for ``opts.handles`` (rank = position of our own
        handle; all meet on the first handle's store under ``torchft/<opts.uuid>``).
        Blocks until it is built (bounded by the group's timeout, as torchft's groups)
        and returns a completed Work; raises a ProcessGroupError like ``configure()``,
        and a ValueError naming the handle for handles that are not torchft handles."""
        rdv = rendezvous_of(opts.uuid, opts.handles, self._handle_id())
        replica_id, group_rank, group_world_size, _ = self._rank_info
        self._apply_config(GroupConfig(
            store_addr=rdv.store_addr, replica_id=replica_id, rank=rdv.rank, world_size=rdv.world_size,
            quorum_id=rdv.uuid, group_rank=group_rank, group_world_size=group_world_size,
            global_ranks=rdv.global_ranks, exact_prefix=True,
        ))
        return CompletedWork(None)

    def abort(self) -> None:
        """Stop the group now: pending and future ops fail until the next configure."""
        self._record_abort()
        self._teardown()

    def _record_abort(self) -> None:
        """Record that the group was aborted (the error every later op fails with)."""
        cfg = self._config
        self._record_error(
            ProcessGroupAborted(
                f"{type(self).__name__} was aborted (quorum {cfg.quorum_id if cfg else None}); reconfigure it",
                op="abort", world_size=cfg.world_size if cfg else None, quorum_id=cfg.quorum_id if cfg else None,
            )
        )

    def shutdown(self) -> None:
        """Release every resource (threads, children, sockets); the group is unusable after."""
        self._teardown()
        self._config = None
        if self._handle_store is not None:
            self._handle_store.close()
            self._handle_store = None

    def errored(self) -> Exception | None:
        """The first error since the last configure (None while healthy)."""
        return self._error

    def set_timeout(self, timeout: timedelta) -> None:
        """The default bound of every wait (and of the next configure)."""
        self._timeout = timeout

    def timeout(self) -> timedelta:
        return self._timeout

    def rank(self) -> int:
        """This process's configured rank (0 before the first configure)."""
        return self._config.rank if self._config is not None else 0

    def size(self) -> int:
        """The configured world size (1 before the first configure)."""
        return self._config.world_size if self._config is not None else 1

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self.backend_name

    @property
    def config(self) -> GroupConfig | None:
        return self._config

    # ------------------------------------------------------------------ subclass hooks

    def _configure(self, cfg: GroupConfig) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be configured")

    def _teardown(self) -> None:
        """Drop the current communicator (never waits for peers)."""

    # ------------------------------------------------------------------ helpers

    def _record_error(self, err: Exception) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = err
                logger.warning("%s errored: %s", type(self).__name__, err)

    def _op_info(self, op: str, timeout: timedelta | None = None) -> OpInfo:
        cfg = self._config
        return OpInfo(
            op=op,
            world_size=cfg.world_size if cfg else 0,
            quorum_id=cfg.quorum_id if cfg else None,
            replica_id=cfg.replica_id if cfg else None,
            timeout=timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout,
        )

    def _require_config(self, op: str) -> GroupConfig:
        cfg = self._config
        if cfg is None:
            raise NotConfiguredError(
                f"{op} on {type(self).__name__} before configure() (or after shutdown())", op=op
            )
        return cfg

    def _unsupported(self, op: str) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} does not support {op}")

    # ------------------------------------------------------------------ collectives (defaults)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("allreduce_coalesced")

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("allgather")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # type: ignore[override]
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("allgather_into_tensor_coalesced")

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Work:
        """Broadcast one tensor from group rank ``root`` (torchft's convenience name): the
        same as ``broadcast([tensor], BroadcastOptions(rootRank=root))``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # type: ignore[override]
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("reduce_scatter_tensor_coalesced")

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("alltoall_base")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        self._unsupported("send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        self._unsupported("recv")

    def barrier(self, opts: Any = None) -> Work:  # type: ignore[override]
        self._unsupported("barrier")

    # torch >= 2.10 names (``dist.all_gather_single`` & co. call these): the C++
    # defaults would look for a registered device backend, which a reconfigurable
    # group does not have, so route them to the implementations above.

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # type: ignore[override]
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # type: ignore[override]
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:  # type: ignore[override]
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    # ------------------------------------------------------------------ torch registration

    def register(self, name: str) -> "ProcessGroup":
        """Register this group as a torch backend and a ``dist`` group named ``name``.

        Needed by DeviceMesh and functional collectives, which look groups up by name.
        Requires an initialized default group (``dist.init_process_group``). The
        registered dist group is this very object (torch keeps Python subclasses of
        ProcessGroup as they are); as for torchft, its dist-level membership is the
        calling rank alone, since a resizable world does not fit a static mesh.
        """
        backend = f"{self.backend_name}-{name}-{next(_register_ids)}"

        def create(store: Store, rank: int, world_size: int, timeout: timedelta) -> "ProcessGroup":
            return self

        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        dist.Backend.register_backend(backend, create, devices=devices)
        pg = dist.new_group(ranks=[dist.get_rank()], backend=backend, group_desc=name, timeout=self._timeout)
        if pg is not self:
            raise RuntimeError(f"torch wrapped the registered group {name!r}; expected the group itself")
        self._registered_name = backend
        return self

    # torch's C++ group reads its name from a registered device backend, which a
    # reconfigurable group does not have; keep the name here instead.
    @property
    def group_name(self) -> str:  # type: ignore[override]
        if self._group_name is None:
            raise ValueError(f"{type(self).__name__} has no group name: register() it first")
        return self._group_name

    def _set_group_name(self, name: str) -> None:  # type: ignore[override]
        self._group_name = name

    def unregister(self) -> None:
        """Remove the dist-level registration made by :meth:`register`."""
        if self._registered_name is not None:
            dist.destroy_process_group(self)
            self._registered_name = None

    def __repr__(self) -> str:
        cfg = self._config
        if cfg is None:
            return f"{type(self).__name__}(unconfigured)"
        return (
            f"{type(self).__name__}(replica={cfg.replica_id}, rank={cfg.rank}/{cfg.world_size}, "
            f"quorum={cfg.quorum_id}, errored={self._error is not None})"
        )
