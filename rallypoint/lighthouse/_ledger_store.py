"""The goodput ledger kept by a running lighthouse, and saved in its state file.

Why apart from :mod:`rallypoint.lighthouse.ledger`: that module is pure (no clock, no I/O);
this one is the shell the core holds. :class:`GoodputBook` stamps each event with the wall
clock, keeps a ledger bug from ever costing a quorum (every call is guarded and logged),
and saves the ledger in the lighthouse's SQLite state file so it survives a restart.

Persistence choices:

* One row of the ``ledger`` table (created by :mod:`rallypoint.lighthouse.state` when it
  opens the file; adding a table needs no schema bump, and older versions ignore it) holds
  the whole ledger as JSON. The ledger is bounded (groups, causes, series bins), so the row
  is too: at most a few hundred KiB, usually a few KiB.
* Saved at most every :data:`SAVE_INTERVAL_S` seconds (from the core's periodic sweep) and
  once more at shutdown, on a worker thread through a connection of its own (SQLite in WAL
  mode serialises it with the state writer), so the event loop never waits on the disk. A
  SIGKILLed lighthouse loses at most the last interval; the next report of each group
  covers the gap (the ledger's marks are saved with it), so the buckets still add up.
* Reading it back is lenient: the ledger is diagnostics, so a row that cannot be read is
  logged and the ledger starts empty; it never stops a lighthouse from starting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from rallypoint.lighthouse import ledger as lg
from rallypoint.lighthouse.stragglers import StepStats

log = logging.getLogger("rallypoint.lighthouse.ledger")

LEDGER_TABLE = "ledger"
#: Run by ``StateStore`` when it creates a file, or opens one without this table.
LEDGER_SCHEMA: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS ledger ("
    " slot INTEGER PRIMARY KEY CHECK (slot = 1),"
    " version INTEGER NOT NULL,"
    " doc TEXT NOT NULL,"
    " saved REAL NOT NULL)",
)
#: Version of the saved JSON document.
LEDGER_VERSION = 1
SAVE_INTERVAL_S = 5.0
#: Groups listed in ``/status`` (which dashboards poll every second); ``/goodput`` lists all.
STATUS_GROUPS = 256
#: How long shutdown waits for the last save.
CLOSE_TIMEOUT_S = 3.0
_ERROR_LOG_INTERVAL_S = 60.0
_BUSY_TIMEOUT_MS = 5000


# ----------------------------------------------------------------------- (de)serialising
def to_state(ledger: lg.Ledger) -> dict[str, Any]:
    """The ledger as plain JSON values (everything needed to continue it)."""

    def totals(t: lg.Totals) -> dict[str, Any]:
        return {"wall": t.wall, "secs": t.secs, "rounds": t.rounds, "failures": t.failures, "step_sum": t.step_sum}

    s = ledger.series
    return {
        "version": LEDGER_VERSION, "since": ledger.since, "first_quorum": ledger.first_quorum,
        "untracked": ledger.untracked, "retired": totals(ledger.retired),
        "groups": [
            {"name": g.name, "rid": g.rid, "since": g.since, "mark": g.mark, "mode": g.mode, "member": g.member,
             "reported": g.reported, "pending": g.pending, "pending_since": g.pending_since, "credit": g.credit,
             "gone_at": g.gone_at, "last_parts": g.last_parts, "totals": totals(g.totals)}
            for g in ledger.groups.values()
        ],
        "series": {"bin_s": s.bin_s, "max_bins": s.max_bins, "newest": s.newest,
                   "bins": [[i, b] for i, b in sorted(s.bins.items())]},
    }


def _num(v: Any, what: str, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} is not a finite number: {str(v)[:40]}")
    return float(v)


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} is not a count: {str(v)[:40]}")
    return v


def _index(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 2**62:
        raise ValueError(f"series bin index is not an integer: {str(v)[:40]}")
    return v


def _str(v: Any, what: str, choices: Collection[str] | None = None) -> str:
    if not isinstance(v, str) or len(v) > 4096 or (choices is not None and v not in choices):
        raise ValueError(f"{what} is not a valid string: {str(v)[:40]}")
    return v


def _dict(v: Any, what: str, value: Callable[[Any, str], Any], limit: int = 64) -> dict[str, Any]:
    if not isinstance(v, dict) or len(v) > limit:
        raise ValueError(f"{what} is not a small object")
    return {_str(k, what): value(x, f"{what}.{k}") for k, x in v.items()}


def _totals(v: Any, what: str) -> lg.Totals:
    if not isinstance(v, dict):
        raise ValueError(f"{what} is not an object")
    return lg.Totals(wall=_num(v.get("wall"), f"{what}.wall"), secs=_dict(v.get("secs"), f"{what}.secs", _num),
                     rounds=_dict(v.get("rounds"), f"{what}.rounds", _int),
                     failures=_int(v.get("failures"), f"{what}.failures"),
                     step_sum=_num(v.get("step_sum"), f"{what}.step_sum"))


def from_state(doc: Any, **limits: Any) -> lg.Ledger:
    """A ledger from :func:`to_state`'s document; ``ValueError`` names what is wrong.
    ``limits`` are :class:`~rallypoint.lighthouse.ledger.Ledger`'s keyword arguments."""
    if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
        raise ValueError(f"not a version {LEDGER_VERSION} ledger")
    out = lg.Ledger(**limits)
    out.since = _num(doc.get("since"), "since", optional=True)
    out.first_quorum = _num(doc.get("first_quorum"), "first_quorum", optional=True)
    out.untracked = _int(doc.get("untracked", 0), "untracked")
    out.retired = _totals(doc.get("retired"), "retired")
    groups = doc.get("groups")
    if not isinstance(groups, list):
        raise ValueError("groups is not a list")
    for i, raw in enumerate(groups[: out.max_groups]):
        w = f"groups[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{w} is not an object")
        g = lg.Group(
            name=_str(raw.get("name"), f"{w}.name"), rid=_str(raw.get("rid"), f"{w}.rid"),
            since=_num(raw.get("since"), f"{w}.since"), mark=_num(raw.get("mark"), f"{w}.mark"),
            mode=_str(raw.get("mode"), f"{w}.mode", lg.STATES), member=bool(raw.get("member")),
            reported=bool(raw.get("reported")), pending=_num(raw.get("pending"), f"{w}.pending"),
            pending_since=_num(raw.get("pending_since"), f"{w}.pending_since"),
            credit=_num(raw.get("credit"), f"{w}.credit"),
            gone_at=_num(raw.get("gone_at"), f"{w}.gone_at", optional=True),
            last_parts=_dict(raw.get("last_parts"), f"{w}.last_parts", _num),
            totals=_totals(raw.get("totals"), f"{w}.totals"),
        )
        out.groups[g.name] = g
    series = doc.get("series")
    if not isinstance(series, dict) or not isinstance(series.get("bins"), list):
        raise ValueError("series is not an object with bins")
    if _num(series.get("bin_s"), "series.bin_s") == out.series.bin_s:  # else: start the chart afresh
        out.series.newest = _index(series.get("newest"))
        for item in series["bins"][-out.series.max_bins:]:
            if not (isinstance(item, list) and len(item) == 2):
                raise ValueError("series.bins holds a malformed bin")
            out.series.bins[_index(item[0])] = _dict(item[1], "series bin", _num)
    return out


