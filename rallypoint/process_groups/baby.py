"""Subprocess-isolated ("baby") process groups.

The backend runs in a child process, so an op that would hang forever, or a
communicator whose abort would poison the CUDA context, costs a ``SIGKILL`` of the
child instead of the training process. ``abort()`` kills the child; ``errored()``
reports its death or a timed-out op; ``configure()`` replaces it.

Data path (CPU tensors): inputs are copied into a shared-memory arena (see
``_shm.py``), the child runs the collective in place, results are copied back.
Control path: ops are queued and sent in batches: an op goes out at once when the
child is idle; while the child is busy, later ops accumulate and leave as one
message when it answers (or when someone waits). The child fuses runs of small
allreduces, so 4k tiny tensors cost a handful of messages and collectives, not 4k
round trips.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait as mp_wait
from typing import Any

import torch
from torch.distributed.distributed_c10d import Work

from . import _baby_child
from ._baby_child import OPS, encode_opts
from ._shm import Arena, view
from .base import DEFAULT_TIMEOUT, GroupConfig, ProcessGroup
from .errors import ProcessGroupAborted, ProcessGroupError
from .work import EventWork, FailedWork

logger = logging.getLogger("rallypoint.process_groups.baby")

SPAWN_GRACE = timedelta(seconds=60)  # starting a child imports torch: seconds on a busy host
EAGER_BYTES = 64 * 1024  # ops this large are sent at once even while the child is busy
MAX_BATCH = 4096
INITIAL_ARENA = 8 << 20
ZERO_COPY_BYTES = 1 << 20  # CPU tensors this large are shared in place, not copied
MAX_SHARED_STORAGES = 64  # storages the child keeps mapped (LRU)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclass
class _Op:
    name: str
    spec: list[Any]
    outputs: list[tuple[torch.Tensor, tuple]]
    work: EventWork
    nbytes: int


@dataclass
class _Batch:
    ops: list[_Op] = field(default_factory=list)


class ProcessGroupBaby(ProcessGroup):
    """Base of the subprocess-isolated groups; subclasses name the child's backend.

    Args:
        timeout: bound of every op and of configure (plus a grace for starting the
            child); an op that times out kills the child.
        start_method: ``forkserver`` (default: the server imports torch once, so a
            reconfigure starts a child in milliseconds) or ``spawn``.
    """

    _child_kind = ""

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, start_method: str = "forkserver") -> None:
        super().__init__(timeout)
        self._start_method = start_method
        self._lock = threading.Condition()
        self._send_lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._arena: Arena | None = None
        self._arena_gen = 0
        self._pending: list[_Op] = []
        self._inflight: dict[int, _Batch] = {}
        self._batch_ids = itertools.count()
        self.batches_sent = 0  # how many messages carried ops (tests/bench read it)
        # large CPU storages shared with the current child: (data_ptr, nbytes) -> (id, storage)
        self._storages: dict[tuple[int, int], tuple[int, Any]] = {}
        self._storage_ids = itertools.count()
        self.zero_copy = True
        self._infos: dict[str, Any] = {}  # OpInfo per op name (rebuilt when config or timeout change)
        self.max_shared_storages = MAX_SHARED_STORAGES

    # ------------------------------------------------------------------ lifecycle

    def _context(self) -> Any:
        if self._start_method == "forkserver":
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "rallypoint.process_groups._baby_child"])
            return ctx
        return mp.get_context(self._start_method)

    def _child_cfg(self, cfg: GroupConfig) -> dict[str, Any]:
        return {
            "store_addr": cfg.store_addr, "replica_id": cfg.replica_id, "rank": cfg.rank,
            "world_size": cfg.world_size, "quorum_id": cfg.quorum_id, "group_rank": cfg.group_rank,
            "group_world_size": cfg.group_world_size,
            "global_ranks": list(cfg.global_ranks) if cfg.global_ranks else None,
            "spawn_grace_s": SPAWN_GRACE.total_seconds(),
            "exact_prefix": cfg.exact_prefix,
        }

    def _configure(self, cfg: GroupConfig) -> None:
        self._infos = {}
        ctx = self._context()
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_baby_child.child_main,
            args=(child, self._child_kind, self._child_cfg(cfg), self._timeout.total_seconds(), logging.getLogger("rallypoint").getEffectiveLevel()),
            daemon=True,
            name=f"rallypoint-baby-{self._child_kind}-q{cfg.quorum_id}",
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self._stop = threading.Event()
        deadline = (self._timeout + SPAWN_GRACE).total_seconds()
        ready = mp_wait([parent, proc.sentinel], timeout=deadline)
        if parent not in ready:
            raise ProcessGroupError(
                f"child process {'died' if proc.sentinel in ready else 'did not answer'} while configuring "
                f"(exit code {proc.exitcode})", op="configure", world_size=cfg.world_size, quorum_id=cfg.quorum_id,
            )
        msg = parent.recv()
        if msg[0] != "ready":
            raise ProcessGroupError(f"child could not configure: {msg[1]}", op="configure", world_size=cfg.world_size, quorum_id=cfg.quorum_id)
        with self._lock:
            self._pending, self._inflight = [], {}
            self._storages = {}
            self._new_arena(max(INITIAL_ARENA, self._arena.nbytes if self._arena else 0))
        self._reader = threading.Thread(target=self._read_loop, args=(parent, proc, self._stop), daemon=True, name="rallypoint-baby-reader")
        self._reader.start()

    def _new_arena(self, nbytes: int) -> None:
        """Replace the arena (caller holds the lock, nothing is outstanding)."""
        self._arena_gen += 1
        arena = Arena(nbytes, self._arena_gen)
        assert self._conn is not None and self._proc is not None
        with self._send_lock:
            self._conn.send(("arena", nbytes))
            reduction.send_handle(self._conn, arena.fd, self._proc.pid)
        arena.close_fd()
        self._arena = arena

    def _teardown(self) -> None:
        proc, conn, reader = self._proc, self._conn, self._reader
        self._proc = self._conn = self._reader = None
        self._stop.set()
        if proc is not None:
            if proc.is_alive() and conn is not None and self._error is None:
                try:
                    with self._send_lock:
                        conn.send(("exit",))
                    proc.join(2.0)
                except OSError:
                    pass
            if proc.is_alive():
                # proc.kill(), not os.kill(pid): the reader thread may reap the child between
                # is_alive() and the signal (reading its exitcode), and multiprocessing sends
                # nothing to a reaped child (no ProcessLookupError, no signal to a reused pid).
                proc.kill()
            proc.join(10.0)
            proc.close()
        if reader is not None and reader is not threading.current_thread():
            reader.join(10.0)
        if conn is not None:
            conn.close()
        self._fail_all(ProcessGroupAborted("the group was reconfigured or shut down before this op completed", op="teardown"))
        with self._lock:
            self._arena = None
            self._storages = {}

    def abort(self) -> None:
        """Kill the child now; pending ops fail; the group needs a configure."""
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
        super().abort()

    def child_pid(self) -> int | None:
        """The child's pid (tests kill it)."""
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ reader thread

    def _read_loop(self, conn: Connection, proc: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                ready = mp_wait([conn, proc.sentinel], timeout=0.5)
            except (OSError, ValueError):
                return
            if stop.is_set():
                return
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    self._on_done(*msg[1:])
                    continue
            if proc.sentinel in ready or (conn in ready):
                code = proc.exitcode
                cfg = self._config
                err = ProcessGroupAborted(
                    f"{type(self).__name__} child process (pid {proc.pid}) died (exit code {code}) in quorum "
                    f"{cfg.quorum_id if cfg else None}; reconfigure the group",
                    op="child", world_size=cfg.world_size if cfg else None, quorum_id=cfg.quorum_id if cfg else None,
                )
                self._record_error(err)
                self._fail_all(err)
                return

    def _on_done(self, batch_id: int, n_ok: int, err_text: str | None) -> None:
        # The batch stays in flight while its outputs are copied out, so the arena
        # cannot be reset or replaced under the copy.
        with self._lock:
            batch = self._inflight.get(batch_id)
        if batch is None:
            return
        results: list[tuple[_Op, Any]] = []
        for k, op in enumerate(batch.ops):
            if k < n_ok:
                for t, slot in op.outputs:
                    t.copy_(self._slot_view(slot))
                results.append((op, None))
            else:
                info = op.work._info
                err = ProcessGroupError(
                    f"{info.label()} failed in the child process: {err_text}",
                    op=op.name, world_size=info.world_size, quorum_id=info.quorum_id,
                )
                self._record_error(err)
                results.append((op, err))
        with self._lock:
            self._inflight.pop(batch_id, None)
            if not self._inflight and self._pending:
                self._flush_locked()
            self._lock.notify_all()
        for op, err in results:
            if err is None:
                op.work.set_result([t for t, _ in op.outputs])
            else:
                op.work.set_error(err)

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            ops = list(self._pending) + [op for b in self._inflight.values() for op in b.ops]
            self._pending, self._inflight = [], {}
            self._lock.notify_all()
        for op in ops:
            op.work.set_error(err)

    # ------------------------------------------------------------------ issuing ops

    def _slot_view(self, slot: tuple) -> torch.Tensor:
        assert self._arena is not None
        return view(self._arena.buf, slot[1], getattr(torch, slot[2]), slot[3])

    def _flush_locked(self) -> None:
        if not self._pending or self._conn is None:
            return
        batch = _Batch(self._pending)
        self._pending = []
        bid = next(self._batch_ids)
        self._inflight[bid] = batch
        msg = ("batch", bid, [(op.name, op.spec) for op in batch.ops])
        self.batches_sent += 1
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError as e:
            self._inflight.pop(bid, None)
            err = ProcessGroupAborted(f"{type(self).__name__}: cannot reach the child ({e}); reconfigure", op="send")
            self._record_error(err)
            for op in batch.ops:
                op.work.set_error(err)

    def _flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _reserve(self, sizes: list[int]) -> list[int]:
        """Arena offsets for ``sizes`` (caller holds the lock); drains or grows the arena if needed."""
        total = sum(s + 8 for s in sizes)
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            arena = self._arena
            if arena is None:
                raise ProcessGroupAborted(f"{type(self).__name__} is not connected; reconfigure it", op="alloc")
            if not self._pending and not self._inflight:
                arena.reset()
            if arena.top + total <= arena.nbytes:
                return [arena.alloc(s) for s in sizes]  # type: ignore[misc]
            if not self._pending and not self._inflight:
                self._new_arena(max(arena.nbytes * 2, total + (1 << 20)))
                continue
            self._flush_locked()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProcessGroupError(f"{type(self).__name__}: shared memory stayed busy past the timeout", op="alloc")
            self._lock.wait(min(left, 1.0))

    def _submit(self, name: str, args: list[Any]) -> Work:
        self._require_config(name)
        info = self._infos.get(name)
        if info is None or info.timeout != self._timeout:
            info = self._infos[name] = self._op_info(name)
        if self._error is not None or self._proc is None:
            return FailedWork(self._error or ProcessGroupAborted(f"{info.label()}: no child; reconfigure", op=name))
        in_idx, out_idx = OPS[name]
        tensors: list[tuple[int, torch.Tensor]] = []

        def collect(x: Any, pos: int) -> None:
            if isinstance(x, torch.Tensor):
                tensors.append((pos, x))
            elif isinstance(x, (list, tuple)):
                for v in x:
                    collect(v, pos)

        for pos, a in enumerate(args):
            collect(a, pos)
        work = EventWork(info, self._record_error, on_timeout=self._on_op_timeout, before_wait=self._flush)
        try:
            self._enqueue(name, args, tensors, in_idx, out_idx, work)
        except OSError as e:  # the child went away while we talked to it
            err = ProcessGroupAborted(f"{info.label()}: cannot reach the child process ({e}); reconfigure", op=name)
            self._record_error(err)
            return FailedWork(err)
        return work

    def _enqueue(self, name: str, args: list[Any], tensors: list[tuple[int, torch.Tensor]], in_idx: tuple[int, ...], out_idx: tuple[int, ...], work: EventWork) -> None:
        """Place the op's tensors (arena, shared storage or CUDA IPC), queue it, maybe send."""
        with self._lock:
            ipc = [self._direct_kind(t) for _, t in tensors]
            arena_sizes = [t.numel() * t.element_size() for (_, t), d in zip(tensors, ipc) if not d]
            arena_offsets = iter(self._reserve(arena_sizes) if arena_sizes else [])
            offsets = [None if d else next(arena_offsets) for d in ipc]
            slots: dict[int, tuple] = {}
            outputs: list[tuple[torch.Tensor, tuple]] = []
            nbytes = 0
            for (pos, t), off, direct in zip(tensors, offsets, ipc, strict=True):
                nbytes += t.numel() * t.element_size()
                if direct == "ipc":  # shared with the child as is (CUDA IPC): in place, no copies
                    slots[id(t)] = ("C", t)
                    continue
                if direct == "shm":  # a shared CPU storage the child has mapped: in place
                    sid = self._storage_id(t)
                    slots[id(t)] = ("S", sid, t.storage_offset(), _dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()))
                    continue
                slot = ("T", off, _dtype_name(t.dtype), tuple(t.shape))
                slots[id(t)] = slot
                if pos in in_idx:
                    self._slot_view(slot).copy_(t)
                if pos in out_idx:
                    outputs.append((t, slot))

            def encode(x: Any) -> Any:
                if isinstance(x, torch.Tensor):
                    return slots[id(x)]
                if isinstance(x, (list, tuple)):
                    return [encode(v) for v in x]
                return x

            spec = [encode(a) for a in args]
            if name not in ("send", "recv"):
                spec[-1] = encode_opts(args[-1])
            if "ipc" in ipc:
                spec.append(("E", self._stream_event_handle()))
            self._pending.append(_Op(name, spec, outputs, work, nbytes))
            if not self._inflight or nbytes >= EAGER_BYTES or len(self._pending) >= MAX_BATCH:
                self._flush_locked()

    def _share_directly(self, t: torch.Tensor) -> bool:
        """True for tensors the child maps itself (CUDA IPC) instead of the arena."""
        return False

    def _direct_kind(self, t: torch.Tensor) -> str | None:
        """How ``t`` reaches the child: "ipc" (CUDA IPC), "shm" (its own shared
        storage, zero-copy) or None (copied through the arena)."""
        if self._share_directly(t):
            return "ipc"
        if self.zero_copy and t.device.type == "cpu" and t.numel() * t.element_size() >= ZERO_COPY_BYTES:
            return "shm"
        return None

    def _storage_id(self, t: torch.Tensor) -> int:
        """The child's id of ``t``'s storage, sharing it first if needed (caller holds the lock).

        Like ``torch.multiprocessing``, a large CPU tensor is moved to shared memory in
        place (once); the child maps the storage once and later ops on the same
        tensor cost no copy at all. The child keeps at most MAX_SHARED_STORAGES.
        """
        st = t.untyped_storage()
        if not st.is_shared():
            t.share_memory_()
            st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        hit = self._storages.pop(key, None)
        if hit is not None:
            self._storages[key] = hit  # most recently used last
            return hit[0]
        fd, size = st._share_fd_cpu_()
        sid = next(self._storage_ids)
        assert self._conn is not None and self._proc is not None
        with self._send_lock:
            self._conn.send(("storage", sid, size))
            reduction.send_handle(self._conn, fd, self._proc.pid)
        self._storages[key] = (sid, st)
        while len(self._storages) > self.max_shared_storages:
            old_key = next(iter(self._storages))
            old_sid, _ = self._storages.pop(old_key)
            with self._send_lock:
                self._conn.send(("drop_storage", old_sid))
        return sid

    def _stream_event_handle(self) -> Any:
        return None

    def _on_op_timeout(self, err: ProcessGroupError) -> None:
        logger.error("%s: killing the child: %s", type(self).__name__, err)
        self._record_error(err)
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self._submit("allreduce", [list(tensors), opts])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("allreduce_coalesced", [list(tensors), opts])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("allgather", [output_tensors, list(input_tensors), opts])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("allgather_into_tensor_coalesced", [list(outputs), list(inputs), opts])

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("broadcast", [list(tensor_list), opts])

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("reduce_scatter", [list(output_tensors), input_tensors, opts])

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("reduce_scatter_tensor_coalesced", [list(outputs), list(inputs), opts])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("alltoall_base", [output, input, list(output_split_sizes), list(input_split_sizes), opts])

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._submit("send", [list(tensors), dst_rank, tag])

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._submit("recv", [list(tensors), src_rank, tag])

    def barrier(self, opts: Any = None) -> Work:  # type: ignore[override]
        return self._submit("barrier", [opts])


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process: a hung or aborted communicator costs the child, not
    this process's CUDA context.

    CUDA tensors are shared with the child through CUDA IPC (no copies). Each op
    carries an interprocess CUDA event recorded on the caller's current stream; the
    child makes its stream wait on it, so the collective reads what the caller's
    stream wrote (torchft's version does not pass the event). The child synchronises
    its stream before reporting an op done, so results are ready when ``wait()``
    returns. Only exercised by ``@pytest.mark.gpu`` tests.
    """

    backend_name = "rallypoint-baby-nccl"
    _child_kind = "nccl"

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, start_method: str = "spawn") -> None:
        # spawn: a forkserver would be fine too, but CUDA in a forked helper is not.
        import torch.multiprocessing  # noqa: F401 - registers CUDA IPC pickling

        super().__init__(timeout, start_method)

    def _child_cfg(self, cfg: GroupConfig) -> dict[str, Any]:
        out = super()._child_cfg(cfg)
        out["device"] = torch.cuda.current_device()
        return out

    def _share_directly(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def _stream_event_handle(self) -> Any:
        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream())
        return ev.ipc_handle()


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a child process (CPU tensors through shared memory)."""

    backend_name = "rallypoint-baby-gloo"
    _child_kind = "gloo"
