"""The serving side of :mod:`rallypoint.transports.http`: the step on offer, the
embedded uvicorn server, and the ASGI response that streams a state dict's bytes
straight from memoryviews (no copy by FastAPI or a thread pool) and stops when the
client leaves or the step is withdrawn."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi.responses import PlainTextResponse, Response

from rallypoint.transports import wire


@dataclass
class _Served:
    """One step on offer: the encoded state and the streams reading it."""

    step: int
    enc: wire.Encoded
    timeout: float
    withdrawn: bool = False  # disallow_checkpoint began: no new stream may start
    aborted: bool = False  # streams still running after the wait must stop
    active: int = 0
    done: threading.Condition = field(default_factory=threading.Condition)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn.Server that leaves process signals to the application."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return None


class _BodyResponse(Response):
    """Streams memoryviews as the body; stops when the client leaves or the step is withdrawn."""

    def __init__(self, served: _Served, pieces: AsyncIterator[memoryview], length: int) -> None:
        super().__init__(status_code=200, media_type="application/octet-stream")
        self.headers["content-length"] = str(length)
        self._served, self._pieces = served, pieces

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        served = self._served
        with served.done:
            # The step may have been withdrawn between routing and now: after
            # disallow_checkpoint returned, no byte of the state dict may be read.
            started = not served.withdrawn
            if started:
                served.active += 1
        if not started:
            await PlainTextResponse(
                f"the checkpoint of step {served.step} was withdrawn", status_code=404
            )(scope, receive, send)
            return
        listener = asyncio.get_running_loop().create_task(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for piece in self._pieces:
                if gone.is_set():
                    return
                if served.aborted:
                    # Raising makes uvicorn drop the connection: the client sees a short body.
                    raise RuntimeError(f"checkpoint of step {served.step} withdrawn mid-transfer")
                # A receiver that stops reading must not pin this stream (and the state
                # dict) forever: each piece has to leave within the transport's timeout.
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": piece, "more_body": True}), served.timeout
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listener.cancel()
            with served.done:
                served.active -= 1
                served.done.notify_all()


__all__ = ["_BodyResponse", "_EmbeddedServer", "_Served"]
