"""The receiving side of :mod:`rallypoint.transports.http`: one receive, from one source
or striped over several.

One source: the header, then the data in ranges over ``num_chunks`` connections, each
range verified as it arrives and retried (up to ``retries`` times) when it fails, from
its first block not yet verified.

Striped (``metadata`` lists several base URLs, comma-separated, the assigned source
first): every source holds the same state (they committed the same steps), so the
ranges are shared out among all of them: each source gets ``num_chunks`` connections,
and every connection takes the next range not yet fetched from one shared queue, so a
faster source serves more of it. A source joins only after its header is byte-for-byte
the first source's (the same tensors, shapes and step). A source that fails
(``retries + 1`` failures, or an answer retrying cannot fix: refused, withdrawn) is
dropped and its ranges go to the others; the receive fails only when every source
did. The inline checksums verify each range against the source that sent it (of the
kind the transport's ``sum_kind`` asks for where the source knows it, else CRC-32). When the
receive is complete, every source is told (``/done``), so a live sender drops its frozen
copy at once instead of at its timeout.

HTTP (:mod:`._http_client`, on the standard library's ``http.client``): every worker
thread keeps one connection to its source for all its ranges, and reads each range's body
straight into the destination tensors (``recv_into`` under the response's buffered
reader; over TLS the ``ssl.SSLSocket`` decrypts into them).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import io
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from http.client import HTTPException, HTTPResponse
from typing import TYPE_CHECKING, Any

from rallypoint._net.limits import MAX_CHECKPOINT_METADATA_BYTES
from rallypoint.transports import wire
from rallypoint.transports._crc import CRC32, SUM_KINDS, kind_named
from rallypoint.transports._http_client import NET_ERRORS, Connection, error_text, read_body
from rallypoint.transports._http_util import SourceRefused, TransferError, TransferTimeout
from rallypoint.transports._prefault import lane_order

if TYPE_CHECKING:
    from rallypoint.transports.http import HTTPTransport

logger = logging.getLogger("rallypoint.transports.http")

#: The data reply's header naming the kind of its inline sums (see _crc.py); none: CRC-32.
SUM_HEADER = "x-rallypoint-sum"
#: The most sources one receive stripes over.
MAX_SOURCES = 8
#: How long a source other than the first may take to publish before it is left out.
SECONDARY_PUBLISH_WAIT_S = 2.0
#: The longest range asked of one of several sources (unless ``max_chunk_bytes`` says):
#: a faster source takes more of them, a dropped one leaves little to hand over.
STRIPE_RANGE_BYTES = 64 << 20


def range_cap(max_chunk: int | None, sources: int) -> int | None:
    """The longest range a receive asks for (None: no cap, one range per connection).

    ``max_chunk`` (``HTTPTransport(max_chunk_bytes=...)``) when set; else, from one source,
    none: every range is a request and a reply head, each about 1.5 ms of wall time on a
    2-core host even with the next request sent ahead, so a warm 1 GB heal over two
    connections took 0.88-0.93 of the time without sums and 0.94-0.99 with XXH3 sums as two
    ranges than as sixteen of 64 MiB (docs/benchmarks.md); a broken range still resumes
    from its first block not yet verified. From several sources, STRIPE_RANGE_BYTES, so
    that the work follows the faster source."""
    if max_chunk is not None:
        return max_chunk
    return STRIPE_RANGE_BYTES if sources > 1 else None


def data_ranges(header: wire.Header, connections: int, sources: int, max_chunk: int | None) -> list[tuple[int, int]]:
    """The byte ranges a receive asks for, in the order its workers take them."""
    return header.split(connections * sources, range_cap(max_chunk, sources))


def piece_bounds(header: wire.Header, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each range's ``[first, last)`` piece indices (ranges are piece-aligned)."""
    return [(header.pieces_in(0, a), header.pieces_in(0, b)) for a, b in ranges]


