"""``GET /goodput``: the goodput ledger (:mod:`rallypoint.lighthouse.ledger`) over HTTP.

Apart from :mod:`rallypoint.lighthouse.http` so that module stays the app's frame; it adds
the route with one call in ``create_app``. Same token and job rule as ``/status`` (the
document names every replica group): the app's job dependency picks the view (``?job=``)
and checks the caller. Query parameters ``tau`` and ``delta`` (seconds) evaluate the goodput
model for a checkpoint interval and save time of the caller's choosing (default: one
committed step and 0, what healing from a live peer costs); ``series=false`` leaves out the
time series.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse

#: Largest tau or delta accepted: a checkpoint interval of more than ~115 days is a typo.
MAX_MODEL_SECONDS = 1e7

GoodputSource = Callable[..., dict[str, Any]]


def goodput_source(view: Any) -> GoodputSource | None:
    """Where the view's ledger document comes from: the view's own ``goodput(tau_s=,
    delta_s=, series=)`` when it has one, else its lighthouse core's ledger
    (``view.core.goodput.document``); None for a view without a ledger."""
    own = getattr(view, "goodput", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    book = getattr(getattr(view, "core", None), "goodput", None)
    doc = getattr(book, "document", None)
    return doc if callable(doc) else None


def add_goodput_route(app: FastAPI, pick: Callable[..., Awaitable[Any]]) -> None:
    """Register ``GET /goodput`` on ``app`` (called by ``create_app``). ``pick``: the app's
    dependency that checks the caller and returns the picked job (``.job``, ``.view``)."""

    @app.get("/goodput")
    async def goodput(
        picked: Any = Depends(pick),
        tau: float | None = Query(None, gt=0, le=MAX_MODEL_SECONDS,
                                  description="checkpoint interval for the model, seconds (default: one step)"),
        delta: float | None = Query(None, ge=0, le=MAX_MODEL_SECONDS,
                                    description="time to save one checkpoint, seconds (default: 0)"),
        series: bool = Query(True, description="include the time series (per 10 s bin)"),
    ) -> JSONResponse:
        """Job totals, per-group buckets, goodput, the model and its time series."""
        source = goodput_source(picked.view)
        if source is None:
            raise HTTPException(status_code=404, detail="this lighthouse keeps no goodput ledger")
        return JSONResponse(source(tau_s=tau, delta_s=delta, series=series), headers={"Cache-Control": "no-store"})


__all__ = ["MAX_MODEL_SECONDS", "add_goodput_route", "goodput_source"]
