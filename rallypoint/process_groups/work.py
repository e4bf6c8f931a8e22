"""Work objects returned by rallypoint process groups.

Every Work here is a real ``torch.distributed.Work`` (DDP and ``dist.*`` calls accept
it) whose ``wait()`` never blocks past the group's timeout and, on failure, raises a
:class:`ProcessGroupError` that names the op, the number of peers and the quorum --
and reports the error to its group so ``errored()`` tells the manager to reconfigure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.distributed_c10d import Work
from torch.futures import Future

from .errors import ProcessGroupError, ProcessGroupTimeout, describe

logger = logging.getLogger("rallypoint.process_groups.work")


@dataclass(frozen=True)
class OpInfo:
    """What an error message needs to say about one op."""

    op: str
    world_size: int
    quorum_id: int | None
    replica_id: str | None
    timeout: timedelta

    def label(self) -> str:
        return describe(self.op, self.world_size, self.quorum_id, self.replica_id)


def effective_timeout(timeout: timedelta | None, default: timedelta) -> timedelta:
    """torch passes ``timedelta(0)`` (or nothing) to mean "the group's timeout"."""
    if timeout is None or timeout.total_seconds() <= 0:
        return default
    return timeout


def wrap_failure(info: OpInfo, exc: BaseException, elapsed: float, timeout: timedelta) -> ProcessGroupError:
    """Turn a backend exception into a ProcessGroupError with the op's context."""
    text = str(exc)
    timed_out = elapsed >= timeout.total_seconds() * 0.95 or "timed out" in text.lower() or "timeout" in text.lower()
    cls = ProcessGroupTimeout if timed_out else ProcessGroupError
    what = f"timed out after {elapsed:.2f}s (timeout {timeout.total_seconds():g}s)" if timed_out else f"failed after {elapsed:.2f}s"
    msg = (
        f"{info.label()} {what}: {text.strip().rstrip('.!') or type(exc).__name__}. "
        "A peer is probably dead or hung; reconfigure the group with a new quorum."
    )
    return cls(msg, op=info.op, world_size=info.world_size, quorum_id=info.quorum_id)


class CompletedWork(Work):
    """A Work that is already done (dummy groups, swallowed errors, no-op ops)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result if result is not None else []

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut


class FailedWork(Work):
    """A Work that fails on ``wait()`` with a fixed error (fault injection, dead group)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self._error

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_exception(self._error)
        return fut


#: How long ``OpWork.wait`` first waits in the backend's own ``wait`` before it waits on an
#: event that the op's completion or an abort sets. Most small collectives end within it,
#: and then no thread hands off: the event path needs a Python callback on gloo's thread,
#: which must take the GIL and wake the waiter (~0.2 ms a collective on a busy 2-core
#: machine). An abort during this first wait is noticed when it ends.
BACKEND_FIRST_WAIT = timedelta(milliseconds=5)


