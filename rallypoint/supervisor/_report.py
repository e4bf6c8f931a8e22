"""Reports ``rallypoint run``'s events (``restart``, ``gave_up``, ``stopped``, ...) to the
lighthouse, so its ``/events`` and dashboard show why a replica group left and came back.

Why a thread and a bounded queue: the supervisor's main loop restarts ranks, and nothing
it does may wait on the network. ``post`` only appends to a queue of :data:`QUEUE_SIZE`
events (the oldest is dropped when full); a daemon thread sends them, each attempt with a
timeout of :data:`SEND_TIMEOUT_S`. Failures are logged (rate-limited) and never raised:
the event is in the supervisor's own log either way, the lighthouse's copy is a
convenience.

Why grpc is imported in the thread: the supervisor process must start fast and imports
neither torch nor grpc (grpc alone costs a noticeable part of a second); the first
event that needs sending pays for it, off the main thread.

A lighthouse without the RPC (torchft's) answers UNIMPLEMENTED: that is logged once at
INFO and the reporter stops sending. Without a lighthouse address, ``post`` does nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from rallypoint._net.limits import MAX_EVENT_DETAILS_BYTES, MAX_REPLICA_ID_BYTES, clip
from rallypoint._net.ratelog import Throttle, left_out_note

log = logging.getLogger("rallypoint.run")

QUEUE_SIZE = 64
#: Each attempt (connecting included) gets at most this long.
SEND_TIMEOUT_S = 3.0
ATTEMPTS = 3
RETRY_S = 0.5  # doubled after each failed attempt
#: At most one warning this often (with a count of those left out).
WARN_INTERVAL_S = 30.0
MAX_LIST = 16
MAX_KEYS = 31  # the lighthouse takes 32, one kept for ``truncated``
MAX_STRING_BYTES = 512
#: Keys the lighthouse's event log reserves, and ``group``, which travels in its own field.
_SKIPPED_KEYS = frozenset({"group", "kind", "replica_id", "self"})
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_INT = 2**62


def group_label(group: str | None, environ: Mapping[str, str]) -> str:
    """The replica group's label: ``group``, else ``REPLICA_GROUP_ID``, else
    ``host:pid`` (a group without an id is still told apart from the others)."""
    label = group if group else environ.get("REPLICA_GROUP_ID") or f"{socket.gethostname()}:{os.getpid()}"
    label = "".join(c if c.isprintable() else "?" for c in label)
    return clip(label, MAX_REPLICA_ID_BYTES)


def _text(value: str) -> str:
    return clip("".join(c if c.isprintable() else " " for c in value), MAX_STRING_BYTES)


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) <= _MAX_INT else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return _text(value if isinstance(value, str) else str(value))


def flat_details(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` in the shape the lighthouse accepts: identifier keys, scalars and lists
    of at most :data:`MAX_LIST` scalars, at most 4 KiB of JSON (fields that do not fit are
    left out and ``truncated`` says so). Never raises for odd values: they become text."""
    out: dict[str, Any] = {}
    size = 2  # "{}"
    budget = MAX_EVENT_DETAILS_BYTES - len(',"truncated":true')
    for key, value in fields.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in _SKIPPED_KEYS or len(out) >= MAX_KEYS:
            continue
        item = [_scalar(v) for v in list(value)[:MAX_LIST]] if isinstance(value, (list, tuple)) else _scalar(value)
        cost = len(json.dumps({key: item}, separators=(",", ":")).encode()) - 1  # less the braces, plus a comma
        if size + cost > budget:
            out["truncated"] = True
            continue
        out[key] = item
        size += cost
    return out


class _Disabled(Exception):
    """Sending can never work (unusable token or TLS settings): stop trying."""


