"""``ProcessGroupNCCL``: NCCL with our own per-op timeout that aborts the communicator.

Why our own: NCCL's watchdog notices a hung collective only after its (long) timeout
and then tears the whole process down. Here every op records a CUDA event after the
collective; a watchdog thread aborts the communicator (``ncclCommAbort`` through
torch's ``abort()``) as soon as an op's deadline passes before its event fired, and
``errored()`` reports it. The communicator is created non-blocking so the abort can
interrupt it. ``wait()`` blocks the CPU until the op finished or timed out (stricter
than torch's stream-only wait, and what a fault-tolerant step needs anyway).
Needs a CUDA build of torch and NCCL; only exercised by ``@pytest.mark.gpu`` tests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.distributed_c10d import Work

from .base import DEFAULT_TIMEOUT, GroupConfig
from .errors import ProcessGroupTimeout
from .gloo import TorchBackendGroup
from .work import OpInfo, effective_timeout, wrap_failure

logger = logging.getLogger("rallypoint.process_groups.nccl")

POLL_S = 0.005


class _NCCLWork(Work):
    """An NCCL op with a CPU-side deadline (the watchdog aborts on expiry)."""

    def __init__(self, group: "ProcessGroupNCCL", inner: Work, event: torch.cuda.Event, info: OpInfo,
                 finish: Callable[[], None] | None, result: Any) -> None:
        super().__init__()
        self._group = group
        self._inner = inner
        self._event = event
        self._info = info
        self._finish = finish
        self._result = result
        self._finished = False
        self._lock = threading.Lock()
        self.start = time.monotonic()
        self.deadline = self.start + info.timeout.total_seconds()

    def done(self) -> bool:
        return bool(self._event.query())

    def _finish_once(self) -> None:
        with self._lock:
            if not self._finished:
                self._finished = True
                if self._finish is not None:
                    self._finish()

    def wait(self, timeout: timedelta | None = None) -> bool:
        t = effective_timeout(timeout, self._info.timeout)
        deadline = min(self.deadline, time.monotonic() + t.total_seconds())
        while not self.done():
            err = self._group.errored()
            if err is not None:
                raise err
            if time.monotonic() >= deadline:
                e = wrap_failure(self._info, TimeoutError("NCCL op did not finish"), time.monotonic() - self.start, t)
                self._group._abort_with(e)
                raise e
            time.sleep(POLL_S)
        self._finish_once()
        return True

    def is_completed(self) -> bool:
        return self.done()

    def get_future(self) -> torch.futures.Future:
        def done(f: torch.futures.Future) -> Any:
            value = f.value()
            self._finish_once()
            return self._result if self._result is not None else value

        return self._inner.get_future().then(done)


class _Watchdog:
    """Aborts the group when a tracked op passes its deadline unfinished."""

    def __init__(self, group: "ProcessGroupNCCL") -> None:
        self._group = group
        self._works: list[_NCCLWork] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, work: _NCCLWork) -> None:
        with self._lock:
            self._works.append(work)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, daemon=True, name="rallypoint-nccl-watchdog")
                self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                self._works = [w for w in self._works if not w.done()]
                late = [w for w in self._works if w.deadline <= now]
            if late:
                w = late[0]
                err = ProcessGroupTimeout(
                    f"{w._info.label()} timed out after {now - w.start:.2f}s (timeout {w._info.timeout.total_seconds():g}s); "
                    "the NCCL communicator was aborted; reconfigure the group",
                    op=w._info.op, world_size=w._info.world_size, quorum_id=w._info.quorum_id,
                )
                self._group._abort_with(err)
                with self._lock:
                    self._works.clear()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5.0)
        self._thread = None
        with self._lock:
            self._works.clear()


class ProcessGroupNCCL(TorchBackendGroup):
    """Reconfigurable NCCL group (CUDA tensors, one device per rank)."""

    backend_name = "rallypoint-nccl"

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, connect_timeout: timedelta | None = None) -> None:
        super().__init__(timeout, connect_timeout)
        self._watchdog = _Watchdog(self)
        # NCCL's non-blocking init/abort honour this bound; keep it no longer than ours.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(timeout.total_seconds(), 1))))

    def _create_backend(self, store: Store, cfg: GroupConfig) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = False
        # torch's own watchdog must never fire before ours (it would kill the process).
        opts._timeout = self._timeout * 4
        if cfg.global_ranks:
            opts.global_ranks_in_group = list(cfg.global_ranks)
        opts.group_name = cfg.group_name()  # type: ignore[assignment]  # GroupName is a str
        backend = dist.ProcessGroupNCCL(store, cfg.rank, cfg.world_size, opts)
        backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return backend

    def _wrap(self, inner: Work, info: Any, finish: Callable[[], None] | None, result: Any) -> Work:
        inner.wait()  # orders the current stream after NCCL's (does not block the CPU)
        event = torch.cuda.Event()
        event.record()
        work = _NCCLWork(self, inner, event, info, finish, result)
        self._watchdog.track(work)
        return work

    def _abort_with(self, err: Exception) -> None:
        self._record_error(err)
        backend = self._backend
        if backend is not None:
            try:
                backend.abort()
            except Exception as e:  # noqa: BLE001
                logger.warning("NCCL abort failed: %s", e)

    def _teardown(self) -> None:
        # Abort, never a graceful destroy: a graceful one waits for peers that may be dead.
        backend = self._backend
        self._watchdog.stop()
        if backend is not None:
            try:
                backend.abort()
            except Exception as e:  # noqa: BLE001
                logger.warning("NCCL abort during teardown failed: %s", e)
        super()._teardown()
