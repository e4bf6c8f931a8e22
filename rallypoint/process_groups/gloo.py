"""``ProcessGroupGloo``: torch's gloo backend, rebuilt on every configure.

Collectives go straight to torch's C++ gloo backend (no extra copies, so the wrapper
costs a Python call per op), wrapped in :class:`OpWork` for bounded waits and clear
errors. What gloo lacks is completed here: AVG is a SUM divided by the world size;
reduce-scatter falls back to an allreduce of a copy when the backend has none.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    Work,
)

from ._store import StoreClients, fresh_prefix_store
from .base import DEFAULT_TIMEOUT, GroupConfig, ProcessGroup
from .errors import ProcessGroupAborted, ProcessGroupError
from .work import FailedWork, OpWork

logger = logging.getLogger("rallypoint.process_groups.gloo")


def reduce_op_of(opts: Any) -> Any:
    """The ReduceOp of ``opts`` (torch passes options objects, torchft users a bare op)."""
    if opts is None:
        return ReduceOp.SUM
    if isinstance(opts, (AllreduceOptions, AllreduceCoalescedOptions, ReduceScatterOptions)):
        return opts.reduceOp
    return opts


def op_name(op: Any) -> str:
    """``SUM``/``AVG``/... for a ReduceOp or its enum (for messages)."""
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(ReduceOp, name):
            return name
    return str(op)


def is_avg(op: Any) -> bool:
    return op == ReduceOp.AVG


def divide_(tensors: list[torch.Tensor], n: int) -> None:
    """In-place mean of a SUM: floats divide, integers truncate (as NCCL's AVG does)."""
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")


class _WorkChain(Work):
    """Several backend Works seen as one (coalesced ops the backend runs one by one)."""

    def __init__(self, works: list[Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        import time

        if timeout is None or timeout.total_seconds() <= 0:
            for w in self._works:
                w.wait()
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self._works:
            left = max(deadline - time.monotonic(), 0.001)
            w.wait(timedelta(seconds=left))
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _release(backend: Any, stuck: list[Work]) -> None:
    """Let an aborted backend's unfinished ops end (by completion or gloo's own timeout)
    before dropping it: destroying a gloo group under a running op aborts the process.
    Runs on its own thread, so no caller waits for it."""
    for work in stuck:
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the op failed: that is how it ends
            pass
    del stuck
    del backend


class TorchBackendGroup(ProcessGroup):
    """A reconfigurable group driving one of torch's C++ backends, rebuilt per configure.

    Subclasses create the backend (``_create_backend``) and may wrap its Works
    (``_wrap``); the collectives and the emulations live here.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, connect_timeout: timedelta | None = None) -> None:
        super().__init__(timeout)
        self._connect_timeout = connect_timeout
        self._backend: Any = None
        self._store: Store | None = None
        self._clients = StoreClients()
        # Tests force the emulated reduce-scatter path with this.
        self.emulate_reduce_scatter = False
        self._infos: dict[str, Any] = {}  # OpInfo per op name, rebuilt per configure
        self._pending: weakref.WeakSet[OpWork] = weakref.WeakSet()  # interrupted by abort()
        # Held while an op is posted and registered, and while abort() takes the backend:
        # so an abort either finds the op among the pending ones (and lets it end before
        # dropping the backend) or comes first (and the op is never posted). Without it,
        # an op posted on the training thread during an abort on another thread (a lease's
        # "member left" notice) ran on a backend being dropped: SIGABRT.
        self._pending_lock = threading.RLock()
        self._connect_wake: threading.Event | None = None  # set while a configure connects

    # ------------------------------------------------------------------ lifecycle

    def _configure(self, cfg: GroupConfig) -> None:
        self._infos = {}
        t0 = time.monotonic()
        store, prefix = fresh_prefix_store(
            cfg.store_addr, rank=cfg.rank, quorum_id=cfg.quorum_id, group_rank=cfg.group_rank,
            timeout=self._connect_timeout or self._timeout,
            clients=self._clients, exact=cfg.exact_prefix,
        )
        if self._connect_timeout is not None and not cfg.exact_prefix:
            # Meet every peer first with the patient timeout; the backend's own connect
            # (and its op timeout) then starts when all are there. Not in a reconfigure:
            # a torchft-nightly peer in the same rendezvous would never arrive at it.
            store_barrier(store, cfg.world_size, self._connect_timeout)
        t1 = time.monotonic()
        try:
            backend = self._connect_abortably(store, cfg)
        except Exception:
            self._clients.drop()
            raise
        logger.debug("configure %s: store %.3fs, connect %.3fs", prefix, t1 - t0, time.monotonic() - t1)
        self._store = store
        self._backend = backend

    def _create_backend(self, store: Store, cfg: GroupConfig) -> Any:
        raise NotImplementedError

    def _connect_abortably(self, store: Store, cfg: GroupConfig) -> Any:
        """``_create_backend`` (which blocks until every rank connected, bounded by the
        timeout) on a helper thread, so that :meth:`abort` can release a configure stuck on
        a peer that died mid-connect; the abandoned connect ends by its own timeout and
        its backend, if any, is dropped there."""
        wake = threading.Event()
        box: dict[str, Any] = {}

        def connect() -> None:
            try:
                box["backend"] = self._create_backend(store, cfg)
            except BaseException as e:  # noqa: BLE001 - handed to the configuring thread
                box["error"] = e
            finally:
                wake.set()
                if box.get("abandoned"):
                    box.clear()  # nobody will use it: release the backend here

        self._connect_wake = wake
        threading.Thread(target=connect, name="rallypoint-gloo-connect", daemon=True).start()
        limit = (self._connect_timeout or self._timeout).total_seconds() + self._timeout.total_seconds() + 5.0
        try:
            wake.wait(limit)
        finally:
            self._connect_wake = None
        if "backend" in box:
            return box["backend"]
        if "error" in box:
            raise box["error"]
        box["abandoned"] = True
        if wake.is_set() and "backend" in box:  # finished just now
            return box.pop("backend")
        if self._error is not None:
            raise ProcessGroupAborted(f"connect aborted: {self._error}")
        raise TimeoutError(f"connect did not finish within {limit:.0f}s")

    def _wrap(self, inner: Work, info: Any, finish: Callable[[], None] | None, result: Any) -> Work:
        work = OpWork(inner, info, self._record_error, finish, result)
        with self._pending_lock:
            self._pending.add(work)
        return work

    def abort(self) -> None:
        """Stop the group now; every pending ``wait()`` fails at once (the backend's
        stuck ops end by their own timeout, with the old backend)."""
        self._record_abort()
        wake = self._connect_wake
        if wake is not None:
            wake.set()  # release a configure blocked in connect
        with self._pending_lock:
            pending, self._pending = list(self._pending), weakref.WeakSet()
            backend, self._backend, self._store = self._backend, None, None
        err = self._error
        for work in pending:
            if isinstance(err, ProcessGroupError):
                work.interrupt(err)
        # Dropping the backend joins its worker threads, which wait out a stuck op's
        # timeout: let that happen off the caller's thread. Not a daemon: a process that
        # exits within that timeout waits for it (bounded by gloo's op timeout), because
        # tearing the interpreter down under a running gloo op ends in std::terminate
        # (SIGABRT, "terminate called without an active exception").
        if backend is not None:
            stuck = [w.inner for w in pending]
            threading.Thread(target=_release, args=(backend, stuck), name="rallypoint-gloo-release", daemon=False).start()
        del backend

    def shutdown(self) -> None:
        super().shutdown()
        self._clients.drop()

    def _teardown(self) -> None:
        # Dropping the last reference joins gloo's worker threads; their ops are bounded
        # by gloo's timeout, so this never waits longer than that.
        self._backend = None
        self._store = None

    def set_timeout(self, timeout: timedelta) -> None:
        """New bound for waits now, and for the backend's own op timeout from the next configure."""
        super().set_timeout(timeout)

    # ------------------------------------------------------------------ plumbing

    def _run(
        self,
        op: str,
        call: Callable[[Any], Work],
        finish: Callable[[], None] | None = None,
        result: Any = None,
    ) -> Work:
        self._require_config(op)
        info = self._infos.get(op)
        if info is None or info.timeout != self._timeout:
            info = self._infos[op] = self._op_info(op)
        with self._pending_lock:  # posted and registered as one step (see __init__)
            backend = self._backend
            if backend is None or self._error is not None:
                err = self._error or ProcessGroupAborted(f"{info.label()}: the group is not connected; reconfigure it")
                return FailedWork(err)  # type: ignore[arg-type]
            # An exception at call time is gloo rejecting the arguments (wrong list
            # lengths, dtypes): a caller bug, raised as torch raises it, not a group failure.
            inner = call(backend)
            return self._wrap(inner, info, finish, result)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = reduce_op_of(opts)
        o = AllreduceOptions()
        o.reduceOp = ReduceOp.SUM if is_avg(op) else op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
        n = self.size()
        finish = (lambda: divide_(tensors, n)) if is_avg(op) else None
        return self._run("allreduce", lambda b: b.allreduce(tensors, o), finish, list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        op = reduce_op_of(opts)
        sum_op = ReduceOp.SUM if is_avg(op) else op
        n = self.size()
        finish = (lambda: divide_(tensors, n)) if is_avg(op) else None
        same = len({(t.dtype, t.device) for t in tensors}) == 1 and all(t.device.type == "cpu" for t in tensors)

        def call(b: Any) -> Work:
            if same:
                o = AllreduceCoalescedOptions()
                o.reduceOp = sum_op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
                return b.allreduce_coalesced(tensors, o)
            works = []
            for t in tensors:
                o1 = AllreduceOptions()
                o1.reduceOp = sum_op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
                works.append(b.allreduce([t], o1))
            return _WorkChain(works)

        return self._run("allreduce_coalesced", call, finish, list(tensors))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._run("allgather", lambda b: b.allgather(output_tensors, input_tensors, AllgatherOptions()))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        def call(b: Any) -> Work:
            return _WorkChain([b._allgather_base(o, i, AllgatherOptions()) for o, i in zip(outputs, inputs, strict=True)])

        return self._run("allgather_into_tensor", call, None, list(outputs))

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        o = BroadcastOptions()
        if isinstance(opts, BroadcastOptions):
            o.rootRank, o.rootTensor = opts.rootRank, opts.rootTensor
        elif isinstance(opts, int):
            o.rootRank = opts
        return self._run("broadcast", lambda b: b.broadcast(tensor_list, o), None, list(tensor_list))

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Work:
        """torchft's convenience: broadcast one tensor from ``root``."""
        return self.broadcast([tensor], root)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:  # type: ignore[override]
        op = reduce_op_of(opts)
        sum_op = ReduceOp.SUM if is_avg(op) else op
        n = self.size()
        native = not self.emulate_reduce_scatter and hasattr(self._backend, "reduce_scatter")
        if native:
            o = ReduceScatterOptions()
            o.reduceOp = sum_op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
            finish = (lambda: divide_(output_tensors, n)) if is_avg(op) else None
            return self._run("reduce_scatter", lambda b: b.reduce_scatter(output_tensors, input_tensors, o), finish, list(output_tensors))
        # Emulation: allreduce a flat copy of every input list, keep our rank's chunk.
        r = self.rank()
        flats = [torch.cat([x.reshape(-1) for x in inputs]) for inputs in input_tensors]

        def finish_emulated() -> None:
            for out, flat, inputs in zip(output_tensors, flats, input_tensors, strict=True):
                start = sum(x.numel() for x in inputs[:r])
                out.copy_(flat[start : start + inputs[r].numel()].view_as(out))
            if is_avg(op):
                divide_(output_tensors, n)

        return self._run("reduce_scatter", lambda b: _all_sum(b, flats, sum_op), finish_emulated, list(output_tensors))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        op = reduce_op_of(opts)
        sum_op = ReduceOp.SUM if is_avg(op) else op
        n = self.size()
        native = not self.emulate_reduce_scatter and hasattr(self._backend, "_reduce_scatter_base")
        if native:
            def call(b: Any) -> Work:
                works = []
                for out, inp in zip(outputs, inputs, strict=True):
                    o = ReduceScatterOptions()
                    o.reduceOp = sum_op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
                    works.append(b._reduce_scatter_base(out, inp, o))
                return _WorkChain(works)

            finish = (lambda: divide_(outputs, n)) if is_avg(op) else None
            return self._run("reduce_scatter_tensor", call, finish, list(outputs))
        r = self.rank()
        copies = [inp.clone() for inp in inputs]

        def finish_emulated() -> None:
            for out, c in zip(outputs, copies, strict=True):
                out.copy_(c.reshape(-1)[r * out.numel() : (r + 1) * out.numel()].view_as(out))
            if is_avg(op):
                divide_(outputs, n)

        return self._run("reduce_scatter_tensor", lambda b: _all_sum(b, copies, sum_op), finish_emulated, list(outputs))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:  # type: ignore[override]
        return self._run(
            "alltoall_base",
            lambda b: b.alltoall_base(output, input, list(output_split_sizes), list(input_split_sizes), AllToAllOptions()),
            None,
            [output],
        )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._run(f"send(to rank {dst_rank})", lambda b: b.send(tensors, dst_rank, tag))

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._run(f"recv(from rank {src_rank})", lambda b: b.recv(tensors, src_rank, tag), None, list(tensors))

    def barrier(self, opts: Any = None) -> Work:  # type: ignore[override]
        return self._run("barrier", lambda b: b.barrier(BarrierOptions()))


class ProcessGroupGloo(TorchBackendGroup):
    """Reconfigurable gloo group for CPU tensors (and CUDA tensors where gloo has them).

    Args:
        timeout: bound of configure and of every op (gloo's own timeout is set to it,
            so a dead peer's op fails in gloo too, not only in our wait).
        threads: gloo worker threads per configure (2 is torch's default).
        connect_timeout: bound of configure's rendezvous, if it must differ from the
            op timeout (a subprocess group's peers may start seconds apart).
    """

    backend_name = "rallypoint-gloo"

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, threads: int = 2, connect_timeout: timedelta | None = None) -> None:
        super().__init__(timeout, connect_timeout)
        self._threads = threads

    def _create_backend(self, store: Store, cfg: GroupConfig) -> Any:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        opts._timeout = self._timeout
        opts._threads = self._threads
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        if cfg.global_ranks:
            opts.global_ranks_in_group = list(cfg.global_ranks)
        opts.group_name = cfg.group_name()
        return dist.ProcessGroupGloo(store, cfg.rank, cfg.world_size, opts)


def store_barrier(store: Store, world_size: int, timeout: timedelta) -> None:
    """Block until ``world_size`` ranks called this on ``store`` (bounded by ``timeout``)."""
    if store.add("rallypoint/arrived", 1) == world_size:
        store.set("rallypoint/all_arrived", b"1")  # type: ignore[arg-type]  # bytes are accepted
    store.wait(["rallypoint/all_arrived"], timeout)


def _all_sum(backend: Any, tensors: list[torch.Tensor], op: Any) -> Work:
    works = []
    for t in tensors:
        o = AllreduceOptions()
        o.reduceOp = op  # type: ignore[assignment]  # stubs: RedOpType converts to ReduceOp
        works.append(backend.allreduce([t], o))
    return _WorkChain(works)
