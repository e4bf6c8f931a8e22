"""HTTPTransport: serve a state dict over HTTP in the safe wire format, fetch it in parallel.

Sender: a small threaded HTTP/1.1 server (:mod:`._http_serve`; one thread per connection,
no web framework to import). ``send_checkpoint`` returns at once: nothing is copied and
nothing is checksummed up front. By default (``serve="live"``) the caller's own tensors
are served and frozen just before they change (:mod:`._live`: ``disallow_checkpoint``,
which the Manager calls in ``should_commit``, and any optimizer step copy whatever is not
yet delivered); ``serve="copy"`` serves a copy taken at ``send_checkpoint``. Each
checksum block's sum is computed on the connection's thread as the block is sent, and
follows it on the wire (``"sums": "inline"``). Routes::

    GET /checkpoint/{step}/header               prefix + JSON header (wire.py)
    GET /checkpoint/{step}/data?start=S&end=E[&sum=K]
                                                data bytes [S, E) with their inline sums,
                                                cut at checksum blocks; the sums are of
                                                kind K where this server knows it, else
                                                CRC-32 (the reply's x-rallypoint-sum
                                                header names the kind; see _crc.py)
    GET /checkpoint/{step}/full                 the whole wire stream (one connection)

Bodies are written with ``sendall`` straight from memoryviews of the tensors (no copy in
Python; over TLS each connection's thread encrypts its own range). An older step than
the served one gets 409 naming it; nothing served, or only an older step, gets 404 (a
receiver asks again: the sender may not have published yet), and a step that was served
and withdrawn (delivered, replaced, expired, or changed while served) gets 410 saying
why (it will not come back); a wrong or missing bearer token gets 401 before anything
else, and its connection is closed; a parameter that is not an integer gets 422. When
the connection cap is reached, a newcomer replaces the oldest connection that has not
sent an authorized request yet, so idle connections cannot lock healing peers out
(:mod:`._http_serve`).

Receiver (:mod:`._http_recv`, over :mod:`._http_client`: keep-alive connections on the
standard library's ``http.client``, nothing more to import at a process's first heal).
It reads the header, allocates the destination tensors (wire.Sink: fresh
ones, their pages mapped by a thread ahead of the bytes (:mod:`._prefault`), or the
caller's own with ``into=``), and fetches the data in ranges over
``num_chunks`` connections per source, straight into the tensors with ``recv_into``,
each range verified as it arrives and retried when it fails. ``metadata`` may list
several sources (comma-separated): the receive is then striped over all of them, and a
source that fails is dropped and its ranges fetched from the others. Any failure that
survives the retries, and any deadline overrun, is a :class:`TransferError` and leaves
the caller's state as :mod:`rallypoint.transports.wire` describes (untouched unless
``in_place=True``), so the caller can retry against another source.

TLS (``rallypoint._net.tls``): the server serves it when the job has a certificate
(``RALLYPOINT_TLS_CERT/KEY``) and then advertises ``https://``; a receiver verifies the
source against ``RALLYPOINT_TLS_CA`` and presents the job's certificate for mutual TLS.

Memory: the live sender holds no copy of contiguous CPU tensors of 1 MiB or more until it
freezes, and then only of what is not yet delivered (with ``precopy=True`` a background
thread copies that ahead of the freeze once a receiver asks). Device, non-contiguous and
smaller tensors are copied once, at ``send_checkpoint``. The receiver holds the state once (fresh
tensors) plus, with ``into=`` and ``in_place=False``, the target until the copy.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from rallypoint._net.addr import is_loopback
from rallypoint._net.auth import bearer_matches, job_token
from rallypoint._net.fds import raise_open_file_limit
from rallypoint._net.tls import TlsConfig, check_server, client_ssl_context, server_ssl_context, tls_config
from rallypoint.transports._crc import CRC32, SUM_KINDS, SumKind, fastest, kind_named
from rallypoint.transports._pool import ReceivePool, pool_enabled
from rallypoint.transports import wire
from rallypoint.transports._http_recv import SUM_HEADER, Receive
from rallypoint.transports._live import COPY_BELOW, LiveEncoded
from rallypoint.transports._http_serve import CheckpointServer, Reply, Request, _Served, int_param, to_int
from rallypoint.transports._http_util import (  # noqa: F401 - re-exported
    SourceRefused,
    TransferError,
    TransferTimeout,
    default_connections,
    default_max_state_bytes,
    usable_cpus,
)
from rallypoint.transports.base import CheckpointTransport

logger = logging.getLogger("rallypoint.transports.http")

#: The kind of inline sum receives ask for when the constructor names none.
CHECKSUM_ENV = "RALLYPOINT_HEAL_CHECKSUM"

#: Largest piece written per sendall: lets an abort land fast.
SEND_PIECE = 1 << 20


class HTTPTransport(CheckpointTransport[Any]):
    """Checkpoint transport over HTTP; ``HTTPTransport(timeout, num_chunks)`` as in torchft.

    Args:
        timeout: default for network calls, for ``disallow_checkpoint``'s wait (copy),
            and for how long a frozen state stays served (live).
        num_chunks: parallel connections per source of a receive (0 or 1: one
            connection; default ``None``: 4, or fewer on a host with fewer CPUs, see
            ``_http_util.default_connections``).
        bind: ``host:port`` to listen on (port 0: any free port).
        advertise_host: host name put in :meth:`metadata` (default: the bound address, or
            this machine's host name for a wildcard bind).
        token: bearer token required to fetch, and sent when fetching (default:
            ``RALLYPOINT_TOKEN``, the job's credential; an empty one is an error).
        max_chunk_bytes: upper bound of one range (default ``None``: from one source, one
            range per connection; striped over several sources, 64 MiB, so the faster
            source takes more; see ``_http_recv.range_cap``). A broken range resumes from
            its first block not yet verified whatever its length.
        block: the checksum block (4 MiB: a quarter of the per-block work of the wire
            format's 1 MiB default, which in bench/heal_stall.py cut the sender's step-time
            loss while serving from ~50 to ~17 ms per GB).
        retries: extra attempts per failed range (against the same source), each from
            the range's first block not yet verified.
        max_state_bytes: the largest state this receiver accepts (checked on the header,
            before anything is allocated; default :func:`default_max_state_bytes`).
        publish_wait: how long a receiver keeps asking a source that serves nothing yet
            (404) before giving up; capped by the call's timeout. A withdrawn step (410)
            or another step (409) fails at once.
            Sender and receiver learn of a heal at the same moment, and the sender
            publishes only when its training thread reaches a safe point, so a receiver
            may arrive first. ``timedelta(0)``: refuse at the first 404.
        serve: ``"live"`` (default): serve the caller's tensors, frozen before they
            change (see :mod:`rallypoint.transports._live`); ``"copy"``: serve a copy
            taken at ``send_checkpoint`` (memory and time for a copy of the state, but
            any change of the caller's state at any time is safe).
        copy_below: live serving copies tensors smaller than this at ``send_checkpoint``
            (what forward changes, like BatchNorm statistics, is small).
        precopy: live serving also copies the undelivered tensors on a background
            thread once a receiver asks, so that a heal longer than the step leaves the
            freeze (on the training thread) little to copy. The cost is memory for what
            is copied (up to the state's size, while the heal runs) and memory bandwidth
            during forward and backward, spent even on bytes the receiver gets before
            the freeze: worth it for a sender that steps while peers still read and has
            idle cores (a DiLoCo sender on a GPU box), not in the Manager's usual step,
            where the sources freeze only after the healing peer has everything.
        copy_on_send: the older spelling: True is ``serve="copy"``, False ``"live"``.
        checksum: the kind of inline sum a receive asks its sources for: ``"xxh3"``
            (the default where the ``xxhash`` package is installed: about 40 % of CRC-32's
            CPU on the receiving side) or ``"crc32"``. A source that does not know the
            kind sends CRC-32 and the receive verifies that (see ``_crc.py``).
            ``"none"`` (opt-in) asks for no sums: the bytes are trusted to the connection
            (redundant with TLS, whose records are authenticated; on clear text, TCP's
            checksum only), which saves both ends a pass over the state (about 0.1 s of
            sender CPU per GB here). A live piece is still never taken whole when the
            sender's step overtook it. A source never sends no sums unasked: a receiver
            that asked for sums refuses such a reply. Default: ``RALLYPOINT_HEAL_CHECKSUM``
            where set (so ``rallypoint run`` and the Manager's own transport can be told),
            else the fastest known.
    """

    #: A connection must finish its TLS handshake and each request head within this.
    HEADER_TIMEOUT_S = 10.0
    #: Connections served at once (receivers open ``num_chunks`` each); more are closed.
    MAX_CONNECTIONS = 64

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        num_chunks: int | None = None,
        *,
        bind: str = "0.0.0.0:0",
        advertise_host: str | None = None,
        token: str | None = None,
        max_chunk_bytes: int | None = None,
        retries: int = 2,
        block: int = 4 << 20,
        max_header_bytes: int = wire.DEFAULT_MAX_HEADER_BYTES,
        publish_wait: timedelta | None = None,
        copy_on_send: bool | None = None,
        max_state_bytes: int | None = None,
        tls: TlsConfig | None = None,
        serve: str | None = None,
        copy_below: int = COPY_BELOW,
        precopy: bool = False,
        checksum: str | None = None,
    ) -> None:
        said = "checksum"
        if checksum is None and os.environ.get(CHECKSUM_ENV):
            checksum, said = os.environ[CHECKSUM_ENV], CHECKSUM_ENV
        kind = fastest() if checksum is None else SUM_KINDS.get(checksum)
        if kind is None:
            raise ValueError(f"{said}={checksum!r}: this process knows {', '.join(SUM_KINDS)}"
                             + ("" if "xxh3" in SUM_KINDS else " (xxh3 needs the xxhash package)"))
        #: the kind of inline sum a receive asks its sources for
        self.sum_kind: SumKind = kind
        if not kind.verifies:
            logger.info("checkpoint receives ask for no inline sums (checksum='none'): the bytes are trusted to "
                        "the connection (TLS's authenticated records from an https source, else TCP's checksum)")
        if block < wire.MIN_NETWORK_BLOCK:
            raise ValueError(f"block={block} is below the {wire.MIN_NETWORK_BLOCK}-byte minimum receivers accept")
        self._max_state = max_state_bytes if max_state_bytes is not None else default_max_state_bytes()
        self._timeout = timeout
        if serve is None:
            serve = "copy" if copy_on_send else "live"
        if serve not in ("live", "copy"):
            raise ValueError(f"serve must be 'live' or 'copy', not {serve!r}")
        #: "live": serve the caller's tensors, frozen before they change (see _live.py);
        #: "copy": serve a copy taken at send_checkpoint.
        self.serve_mode = serve
        self._copy_below = copy_below
        self._precopy = precopy
        #: A receive can be striped over several sources (``metadata`` lists them).
        self.stripes = True
        #: The served state is guarded by the transport itself (a copy, or live tensors
        #: frozen before the optimizer changes them): the Manager passes its own state.
        self.copies_state = True
        self._publish_wait = None if publish_wait is None else publish_wait.total_seconds()
        self._num_chunks = default_connections(usable_cpus()) if num_chunks is None else max(1, int(num_chunks))
        #: buffers kept from one receive ``into=`` a state to the next (None: RALLYPOINT_HEAL_BUFFERS=0);
        #: see rallypoint/transports/_pool.py
        self.receive_pool: ReceivePool | None = ReceivePool() if pool_enabled() else None
        self._token = job_token(token)  # the argument, else RALLYPOINT_TOKEN (the job's credential)
        self._tls = tls or tls_config()  # the argument, else RALLYPOINT_TLS_*
        if max_chunk_bytes is not None and max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes={max_chunk_bytes}: a range holds at least one byte (None: no cap)")
        self._max_chunk = max_chunk_bytes
        self._retries = retries
        self._block = block
        self._max_header = max_header_bytes
        self._served: _Served | None = None
        self._withdrawn: int | None = None  # the step last withdrawn (answered 410, not 404)
        self._ssl_ctx: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        host, _, port = bind.rpartition(":")
        host = host.strip("[]")
        check_server(self._tls, "the checkpoint server", host, self._token, is_loopback(host))
        server_ctx = server_ssl_context(self._tls)  # None for clear text; fails here naming the files
        raise_open_file_limit()  # idle sockets from anyone must not exhaust our descriptors
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, int(port)))
        self._sock.listen(128)
        self._port = int(self._sock.getsockname()[1])
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        shown = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self._url = f"{self._tls.scheme()}://{shown}:{self._port}"
        self._server = CheckpointServer(self._sock, self._route, ssl_context=server_ctx, name=f"checkpoint:{self._port}",
                                        header_timeout=self.HEADER_TIMEOUT_S, max_connections=self.MAX_CONNECTIONS,
                                        authorize=self._authorized)
        logger.info("checkpoint HTTP transport serving on %s", self._url)

    # ------------------------------------------------------------------ serving side

    def _authorized(self, request: Request) -> bool:
        return self._token is None or bearer_matches(request.headers.get("authorization"), self._token)

    def _lookup(self, step: int) -> _Served | Reply:
        served = self._served
        spoiled = getattr(served.enc, "spoiled", None) if served is not None else None
        if served is not None and spoiled is not None and served.step == step:
            return Reply(410, f"the checkpoint of step {step} is withdrawn: {spoiled}")
        if served is None and self._withdrawn is not None and step <= self._withdrawn:
            return Reply(
                410,
                f"the checkpoint of step {self._withdrawn} was withdrawn (the sender's step ended); "
                "heal again in the next quorum",
            )
        if served is None:
            return Reply(404, f"no checkpoint is being served (asked for step {step}); this replica is not sending now")
        if served.step < step:
            # An older offer is still up (a copy served on the training thread stays until
            # the sender's next step): step ``step`` may not be published yet.
            return Reply(404, f"serving the checkpoint of step {served.step}; step {step} is not published yet")
        if served.step != step:
            return Reply(409, f"serving the checkpoint of step {served.step}, not step {step}")
        return served

    def _pieces(self, served: _Served, start: int, end: int, with_header: bool,
                sum_kind: SumKind = CRC32) -> Iterator[memoryview]:
        """The body's pieces (inline sums of kind ``sum_kind``); tests override this to
        inject faults."""
        if with_header:
            yield memoryview(served.enc.header)
        yield from served.enc.iter_data(start, end, SEND_PIECE, sum_kind)

    def _route(self, request: Request) -> Reply:
        """``GET /checkpoint/{step}/{header,data,full,done}`` (the server has checked the
        token: a request without it never gets here)."""
        parts = request.parts
        if len(parts) != 3 or parts[0] != "checkpoint" or parts[2] not in ("header", "data", "full", "done"):
            return Reply(404, "not found: the routes are /checkpoint/{step}/header, /data?start=&end=, /full and /done")
        step = to_int(parts[1], "the step in the path")
        if parts[2] == "done":  # a receiver has what it needs from us: the frozen state may go
            with self._lock:
                current = self._served
            if current is not None and current.step == step and isinstance(current.enc, LiveEncoded):
                current.enc.receiver_done()
            return Reply(200, "ok")
        served = self._lookup(step)
        if isinstance(served, Reply):
            return served
        enc = served.enc
        if isinstance(enc, LiveEncoded):
            enc.started = True
        if parts[2] == "header":
            return Reply(200, served=served, pieces=iter([memoryview(enc.header)]), length=len(enc.header))
        if parts[2] == "full":
            return Reply(200, served=served, pieces=self._pieces(served, 0, enc.data_bytes, True), length=enc.stream_bytes)
        start, end = int_param(request.query, "start"), int_param(request.query, "end")
        if not 0 <= start <= end <= enc.data_bytes:
            return Reply(416, f"range [{start}, {end}) outside the data of {enc.data_bytes} bytes")
        if enc.inline and not enc.aligned(start, end):
            return Reply(416, f"range [{start}, {end}) is not aligned to the {enc.block}-byte checksum blocks")
        kind = CRC32
        if enc.inline:  # the receiver may ask for another kind of inline sum (see _crc.py)
            kind = kind_named((request.query.get("sum") or [""])[-1]) or CRC32
        return Reply(200, served=served, pieces=self._pieces(served, start, end, False, kind),
                     length=enc.wire_bytes(start, end), headers={SUM_HEADER: kind.name})

    def metadata(self) -> str:
        """The base URL receivers fetch from (the token is not part of it)."""
        return self._url

    @property
    def port(self) -> int:
        """The port the checkpoint server listens on."""
        return self._port

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` as ``step`` until every receiver has it (or ``timeout``
        after :meth:`disallow_checkpoint`, or the next ``send_checkpoint``).

        Returns at once: nothing is copied or checksummed up front (checksums are computed
        as each piece is sent). ``serve="live"`` (the default) serves the caller's tensors
        and freezes them before they change (:mod:`rallypoint.transports._live`): call
        :meth:`disallow_checkpoint` before changing the state outside an optimizer step
        (an optimizer step freezes it on its own). ``serve="copy"`` serves a copy taken
        here, so the caller may change its state at once. ``dst_ranks``: the receivers
        expected (the frozen state is dropped once each has every byte). ``timeout``
        bounds each piece's send and the life of the frozen state.
        """
        self._withdraw()
        box: list[_Served] = []

        def delivered() -> None:
            if box:
                self._withdraw(box[0], "delivered")

        if self.serve_mode == "copy":
            enc: wire.Encoded = wire.encode(state_dict, block=self._block, extra={"step": step}, copy=True,
                                            sums="inline")
        else:
            enc = LiveEncoded(
                wire.encode(state_dict, block=self._block, extra={"step": step}, copy_below=self._copy_below,
                            sums="inline"),
                receivers=len(dst_ranks), on_complete=delivered, precopy=self._precopy,
            )
        served = _Served(step, enc, timeout.total_seconds())
        box.append(served)
        with self._lock:
            self._served = served
        logger.info(
            "serving checkpoint of step %d (%d bytes, %d tensors, %s) to ranks %s",
            step,
            enc.data_bytes,
            len(enc.views),
            f"{getattr(enc, 'live_bytes', 0)} bytes live" if self.serve_mode == "live" else "a copy",
            list(dst_ranks),
        )

    def disallow_checkpoint(self) -> None:
        """The caller is about to change its state (the Manager calls this in
        ``should_commit``, before the optimizer steps). Live: freeze the served state
        (copy what is not yet delivered; return once no read of live memory is in
        flight) and go on serving the frozen state until the receivers have it, for at
        most the timeout; a live state no receiver asked for yet is withdrawn instead
        (nothing copied), and a state already frozen (``freeze_checkpoint`` in an earlier
        round) is left to its receivers and its expiry. Copy: stop offering it, waiting
        (up to the timeout) for the streams in flight, then abort those still running."""
        with self._lock:
            served = self._served
        if served is None:
            return
        enc = served.enc
        if isinstance(enc, LiveEncoded):
            if enc.frozen and enc.spoiled is None:
                # Already independent of the caller's memory (frozen by freeze_checkpoint
                # in an earlier round, or by an optimizer step): it stays served until its
                # receivers have it, a newer state replaces it, or its expiry. Withdrawing
                # it here, because this round serves nothing, took it from under a
                # receiver that had not asked yet.
                self._expire_later(served)
                return
            if enc.delivered or enc.spoiled is not None or not enc.started:
                # Nothing to keep: every receiver has it, or none came (a late one is
                # told it was withdrawn and heals again): no copy.
                self._withdraw(served, "delivered" if enc.delivered else "spoiled" if enc.spoiled else "not asked for")
                return
            enc.freeze(served.timeout)
            if enc.spoiled is not None:
                self._withdraw(served, "spoiled")
            else:
                self._expire_later(served)
            return
        with self._lock:
            if self._served is served:
                self._served = None
                self._withdrawn = served.step
        wait_s = served.timeout
        with served.done:
            served.withdrawn = True
            if not served.done.wait_for(lambda: served.active == 0, timeout=wait_s):
                logger.warning(
                    "step %d: %d transfers still running after %.1f s; aborting them",
                    served.step,
                    served.active,
                    wait_s,
                )
                served.aborted = True
                served.done.wait_for(lambda: served.active == 0, timeout=5.0)
        logger.info("stopped serving checkpoint of step %d", served.step)

    def freeze_checkpoint(self) -> None:
        """The caller is about to change its state, but a receiver may not have asked yet
        (the Manager serves on the training thread right before its vote): live, copy
        what is not yet delivered and go on serving it (for at most the timeout); copy,
        nothing to do."""
        with self._lock:
            served = self._served
        if served is None or not isinstance(served.enc, LiveEncoded):
            return
        served.enc.freeze(served.timeout)
        self._expire_later(served)

    def _expire_later(self, served: _Served) -> None:
        if served.enc.delivered if isinstance(served.enc, LiveEncoded) else False:
            self._withdraw(served, "delivered")
        elif served.expiry is None:
            served.expiry = threading.Timer(served.timeout, self._withdraw, args=(served, "timed out"))
            served.expiry.daemon = True
            served.expiry.start()

    def _withdraw(self, served: _Served | None = None, why: str = "replaced") -> bool:
        """Stop offering ``served`` (default: whatever is on offer) at once: streams in
        flight stop at their next piece; a live state is frozen first, so no byte of the
        caller's memory is read after this returns."""
        with self._lock:
            if served is None:
                served = self._served
            if served is None or served.withdrawn:
                return False
            served.withdrawn = True
            if self._served is served:
                self._served = None
                self._withdrawn = served.step
        if served.expiry is not None:
            served.expiry.cancel()
        if isinstance(served.enc, LiveEncoded):
            served.enc.freeze(served.timeout, keep=False)
        if why != "delivered":
            served.aborted = True
        with served.done:
            idle = served.active == 0
        if idle:
            served.release()
        logger.info("stopped serving checkpoint of step %d (%s)", served.step, why)
        return True

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving: close the port and every connection (threads joined up to 10 s when ``wait``)."""
        self._withdraw(why="shutting down")
        self._server.stop(timeout=10.0 if wait else 0.0)
        if self.receive_pool is not None:
            self.receive_pool.clear()  # the receive buffers kept for the next heal

    # ------------------------------------------------------------------ receiving side

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta,
        *,
        into: Any = None,
        in_place: bool = False,
        mesh: Any = None,
        defer_landing: bool = False,
    ) -> Any:
        """Fetch the checkpoint of ``step`` from ``metadata``: a base URL, or several,
        comma-separated, to stripe the receive over (the first is the assigned source;
        see :mod:`rallypoint.transports._http_recv`).

        ``into``/``in_place``/``mesh`` as in :class:`rallypoint.transports.wire.Sink`;
        ``defer_landing`` (with ``into``): return a :class:`~rallypoint.transports.wire.Landing`
        whose ``land()`` puts the verified state into ``into`` later, on the caller's thread
        of choice (``Sink(defer=True)``). Raises :class:`TransferError` (or
        :class:`TransferTimeout`) naming the source.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        return Receive(self, src_rank, metadata, step, deadline).run(into, in_place, mesh, defer_landing)

    def _ssl(self) -> ssl.SSLContext:
        """One TLS context per transport (only used for TLS sources): building one per
        receive costs tens of milliseconds of CA loading. It verifies against the job's CA
        (``RALLYPOINT_TLS_CA``; the system's without one) and presents the job's certificate."""
        with self._lock:
            if self._ssl_ctx is None:
                self._ssl_ctx = client_ssl_context(self._tls)
            return self._ssl_ctx
