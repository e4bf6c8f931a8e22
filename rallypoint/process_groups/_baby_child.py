"""The child side of the subprocess-isolated groups, and the op encoding both sides use.

The parent sends batches of op descriptors; tensors are replaced by ``("T", offset,
dtype, shape)`` slots in the shared arena, options by plain values. The child runs
them in order on an in-process rallypoint group, fusing runs of small allreduces of
one dtype and reduce op into a single collective over their (adjacent) arena range:
that is what makes thousands of tiny tensors cheap.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)

from ._shm import map_received, view
from .base import GroupConfig

logger = logging.getLogger("rallypoint.process_groups.baby.child")

# op name -> (indices of args that are inputs, indices of args that are outputs)
OPS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "allreduce": ((0,), (0,)),
    "allreduce_coalesced": ((0,), (0,)),
    "allgather": ((1,), (0,)),
    "allgather_into_tensor_coalesced": ((1,), (0,)),
    "broadcast": ((0,), (0,)),
    "reduce_scatter": ((1,), (0,)),
    "reduce_scatter_tensor_coalesced": ((1,), (0,)),
    "alltoall_base": ((1,), (0,)),
    "send": ((0,), ()),
    "recv": ((), (0,)),
    "barrier": ((), ()),
}

_OPT_CLASSES = {
    c.__name__: c
    for c in (
        AllreduceOptions, AllreduceCoalescedOptions, AllgatherOptions, BroadcastOptions,
        ReduceScatterOptions, AllToAllOptions, BarrierOptions,
    )
}
_REDUCE_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def reduce_name(op: Any) -> str:
    for name in _REDUCE_NAMES:
        if op == getattr(ReduceOp, name):
            return name
    raise NotImplementedError(f"reduce op {op} cannot cross to the child process")


def encode_opts(opts: Any) -> Any:
    """Options objects -> plain tuples (they do not pickle)."""
    if opts is None or isinstance(opts, (int, float, str)):
        return opts
    if type(opts).__name__ in _OPT_CLASSES:
        fields: dict[str, Any] = {}
        if hasattr(opts, "reduceOp"):
            fields["reduceOp"] = reduce_name(opts.reduceOp)
        if isinstance(opts, BroadcastOptions):
            fields["rootRank"], fields["rootTensor"] = opts.rootRank, opts.rootTensor
        return ("O", type(opts).__name__, fields)
    return ("R", reduce_name(opts))


def decode_opts(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "O":
        o = _OPT_CLASSES[spec[1]]()
        for k, v in spec[2].items():
            setattr(o, k, getattr(ReduceOp, v) if k == "reduceOp" else v)
        return o
    if isinstance(spec, tuple) and spec and spec[0] == "R":
        return getattr(ReduceOp, spec[1])
    return spec


STORAGES: dict[int, Any] = {}  # shared CPU storages mapped from the parent, by id
_DROPS: list[int] = []  # storages to unmap once no queued op can use them


def decode(spec: Any, buf: torch.Tensor) -> Any:
    """Slots -> views of the arena; lists recursively; everything else as is."""
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        return view(buf, spec[1], getattr(torch, spec[2]), spec[3])
    if isinstance(spec, tuple) and spec and spec[0] == "C":
        return spec[1]  # a CUDA tensor that arrived through CUDA IPC
    if isinstance(spec, tuple) and spec and spec[0] == "S":
        _, sid, offset, dtype, shape, stride = spec
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(STORAGES[sid], offset, shape, stride)
    if isinstance(spec, list):
        return [decode(s, buf) for s in spec]
    return spec


FUSE_MAX_BYTES = 1024  # allreduces up to this size may be fused with their neighbours


def _fusable(op: tuple) -> tuple | None:
    """(reduce op, dtype) of a small single-tensor allreduce, else None."""
    name, args = op
    if name != "allreduce" or len(args[0]) != 1:
        return None
    slot = args[0][0]
    if slot[0] != "T" or _nbytes(slot) > FUSE_MAX_BYTES:
        return None
    return (args[1], slot[2])


def _nbytes(slot: tuple) -> int:
    n = getattr(torch, slot[2]).itemsize
    for d in slot[3]:
        n *= d
    return n


class Runner:
    """Runs queued ops in order on the child's group, fusing small allreduces.

    Fusion must be identical on every rank, but each rank's parent batches ops by
    its own timing. So before a run of fusable ops the ranks agree on its length
    with one tiny MIN-allreduce of "how many fusable ops I have queued": every rank
    then fuses exactly that many. The agreement sits at the same place of every
    rank's op sequence (ops are issued in the same order everywhere, as collectives
    require), so it cannot deadlock; it costs one extra small collective per fused
    run, which is why only ops up to FUSE_MAX_BYTES are fusable.
    """

    def __init__(self, pg: Any, timeout: timedelta) -> None:
        self.pg = pg
        self.timeout = timeout
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.queue: list[tuple[int, int, tuple]] = []  # (batch_id, index in batch, op)
        self.batch_len: dict[int, int] = {}
        self.broken: str | None = None

    def add(self, batch_id: int, ops: list[tuple]) -> None:
        self.batch_len[batch_id] = len(ops)
        self.queue.extend((batch_id, i, op) for i, op in enumerate(ops))

    def step(self) -> list[tuple[int, int, str | None]]:
        """Run the next group of ops; batches finished by it as (batch_id, n_ok, error)."""
        done: list[tuple[int, int, str | None]] = []
        if self.broken is not None:
            for bid, n in list(self.batch_len.items()):
                done.append((bid, 0, self.broken))
            self.queue.clear()
            self.batch_len.clear()
            return done
        head = self.queue[0]
        key = _fusable(head[2])
        n = 1
        try:
            if key is not None:
                k = 1
                while k < len(self.queue) and _fusable(self.queue[k][2]) == key:
                    k += 1
                agree = torch.tensor([k], dtype=torch.int64)
                self.pg.allreduce([agree], ReduceOp.MIN).wait(self.timeout)
                n = int(agree.item())
            group = self.queue[:n]
            if n > 1:
                views = [decode(op[1][0][0], self.buf) for _, _, op in group]
                flat = torch.cat([v.reshape(-1) for v in views])
                self.pg.allreduce([flat], decode_opts(key[0])).wait(self.timeout)  # type: ignore[index]
                pos = 0
                for v in views:
                    v.copy_(flat[pos : pos + v.numel()].view_as(v))
                    pos += v.numel()
            else:
                name, args = head[2]
                event = None
                if args and isinstance(args[-1], tuple) and args[-1] and args[-1][0] == "E":
                    event, args = args[-1][1], args[:-1]
                decoded = [decode(a, self.buf) for a in args]
                if name not in ("send", "recv"):
                    decoded[-1] = decode_opts(decoded[-1])
                if event is not None:
                    # order the collective after the parent's writes (its stream's event)
                    ev = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), event)
                    torch.cuda.current_stream().wait_event(ev)
                getattr(self.pg, name)(*decoded).wait(self.timeout)
                if event is not None:
                    torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - reported to the parent; the group is broken now
            self.broken = f"{type(e).__name__}: {e}"
            bid, idx, _ = head
            done.append((bid, idx, self.broken))
            self.batch_len.pop(bid, None)
            self.queue = [q for q in self.queue if q[0] != bid]
            return done + self.step() if self.queue else done
        del self.queue[:n]
        for bid, idx, _ in group:
            if idx == self.batch_len.get(bid, -1) - 1:
                self.batch_len.pop(bid)
                done.append((bid, idx + 1, None))
        return done


def _receive(conn: Connection, inbox: "queue.Queue[tuple]") -> None:
    """Receiver thread: drain the control socket at all times, so the parent never
    blocks sending while the runner waits on peers. File descriptors that follow a
    message on the socket are taken here, in order, and mapped."""
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "arena":
                msg = ("arena", map_received(reduction.recv_handle(conn), msg[1]))
            elif msg[0] == "storage":
                fd = reduction.recv_handle(conn)
                try:
                    msg = ("storage", msg[1], torch.UntypedStorage._new_shared_fd_cpu(fd, msg[2]))  # type: ignore[attr-defined]
                finally:
                    os.close(fd)
            inbox.put(msg)
            if msg[0] == "exit":
                return
    except (EOFError, OSError):
        inbox.put(("exit",))


def _handle(msg: tuple, runner: Runner) -> bool:
    """Apply one message from the parent; False when told to exit."""
    if msg[0] == "batch":
        runner.add(msg[1], msg[2])
    elif msg[0] == "arena":
        runner.buf = msg[1]
    elif msg[0] == "storage":
        STORAGES[msg[1]] = msg[2]
    elif msg[0] == "drop_storage":
        _DROPS.append(msg[1])
    elif msg[0] == "exit":
        return False
    else:
        logger.error("unknown message %r", msg[0])
    return True


def child_main(conn: Connection, kind: str, cfg: dict[str, Any], timeout_s: float, log_level: int) -> None:
    """Entry point of the child: configure, then serve batches until told to exit.

    Exits when the parent goes away (EOF on the control socket), so an orphaned child
    never lingers.
    """
    logging.basicConfig(level=log_level, stream=sys.stderr, format=f"[baby {os.getpid()}] %(name)s %(levelname)s %(message)s")
    # The parent enforces the group's timeout and kills this child when it passes; the
    # child's own bounds are a little longer, so an op that times out is always handled
    # by the parent (kill) rather than racing it with an error of its own.
    timeout = timedelta(seconds=timeout_s + max(1.0, 0.25 * timeout_s))
    import torch.multiprocessing  # noqa: F401 - CUDA IPC unpickling

    if kind == "gloo":
        from .gloo import ProcessGroupGloo

        # Peers' children may start seconds apart (each imports torch): be patient
        # in the rendezvous; ops keep the group's timeout.
        pg: Any = ProcessGroupGloo(timeout=timeout, connect_timeout=timeout + timedelta(seconds=cfg.get("spawn_grace_s", 60)))
    elif kind == "nccl":
        from .nccl import ProcessGroupNCCL

        if cfg.get("device") is not None:
            torch.cuda.set_device(cfg["device"])
        pg = ProcessGroupNCCL(timeout=timeout)
    else:
        raise ValueError(kind)
    runner = Runner(pg, timeout)
    try:
        pg._apply_config(GroupConfig(
            store_addr=cfg["store_addr"], replica_id=cfg["replica_id"], rank=cfg["rank"],
            world_size=cfg["world_size"], quorum_id=cfg["quorum_id"], group_rank=cfg["group_rank"],
            group_world_size=cfg["group_world_size"],
            global_ranks=tuple(cfg["global_ranks"]) if cfg["global_ranks"] else None,
            exact_prefix=bool(cfg.get("exact_prefix", False)),
        ))
    except Exception as e:  # noqa: BLE001
        conn.send(("configure_failed", str(e)))
        return
    conn.send(("ready", os.getpid()))
    inbox: queue.Queue[tuple] = queue.Queue()
    threading.Thread(target=_receive, args=(conn, inbox), daemon=True, name="rallypoint-baby-recv").start()
    running = True
    while running:
        # Block only when there is nothing to run; otherwise take what has arrived.
        while running:
            try:
                msg = inbox.get_nowait() if runner.queue else inbox.get()
            except queue.Empty:
                break
            running = _handle(msg, runner)
        if running and runner.queue:
            for bid, n_ok, err in runner.step():
                conn.send(("done", bid, n_ok, err))
        if not runner.queue and _DROPS:
            for sid in _DROPS:
                STORAGES.pop(sid, None)
            _DROPS.clear()
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001
        logger.warning("shutdown failed: %s", traceback.format_exc())
