"""Request bodies of the lighthouse's mutating routes (kill, inject), read with a bound.

Why a bound while reading, not after: without a token (a loopback lighthouse) anyone who
reaches the port may post, and reading a body whole before checking its size would let one
request make the lighthouse buffer gigabytes. Parsed by hand after the token check, so an
unauthenticated caller always gets 401 first.
"""

from __future__ import annotations

import json

from fastapi import HTTPException, Request

#: The largest kill body accepted, and the longest reason in it.
MAX_KILL_BODY_BYTES = 64 * 1024
MAX_REASON_CHARS = 4096
#: The reason sent to a manager when the kill request names none.
DEFAULT_KILL_REASON = "killed through the lighthouse HTTP API"


async def read_capped(request: Request, limit: int, what: str) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (a declared
    Content-Length over it is refused before anything is read), so no caller can make the
    lighthouse buffer more than ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(status_code=413, detail=f"{what} body too large ({declared} bytes, at most {limit})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(status_code=413, detail=f"{what} body too large (over {limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def kill_reason(request: Request) -> str:
    """The reason of an optional ``{"reason": "..."}`` body.

    Parsed by hand, after the token check, so an unauthenticated caller always gets
    401 (never a 422 that would tell it about the body format first), and an empty
    body, ``null`` or ``{}`` all mean "no reason given".
    """
    raw = await read_capped(request, MAX_KILL_BODY_BYTES, "kill")
    if not raw.strip():
        return DEFAULT_KILL_REASON
    try:
        data = json.loads(raw)
    except ValueError:  # includes UnicodeDecodeError
        raise HTTPException(
            status_code=422, detail='kill body must be JSON like {"reason": "..."} (or empty)'
        ) from None
    if data is None:
        return DEFAULT_KILL_REASON
    if not isinstance(data, dict):
        raise HTTPException(status_code=422, detail='kill body must be a JSON object like {"reason": "..."}')
    reason = data.get("reason")
    if reason is None or reason == "":
        return DEFAULT_KILL_REASON
    if not isinstance(reason, str):
        raise HTTPException(status_code=422, detail='"reason" must be a string')
    if len(reason) > MAX_REASON_CHARS:
        raise HTTPException(status_code=422, detail=f'"reason" is longer than {MAX_REASON_CHARS} characters')
    return reason


__all__ = ["DEFAULT_KILL_REASON", "MAX_KILL_BODY_BYTES", "MAX_REASON_CHARS", "kill_reason", "read_capped"]
