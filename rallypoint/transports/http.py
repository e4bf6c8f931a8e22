"""HTTPTransport: serve a state dict over HTTP in the safe wire format, fetch it in parallel.

Sender: a small threaded HTTP/1.1 server (:mod:`._http_serve`; one thread per connection,
no web framework to import). ``send_checkpoint`` encodes the state dict once (checksums
computed, device or non-contiguous tensors copied to contiguous host memory; contiguous CPU
tensors are *not* copied) and serves exactly that step until ``disallow_checkpoint``. Routes::

    GET /checkpoint/{step}/header               prefix + JSON header (wire.py)
    GET /checkpoint/{step}/data?start=S&end=E   data bytes [S, E), cut at checksum blocks
    GET /checkpoint/{step}/full                 the whole wire stream (one connection)

Bodies are written with ``sendall`` straight from memoryviews of the tensors (no copy in
Python; over TLS each connection's thread encrypts its own range). An older step than
the served one gets 409 naming it; nothing served, or only an older step, gets 404 (a
receiver asks again: the sender may not have published yet), and a step that was served
and withdrawn gets 410 (it will not come back); a wrong or missing bearer token gets 401
before anything else; a parameter that is not an integer gets 422.

Receiver: httpx, imported at the first receive (not at import: a Manager constructs a
transport to serve, and most never fetch; httpx costs a cold start tens of ms). It reads
the header, allocates the destination tensors (wire.Sink: fresh ones, or the caller's own
with ``into=``), splits the data into ``num_chunks`` or more ranges and fetches them over
that many connections at once; each range is verified as it arrives and retried (up to
``retries`` times) when it fails. Any failure that survives the retries, and any deadline
overrun, is a :class:`TransferError` and leaves the caller's state as
:mod:`rallypoint.transports.wire` describes (untouched unless ``in_place=True``), so the
caller can retry against another source.

Receive fast path: httpx parses a body 64 KiB at a time in Python and hands out ``bytes``
(one more copy). The status and headers still go through httpx, then the body is read
with ``recv_into`` straight into the destination tensors from the socket under the
response (httpcore's ``network_stream`` extension; over TLS the ``ssl.SSLSocket``, which
decrypts into them); that connection is then closed rather than reused. Where the
extension is missing, the plain ``iter_raw`` path is used.

TLS (``rallypoint._net.tls``): the server serves it when the job has a certificate
(``RALLYPOINT_TLS_CERT/KEY``) and then advertises ``https://``; a receiver verifies the
source against ``RALLYPOINT_TLS_CA`` and presents the job's certificate for mutual TLS.

Memory: the sender holds no copy of contiguous CPU tensors (device or non-contiguous ones
are copied once, at ``send_checkpoint``); the receiver holds the state once (fresh
tensors) plus, with ``into=`` and ``in_place=False``, the target until the copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rallypoint._net.auth import bearer_matches, job_token
from rallypoint._net.addr import is_loopback
from rallypoint._net.limits import MAX_CHECKPOINT_METADATA_BYTES
from rallypoint._net.tls import TlsConfig, check_server, client_ssl_context, server_ssl_context, tls_config
from rallypoint.transports import wire
from rallypoint.transports._http_serve import CheckpointServer, Reply, Request, _Served, int_param, to_int
from rallypoint.transports._http_util import (
    SourceRefused,
    TransferError,
    TransferTimeout,
    _check_status,
    _Fatal,
    _plain_socket,
    _timeout,
    default_max_state_bytes,
)
from rallypoint.transports.base import CheckpointTransport

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("rallypoint.transports.http")

#: Largest piece written per sendall: lets an abort land fast.
SEND_PIECE = 1 << 20


class HTTPTransport(CheckpointTransport[Any]):
    """Checkpoint transport over HTTP; ``HTTPTransport(timeout, num_chunks)`` as in torchft.

    Args:
        timeout: default for network calls and for ``disallow_checkpoint``'s wait.
        num_chunks: parallel connections per receive (0 or 1: one connection).
        bind: ``host:port`` to listen on (port 0: any free port).
        advertise_host: host name put in :meth:`metadata` (default: the bound address, or
            this machine's host name for a wildcard bind).
        token: bearer token required to fetch, and sent when fetching (default:
            ``RALLYPOINT_TOKEN``, the job's credential; an empty one is an error).
        max_chunk_bytes: upper bound of one range, so a retry re-fetches little.
        retries: extra attempts per failed range (against the same source).
        max_state_bytes: the largest state this receiver accepts (checked on the header,
            before anything is allocated; default :func:`default_max_state_bytes`).
        publish_wait: how long a receiver keeps asking a source that serves nothing yet
            (404) before giving up; capped by the call's timeout. A withdrawn step (410)
            or another step (409) fails at once.
            Sender and receiver learn of a heal at the same moment, and the sender
            publishes only when its training thread reaches a safe point, so a receiver
            may arrive first. ``timedelta(0)``: refuse at the first 404.
    """

    #: A connection must finish its TLS handshake and each request head within this.
    HEADER_TIMEOUT_S = 10.0
    #: Connections served at once (receivers open ``num_chunks`` each); more are closed.
    MAX_CONNECTIONS = 64

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        num_chunks: int = 4,
        *,
        bind: str = "0.0.0.0:0",
        advertise_host: str | None = None,
        token: str | None = None,
        max_chunk_bytes: int = 64 << 20,
        retries: int = 2,
        block: int = wire.DEFAULT_BLOCK,
        max_header_bytes: int = wire.DEFAULT_MAX_HEADER_BYTES,
        publish_wait: timedelta | None = None,
        copy_on_send: bool = True,
        max_state_bytes: int | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        if block < wire.MIN_NETWORK_BLOCK:
            raise ValueError(f"block={block} is below the {wire.MIN_NETWORK_BLOCK}-byte minimum receivers accept")
        self._max_state = max_state_bytes if max_state_bytes is not None else default_max_state_bytes()
        self._timeout = timeout
        #: ``send_checkpoint`` serves a copy (the caller may change its state at once);
        #: off: contiguous CPU tensors are served from their own memory (no extra RAM).
        self.copies_state = bool(copy_on_send)
        self._publish_wait = None if publish_wait is None else publish_wait.total_seconds()
        self._num_chunks = max(1, int(num_chunks))
        self._token = job_token(token)  # the argument, else RALLYPOINT_TOKEN (the job's credential)
        self._tls = tls or tls_config()  # the argument, else RALLYPOINT_TLS_*
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
                                        header_timeout=self.HEADER_TIMEOUT_S, max_connections=self.MAX_CONNECTIONS)
        logger.info("checkpoint HTTP transport serving on %s", self._url)

    # ------------------------------------------------------------------ serving side

    def _authorized(self, request: Request) -> bool:
        return self._token is None or bearer_matches(request.headers.get("authorization"), self._token)

    def _lookup(self, step: int) -> _Served | Reply:
        served = self._served
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

    def _pieces(self, served: _Served, start: int, end: int, with_header: bool) -> Iterator[memoryview]:
        """The body's pieces; tests override this to inject faults."""
        if with_header:
            yield memoryview(served.enc.header)
        yield from served.enc.iter_data(start, end, SEND_PIECE)

    def _route(self, request: Request) -> Reply:
        """``GET /checkpoint/{step}/{header,data,full}``: the token first, then the step."""
        if not self._authorized(request):
            return Reply(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                         {"www-authenticate": "Bearer"})
        parts = request.parts
        if len(parts) != 3 or parts[0] != "checkpoint" or parts[2] not in ("header", "data", "full"):
            return Reply(404, "not found: the routes are /checkpoint/{step}/header, /data?start=&end= and /full")
        step = to_int(parts[1], "the step in the path")
        served = self._lookup(step)
        if isinstance(served, Reply):
            return served
        enc = served.enc
        if parts[2] == "header":
            return Reply(200, served=served, pieces=iter([memoryview(enc.header)]), length=len(enc.header))
        if parts[2] == "full":
            return Reply(200, served=served, pieces=self._pieces(served, 0, enc.data_bytes, True), length=enc.stream_bytes)
        start, end = int_param(request.query, "start"), int_param(request.query, "end")
        if not 0 <= start <= end <= enc.data_bytes:
            return Reply(416, f"range [{start}, {end}) outside the data of {enc.data_bytes} bytes")
        return Reply(200, served=served, pieces=self._pieces(served, start, end, False), length=end - start)

    def metadata(self) -> str:
        """The base URL receivers fetch from (the token is not part of it)."""
        return self._url

    @property
    def port(self) -> int:
        return self._port

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Encode ``state_dict`` and serve it as ``step`` until :meth:`disallow_checkpoint`.

        Returns once it is served. By default (``copy_on_send``) a copy is served, so the
        caller may change its state at once: training goes on while a peer fetches (a
        synchronous quorum's sender keeps stepping through DiLoCo's sync delay; BatchNorm
        buffers change during forward). With ``copy_on_send=False`` contiguous CPU tensors
        are served from their own memory and must not change before ``disallow_checkpoint``
        returns (a change is caught by the receiver's checksums, not silently received).
        ``timeout`` bounds each piece's send and ``disallow_checkpoint``'s wait for this step.
        """
        enc = wire.encode(state_dict, block=self._block, extra={"step": step}, copy=self.copies_state)
        self.disallow_checkpoint()
        with self._lock:
            self._served = _Served(step, enc, timeout.total_seconds())
        logger.info(
            "serving checkpoint of step %d (%d bytes, %d tensors) to ranks %s",
            step,
            enc.stream_bytes,
            len(enc.views),
            list(dst_ranks),
        )

    def disallow_checkpoint(self) -> None:
        """Stop offering the checkpoint; wait (up to the timeout) for streams in flight,
        then abort those still running, so the state dict may be mutated afterwards."""
        with self._lock:
            served, self._served = self._served, None
            if served is not None:
                self._withdrawn = served.step
        if served is None:
            return
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

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving: close the port and every connection (threads joined up to 10 s when ``wait``)."""
        with self._lock:
            served, self._served = self._served, None
        if served is not None:
            served.aborted = True
        self._server.stop(timeout=10.0 if wait else 0.0)

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
    ) -> Any:
        """Fetch the checkpoint of ``step`` from ``metadata`` (a base URL).

        ``into``/``in_place``/``mesh`` as in :class:`rallypoint.transports.wire.Sink`.
        Raises :class:`TransferError` (or :class:`TransferTimeout`) naming the source.
        """
        import httpx  # here, not at import (see the module docstring)

        base = metadata.rstrip("/")
        deadline = time.monotonic() + timeout.total_seconds()
        if len(base) > MAX_CHECKPOINT_METADATA_BYTES or not base.lower().startswith(("http://", "https://")):
            raise TransferError(f"rank {src_rank}'s checkpoint address {base[:200]!r} is not an http(s) URL: "
                                "refusing to fetch from it")
        where = f"checkpoint of step {step} from rank {src_rank} at {base}"
        headers = {"authorization": f"Bearer {self._token}"} if self._token is not None else {}
        limits = httpx.Limits(max_connections=self._num_chunks, max_keepalive_connections=self._num_chunks)
        # No TLS context for plain http: loading the CA bundle costs ~50 ms of a cold receive.
        try:
            verify: ssl.SSLContext | bool = self._ssl() if self._tls.client_tls(base) else False
        except ValueError as exc:  # TLS required and the source is clear text
            raise TransferError(f"{where}: {exc}") from exc
        if verify is not False and base.startswith("http://"):
            base = "https://" + base[len("http://"):]
        with httpx.Client(headers=headers, limits=limits, timeout=_timeout(deadline), verify=verify) as client:
            try:
                raw = self._await_header(client, f"{base}/checkpoint/{step}/header", deadline, where)
                header = wire.read_header(io.BytesIO(raw).readinto, self._max_header, wire.MIN_NETWORK_BLOCK,
                                          self._max_state)
            except httpx.TimeoutException as exc:
                raise TransferTimeout(f"{where}: no header within the timeout ({exc})") from exc
            except httpx.HTTPError as exc:
                raise TransferError(f"{where}: {type(exc).__name__}: {exc}") from exc
            except wire.WireError as exc:
                raise TransferError(f"{where}: bad header: {exc}") from exc
            if header.extra.get("step") != step:
                raise TransferError(f"{where}: the header is for step {header.extra.get('step')!r}")
            try:
                sink = wire.Sink(header, into=into, in_place=in_place, mesh=mesh)
            except wire.WireError as exc:
                raise TransferError(f"{where}: {exc}") from exc
            max_chunk = self._max_chunk
            if verify is not False:
                # Over TLS every range is a new connection and a full handshake (the fast
                # path closes it after the body): no more ranges than connections.
                max_chunk = max(max_chunk, -(-header.data_bytes // self._num_chunks))
            ranges = header.split(self._num_chunks, max_chunk)
            self._fetch_all(client, base, step, sink, ranges, deadline, where)
        try:
            return sink.finish()
        except wire.WireError as exc:  # pragma: no cover - every range was verified
            raise TransferError(f"{where}: {exc}") from exc

    def _await_header(self, client: httpx.Client, url: str, deadline: float, where: str) -> bytes:
        """The header, asking again while the source has not published this step yet."""
        give_up = deadline if self._publish_wait is None else min(deadline, time.monotonic() + self._publish_wait)
        pause = 0.005
        while True:
            try:
                return self._get_header(client, url, deadline, where)
            except SourceRefused as exc:
                if exc.status != 404 or time.monotonic() + pause >= give_up:
                    if exc.status == 404 and self._publish_wait != 0:
                        raise TransferTimeout(f"{exc} (still, after waiting for it to be published)") from exc
                    raise
                logger.debug("%s: not published yet (HTTP %d); asking again", where, exc.status)
            time.sleep(pause)  # the source is remote: there is no event to wait on
            pause = min(pause * 2, 0.02)  # a restarted replica waits on this: keep the lag small

    def _get_header(self, client: httpx.Client, url: str, deadline: float, where: str) -> bytes:
        """The header bytes, refusing to buffer more than the header size limit."""
        limit = self._max_header + wire.PREFIX_BYTES
        with client.stream("GET", url, timeout=_timeout(deadline)) as r:
            if r.status_code != 200:
                _check_status(r, where)
            buf = bytearray()
            for chunk in r.iter_bytes():
                buf += chunk
                if len(buf) > limit:
                    raise TransferError(f"{where}: header larger than the limit of {self._max_header} bytes")
            return bytes(buf)

    def _ssl(self) -> ssl.SSLContext:
        """One TLS context per transport (only used for TLS sources): building one per
        receive costs tens of milliseconds of CA loading. It verifies against the job's CA
        (``RALLYPOINT_TLS_CA``; the system's without one) and presents the job's certificate."""
        with self._lock:
            if self._ssl_ctx is None:
                self._ssl_ctx = client_ssl_context(self._tls)
            return self._ssl_ctx

    def _fetch_all(
        self,
        client: httpx.Client,
        base: str,
        step: int,
        sink: wire.Sink,
        ranges: list[tuple[int, int]],
        deadline: float,
        where: str,
    ) -> None:
        import httpx

        stop = threading.Event()

        def fetch(rng: tuple[int, int]) -> None:
            last: Exception | None = None
            for attempt in range(self._retries + 1):
                if stop.is_set():
                    return
                try:
                    self._fetch_range(client, base, step, sink, rng, deadline, stop)
                    return
                except _Fatal:
                    raise
                except (httpx.HTTPError, wire.WireError) as exc:
                    last = exc
                    if time.monotonic() >= deadline:
                        break
                    logger.warning("%s: range %s attempt %d failed: %s", where, rng, attempt + 1, exc)
            assert last is not None
            raise last

        ex = cf.ThreadPoolExecutor(max(1, min(self._num_chunks, len(ranges))), thread_name_prefix="rp-http-recv")
        futures = [ex.submit(fetch, r) for r in ranges]
        try:
            done, pending = cf.wait(
                futures, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_EXCEPTION
            )
            failed = [f for f in done if f.exception() is not None]
            if failed:
                exc = failed[0].exception()
                if isinstance(exc, TransferError):
                    raise exc
                if isinstance(exc, httpx.TimeoutException):
                    raise TransferTimeout(f"{where}: timed out: {exc}") from exc
                raise TransferError(f"{where}: {type(exc).__name__}: {exc}") from exc
            if pending:
                raise TransferTimeout(f"{where}: not complete within the timeout")
        finally:
            stop.set()
            # Workers notice ``stop`` at their next chunk and every read has a deadline, so
            # they end by then anyway; wait a moment so none writes after we return.
            ex.shutdown(wait=False, cancel_futures=True)
            cf.wait(futures, timeout=min(1.0, max(0.0, deadline - time.monotonic())))

    def _fetch_range(
        self,
        client: httpx.Client,
        base: str,
        step: int,
        sink: wire.Sink,
        rng: tuple[int, int],
        deadline: float,
        stop: threading.Event,
    ) -> None:
        import httpx

        start, end = rng
        url = f"{base}/checkpoint/{step}/data"
        with client.stream("GET", url, params={"start": start, "end": end}, timeout=_timeout(deadline)) as r:
            if r.status_code != 200:
                _check_status(r, f"range [{start}, {end})")
            length = int(r.headers.get("content-length", -1))
            if length != end - start:
                raise wire.WireError(f"range [{start}, {end}): the source announced {length} bytes")
            w = sink.writer(start, end)
            sock = _plain_socket(r)
            chunks = r.iter_raw()
            if sock is None:
                for chunk in chunks:
                    if stop.is_set():
                        return
                    w.write(chunk)
                w.close()
                return
            # Fast path: take what httpx already buffered, then recv_into the tensors
            # directly (no per-64 KiB Python parsing, no intermediate bytes). The
            # connection's HTTP state no longer matches its socket, so httpx closes it
            # instead of reusing it (it never saw the end of this body).
            first = next(chunks, b"")
            w.write(first)
            left = end - start - len(first)

            timeout_set = float("inf")

            def readinto(mv: memoryview) -> int:
                nonlocal left, timeout_set
                if stop.is_set() or left <= 0:
                    return 0
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise httpx.ReadTimeout(f"range [{start}, {end}) not complete by the deadline")
                if timeout_set - remaining > 0.25:
                    # Not per read: over TLS a read is one 16 KiB record, and each
                    # settimeout costs syscalls. A read may overrun the deadline by 0.25 s.
                    sock.settimeout(remaining)
                    timeout_set = remaining
                try:
                    n = sock.recv_into(mv, min(mv.nbytes, left))
                except TimeoutError as exc:
                    raise httpx.ReadTimeout(f"range [{start}, {end}): {exc}") from exc
                except OSError as exc:
                    raise httpx.ReadError(f"range [{start}, {end}): {exc}") from exc
                left -= n
                return n

            w.pull(readinto)
            if stop.is_set():
                return
            w.close()
