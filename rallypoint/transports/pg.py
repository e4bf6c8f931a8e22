"""``PGTransport``: heal over a process group (send/recv), in the safe wire format.

The sender encodes the state dict with :func:`rallypoint.transports.wire.encode` (JSON
header, per-block CRC-32, raw bytes; never pickle) and sends it to every destination rank
of a configured process group (``ProcessGroupGloo``, ``ProcessGroupBabyGloo``, NCCL with
``device=cuda``). One transfer, per destination, is these point-to-point messages (all
with tag :data:`TAG`)::

    receiver -> sender   int64[2]   [REQUEST_MAGIC, step the receiver wants]
    sender -> receiver   uint8[20]  the wire prefix: magic, header length H, header CRC
    sender -> receiver   uint8[H]   the wire JSON header (its "extra" holds {"step": s})
    sender -> receiver   data messages, unless the steps differ (then none)

Data messages follow a plan both sides compute from the tensors' byte sizes alone
(:func:`plan_messages`): a tensor of at least :data:`DIRECT_BYTES` is one message sent
from and received into its own storage (no copy); runs of smaller tensors are packed into
one buffer of at most :data:`PACK_BYTES` (so 4,000 tiny tensors are one message). The
receiver checks every CRC block as soon as its message arrived.

Because the receiver first says which step it wants, a step mismatch costs no data: the
sender sends only the header, the receiver raises a :class:`WireError` naming both steps,
and the sender raises a :class:`PGTransportError` for that destination after serving the
others; no message is left unmatched, so the group stays usable.

Receiving (``recv_checkpoint(..., into=None, in_place=True)``; ``into`` defaults to the
``state_dict`` callable's result, as in torchft):

* tensors of ``into`` with the same dtype and shape (CPU, contiguous) are received
  **in place** (same tensor objects; with Gloo the same storage: ``data_ptr`` unchanged;
  ``ProcessGroupBabyGloo`` moves tensors of 1 MiB and more to shared memory in place, once,
  as ``torch.multiprocessing`` does, so their ``data_ptr`` changes but the objects stay);
* other tensors (no match, other device) arrive in fresh CPU tensors (then copied into a
  matching non-CPU target at the end).

Failures (a timeout, a dead peer, a bad checksum): the call raises within ``timeout`` (one
deadline bounds every wait of the call). With ``in_place=False`` or ``into=None`` the
caller's tensors are untouched. With ``in_place=True`` a failure after the first data
message was posted may leave **partial bytes** in the target's tensors; the error then has
``target_modified=True`` and says so (heal again, from this or another peer, before using
them). After a failed receive whose peer may still send (timeout, dead peer, a header we
refuse), the transport calls ``pg.abort()``: messages left in flight would otherwise land
in later operations (or in the target's memory); reconfigure the group before reusing it
(the manager does so on its next quorum). A failed *send* does not abort the group.

CUDA: with ``device=cuda`` (NCCL), tensors of the state dict on that device are sent from
their own device memory and received into device memory (the matching tensor of
``into=`` on that device, in place, else a fresh device tensor): no host copy on either
side. They carry no CRC-32 (``"device": true`` in the header; NCCL moves them device to
device and a checksum would need the bytes on the host); a receiver without a device
refuses such a header. Host tensors of such a state dict travel as on gloo, staged
through a device buffer, with their checksums.
"""

from __future__ import annotations

import collections
import logging
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch

from rallypoint.transports._pool import ReceivePool, pool_enabled
from rallypoint.transports import _tensors as T
from rallypoint.transports._header import (
    _PREFIX,
    DEFAULT_MAX_HEADER_BYTES,
    MAGIC,
    PREFIX_BYTES,
    WireError,
    parse_header,
)
from rallypoint.transports._range_writer import COALESCE_BELOW, RangeWriter
from rallypoint.transports.base import CheckpointTransport
from rallypoint.transports.wire import Sink, encode

logger = logging.getLogger("rallypoint.transports.pg")