class OpWork(Work):
    """Wraps a backend Work: bounded wait, contextual errors, one-time finishing step.

    ``finish`` runs exactly once after the backend op succeeded, whichever of
    ``wait()`` or ``get_future()`` sees it first: it completes ops the backend
    cannot do natively (AVG on gloo divides the SUM; emulated reduce-scatters copy
    their chunk out).
    """

    def __init__(
        self,
        inner: Work,
        info: OpInfo,
        on_error: Callable[[ProcessGroupError], None],
        finish: Callable[[], None] | None = None,
        result: Any = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._info = info
        self._on_error = on_error
        self._finish = finish
        self._result = result
        self._lock = threading.Lock()
        self._finished = False
        self._error: ProcessGroupError | None = None
        self._start = time.monotonic()
        self._done = threading.Event()
        self._watched = False

    def interrupt(self, err: ProcessGroupError) -> None:
        """Fail a pending ``wait()`` now with ``err`` (the group was aborted).

        A backend op blocked on a hung or dead peer cannot be cancelled (gloo's own
        abort leaves it waiting for its timeout), but its waiter need not wait with it:
        the caller moves on to a new quorum, and the stuck op ends with its old backend.
        """
        with self._lock:
            if self._done.is_set() or self._error is not None:
                return
            self._error = err
        self._done.set()

    @property
    def inner(self) -> Work:
        """The backend's own work."""
        return self._inner

    def _finish_once(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if self._finish is not None:
                self._finish()

    def _fail(self, exc: BaseException, timeout: timedelta) -> ProcessGroupError:
        with self._lock:
            if self._error is None:
                self._error = wrap_failure(self._info, exc, time.monotonic() - self._start, timeout)
                err = self._error
            else:
                return self._error
        logger.warning("%s", err)
        self._on_error(err)
        return err

    def wait(self, timeout: timedelta | None = None) -> bool:
        t = effective_timeout(timeout, self._info.timeout)
        if self._error is not None:
            raise self._error
        with self._lock:
            watch, self._watched = not self._watched, True
        left = t.total_seconds()
        if watch:
            # Wait on an event that the backend's completion *or* an abort sets. Some
            # gloo works (send/recv, barrier) have no future: those wait in the backend
            # for the whole timeout (no short first wait: gloo fails a send or recv whose
            # limited wait runs out).
            try:
                fut = self._inner.get_future()
            except RuntimeError:
                self._done.set()
            else:
                # Not for a wait shorter than that: gloo takes a limit in whole
                # milliseconds, and 0 ms would mean none.
                if t >= BACKEND_FIRST_WAIT:
                    if self._waited_in_backend(BACKEND_FIRST_WAIT, t):
                        self._finish_once()
                        return True
                    left -= BACKEND_FIRST_WAIT.total_seconds()  # the whole wait stays within t
                fut.add_done_callback(lambda _f: self._done.set())
        if not self._done.wait(left):
            raise self._fail(TimeoutError(f"no completion within {t.total_seconds():g}s"), t)
        if self._error is not None:
            raise self._error
        try:
            self._inner.wait(t)  # completed: returns at once, or raises the backend's error
        except Exception as e:  # noqa: BLE001 - every backend failure becomes a ProcessGroupError
            raise self._fail(e, t) from e
        self._finish_once()
        return True

    def _waited_in_backend(self, limit: timedelta, timeout: timedelta) -> bool:
        """Wait up to ``limit`` in the backend itself: True when the op succeeded within it.
        Raises the op's own failure; False when it is still running (or an abort came
        meanwhile): then ``wait`` goes on with the event an abort also sets."""
        try:
            self._inner.wait(limit)
        except Exception:  # noqa: BLE001 - the limit's end ("Operation timed out!"), or the op's own failure
            if not self._inner.is_completed():
                return False  # the op runs on, nothing is marked failed
            self._done.set()  # any other waiter reads the outcome from the completed work
            try:  # it ended meanwhile: a completed work returns at once or raises its own failure
                self._inner.wait(limit)
            except Exception as e:  # noqa: BLE001 - every backend failure becomes a ProcessGroupError
                raise self._fail(e, timeout) from e
        self._done.set()
        return self._error is None

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._error is None and self._inner.is_success()

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> Future:
        inner_fut = self._inner.get_future()

        def done(f: Future) -> Any:
            try:
                value = f.value()
            except Exception as e:  # noqa: BLE001
                raise self._fail(e, self._info.timeout) from e
            self._finish_once()
            return self._result if self._result is not None else value

        return inner_fut.then(done)


class EventWork(Work):
    """A Work completed by another thread (``set_result``/``set_error``).

    Used by groups whose ops do not run on a torch backend in this process (the
    subprocess-isolated groups, the managed group): ``wait()`` waits on an Event
    with the group's timeout, and ``on_timeout`` lets the group act (kill a child).
    """

    def __init__(
        self,
        info: OpInfo,
        on_error: Callable[[ProcessGroupError], None],
        on_timeout: Callable[[ProcessGroupError], None] | None = None,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._info = info
        self._on_error = on_error
        self._on_timeout = on_timeout
        self._before_wait = before_wait
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._value: Any = None
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def set_result(self, value: Any) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._value = value
            self._event.set()
            futs, self._futures = self._futures, []
        for f in futs:
            f.set_result(value)

    def set_error(self, exc: BaseException) -> None:
        with self._lock:
            if self._event.is_set():
                return
            if not isinstance(exc, ProcessGroupError):
                exc = wrap_failure(self._info, exc, time.monotonic() - self._start, self._info.timeout)
            self._error = exc
            self._event.set()
            futs, self._futures = self._futures, []
        for f in futs:
            f.set_exception(exc)

    def wait(self, timeout: timedelta | None = None) -> bool:
        t = effective_timeout(timeout, self._info.timeout)
        if self._before_wait is not None:
            self._before_wait()
        if not self._event.wait(t.total_seconds()):
            err = wrap_failure(self._info, TimeoutError("no answer"), time.monotonic() - self._start, t)
            logger.warning("%s", err)
            if self._on_timeout is not None:
                self._on_timeout(err)
            self.set_error(err)
            self._on_error(err)
            raise err
        if self._error is not None:
            if isinstance(self._error, ProcessGroupError):
                self._on_error(self._error)
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def value(self) -> Any:
        return self._value

    def get_future(self) -> Future:
        if self._before_wait is not None:
            self._before_wait()
        fut: Future = Future()
        with self._lock:
            if not self._event.is_set():
                self._futures.append(fut)
                return fut
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._value)
        return fut