def parse_sources(metadata: str, src_rank: int) -> list[str]:
    """The base URLs in ``metadata`` (comma-separated, at most MAX_SOURCES); raises
    :class:`TransferError` for anything that is not an http(s) URL."""
    if len(metadata) > MAX_CHECKPOINT_METADATA_BYTES * MAX_SOURCES:
        raise TransferError(f"rank {src_rank}'s checkpoint address is over the size limit: refusing to fetch")
    bases = [b.strip().rstrip("/") for b in metadata.split(",")][:MAX_SOURCES]
    for b in bases:
        if len(b) > MAX_CHECKPOINT_METADATA_BYTES or not b.lower().startswith(("http://", "https://")):
            raise TransferError(f"rank {src_rank}'s checkpoint address {b[:200]!r} is not an http(s) URL: "
                                "refusing to fetch from it")
    return bases


@dataclass
class _Source:
    base: str
    where: str
    ready: bool = False  # its header matched the first source's
    joining: bool = False  # one of its workers is asking for its header
    dead: str | None = None  # why it was dropped
    failures: int = 0
    served: int = 0  # ranges it delivered


class Receive:
    """One ``recv_checkpoint`` call of ``transport`` (its settings: token, TLS, chunks,
    limits, retries)."""

    def __init__(self, transport: HTTPTransport, src_rank: int, metadata: str, step: int, deadline: float) -> None:
        self.t = transport
        self.step = step
        self.deadline = deadline
        bases = parse_sources(metadata, src_rank)
        self.where = f"checkpoint of step {step} from rank {src_rank} at {bases[0]}"
        if len(bases) > 1:
            self.where += f" (+{len(bases) - 1} more sources)"
        try:
            self.context: ssl.SSLContext | None = transport._ssl() if transport._tls.client_tls(bases[0]) else None
        except ValueError as exc:  # TLS required and the source is clear text
            raise TransferError(f"{self.where}: {exc}") from exc
        if self.context is not None:
            bases = ["https://" + b[len("http://"):] if b.startswith("http://") else b for b in bases]
        self.headers = {"authorization": f"Bearer {transport._token}"} if transport._token is not None else {}
        self.sources = [_Source(b, f"{b} (step {step})") for b in bases]
        self.lock = threading.Lock()
        self.header_raw = b""

    # ---------------------------------------------------------------- the whole receive

    def connect(self, src: _Source) -> Connection:
        """A new (not yet opened) connection to ``src`` with this receive's credentials."""
        return Connection(src.base, self.context, self.headers)

    def run(self, into: Any, in_place: bool, mesh: Any, defer: bool = False) -> Any:
        t = self.t
        first = self.sources[0]
        with self.connect(first) as conn:
            try:
                self.header_raw = self._await_header(conn, first, self.deadline)
                header = wire.read_header(io.BytesIO(self.header_raw).readinto, t._max_header, wire.MIN_NETWORK_BLOCK,
                                          t._max_state)
            except TransferError:
                raise
            except TimeoutError as exc:
                raise TransferTimeout(f"{self.where}: no header within the timeout ({exc})") from exc
            except NET_ERRORS as exc:
                raise TransferError(f"{self.where}: {type(exc).__name__}: {exc}") from exc
            except wire.WireError as exc:
                raise TransferError(f"{self.where}: bad header: {exc}") from exc
            if header.extra.get("step") != self.step:
                raise TransferError(f"{self.where}: the header is for step {header.extra.get('step')!r}")
            first.ready = True
            ranges = data_ranges(header, t._num_chunks, len(self.sources), t._max_chunk)
            per_source = max(1, min(t._num_chunks, len(ranges)))  # workers (connections) per source
            try:
                sink = wire.Sink(header, into=into, in_place=in_place, mesh=mesh, pool=t.receive_pool,
                                 defer=defer and into is not None,
                                 prefault_order=lane_order(piece_bounds(header, ranges), per_source * len(self.sources)))
            except wire.WireError as exc:
                raise TransferError(f"{self.where}: {exc}") from exc
            try:
                self._fetch_all(sink, ranges, per_source)
            finally:
                sink.close()
            self._say_done(conn)
        try:
            return sink.finish()
        except wire.WireError as exc:  # pragma: no cover - every range was verified
            raise TransferError(f"{self.where}: {exc}") from exc

    def _say_done(self, first: Connection) -> None:
        """Tell every live source we have everything (best effort, 2 s at most). ``first``:
        the connection to the first source (its header's)."""
        deadline = time.monotonic() + min(2.0, max(0.1, self.deadline - time.monotonic()))

        def done(src: _Source) -> None:
            conn = first if src is self.sources[0] else self.connect(src)
            try:
                reply = conn.get(f"/checkpoint/{self.step}/done", deadline)
                error_text(conn, reply, deadline)  # a few bytes: read, so the connection could be reused
            except NET_ERRORS as exc:
                logger.debug("%s: could not say done: %s", src.where, exc)
            finally:
                if conn is not first:
                    conn.close()

        # Every source still up, used or not: one that was asked for its header counts
        # the receive as started and would otherwise keep (and copy) its state.
        live = [s for s in self.sources if s.dead is None]
        if len(live) == 1:
            done(live[0])
            return
        with cf.ThreadPoolExecutor(len(live), thread_name_prefix="rp-http-done") as ex:
            list(ex.map(done, live))

    # ---------------------------------------------------------------- headers

    def _await_header(self, conn: Connection, src: _Source, deadline: float,
                      stop: threading.Event | None = None) -> bytes:
        """The header, asking again while the source has not published this step yet
        (until ``stop``: the receive is complete without this source)."""
        pw = self.t._publish_wait
        give_up = deadline if pw is None else min(deadline, time.monotonic() + pw)
        pause = 0.005
        while True:
            if stop is not None and stop.is_set():
                raise TransferError(f"{src.where}: not needed any more")
            try:
                return self._get_header(conn, src, deadline)
            except SourceRefused as exc:
                if exc.status != 404 or time.monotonic() + pause >= give_up:
                    if exc.status == 404 and pw != 0:
                        raise TransferTimeout(f"{exc} (still, after waiting for it to be published)") from exc
                    raise
                logger.debug("%s: not published yet (HTTP %d); asking again", src.where, exc.status)
            time.sleep(pause)  # the source is remote: there is no event to wait on
            pause = min(pause * 2, 0.02)  # a restarted replica waits on this: keep the lag small

    def _get_header(self, conn: Connection, src: _Source, deadline: float) -> bytes:
        """The header bytes, refusing to buffer more than the header size limit."""
        limit = self.t._max_header + wire.PREFIX_BYTES
        reply = conn.get(f"/checkpoint/{self.step}/header", deadline)
        if reply.status != 200:
            raise _refused(conn, reply, src.where, deadline)
        try:
            return read_body(conn, reply, limit, deadline, f"{src.where}: header")
        except ValueError:
            raise TransferError(f"{src.where}: header larger than the limit of {self.t._max_header} bytes") from None

    def _join(self, conn: Connection, src: _Source, cv: threading.Condition, stop: threading.Event) -> bool:
        """Whether ``src`` may serve ranges: its header must be the first source's. One of
        the source's workers asks (over its own connection ``conn``); the others wait for
        its answer."""
        with cv:
            while src.joining and not (src.ready or src.dead is not None or stop.is_set()):
                cv.wait(0.05)
            if src.ready or src.dead is not None or stop.is_set():
                return src.dead is None and src.ready
            src.joining = True
        try:
            raw = self._await_header(conn, src, min(self.deadline, time.monotonic() + SECONDARY_PUBLISH_WAIT_S),
                                     stop)
        except (OSError, HTTPException, TransferError) as exc:
            if not stop.is_set():
                self._drop(src, f"no header: {exc}")
            with cv:
                src.joining = False
                cv.notify_all()
            return False
        with cv:
            src.joining = False
            if raw != self.header_raw:
                src.dead = src.dead or "it serves a different state (its header differs from the first source's)"
                logger.warning("%s: left out of the striped heal: %s", src.where, src.dead)
            else:
                src.ready = True
            cv.notify_all()
            return src.dead is None and src.ready

    def _drop(self, src: _Source, why: str, refused: bool = False) -> None:
        """Take ``src`` out of the receive. ``refused``: the source itself said why (a
        410 naming a changed tensor, say): that reason wins over an earlier symptom of
        the same cause (the stream it dropped mid-range)."""
        with self.lock:
            first = src.dead is None
            if first or refused:
                src.dead = why
            if first:
                others = [s for s in self.sources if s.dead is None]
                if others:
                    logger.warning("%s: dropped from the striped heal (%s); %d other source(s) go on",
                                   src.where, why, len(others))

    # ---------------------------------------------------------------- data

    def _fetch_all(self, sink: wire.Sink, ranges: list[tuple[int, int]], per_source: int) -> None:
        t = self.t
        todo: collections.deque[tuple[int, int]] = collections.deque(ranges)
        left = [len(ranges)]
        writing = [0]  # workers inside _fetch_range: the only ones that write into the sink
        cv = threading.Condition(self.lock)
        stop = threading.Event()
        errors: list[BaseException] = []

        def worker(src: _Source) -> None:
            with self.connect(src) as conn:  # this worker's, for all its ranges
                work(src, conn)

        def work(src: _Source, conn: Connection) -> None:
            if src is not self.sources[0] and not self._join(conn, src, cv, stop):
                with cv:
                    cv.notify_all()
                return
            while not stop.is_set():
                with cv:
                    while not todo and left[0] > 0 and src.dead is None and not stop.is_set():
                        cv.wait(0.1)  # a range may come back from a failing source
                    if not todo or src.dead is not None or stop.is_set():
                        return
                    rng = todo.popleft()
                    writing[0] += 1
                at = [rng[0]]  # where the range's first piece not yet verified starts
                try:
                    try:
                        self._fetch_range(conn, src, sink, rng, stop, at)
                    finally:
                        with cv:
                            writing[0] -= 1
                            cv.notify_all()
                except (OSError, HTTPException, wire.WireError, TransferError) as exc:
                    with cv:
                        # Fetched again from its first piece not yet verified: the pieces
                        # before it are in place and checked, and a live sender may have
                        # retired their tensors once it sent them (HTTP 410 to fetching them again).
                        todo.appendleft((at[0], rng[1]))
                        src.failures += 1
                        fatal = isinstance(exc, SourceRefused) or src.failures > t._retries
                        cv.notify_all()
                    if time.monotonic() >= self.deadline:
                        errors.append(exc)
                        stop.set()
                        return
                    logger.warning("%s: range %s failed (%d): %s%s", src.where, rng, src.failures, exc,
                                   f" (resumed from {at[0]})" if at[0] > rng[0] else "")
                    if fatal:
                        self._drop(src, f"{type(exc).__name__}: {exc}", refused=isinstance(exc, SourceRefused))
                        errors.append(exc)
                        with cv:
                            cv.notify_all()
                        return
                    continue
                with cv:
                    src.served += 1
                    src.failures = 0  # failures in a row drop a source, not failures in all
                    left[0] -= 1
                    cv.notify_all()

        workers = [s for s in self.sources for _ in range(per_source)]
        ex = cf.ThreadPoolExecutor(max(1, len(workers)), thread_name_prefix="rp-http-recv")
        futures = [ex.submit(worker, s) for s in workers]
        try:
            with cv:
                while left[0] > 0 and not stop.is_set():
                    if all(s.dead is not None for s in self.sources):
                        break
                    if time.monotonic() >= self.deadline:
                        break
                    if all(f.done() for f in futures):
                        break
                    cv.wait(min(0.1, max(0.0, self.deadline - time.monotonic())))
                done = left[0] == 0
            if not done:
                # A source's own refusal says why; a dropped stream is only its symptom.
                refusals = [e for e in errors if isinstance(e, SourceRefused)]
                exc = refusals[-1] if refusals else errors[-1] if errors else None
                if isinstance(exc, TimeoutError) or (exc is None and time.monotonic() >= self.deadline):
                    raise TransferTimeout(f"{self.where}: not complete within the timeout"
                                          + (f": {exc}" if exc else "")) from exc
                if isinstance(exc, TransferError) and len(self.sources) == 1:
                    raise exc
                why = "; ".join(f"{s.base}: {s.dead}" for s in self.sources if s.dead) or repr(exc)
                raise TransferError(f"{self.where}: every source failed: {why}") from exc
        finally:
            stop.set()
            with cv:
                cv.notify_all()
            # Workers notice ``stop`` at their next chunk and every read has a deadline, so
            # they end by then anyway; wait (a moment at most) until none is still writing a
            # range into the destination. A worker still asking a late source for its header
            # writes nothing: waiting for it held a complete receive up by up to a second.
            ex.shutdown(wait=False, cancel_futures=True)
            end = time.monotonic() + min(1.0, max(0.0, self.deadline - time.monotonic()))
            with cv:
                while writing[0] > 0 and time.monotonic() < end:
                    cv.wait(max(0.0, end - time.monotonic()))
            cf.wait(futures, timeout=0.05)  # the others (asking for a header) stop at their next poll
        served = {s.base: s.served for s in self.sources if s.served}
        if len(self.sources) > 1:
            logger.info("%s: ranges per source %s", self.where, served)

    def _fetch_range(self, conn: Connection, src: _Source, sink: wire.Sink, rng: tuple[int, int],
                     stop: threading.Event, at: list[int]) -> None:
        """Range ``rng`` from ``src`` over ``conn``, read straight into the sink's tensors;
        ``at[0]`` follows where its first piece not yet verified starts (where a retry resumes)."""
        start, end = rng
        deadline = self.deadline
        what = f"{src.where}: range [{start}, {end})"
        params: dict[str, int | str] = {"start": start, "end": end}
        if self.t.sum_kind is not CRC32:
            params["sum"] = self.t.sum_kind.name
        reply = conn.get(f"/checkpoint/{self.step}/data", deadline, params)
        if reply.status != 200:
            raise _refused(conn, reply, what, deadline)
        if reply.length != sink.header.wire_bytes(start, end):
            conn.close()
            raise wire.WireError(f"range [{start}, {end}): the source announced {reply.length} bytes")
        said = reply.getheader(SUM_HEADER)  # absent: a source that knows only CRC-32
        kind = kind_named(said) if sink.header.inline else CRC32
        if kind is None:
            conn.close()
            raise wire.WireError(f"range [{start}, {end}): the source's sums are of kind {(said or '')[:40]!r}, "
                                 f"which this receiver does not know (it knows {', '.join(SUM_KINDS)})")
        if not kind.verifies and self.t.sum_kind.verifies:
            conn.close()
            raise wire.WireError(f"range [{start}, {end}): the source sent no sums, and this receiver asked for "
                                 f"{self.t.sum_kind.name} (HTTPTransport(checksum='none') is the receiver's choice)")
        w = sink.writer(start, end, kind)
        try:
            w.pull(conn.body_reader(reply, deadline, what, stop))
        except BaseException:
            at[0] = w.verified_to
            conn.close()
            raise
        if stop.is_set():
            conn.close()
            return
        w.close()
        conn.release(reply)


def _refused(conn: Connection, reply: HTTPResponse, where: str, deadline: float) -> SourceRefused:
    """The error for a reply that is not 200, quoting the start of its body."""
    return SourceRefused(f"{where}: HTTP {reply.status}: {error_text(conn, reply, deadline)}", reply.status)


__all__ = ["MAX_SOURCES", "Receive", "SUM_HEADER", "parse_sources"]
