"""The Manager's torchft-named conveniences that are not on rallypoint's own paths:
``set_state_dict_fns`` (torchft 0.2's deprecated name, which TorchTitan calls), the state
dict's read gate (``disallow_state_dict_read`` / ``allow_state_dict_read``) and
``wrap_future``. A mixin, so that ``manager.py`` keeps the step's logic only; each method
is what torchft's Manager does under the same name.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Callable, TypeVar

import torch

from rallypoint.manager._state import UserState

T = TypeVar("T")


def _with_timeout(fut: torch.futures.Future[T], timeout: timedelta) -> torch.futures.Future[T]:
    """A future completed as ``fut`` is, or with a ``TimeoutError`` after ``timeout``
    (torch's futures have no timeout of their own)."""
    out: torch.futures.Future[T] = torch.futures.Future()
    done = threading.Lock()

    def settle(fn: Callable[[], None]) -> None:
        if done.acquire(blocking=False):
            fn()

    def on_done(f: torch.futures.Future[T]) -> None:
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - carried to the wrapper's future
            settle(lambda: out.set_exception(e))  # type: ignore[arg-type]  # torch stubs type it as T
            return
        settle(lambda: out.set_result(value))

    def on_timeout() -> None:
        settle(lambda: out.set_exception(TimeoutError(f"future not completed within {timeout}")))  # type: ignore[arg-type]

    timer = threading.Timer(timeout.total_seconds(), on_timeout)
    timer.daemon = True
    timer.start()
    fut.add_done_callback(on_done)
    out.add_done_callback(lambda _f: timer.cancel())
    return out


class TorchftApi:
    """torchft's Manager methods that a trainer may call and rallypoint's paths do not need."""

    _user_state: UserState
    _timeout: timedelta
    _log: logging.LoggerAdapter

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[T], None],
                               state_dict: Callable[[], T]) -> None:  # pragma: no cover - the Manager's
        raise NotImplementedError

    def report_error(self, e: Exception) -> None:  # pragma: no cover - the Manager's
        raise NotImplementedError

    def set_state_dict_fns(self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]) -> None:
        """Deprecated (torchft 0.2's name, which TorchTitan calls): :meth:`register_state_dict_fn`
        under torchft's key ``"set_state_dict_fns"``."""
        self._log.warning("set_state_dict_fns is deprecated, use register_state_dict_fn")
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def disallow_state_dict_read(self) -> None:
        """Keep a healing peer from reading the registered state until
        :meth:`allow_state_dict_read`: call it before mutating the state outside the
        optimizer step (as torchft's LocalSGD/DiLoCo do around their sync). A read in
        progress ends first; a read that comes meanwhile waits (at most the Manager's
        timeout, then that heal fails and is retried). A no-op when already disallowed."""
        self._user_state.disallow_read()

    def allow_state_dict_read(self) -> None:
        """Let healing peers read the registered state again (a no-op when allowed)."""
        self._user_state.allow_read()

    def wrap_future(self, fut: torch.futures.Future[T], default: T,
                    timeout: timedelta | None = None) -> torch.futures.Future[T]:
        """A future that completes with ``fut``'s value, or, if ``fut`` fails or takes longer
        than ``timeout`` (default: the Manager's), with ``default`` after reporting the
        error with :meth:`report_error` (so this step will not commit), as torchft's does."""
        limited = _with_timeout(fut, timeout or self._timeout)

        def swallow(f: torch.futures.Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001 - reported to the Manager, the default returned
                self._log.warning("a wrapped future failed, this step will not commit: %s", e)
                self.report_error(e)
                return default

        return limited.then(swallow)


__all__ = ["TorchftApi"]
