"""How the supervisors of one replica group that spans hosts meet: a thin shell over
torch.distributed.elastic's dynamic rendezvous (the engine torchrun uses), with the
decisions in ``nodes.py``.

- ``--rdzv-backend c10d`` (the default): the node whose ``--local-addr`` is the
  ``--rdzv-endpoint``'s host (or ``is_host=1`` in ``--rdzv-conf``) hosts the rendezvous'
  ``TCPStore``, listening on the endpoint's address only (port 0 there: one the OS picks,
  logged); the others connect to it, retrying until ``--rdzv-timeout``. torch's
  ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler`` run the rounds. ``etcd`` and
  ``etcd-v2`` come from torch's handler registry as torchrun makes them (they need the
  python-etcd client; the announcements that catch mismatched command lines early are
  c10d's only).
- Each round (``join``, on a thread: it blocks until every node arrived or the timeout)
  is torch's ``next_rendezvous()``; then every node writes its ``NodeInfo`` to the round's
  store and reads the others', and ``plan_round`` says where it stands. The result is
  posted to the supervisor's event queue: ``("round", plan)`` or ``("round_error",
  message, exit_code)``.
- From the moment a round forms until the incarnation ends here (``watch``; started by
  the round's join thread, so a node whose ranks take seconds to start is not taken for
  a lost one), a thread beats every ``BEAT_S`` in the round's store and reads the other
  nodes' beats: a node that ended the incarnation (a rank failed
  or hung there) says so at once (``ended``), a node that finished says ``done``, and a
  node whose beat stopped for ``lost_after_s`` (its host is gone) is lost; torch's own
  signal, a node waiting for the next round, is looked at too. Any of these posts
  ``("peer", reason, incarnation)`` once and the supervisor restarts the group on this node
  too (a peer event of an incarnation that already ended here is ignored).
- torch polls the rendezvous state once a second while it waits for the other nodes (a
  constant in its join loop); a restart should not wait for that, so this module shortens
  that poll to ``sync_interval`` (``--rdzv-conf sync_interval=S``, 0.02 s by default) in
  this process, which hosts no other rendezvous, and has each poll read the shared state
  (torch serves it from a one-second cache otherwise). With a few nodes per group that is
  a few small reads a second while a round forms.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rallypoint.supervisor.nodes import (
    GAVE_UP_EXIT, NodeError, NodeInfo, RoundPlan, announcement_conflict, give_up_message, plan_round, split_endpoint, stale_peers,
)  # fmt: skip

log = logging.getLogger("rallypoint.run")

BEAT_S = 0.05  # how often a node beats and looks at the others while its ranks run
WAITING_POLL_S = 1.0  # how often it asks torch whether a node waits for the next round
EXCHANGE_TIMEOUT_S = 60.0  # the longest wait for the other nodes' facts once a round formed
ANNOUNCE_S = 0.25  # how often a waiting node beats its announcement and reads the others'
ANNOUNCE_LIVE_S = 3.0  # an announcement whose beat has not changed for this long is a gone node's
ANNOUNCE_MAX = 256  # announcements read at most (the slots a run id ever handed out)
EXIT_BARRIER_S = 60.0
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = "1", "5"  # torch's heartbeat, and how many missed make a node lost  # how long the rendezvous host waits for the other nodes to finish
PREFIX = "rallypoint/"


@dataclass(frozen=True)
class RdzvConfig:
    """The rendezvous part of a ``rallypoint run`` command line."""

    backend: str
    endpoint: str
    run_id: str
    nnodes: int
    timeout_s: float
    local_addr: str
    conf: dict[str, str] = field(default_factory=dict)


def _addresses(host: str) -> set[str]:
    try:
        return {str(ai[4][0]) for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def hosts_endpoint(cfg: RdzvConfig) -> bool:
    """Does this node host the c10d rendezvous store? ``is_host`` in ``--rdzv-conf``
    decides when given; otherwise this node does when its ``--local-addr`` and the
    endpoint's host name the same address."""
    if "is_host" in cfg.conf:
        return cfg.conf["is_host"].lower() in ("1", "true", "yes")
    host, _ = split_endpoint(cfg.endpoint)
    return host == cfg.local_addr or bool(_addresses(host) & _addresses(cfg.local_addr))


_JOINED = threading.Event()  # this process has been through a round: no more start-up skew