#: Point-to-point tag of every message of this transport.
TAG = 0x5250  # "RP"
#: First element of a receiver's request (catches a peer speaking another protocol).
REQUEST_MAGIC = 0x5250_5047_0001  # "RPPG" v1
#: Tensors of this many bytes or more travel as their own message (no copy).
DIRECT_BYTES = COALESCE_BELOW
#: Smaller tensors are packed into buffers of at most this many bytes.
PACK_BYTES = 4 << 20
#: Operations in flight at once per call (bounds pending work; BabyGloo maps at most 64 storages).
WINDOW = 16


class PGTransportError(RuntimeError):
    """A transfer over the process group failed (timeout, dead peer, refused step).

    ``target_modified`` is True when an in-place receive had already written part of the
    caller's tensors.
    """

    def __init__(self, message: str, *, target_modified: bool = False) -> None:
        if target_modified:
            message += " (in-place receive: the target's tensors were partly overwritten; heal again before using them)"
        super().__init__(message)
        self.target_modified = target_modified


@dataclass(frozen=True)
class Message:
    """One data message: tensors ``[first, last)``, data bytes ``[start, start + nbytes)``;
    ``direct``: one tensor sent from / received into its own storage, else a packed buffer."""

    first: int
    last: int
    start: int
    nbytes: int
    direct: bool


def plan_messages(sizes: list[int], direct_bytes: int = DIRECT_BYTES, pack_bytes: int = PACK_BYTES,
                  on_device: list[bool] | None = None) -> list[Message]:
    """The data messages for tensors of ``sizes`` bytes (both sides compute the same).
    A tensor sent from device memory (``on_device``) is always its own message."""
    out: list[Message] = []
    run_first, run_bytes, run_start = 0, 0, 0
    off = 0

    def flush(upto: int) -> None:
        if run_bytes:
            out.append(Message(run_first, upto, run_start, run_bytes, False))

    for i, n in enumerate(sizes):
        if n >= direct_bytes or (on_device is not None and on_device[i] and n):
            flush(i)
            out.append(Message(i, i + 1, off, n, True))
            run_first, run_bytes, run_start = i + 1, 0, off + n
        else:
            if run_bytes and run_bytes + n > pack_bytes:
                flush(i)
                run_first, run_bytes, run_start = i, 0, off
            if not run_bytes:
                run_first, run_start = i, off
            run_bytes += n
        off += n
    flush(len(sizes))
    return out


@dataclass
class TransferStats:
    """What the last send or receive did (for tests and benchmarks)."""

    messages: int = 0  #: point-to-point messages this side issued (requests, header, data)
    data_messages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    peers: list[int] = field(default_factory=list)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (same storage)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    try:
        return flat.view(torch.uint8)
    except RuntimeError:  # dtypes torch will not reinterpret (e.g. complex on some builds)
        return torch.frombuffer(T.byte_view(t), dtype=torch.uint8)


