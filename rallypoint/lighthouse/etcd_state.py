"""The lighthouse's state in etcd, and the election that lets several lighthouses share it.

Why: with its state in a local SQLite file, a lighthouse is one process on one host. A
lost host takes the job's membership service with it until someone restarts the
lighthouse elsewhere. With ``--state etcd://host:port[,host:port...]/prefix``, several
lighthouse processes run against one etcd cluster:
- one of them leads: it holds the leader key, bound to an etcd lease it keeps alive;
- the others wait as standbys and take over when that key goes away.

What lives in etcd, under ``prefix``:

- ``leader``: the leader's identity and address, attached to its etcd lease. A SIGKILLed
  leader's key expires with its lease (``ttl`` seconds), and a standby takes over.
- ``quorum_id`` and ``quorum``: the last quorum id handed out and the last quorum (JSON). A
  new quorum id is written with a compare-and-swap: the write succeeds only while the
  stored id is the one this leader last wrote and the leader key is still its own. So
  ``quorum_id`` is strictly increasing across failovers, and a deposed leader can never
  hand out an id.
- ``events/NNNN``: the event log, as a ring of the last :data:`EVENT_RING` entries.
- ``jobs/<name>/quorum_id``, ``jobs/<name>/quorum``, ``jobs/<name>/events/NNNN``: the same
  for each job other than ``default`` (:mod:`~rallypoint.lighthouse.jobs`), loaded when the
  job's first call reaches a leader, and written by the same compare-and-swap (the leader key
  is one for every job).

Not in etcd:
- the goodput ledger, which stays in the leader's memory;
- leases, which a new leader revokes when the groups re-attach (LEASES.md);
- heartbeats and stream state, which are rebuilt from the groups' streams within a
  heartbeat.

Safety of leadership: the leader believes it leads until ``sent + ttl``, where ``sent`` is
when it sent its last keep-alive that etcd acknowledged. etcd expires the lease no earlier
than that. After that moment the leader refuses to form quorums, even before it learns it
was deposed, so no two leaders ever form quorums.

The client is ``aetcd`` (asyncio, gRPC): it runs on the lighthouse's own event loop and
uses the grpcio we already depend on. Each call is bounded by a timeout, and a failed
endpoint moves the session to the next one. TLS and etcd user authentication:
:mod:`~rallypoint.lighthouse.etcd_auth`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from rallypoint.lighthouse.etcd_auth import EtcdSecurity, make_client, refused_credentials, stale_token
from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.state import MEMORY, Event, Restored, StateStore

log = logging.getLogger("rallypoint.lighthouse.etcd")

#: Events kept in etcd (the newest; older ones are overwritten in place).
EVENT_RING = 1000
#: Event writes to etcd in flight, at most (more are kept in memory only).
MAX_EVENT_WRITES = 64
#: Bound of one etcd call, seconds.
CALL_TIMEOUT_S = 2.0
SCHEME = "etcd://"


class EtcdUnavailable(RuntimeError):
    """etcd could not be reached (at start: a clear error, the lighthouse does not start)."""


@dataclass(frozen=True)
class EtcdSpec:
    """``etcd://host:port[,host:port...]/prefix``, parsed."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    def key(self, name: str) -> bytes:
        return f"{self.prefix}/{name}".encode()

    def __str__(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints) + self.prefix


def is_etcd(state: str) -> bool:
    return state.startswith(SCHEME)


def parse_spec(spec: str) -> EtcdSpec:
    """``etcd://h1:p1,h2:p2/prefix`` -> :class:`EtcdSpec`; ``ValueError`` naming what is wrong."""
    if not is_etcd(spec):
        raise ValueError(f"not an etcd state address (etcd://host:port[,host:port...]/prefix): {spec!r}")
    rest = spec[len(SCHEME):]
    hosts, slash, prefix = rest.partition("/")
    prefix = "/" + prefix.strip("/") if slash and prefix.strip("/") else ""
    if not prefix:
        raise ValueError(f"{spec!r} names no key prefix: add one, e.g. etcd://127.0.0.1:2379/rallypoint/myjob "
                         "(each job needs its own)")
    endpoints = []
    for part in (p.strip() for p in hosts.split(",")):
        if not part:
            continue
        u = urlsplit("//" + part)
        if not u.hostname or u.port is None:
            raise ValueError(f"etcd endpoint {part!r} in {spec!r} is not host:port")
        endpoints.append((u.hostname, u.port))
    if not endpoints:
        raise ValueError(f"{spec!r} names no etcd endpoint")
    return EtcdSpec(tuple(endpoints), prefix)