class EventReporter:
    """Sends ``rallypoint run``'s events to the lighthouse at ``lighthouse_addr`` (None:
    nowhere) as replica group ``group``, with the token and TLS settings of ``environ``
    (``RALLYPOINT_TOKEN``, ``RALLYPOINT_TLS_*``), as every rallypoint client does."""

    def __init__(self, lighthouse_addr: str | None, group: str | None, environ: Mapping[str, str], *,
                 queue_size: int = QUEUE_SIZE, send_timeout: float = SEND_TIMEOUT_S) -> None:
        self._addr = (lighthouse_addr or "").strip() or None
        self.group = group_label(group, environ)
        self._environ = dict(environ)
        self._send_timeout = send_timeout
        self._queue: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=queue_size)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._client: Any = None  # a LighthouseClient, made in the thread
        self._closed = False  # no more posts
        self._off = self._addr is None  # nothing will ever be sent
        self._deadline: float | None = None  # set by close(): flush until then
        self.sent = 0
        self.dropped = 0
        self._warn_throttle = Throttle(WARN_INTERVAL_S)

    @property
    def enabled(self) -> bool:
        """Whether posted events are (still) being sent."""
        return not self._off

    # ------------------------------------------------------------------ caller side
    def post(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Queue one event for the lighthouse; returns at once and never raises."""
        if self._off:
            return
        try:
            details = flat_details(fields)
        except Exception as e:  # noqa: BLE001 - a reporting problem must never reach the main loop
            log.debug("event %s not reported: its fields cannot be encoded: %r", kind, e)
            return
        with self._cond:
            if self._closed or self._off:
                return
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1  # the deque drops the oldest (counters change under the lock)
            self._queue.append((kind, details))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rallypoint-run-events", daemon=True)
                try:
                    self._thread.start()
                except RuntimeError as e:  # no thread can be started: report nothing
                    self._off = True
                    log.warning("not reporting events to the lighthouse: cannot start a thread: %s", e)
                    return
            self._cond.notify()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued for at most ``timeout`` seconds, then stop; what is left
        is dropped (and counted). Idempotent; later posts do nothing."""
        with self._cond:
            self._closed = True
            if self._deadline is None:
                self._deadline = time.monotonic() + max(0.0, timeout)
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            return
        thread.join(max(0.0, self._deadline - time.monotonic()) + 0.1)
        if thread.is_alive():
            # Stuck past its deadline (a connect or call that ignores its timeout):
            # closing the channel cancels what is in flight; the thread is a daemon.
            with self._cond:
                self._off = True
                self._drop(len(self._queue))
                self._queue.clear()
            client = self._client
            if client is not None:
                client.close()

    # ------------------------------------------------------------------ thread side
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed and not self._off:
                        self._cond.wait(60.0)
                    if self._off or not self._queue:
                        return
                    kind, details = self._queue.popleft()
                self._deliver(kind, details)
        except Exception as e:  # noqa: BLE001 - never let a reporting bug kill anything but reporting
            self._off = True
            log.warning("stopped reporting events to the lighthouse at %s: %r", self._addr, e)
        finally:
            client, self._client = self._client, None
            if client is not None:
                client.close()
            with self._cond:
                left = len(self._queue)
                self._drop(left)
                self._queue.clear()
            if left:
                log.info("%d queued event(s) were not reported to the lighthouse at %s", left, self._addr)

    def _budget(self, attempt_end: float) -> float:
        """Seconds left for this attempt: to its end, or to close()'s deadline if sooner."""
        deadline = self._deadline
        end = attempt_end if deadline is None else min(attempt_end, deadline)
        return end - time.monotonic()

    def _deliver(self, kind: str, details: dict[str, Any]) -> None:
        last: Exception | None = None
        for attempt in range(ATTEMPTS):
            end = time.monotonic() + self._send_timeout
            budget = self._budget(end)
            if budget <= 0:
                self._requeue_front(kind, details)  # counted with the rest by _run
                self._off = True
                return
            try:
                client = self._connect(budget)
                client.report_event(self.group, kind, details, timeout=max(0.05, self._budget(end)))
                with self._cond:
                    self.sent += 1
                return
            except NotImplementedError as e:
                log.info("not reporting events to the lighthouse: %s", e)
                self._off = True
                self._drop(1)
                return
            except _Disabled as e:
                log.warning("not reporting events to the lighthouse at %s: %s", self._addr, e)
                self._off = True
                self._drop(1)
                return
            except (ValueError, PermissionError) as e:  # refused as malformed, or the wrong token
                last = e
                break
            except Exception as e:  # noqa: BLE001 - ConnectionError, TimeoutError, rate limit: try again
                last = e
            pause = min(RETRY_S * 2**attempt, max(0.0, self._budget(math.inf)))
            if attempt + 1 < ATTEMPTS and pause > 0:
                with self._cond:
                    self._cond.wait_for(lambda: self._off, pause)
            if self._off:
                break
        self._drop(1)
        self._warn(f"the {kind} event of group {self.group} was not reported to the lighthouse at {self._addr}: {last}")

    def _drop(self, count: int) -> None:
        with self._cond:
            self.dropped += count

    def _requeue_front(self, kind: str, details: dict[str, Any]) -> None:
        with self._cond:
            self._queue.appendleft((kind, details))

    def _connect(self, timeout: float) -> Any:
        if self._client is not None:
            return self._client
        from rallypoint._net.auth import job_token
        from rallypoint._net.tls import tls_config
        from rallypoint.lighthouse.client import LighthouseClient

        try:
            token, tls = job_token(None, self._environ), tls_config(environ=self._environ)
        except (ValueError, OSError) as e:  # TlsError is a ValueError
            raise _Disabled(f"the job's token or TLS settings are unusable: {e}") from None
        try:
            self._client = LighthouseClient(self._addr or "", connect_timeout=timeout, token=token, tls=tls)
        except ValueError as e:  # e.g. TLS required but the address is clear text
            raise _Disabled(str(e)) from None
        return self._client

    def _warn(self, message: str) -> None:
        left_out = self._warn_throttle.ready()
        if left_out is not None:
            log.warning("%s%s", message, left_out_note(left_out, "similar warning(s)"))


__all__ = ["EventReporter", "flat_details", "group_label"]