class _Deadline:
    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout.total_seconds()
        self.t0 = time.monotonic()
        self.end = self.t0 + self.timeout

    def left(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _wait(work: Any, dl: _Deadline, what: str) -> None:
    left = dl.left()
    if left <= 0:
        raise TimeoutError(f"{what}: timed out after {dl.elapsed():.2f}s (timeout {dl.timeout:g}s)")
    if work.wait(timedelta(seconds=left)) is False:
        raise TimeoutError(f"{what}: timed out after {dl.elapsed():.2f}s (timeout {dl.timeout:g}s)")


class PGTransport(CheckpointTransport[Any]):
    """Checkpoint transfer over a configured process group (see the module docstring).

    ``send_checkpoint`` returns only when the receivers have everything, so the caller's
    state may change right after it (``copies_state``: nothing served outlives the call).

    Args:
        pg: the group to send/recv on (a temporary one or the cross-replica group); ranks
            passed to send/recv are ranks of this group.
        timeout: default bound of a whole transfer.
        device: where the messages live for the group: CPU for gloo, CUDA for NCCL.
        state_dict: optional callable returning the receiver's own state dict, the
            default ``into=`` template of :meth:`recv_checkpoint` (torchft's argument).
    """

    copies_state = True

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device = torch.device("cpu"),
        state_dict: Callable[[], Any] | None = None,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        abort_on_error: bool = True,
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        #: buffers kept from one receive ``into=`` a state to the next (None: RALLYPOINT_HEAL_BUFFERS=0);
        #: see rallypoint/transports/_pool.py
        self.receive_pool: ReceivePool | None = ReceivePool() if pool_enabled() else None
        self._state_dict = state_dict
        self._max_header_bytes = max_header_bytes
        self._abort_on_error = abort_on_error
        self.last_send = TransferStats()
        self.last_recv = TransferStats()

    def metadata(self) -> str:
        """What peers need to fetch from this transport: nothing (the process group carries it)."""
        return "<pg>"

    def disallow_checkpoint(self) -> None:
        """Nothing to stop: :meth:`send_checkpoint` returns only when it is done."""

    def shutdown(self, wait: bool = True) -> None:
        """The group belongs to the caller; the receive buffers kept are freed."""
        if self.receive_pool is not None:
            self.receive_pool.clear()

    # ------------------------------------------------------------------ helpers

    @property
    def receives_on_device(self) -> bool:
        """Whether received tensors land in device memory (``device=`` not the CPU): the
        Manager then leaves a quorum-thread heal's landing to the transport's default
        (a deferred landing would hold a second device copy of the state until applied)."""
        return self._device.type != "cpu"


    def _send(self, t: torch.Tensor, dst: int) -> Any:
        if self.receives_on_device:
            t = t.to(self._device, non_blocking=False)
        return self._pg.send([t], dst, TAG)

    def _abort(self, why: str) -> None:
        if not self._abort_on_error:
            return
        abort = getattr(self._pg, "abort", None)
        if callable(abort):
            logger.warning("PGTransport: aborting the process group after a failed receive: %s", why)
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort; the receive error is what matters
                logger.exception("PGTransport: abort failed")

    # ------------------------------------------------------------------ sending

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta | None = None) -> None:
        """Send ``state_dict`` as step ``step`` to every rank of ``dst_ranks`` (interleaved,
        message by message, so the destinations progress together). Returns when all
        are done; raises :class:`PGTransportError` naming the destinations that failed
        (the others were served)."""
        dl = _Deadline(timeout or self._timeout)
        stats = self.last_send = TransferStats(peers=list(dst_ranks))
        enc = encode(state_dict, extra={"step": int(step)}, keep_device=self._device if self.receives_on_device else None)
        prefix = torch.frombuffer(bytearray(enc.header[:PREFIX_BYTES]), dtype=torch.uint8)
        body_bytes = enc.header[PREFIX_BYTES:]
        body = torch.frombuffer(bytearray(body_bytes), dtype=torch.uint8) if body_bytes else None
        plan = plan_messages(enc.sizes, on_device=enc.on_device)
        errors: dict[int, str] = {}

        # 1. every destination's request (posted at once, awaited in order)
        reqs = {d: torch.zeros(2, dtype=torch.int64, device=self._device) for d in dst_ranks}
        works = {d: self._pg.recv([reqs[d]], d, TAG) for d in dst_ranks}
        stats.messages += len(dst_ranks)
        serve: list[int] = []
        for d in dst_ranks:
            try:
                _wait(works[d], dl, f"waiting for rank {d}'s request")
            except Exception as e:  # noqa: BLE001
                errors[d] = f"no request from rank {d}: {e}"
                continue
            magic, want = (int(x) for x in reqs[d].cpu().tolist())
            if magic != REQUEST_MAGIC:
                errors[d] = f"rank {d} sent a request that is not a rallypoint PGTransport request (magic {magic:#x})"
                continue
            serve.append(d)
            if want != step:
                errors[d] = f"rank {d} asked for step {want}, this sender serves step {step}; sent the header only"

        # 2. header, then the data (unless the steps differ), destinations interleaved
        inflight: collections.deque[tuple[Any, int, str]] = collections.deque()
        failed: set[int] = set()

        def post(t: torch.Tensor, d: int, what: str) -> None:
            while len(inflight) >= WINDOW:
                settle(*inflight.popleft())
            if d in failed:
                return
            inflight.append((self._send(t, d), d, what))
            stats.messages += 1

        def settle(work: Any, d: int, what: str) -> None:
            if d in failed:
                return
            try:
                _wait(work, dl, f"sending {what} to rank {d}")
            except Exception as e:  # noqa: BLE001
                failed.add(d)
                errors[d] = f"sending {what} to rank {d} failed: {e}"

        for d in serve:
            post(prefix, d, "the header length")
            if body is not None:
                post(body, d, "the header")
        data_dsts = [d for d in serve if d not in errors]
        keep: list[torch.Tensor] = []
        for m in plan:
            if m.direct:
                t = _u8(enc.tensor(m.first))
                what = f"tensor {m.first}"
            else:
                t = torch.empty(m.nbytes, dtype=torch.uint8)
                bv = T.byte_view(t)
                pos = 0
                for i in range(m.first, m.last):
                    v = enc.views[i]
                    bv[pos : pos + v.nbytes] = v
                    pos += v.nbytes
                keep.append(t)
                what = f"tensors {m.first}..{m.last - 1} (packed)"
            for d in data_dsts:
                post(t, d, what)
                stats.data_messages += 1
                stats.bytes += m.nbytes
        while inflight:
            settle(*inflight.popleft())
        stats.seconds = dl.elapsed()
        if errors:
            msg = "; ".join(errors[d] for d in dst_ranks if d in errors)
            raise PGTransportError(f"send_checkpoint of step {step} to ranks {list(dst_ranks)}: {msg}")
        logger.info(
            "PGTransport: sent step %d to ranks %s: %d bytes in %d data messages, %.3fs",
            step, list(dst_ranks), enc.data_bytes, len(plan), stats.seconds,
        )

    # ------------------------------------------------------------------ receiving

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta | None = None,
        *,
        into: Any = None,
        in_place: bool = True,
        mesh: Any = None,
        defer_landing: bool = False,
    ) -> Any:
        """Receive step ``step`` from rank ``src_rank`` of the group.

        ``into``: the receiver's state dict (default: the ``state_dict`` callable's);
        matching tensors are filled (in place with ``in_place``, else from a verified
        staging copy), the rest arrive fresh. Returns the received state dict (holding
        ``into``'s tensor objects where they matched). ``defer_landing`` (with
        ``in_place=False``): return a :class:`~rallypoint.transports.wire.Landing` instead,
        whose ``land()`` puts the verified state into ``into`` later (``Sink(defer=True)``).
        """
        dl = _Deadline(timeout or self._timeout)
        stats = self.last_recv = TransferStats(peers=[src_rank])
        if into is None and self._state_dict is not None:
            into = self._state_dict()
        src = src_rank
        sink: Sink | None = None
        may_be_in_flight = False  # the sender may still send messages we have not posted/finished
        try:
            req = torch.tensor([REQUEST_MAGIC, int(step)], dtype=torch.int64)
            req_work = self._send(req, src)
            pre = torch.zeros(PREFIX_BYTES, dtype=torch.uint8, device=self._device)
            pre_work = self._pg.recv([pre], src, TAG)
            stats.messages += 2
            may_be_in_flight = True
            _wait(req_work, dl, f"sending the request to rank {src}")
            _wait(pre_work, dl, f"receiving the header length from rank {src}")
            magic, hlen, hcrc = _PREFIX.unpack(bytes(T.byte_view(pre.cpu())))
            if magic != MAGIC:
                raise WireError(f"rank {src} did not send a rallypoint wire stream (magic {bytes(magic)!r})")
            if hlen > self._max_header_bytes:
                raise WireError(f"rank {src}'s header of {hlen} bytes is over the limit of {self._max_header_bytes} bytes")
            raw = torch.zeros(hlen, dtype=torch.uint8, device=self._device)
            if hlen:
                w = self._pg.recv([raw], src, TAG)
                stats.messages += 1
                _wait(w, dl, f"receiving the header from rank {src}")
            raw_b = bytes(T.byte_view(raw.cpu())) if hlen else b""
            if zlib.crc32(raw_b) != hcrc:
                raise WireError(f"header from rank {src}: checksum mismatch, the stream is corrupt")
            header = parse_header(raw_b)
            sent_step = header.extra.get("step") if isinstance(header.extra, dict) else None
            if sent_step != step:
                may_be_in_flight = False  # a sender that saw our request sends no data
                raise WireError(
                    f"step mismatch: asked rank {src} for the checkpoint of step {step}, it serves step {sent_step}; "
                    "the quorum's recovery assignment is stale: rejoin the next quorum"
                )
            sink = Sink(header, into=into, in_place=in_place, mesh=mesh,
                        device=self._device if self.receives_on_device else None, pool=self.receive_pool,
                        defer=defer_landing and into is not None)
            try:
                self._recv_data(src, header, sink, dl, stats)
            finally:
                sink.close()
            may_be_in_flight = False
            result = sink.finish()
        except WireError as e:
            if may_be_in_flight:
                self._abort(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - timeouts and process-group failures
            touched = bool(sink is not None and sink.target_touched)
            if may_be_in_flight:
                self._abort(str(e))
            raise PGTransportError(
                f"recv_checkpoint of step {step} from rank {src} failed after {dl.elapsed():.2f}s "
                f"(timeout {dl.timeout:g}s): {e}. Retry from another peer after the group is reconfigured",
                target_modified=touched,
            ) from e
        stats.seconds = dl.elapsed()
        logger.info(
            "PGTransport: received step %d from rank %d: %d bytes in %d data messages, %.3fs",
            step, src, header.data_bytes, stats.data_messages, stats.seconds,
        )
        return result

    def _recv_data(self, src: int, header: Any, sink: Sink, dl: _Deadline, stats: TransferStats) -> None:
        plan = plan_messages([t.nbytes for t in header.tensors], on_device=[t.device for t in header.tensors])
        pieces_of: dict[int, list[int]] = collections.defaultdict(list)
        for pi, p in enumerate(header.pieces):
            pieces_of[p[2]].append(pi)
        inflight: collections.deque[tuple[Any, Message, torch.Tensor, torch.Tensor | None]] = collections.deque()

        def settle(work: Any, m: Message, buf: torch.Tensor, dest: torch.Tensor | None) -> None:
            _wait(work, dl, f"receiving {'tensor ' + header.tensors[m.first].key if m.direct else 'packed tensors'} from rank {src}")
            if m.direct:
                ti = m.first
                assert dest is not None
                if buf is not dest:  # staged on the device
                    _u8(dest).copy_(buf)
                sink.verify_tensor(ti, pieces_of[ti])
            else:
                host = buf.cpu() if buf.device.type != "cpu" else buf
                w = RangeWriter(sink, m.start, m.start + m.nbytes)
                w.write(T.byte_view(host))
                w.close()

        for m in plan:
            while len(inflight) >= WINDOW:
                settle(*inflight.popleft())
            dest: torch.Tensor | None = None
            if m.direct:
                ti = m.first
                dest = sink.destination(ti)
                if sink.writes_into_target(ti):
                    sink.target_touched = True
                if not self.receives_on_device or dest.device == self._device:
                    buf = _u8(dest)  # straight into its storage: host for gloo, the device for NCCL
                    dest = buf
                else:
                    buf = torch.empty(m.nbytes, dtype=torch.uint8, device=self._device)
            else:
                buf = torch.empty(m.nbytes, dtype=torch.uint8, device=self._device)
            inflight.append((self._pg.recv([buf], src, TAG), m, buf, dest))
            stats.messages += 1
            stats.data_messages += 1
            stats.bytes += m.nbytes
        while inflight:
            settle(*inflight.popleft())