# ----------------------------------------------------------------------------- the file
class LedgerStore:
    """The ``ledger`` row of a state file, on a connection of its own (see the module
    docstring). Thread-safe: saves run on worker threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000
        )
        self._conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        self._conn.execute("PRAGMA synchronous = NORMAL")

    def load(self) -> Any:
        """The saved document (parsed JSON), or None when there is none."""
        with self._lock:
            if self._conn is None:
                return None
            row = self._conn.execute("SELECT version, doc FROM ledger WHERE slot = 1").fetchone()
        if row is None:
            return None
        if row[0] != LEDGER_VERSION:
            raise ValueError(f"it is ledger version {row[0]}, this lighthouse reads version {LEDGER_VERSION}")
        return json.loads(row[1])

    def save(self, text: str) -> None:
        with self._lock:
            if self._conn is None:
                return
            self._conn.execute("INSERT OR REPLACE INTO ledger (slot, version, doc, saved) VALUES (1, ?, ?, ?)",
                               (LEDGER_VERSION, text, time.time()))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        if not self._lock.acquire(timeout=timeout):
            log.warning("goodput ledger: a save to %s is stuck; leaving its connection", self.path)
            return
        try:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
        finally:
            self._lock.release()


# ----------------------------------------------------------------------------- the book
class GoodputBook:
    """The core's ledger: events stamped with the wall clock, guarded, saved now and then.

    ``path``: the state file, or None (``--state :memory:``: nothing survives a restart).
    Methods other than :meth:`close` run on the lighthouse's event-loop thread.
    """

    def __init__(self, path: str | None, *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._wall = wall
        self._clock = clock
        self._born = clock()
        self._last_error = -math.inf
        self._last_save = clock()
        self._saving: asyncio.Future[None] | None = None
        self._dirty = False
        self.store: LedgerStore | None = None
        self.ledger = lg.Ledger()
        if path is None:
            return
        try:
            self.store = LedgerStore(path)
            doc = self.store.load()
            if doc is not None:
                self.ledger = from_state(doc)
                self.ledger.restarted(wall())
                log.info("goodput ledger restored from %s: %d group(s)", path, len(self.ledger.groups))
        except (sqlite3.Error, ValueError, TypeError, RecursionError) as e:
            log.warning("goodput ledger in %s cannot be read (%s); starting an empty one (it is overwritten "
                        "at the next save)", path, e)
            self.ledger = lg.Ledger()

    # ----------------------------------------------------------- events
    def _do(self, fn: Callable[..., None], *args: Any, **kw: Any) -> None:
        try:
            fn(*args, now=self._wall(), **kw)
            self._dirty = True
        except Exception:  # a ledger bug must never cost the job its quorum
            now = self._clock()
            if now - self._last_error >= _ERROR_LOG_INTERVAL_S:
                self._last_error = now
                log.exception("goodput ledger failed on %s; the lighthouse carries on", fn.__name__)

    def join(self, rid: str) -> None:
        self._do(self.ledger.join, rid)

    def down(self, rid: str, clean: bool) -> None:
        self._do(self.ledger.down, rid, clean=clean)

    def round(self, rid: str, stats: StepStats) -> None:
        self._do(self.ledger.round, rid, stats)

    def evicted(self, rid: str) -> None:
        self._do(self.ledger.evicted, rid)

    def readmitted(self, rid: str) -> None:
        self._do(self.ledger.readmitted, rid)

    def quorum(self, rids: Iterable[str]) -> None:
        self._do(self.ledger.quorum, list(rids))

    def tick(self, live: Collection[str], grace_s: float) -> None:
        """From the core's sweep: groups restored but never heard from again are dead once
        the lighthouse has been up ``grace_s``; a save when one is due."""
        if self._clock() - self._born >= grace_s:
            self._do(self.ledger.reconcile, live)
        if self.store is not None and self._dirty and self._saving is None \
                and self._clock() - self._last_save >= SAVE_INTERVAL_S:
            self._save_soon()

    def _save_soon(self) -> None:
        text = self._serialise()
        if text is None or self.store is None:
            return
        self._dirty, self._last_save = False, self._clock()
        fut = asyncio.get_running_loop().run_in_executor(None, self.store.save, text)
        self._saving = fut

        def done(f: asyncio.Future[None]) -> None:
            self._saving = None
            if not f.cancelled() and f.exception() is not None:
                self._dirty = True  # retried at the next interval; said at most once a minute
                now = self._clock()
                if now - self._last_error >= _ERROR_LOG_INTERVAL_S:
                    self._last_error = now
                    log.warning("goodput ledger not saved to %s: %s (retrying every %.0fs)",
                                self.store and self.store.path, f.exception(), SAVE_INTERVAL_S)

        fut.add_done_callback(done)

    def _serialise(self) -> str | None:
        try:
            return json.dumps(to_state(self.ledger), separators=(",", ":"))
        except (TypeError, ValueError):
            log.exception("goodput ledger cannot be serialised; not saved")
            return None

    async def close(self) -> None:
        """Save one last time (bounded by :data:`CLOSE_TIMEOUT_S`) and close the file."""
        store = self.store
        if store is None:
            return
        loop = asyncio.get_running_loop()
        try:
            if self._saving is not None:
                await asyncio.wait_for(asyncio.shield(self._saving), CLOSE_TIMEOUT_S)
            text = self._serialise()
            if text is not None:
                await asyncio.wait_for(loop.run_in_executor(None, store.save, text), CLOSE_TIMEOUT_S)
        except (TimeoutError, sqlite3.Error, OSError) as e:
            log.warning("goodput ledger: last save to %s failed: %s", store.path, e)
        await loop.run_in_executor(None, store.close)
        self.store = None

    # ----------------------------------------------------------- views
    def document(self, tau_s: float | None = None, delta_s: float | None = None,
                 series: bool = True) -> dict[str, Any]:
        """What ``GET /goodput`` serves (``series=False``: the summary in ``/status``)."""
        return self.ledger.document(self._wall(), tau_s, delta_s, series)

    def summary(self) -> dict[str, Any] | None:
        """The document without the series, or None if it cannot be built (logged)."""
        try:
            return self.ledger.document(self._wall(), series=False, listed=STATUS_GROUPS)
        except Exception:
            log.exception("goodput ledger summary failed")
            return None


__all__ = ["LEDGER_SCHEMA", "LEDGER_TABLE", "LEDGER_VERSION", "GoodputBook", "LedgerStore", "from_state", "to_state"]