def quorum_json(quorum: Quorum) -> str:
    return json.dumps({"quorum_id": quorum.quorum_id, "created": quorum.created,
                       "members": [m.__dict__ for m in quorum.members]})


def quorum_from_json(text: str) -> Quorum:
    doc = json.loads(text)
    members = tuple(Member(**{k: v for k, v in m.items() if k in Member.__dataclass_fields__}) for m in doc["members"])
    return Quorum(int(doc["quorum_id"]), members, float(doc.get("created", 0.0)))


class EtcdSession:
    """One lighthouse's connection to etcd: the endpoint in use (failing over among them),
    its etcd lease, and whether it leads."""

    def __init__(self, spec: EtcdSpec, identity: str, ttl: float = 2.0, timeout: float = CALL_TIMEOUT_S,
                 security: EtcdSecurity | None = None) -> None:
        """``security``: TLS and user for etcd (:mod:`~rallypoint.lighthouse.etcd_auth`;
        None: clear text, no user)."""
        self.spec = spec
        self.security = security or EtcdSecurity()
        self.identity = identity
        self.ttl = max(1, math.ceil(ttl))  # etcd grants whole seconds (and may raise it to its minimum)
        self.timeout = timeout
        self._client: Any = None
        self._endpoint = 0
        self._lease: Any = None
        self.leader_until = 0.0  # monotonic: this lighthouse may act as leader until then
        self.lost = asyncio.Event()
        self._keeper: asyncio.Task | None = None
        # Per job namespace ("" = the default job): the quorum_id this leader last wrote (or read at election).
        self._qid_written: dict[str, int] = {}
        self._cas_lock = asyncio.Lock()
        # Clients dropped for a stale auth token, closed once their calls are over (or at resign).
        self._closing: dict[asyncio.Future, Any] = {}

    # ------------------------------------------------------------------ connection
    async def connect(self, timeout: float) -> None:
        """Reach any endpoint within ``timeout`` or raise :class:`EtcdUnavailable`."""
        try:
            import aetcd  # noqa: F401
        except ImportError:
            raise ImportError("--state etcd://... needs the etcd client aetcd: pip install 'rallypoint[etcd]'") from None

        deadline = time.monotonic() + timeout
        errors: list[str] = []
        while True:
            try:
                await self._call(lambda c: c.get(self.spec.key("quorum_id")))
                return
            except Exception as e:  # noqa: BLE001 - any failure: the next endpoint, or give up
                if refused_credentials(e):  # another endpoint will not accept them either
                    await self._next_endpoint()
                    raise EtcdUnavailable(
                        f"etcd at {self._where()} refused the lighthouse's credentials "
                        f"(user {self.security.user!r}): {e}; check --etcd-user and --etcd-password-file, and "
                        "that the user's role may read and write the --state prefix") from None
                errors.append(f"{self._where()}: {type(e).__name__}: {e}"[:300])
                await self._next_endpoint()
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(
                    f"etcd is unreachable at {', '.join(f'{h}:{p}' for h, p in self.spec.endpoints)} "
                    f"(tried for {timeout:.0f}s; last errors: {'; '.join(errors[-len(self.spec.endpoints):])}); "
                    "is the etcd cluster running, and is --state right?"
                    + (" (TLS: do --etcd-ca, --etcd-cert and --etcd-key match etcd's certificates?)"
                       if self.security.tls else ""))
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _where(self) -> str:
        h, p = self.spec.endpoints[self._endpoint]
        return f"{h}:{p}"

    async def _next_endpoint(self, failed: Any = None) -> None:
        """Move to the next endpoint, unless another call already did (``failed`` is not
        the client in use any more): a burst of failures must not close a fresh client
        under the calls in flight on it."""
        if failed is not None and failed is not self._client:
            return
        old, self._client = self._client, None
        self._endpoint = (self._endpoint + 1) % len(self.spec.endpoints)
        if old is not None:
            try:
                await asyncio.wait_for(old.close(), self.timeout)
            except Exception:  # noqa: BLE001 - it is being dropped anyway
                pass

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on the endpoint in use, bounded by the call timeout. A call refused
        for an expired etcd auth token (applied nowhere) is made once more after
        authenticating again."""
        for attempt in (0, 1):
            if self._client is None:
                host, port = self.spec.endpoints[self._endpoint]
                self._client = make_client(host, port, self.security, self.timeout)
            client = self._client
            try:
                return await asyncio.wait_for(fn(client), self.timeout + 0.5)
            except Exception as e:  # noqa: BLE001 - only a stale token is retried here
                if attempt or self.security.user is None or not stale_token(e):
                    raise
                log.info("etcd auth token of user %r expired (%s); authenticating again", self.security.user, e)
                await self._reconnect(client)
        raise AssertionError("unreachable")

    async def _reconnect(self, failed: Any) -> None:
        """Drop ``failed`` (unless another call did already) so that the next call connects
        (and authenticates) to the same endpoint again. It is closed only once the calls
        still in flight on it are over (each is bounded by the call timeout): closing it now
        would cancel them, a quorum's compare-and-swap among them."""
        if failed is not self._client:
            return
        self._client = None

        async def close_later() -> None:
            await asyncio.sleep(self.timeout + 1.0)
            await self._close_quietly(failed)

        task = asyncio.ensure_future(close_later())
        self._closing[task] = failed
        task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def _close_quietly(self, client: Any) -> None:
        try:
            await asyncio.wait_for(client.close(), self.timeout)
        except Exception:  # noqa: BLE001 - it is being dropped anyway
            pass

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, trying each endpoint once before giving up (only for calls that
        may be repeated: reads, puts, lease calls; not the quorum's compare-and-swap)."""
        last: Exception | None = None
        for _ in self.spec.endpoints:
            client = self._client
            try:
                return await self._call(fn)
            except Exception as e:  # noqa: BLE001
                last = e
                await self._next_endpoint(client or self._client)
        assert last is not None
        raise last

    # ------------------------------------------------------------------ leadership
    async def campaign(self, address: str, poll: float = 0.2) -> None:
        """Return once this lighthouse holds the leader key (waiting while another does)."""
        key = self.spec.key("leader")
        value = json.dumps({"identity": self.identity, "address": address}).encode()
        announced = False
        while True:
            try:
                if await self.call(lambda c: c.get(key)) is not None:  # someone leads: no etcd write
                    if not announced:
                        log.info("standby: another lighthouse leads (%s); taking over when its etcd lease ends",
                                 await self.leader_address())
                        announced = True
                    await asyncio.sleep(poll)
                    continue
                sent = time.monotonic()  # before the grant: etcd's lease cannot end before sent + ttl
                lease = await self.call(lambda c: c.lease(self.ttl))
                ok, _ = await self.call(lambda c: c.transaction(
                    compare=[c.transactions.create(key) == 0],
                    success=[c.transactions.put(key, value, lease=lease)], failure=[]))
                if ok:
                    self._lease, self.leader_until = lease, sent + lease.ttl
                    self.lost.clear()
                    if self._keeper is not None:
                        self._keeper.cancel()
                    self._keeper = asyncio.ensure_future(self._keep_alive(lease))
                    return
                await self.call(lambda c: c.revoke_lease(lease.id))
            except Exception as e:  # noqa: BLE001 - etcd unreachable for now: keep trying
                log.warning("election: etcd call failed (%s: %s); retrying", type(e).__name__, e)
            await asyncio.sleep(poll)

    async def leader_address(self) -> str:
        """The current leader's address, or ``?``."""
        try:
            got = await self.call(lambda c: c.get(self.spec.key("leader")))
            return str(json.loads(got.value).get("address", "?")) if got is not None else "?"
        except Exception:  # noqa: BLE001
            return "?"

    def leads(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.leader_until

    async def _keep_alive(self, lease: Any) -> None:
        """Refresh this term's etcd lease every ttl/4. Leadership ends at ``leader_until``
        whatever the calls in flight do: a refresh is bounded by the time left, and the
        lighthouse steps down the moment it runs out."""
        while not self.lost.is_set() and self._lease is lease:
            await asyncio.sleep(lease.ttl / 4)
            sent = time.monotonic()
            left = self.leader_until - sent
            try:
                if left <= 0:
                    raise TimeoutError("no keep-alive acknowledged within the lease")
                reply = await asyncio.wait_for(self.call(lambda c: c.refresh_lease(lease.id)), left)
                if reply is None or reply.TTL <= 0:
                    raise RuntimeError("etcd says the lease has expired")
                if self._lease is lease:
                    self.leader_until = sent + reply.TTL
            except Exception as e:  # noqa: BLE001
                if time.monotonic() >= self.leader_until:
                    self._step_down(f"etcd session lost ({type(e).__name__}: {e})")
                    return
                log.warning("keep-alive of the leader's etcd lease failed (%s); %.1fs of leadership left",
                            e, self.leader_until - time.monotonic())

    def _step_down(self, why: str) -> None:
        if not self.lost.is_set():
            log.error("no longer the leader: %s; refusing quorums from now on", why)
            self.leader_until = 0.0
            self._lease = None
            self.lost.set()
            if self._keeper is not None and self._keeper is not asyncio.current_task():
                self._keeper.cancel()

    async def resign(self) -> None:
        """Give the leader key up now (a clean stop), so a standby takes over at once."""
        lease, self._lease = self._lease, None
        self.lost.set()
        if self._keeper is not None:
            self._keeper.cancel()
        if lease is not None:
            try:
                await self.call(lambda c: c.revoke_lease(lease.id))
            except Exception as e:  # noqa: BLE001
                log.warning("could not give up the leader key (%s); it expires with its etcd lease", e)
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.close(), self.timeout)
            except Exception:  # noqa: BLE001
                pass
            self._client = None
        for task, dropped in list(self._closing.items()):
            task.cancel()
            await self._close_quietly(dropped)

    # ------------------------------------------------------------------ state
    async def load(self, ns: str = "") -> tuple[Restored, list[Event]]:
        """The state a new leader starts from, for the job whose keys live under ``ns``
        (:func:`~rallypoint.lighthouse.jobs.etcd_namespace`; "" for the default job)."""
        qid_kv = await self.call(lambda c: c.get(self.spec.key(ns + "quorum_id")))
        quorum_kv = await self.call(lambda c: c.get(self.spec.key(ns + "quorum")))
        qid = int(qid_kv.value) if qid_kv is not None else 0
        quorum = quorum_from_json(quorum_kv.value) if quorum_kv is not None else None
        rows = await self.call(lambda c: c.get_prefix(self.spec.key(ns + "events/")))
        events = []
        for kv in rows or ():
            try:
                d = json.loads(kv.value)
                events.append(Event(int(d["id"]), float(d["time"]), str(d["kind"]), d.get("replica_id"),
                                    dict(d.get("detail") or {})))
            except (ValueError, KeyError, TypeError):
                continue
        events.sort(key=lambda e: e.id)
        self._qid_written[ns] = qid
        return Restored(quorum_id=qid, last_quorum=quorum, events=len(events)), events

    async def cas_quorum(self, quorum: Quorum, ns: str = "") -> bool:
        """Write ``quorum`` (and its id) if this lighthouse still leads and nobody wrote an id
        since it last did; False otherwise (then it steps down)."""
        if not self.leads():
            return False
        qkey, leader = self.spec.key(ns + "quorum_id"), self.spec.key("leader")
        expected = self._qid_written.get(ns) or 0
        ident = json.dumps(self.identity)[1:-1]  # as it appears inside the leader value

        async def txn(c: Any) -> Any:
            got = await c.get(leader)
            if got is None or json.loads(got.value).get("identity") != self.identity:
                return False, None
            compare = [c.transactions.value(leader) == got.value]
            compare.append(c.transactions.value(qkey) == str(expected).encode() if expected
                           else c.transactions.version(qkey) == 0)
            return await c.transaction(compare=compare, success=[
                c.transactions.put(qkey, str(quorum.quorum_id).encode()),
                c.transactions.put(self.spec.key(ns + "quorum"), quorum_json(quorum).encode())], failure=[])

        async with self._cas_lock:
            try:
                ok, _ = await self._call(txn)  # once: a txn that timed out may have committed
            except Exception as e:  # noqa: BLE001
                ok = await self._committed(quorum.quorum_id, e, ns)
            if ok:
                self._qid_written[ns] = quorum.quorum_id
            else:
                self._step_down(f"the compare-and-swap of quorum_id {expected} -> {quorum.quorum_id} failed "
                                f"(this lighthouse ({ident}) does not lead any more, or cannot reach etcd)")
            return bool(ok)

    async def _committed(self, quorum_id: int, error: Exception, ns: str = "") -> bool:
        """After a failed compare-and-swap call: did it commit anyway (read back)?"""
        log.warning("writing quorum %d to etcd failed (%s: %s); reading it back", quorum_id, type(error).__name__, error)
        try:
            got = await self.call(lambda c: c.get(self.spec.key(ns + "quorum_id")))
            leader = await self.call(lambda c: c.get(self.spec.key("leader")))
        except Exception:  # noqa: BLE001 - cannot tell: not confirmed
            return False
        return (got is not None and int(got.value) == quorum_id and leader is not None
                and json.loads(leader.value).get("identity") == self.identity)

    async def put_event(self, event: Event, ns: str = "") -> None:
        doc = {"id": event.id, "time": event.time, "kind": event.kind, "replica_id": event.replica_id,
               "detail": event.detail}
        text = json.dumps(doc, default=str)
        await self.call(lambda c: c.put(self.spec.key(f"{ns}events/{event.id % EVENT_RING:04d}"), text.encode()))


class EtcdStore(StateStore):
    """The :class:`~rallypoint.lighthouse.state.StateStore` API over an :class:`EtcdSession`,
    for the core of the lighthouse that leads. The in-memory store underneath keeps the
    event ring and the quorum dedupe; this adds the writes to etcd. ``flush`` (run on an
    executor thread by the core) does the quorum's compare-and-swap on the event loop."""

    strict = True  # a quorum that is not confirmed written is not answered (core._persist_then_answer)

    def __init__(self, session: EtcdSession, restored: Restored, events: list[Event],
                 loop: asyncio.AbstractEventLoop, ns: str = "") -> None:
        super().__init__(MEMORY, max_events=EVENT_RING)
        self._session = session
        self._ns = ns  # the job's key namespace ("" for the default job)
        self._loop = loop
        self._restored = restored
        self._ring.extend(events)
        self._next_id = (events[-1].id + 1) if events else 1
        self._pending: Quorum | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def path(self) -> str:
        return str(self._session.spec) + (f" ({self._ns.rstrip('/')})" if self._ns else "")

    @property
    def local_path(self) -> None:
        return None

    def save_quorum(self, quorum: Quorum) -> None:
        super().save_quorum(quorum)
        self._pending = quorum

    def record_event(self, kind: str, replica_id: str | None = None, **detail: Any) -> Event:
        event = super().record_event(kind, replica_id, **detail)
        if len(self._tasks) >= MAX_EVENT_WRITES:  # etcd is slow: this one stays in memory only
            log.debug("event %d not written to etcd: %d writes in flight", event.id, len(self._tasks))
            return event
        task = self._loop.create_task(self._put(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return event

    async def _put(self, event: Event) -> None:
        try:
            await self._session.put_event(event, self._ns)
        except Exception as e:  # noqa: BLE001 - the event stays in memory; etcd misses it
            log.debug("event %d not written to etcd: %s", event.id, e)

    def flush(self, timeout: float = 5.0) -> bool:
        quorum = self._pending
        if quorum is None:
            return True
        fut = asyncio.run_coroutine_threadsafe(self._session.cas_quorum(quorum, self._ns), self._loop)
        try:  # the compare-and-swap has its own bound (a read-back included): wait for it
            ok = bool(fut.result(max(timeout, 4 * self._session.timeout + 2)))
        except Exception:  # noqa: BLE001 - not confirmed
            fut.cancel()
            ok = False
        if not ok:  # never answer it, and stop leading: the next leader reads what etcd holds
            self._loop.call_soon_threadsafe(self._session._step_down, f"quorum {quorum.quorum_id} not confirmed in etcd")
        return ok

    def leads(self) -> bool:
        return self._session.leads()

    def close(self, timeout: float = 5.0) -> None:
        for task in list(self._tasks):
            task.cancel()
        super().close(timeout)


__all__ = ["EVENT_RING", "EtcdSession", "EtcdSpec", "EtcdStore", "EtcdUnavailable", "is_etcd", "parse_spec",
           "quorum_from_json", "quorum_json"]