def _shorten_sync_poll(interval: float) -> None:
    """torch's join loop sleeps ``_delay(seconds=1)`` between polls of the shared state;
    make that ``interval``. Its random skew of up to 0.3 s (a tuple) before a join while the
    state is still in round 0 spreads the nodes' first attempts; it stays for the first
    join, but not for the restart after it (the state is still in round 0 then too, and
    every node would wait up to 0.3 s more)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr, "_rallypoint_original_delay", None) or getattr(dr, "_delay", None)
    if original is None:
        return

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple) and _JOINED.is_set():
            return
        original(interval if seconds == 1 else seconds)

    dr._rallypoint_original_delay = original  # type: ignore[attr-defined]
    dr._delay = delay


class NodeRendezvous:
    """This node's side of the group's rendezvous; see the module docstring."""

    def __init__(self, cfg: RdzvConfig, post: Callable[..., None]) -> None:
        self.cfg = cfg
        self._post = post
        self._handler: Any = None
        self._store: Any = None  # the c10d host's own TCPStore (kept alive here)
        self._round_store: Any = None
        self._plan: RoundPlan | None = None
        self._watching: threading.Event | None = None
        self._watched: RoundPlan | None = None  # the round being watched
        self._lock = threading.Lock()
        self._raw_store: Any = None  # c10d: the rendezvous store itself (for the announcements)
        self.is_host = False
        self.endpoint = cfg.endpoint  # with the port the host listens on, once known

    # --- setting up (on the join thread: it may wait up to --rdzv-timeout) ---------------
    def _open(self) -> None:
        if self._handler is not None:
            return
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the group's store is ours
        # The connect retries are ours to report, in one line; not torch's C++ stack traces (the
        # ranks' environment was taken before this, so they keep torch's default).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        cfg = self.cfg
        conf = {k: v for k, v in cfg.conf.items() if k != "sync_interval"}
        conf.setdefault("join_timeout", str(max(1, math.ceil(cfg.timeout_s))))
        conf.setdefault("last_call_timeout", "1")  # unused: min_nodes == max_nodes completes at once
        conf.setdefault("keep_alive_interval", KEEP_ALIVE_S)
        conf.setdefault("keep_alive_max_attempt", KEEP_ALIVE_ATTEMPTS)
        _shorten_sync_poll(float(cfg.conf.get("sync_interval", "0.02")))
        params = RendezvousParameters(backend=cfg.backend, endpoint=cfg.endpoint, run_id=cfg.run_id,
                                      min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, local_addr=cfg.local_addr, **conf)
        if cfg.backend != "c10d":
            from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

            self._handler = rendezvous_handler_registry.create_handler(params)
            return
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        host, port = split_endpoint(cfg.endpoint)
        timeout = timedelta(seconds=cfg.timeout_s)
        self.is_host = hosts_endpoint(cfg)
        if self.is_host:
            listen = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          backlog=256)
            port = listen.getsockname()[1]
            self._store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                   timeout=timeout, master_listen_fd=listen.detach())
            self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            log.info("rendezvous: this node hosts the rendezvous store at %s (run id %s)", self.endpoint, cfg.run_id)
            store = self._store
        else:
            store = self._connect(TCPStore, host, port, timeout)
        self._raw_store = store
        backend = C10dRendezvousBackend(store, cfg.run_id)
        self._handler = dr.create_handler(store, backend, params)
        holder = getattr(self._handler, "_state_holder", None)
        if getattr(holder, "_cache_duration", None) == 1:  # see _shorten_sync_poll: each poll reads the state
            holder._cache_duration = 0  # type: ignore[union-attr]

    def _connect(self, tcp_store: Any, host: str, port: int, timeout: timedelta) -> Any:
        """A client of the rendezvous store, trying until ``--rdzv-timeout`` (its host may
        start later than this node); torch's own connect retries would wait up to twice
        the timeout."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                store = tcp_store(host, port, is_master=False, timeout=timedelta(seconds=max(0.5, min(5.0, left / 3))))
                store.set_timeout(timeout)
                return store
            except Exception:  # noqa: BLE001 - DistNetworkError, TimeoutError: not up yet
                if deadline - time.monotonic() <= 0:
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    # --- a round ----------------------------------------------------------------------
    def join(self, mine: NodeInfo) -> None:
        """Start joining the next round on a thread; the outcome arrives as an event."""
        self.stop_watch()
        threading.Thread(target=self._join, args=(mine,), name="rendezvous", daemon=True).start()

    def _join(self, mine: NodeInfo) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        what = f"could not reach the rendezvous endpoint {self.cfg.endpoint}"
        try:
            self._open()
            while True:
                what = f"the group's {self.cfg.nnodes} nodes did not all arrive"
                announcing = threading.Event()
                if self._raw_store is not None:
                    threading.Thread(target=self._announce, args=(mine, announcing), name="rendezvous announce",
                                     daemon=True).start()
                try:
                    info = self._handler.next_rendezvous()
                finally:
                    announcing.set()
                store, me = info.store, info.rank
                what = "the nodes of the round did not all tell their facts"
                store.set(f"{PREFIX}node/{me}", mine.to_json())
                keys = [f"{PREFIX}node/{r}" for r in range(info.world_size)]
                try:
                    store.wait(keys, timedelta(seconds=max(1.0, min(EXCHANGE_TIMEOUT_S, deadline - time.monotonic()))))
                except Exception:  # noqa: BLE001 - a node died right after the round: try the next one
                    if time.monotonic() >= deadline:
                        raise
                    log.warning("rendezvous: a node of round %s left before it told its facts; joining the next round",
                                keys)
                    continue
                infos = [NodeInfo.from_json(bytes(store.get(k)), f"rendezvous rank {r}") for r, k in enumerate(keys)]
                plan = plan_round(infos, me)
                with self._lock:
                    self._round_store, self._plan = store, plan
                # Beat from now on (starting this node's ranks may take seconds), but post
                # nothing before the round itself is posted.
                posted = threading.Event()
                self._start_watch(posted)
                _JOINED.set()
                try:
                    self._post("round", plan)
                finally:
                    posted.set()
                return
        except NodeError as e:
            self._post("round_error", str(e), e.code)
        except Exception as e:  # noqa: BLE001 - torch's rendezvous errors, the store's network errors
            name = type(e).__name__
            if "Closed" in name:
                msg = ("rallypoint run: gave up: the group's rendezvous was closed: another node of the group finished "
                       "or gave up (see its log); start every node again to run the group again")
            else:
                detail = str(e).splitlines()[0][:300] if str(e).strip() else ""
                msg = give_up_message(what, self.cfg.nnodes, self.cfg.timeout_s, self.endpoint) + \
                    (f" ({name}: {detail})" if detail else "")
            self._post("round_error", msg, GAVE_UP_EXIT)

    def _announce(self, mine: NodeInfo, stop: threading.Event) -> None:
        """While this node waits for a round: announce its facts in a slot of the
        rendezvous store, beat it, and read the live announcements of the others; a node
        that disagrees (``nodes.announcement_conflict``) ends the wait with exit 2, on both
        sides, instead of at --rdzv-timeout."""
        store, key = self._raw_store, f"{PREFIX}{self.cfg.run_id}/announce"
        try:
            slot = int(store.add(f"{key}/count", 1)) - 1
            store.set(f"{key}/{slot}", mine.to_json())
            seen: dict[int, tuple[int, float]] = {}
            while not stop.is_set():
                store.add(f"{key}/{slot}/beat", 1)
                now, others = time.monotonic(), []
                count = min(int(store.add(f"{key}/count", 0)), ANNOUNCE_MAX)
                for other in range(max(0, count - ANNOUNCE_MAX), count):
                    if other == slot:
                        continue
                    beat = int(store.add(f"{key}/{other}/beat", 0))
                    old = seen.get(other)
                    if old is None or old[0] != beat:  # a first sight is no sign of life: wait for a change
                        seen[other] = (beat, now if old is not None else now - ANNOUNCE_LIVE_S)
                    if now - seen[other][1] < ANNOUNCE_LIVE_S and store.check([f"{key}/{other}"]):
                        others.append(NodeInfo.from_json(bytes(store.get(f"{key}/{other}")), f"announcement {other}"))
                conflict = announcement_conflict(mine, others)
                if conflict is not None and not stop.is_set():
                    self._post("round_error", f"rallypoint run: {conflict}", conflict.code)
                    return
                stop.wait(ANNOUNCE_S)
        except NodeError as e:
            log.warning("rendezvous: %s", e)
        except Exception as e:  # noqa: BLE001 - only an early warning is lost; the round's own check remains
            log.debug("rendezvous: announcements: %s", e)

    # --- while the ranks run -----------------------------------------------------------
    def watch(self) -> None:
        """Beat and watch the other nodes of the current round (see the module docstring).
        The round's own join thread starts this as soon as the round formed, before this
        node's ranks start (waiting for the zygote, forking: seconds on a loaded host), so
        the other nodes never take a node that is still starting for a lost one; the
        supervisor's call once the ranks run finds it watching and leaves it so."""
        self._start_watch(None)

    def _start_watch(self, posted: threading.Event | None) -> None:
        with self._lock:
            store, plan = self._round_store, self._plan
            if store is None or plan is None or (self._watching is not None and self._watched is plan):
                return
            if self._watching is not None:
                self._watching.set()
            stop = threading.Event()
            self._watching, self._watched = stop, plan
        threading.Thread(target=self._watch, args=(store, plan, stop, posted), name="rendezvous watch",
                         daemon=True).start()

    def stop_watch(self) -> None:
        """Stop beating (the incarnation ended here)."""
        with self._lock:
            if self._watching is not None:
                self._watching.set()
            self._watching, self._watched = None, None

    def _lost_after_s(self) -> float:
        c = self.cfg.conf
        return float(c.get("keep_alive_interval", KEEP_ALIVE_S)) * float(c.get("keep_alive_max_attempt",
                                                                                  KEEP_ALIVE_ATTEMPTS))

    def _watch(self, store: Any, plan: RoundPlan, stop: threading.Event, posted: threading.Event | None) -> None:
        me, n = plan.group_rank, plan.nnodes
        if posted is not None:  # the round is posted at once after this thread starts
            posted.wait(EXCHANGE_TIMEOUT_S)
        lost_after = self._lost_after_s()
        seen: list[tuple[bytes | None, float]] = [(None, time.monotonic())] * n
        next_waiting = time.monotonic() + WAITING_POLL_S
        try:
            while not stop.is_set():
                store.add(f"{PREFIX}beat/{me}", 1)
                if store.add(f"{PREFIX}ended", 0) > 0:
                    if not stop.is_set():
                        why = store.get(f"{PREFIX}ended_by").decode(errors="replace")[:300] \
                            if store.check([f"{PREFIX}ended_by"]) else "another node"
                        self._post("peer", why, plan.incarnation)
                    return
                done = [store.add(f"{PREFIX}done/{g}", 0) > 0 for g in range(n)]
                beats = [str(store.add(f"{PREFIX}beat/{g}", 0)).encode() for g in range(n)]
                seen, lost = stale_peers(beats, seen, time.monotonic(), lost_after, me)
                lost = [g for g in lost if not done[g]]
                if lost and not stop.is_set():
                    self._post("peer", f"node {lost[0]} of the group stopped beating for {lost_after:g}s "
                                       "(its host or supervisor is gone)", plan.incarnation)
                    return
                if time.monotonic() >= next_waiting:
                    next_waiting = time.monotonic() + WAITING_POLL_S
                    if self._handler.num_nodes_waiting() > 0 and not stop.is_set():
                        self._post("peer", "a node is waiting for the next round of the rendezvous", plan.incarnation)
                        return
                stop.wait(BEAT_S)
        except Exception as e:  # noqa: BLE001 - the rendezvous store went away with its host
            if not stop.is_set():
                self._post("peer", f"the rendezvous store is unreachable ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''})", plan.incarnation)

    def end(self, reason: str) -> None:
        """This node's incarnation ended (a rank failed or hung here): tell the others at
        once, before this node's ranks are even stopped."""
        self.stop_watch()
        with self._lock:
            store = self._round_store
        if store is None:
            return
        try:
            store.set(f"{PREFIX}ended_by", reason.encode()[:300])
            store.add(f"{PREFIX}ended", 1)
        except Exception as e:  # noqa: BLE001 - they learn it from the rendezvous then
            log.warning("rendezvous: could not tell the other nodes that this incarnation ended: %s", e)

    def finish(self) -> None:
        """Every rank here exited 0: say so; the rendezvous host waits (at most
        ``EXIT_BARRIER_S``) for the other nodes to finish or end, since its store goes
        away with it. Then close the rendezvous, as torchrun does after success."""
        self.stop_watch()
        with self._lock:
            store, plan = self._round_store, self._plan
        if store is not None and plan is not None:
            try:
                store.add(f"{PREFIX}done/{plan.group_rank}", 1)
                deadline = time.monotonic() + EXIT_BARRIER_S
                while self.is_host and time.monotonic() < deadline:
                    if store.add(f"{PREFIX}ended", 0) > 0 or all(
                            store.add(f"{PREFIX}done/{g}", 0) > 0 for g in range(plan.nnodes)):
                        break
                    time.sleep(BEAT_S)
            except Exception as e:  # noqa: BLE001
                log.warning("rendezvous: could not wait for the other nodes to finish: %s", e)
        self.close()

    def close(self) -> None:
        """Close the rendezvous for every node (after success or giving up): a node that
        tries to join again is told so and exits."""
        self.stop_watch()
        if self._handler is None:
            return
        try:
            self._handler.shutdown()
        except Exception as e:  # noqa: BLE001
            log.debug("rendezvous: shutdown: %s", e)


__all__ = ["BEAT_S", "NodeRendezvous", "RdzvConfig", "hosts_endpoint"]
