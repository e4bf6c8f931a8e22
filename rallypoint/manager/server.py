"""``ManagerServer``: torchft's ``ManagerService`` for one replica group, run on its
group rank 0 in a background thread with its own asyncio loop.

* ``Quorum``: gathers one request from each of the group's ``world_size`` ranks for the
  same step, asks the lighthouse once for the whole group
  (:func:`~rallypoint.manager.rules.aggregate_requests`: ``shrink_only`` if any rank
  asked, ``commit_failures`` the maximum over ranks, ``data`` a JSON object of step
  statistics, with the step stats of the rank that held the group up when ranks send
  them in the ``x-rallypoint-step-stats`` metadata), then answers each rank with
  :func:`~rallypoint.manager.recovery.compute_quorum_result`.
  The lighthouse call is bounded by the waiting ranks' own gRPC deadlines; when it fails,
  every waiting rank gets that error at once (torchft leaves them hanging).
  A rank whose call goes away before the group is complete is taken out of the round.
  Bad step stats are INVALID_ARGUMENT and change nothing. torchft 0.3's reconfigure
  handles: the ranks' go up in the group's member (index = group rank), each rank gets its
  own in every member, in replica order; a bad or repeated one is INVALID_ARGUMENT
  (:mod:`rallypoint._net.handles`).
* ``ShouldCommit``: votes are keyed by step; the decision is true only if every rank
  voted true for that step. An undecided vote whose caller went away is withdrawn.
* ``CheckpointMetadata(rank)``: what that rank sent with its last ``Quorum``.
* ``Kill(msg)``: logs the reason and ends the process (``on_kill`` replaces that).

It also heartbeats the lighthouse every ``heartbeat_interval`` and holds rallypoint's
liveness stream (a goodbye on :meth:`shutdown`, so a clean stop is not a crash). When the
lighthouse grants a quorum as a lease, later rounds are answered from it without asking
(:mod:`rallypoint.manager._lease`, ``rallypoint/lighthouse/LEASES.md``); their step stats
go to the lighthouse on the stream instead.
The decisions themselves are pure functions in :mod:`rallypoint.manager.rules`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures as cf
import functools
import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import grpc

from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net.auth import TokenInterceptor, job_token
from rallypoint._net.fds import raise_open_file_limit
from rallypoint._net.handles import group_handles, rank_handle_refusal
from rallypoint._net.limits import MAX_CHECKPOINT_METADATA_BYTES, MAX_REASON_BYTES, utf8_len
from rallypoint._net.peercap import PeerCap
from rallypoint._net.rpc import seconds, server_options, unary_handler
from rallypoint._net.tls import TlsConfig, add_port, check_server, tls_config
from rallypoint._net.addr import is_loopback, split_host_port
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream, Quorum
from rallypoint.manager.client import result_to_pb
from rallypoint.manager.client import stripe_metadata
from rallypoint.manager.recovery import QuorumResult, compute_quorum_result
from rallypoint.manager import rules
from rallypoint._net.inject import INJECT_KEY, parse_injections
from rallypoint._net.lease import parse_lease
from rallypoint.manager._lease import LeaseHolder, ResultCache, StatsBatch
from rallypoint.manager._inprocess import InProcessCalls, _Failure
from rallypoint.manager._server_lease import LeasedRounds
from rallypoint.manager._server_next import NextRounds
from rallypoint.manager._votes import RANK_KEY_HEADER, CommitVotes, new_rank_key
from rallypoint.manager._server_votes import VoteCalls
from rallypoint.manager._vote_socket import VoteSocketServer
from rallypoint.manager._vote_socket import enabled as vote_socket_enabled

from rallypoint.manager._server_parts import (QuorumRound as _QuorumRound, default_kill as _default_kill,
                                             discard as _discard, header as _header, raw as _raw)

log = logging.getLogger("rallypoint.manager")

# Used when a Quorum request carries no deadline and no quorum_timeout was given.
DEFAULT_QUORUM_TIMEOUT_S = 60.0


class ManagerServer(VoteCalls, InProcessCalls, LeasedRounds, NextRounds):
    """torchft's ``ManagerServer(replica_id, lighthouse_addr, hostname, bind, store_addr,
    world_size, heartbeat_interval, connect_timeout, quorum_retries)`` plus ours.

    Durations accept ``timedelta`` or float seconds. ``quorum_timeout`` caps the
    lighthouse call (by default the ranks' request deadlines alone bound it).
    ``quorum_retries`` (torchft's): how many times a failed (not timed-out) lighthouse
    call is retried within the ranks' deadline before every waiting rank gets the error.
    ``on_kill(msg)`` replaces ending the process on ``Kill``; ``on_peer_down(replica_id,
    reason)`` is called (on the liveness stream's thread) when the lighthouse reports
    another replica dead. Raises ``ConnectionError`` if the lighthouse is unreachable
    within ``connect_timeout`` and ``OSError`` if ``bind`` cannot be bound.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: float | timedelta = 0.1,
        connect_timeout: float | timedelta = 10.0,
        quorum_retries: int = 0,
        quorum_timeout: float | timedelta | None = None,
        token: str | None = None,
        *,
        on_kill: Callable[[str], None] | None = None,
        on_peer_down: Callable[[str, str], None] | None = None,
        liveness: bool = True,
        startup_timeout: float = 30.0,
        tls: TlsConfig | None = None,
        leases: bool | None = None,
        on_lease_left: Callable[[str, str, int, int], None] | None = None,
        published_rank_key: Callable[[int], str | None] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size} (replica {replica_id})")
        self.replica_id = replica_id
        self.lighthouse_addr = lighthouse_addr
        self.hostname = hostname
        self.store_addr = store_addr
        self.world_size = world_size
        self._bind = bind
        self._heartbeat_interval = seconds(heartbeat_interval)
        self._connect_timeout = seconds(connect_timeout)
        self._quorum_timeout = seconds(quorum_timeout) if quorum_timeout is not None else None
        self._quorum_retries = max(0, int(quorum_retries))
        self._token = job_token(token)  # the argument, else RALLYPOINT_TOKEN; guards this server too
        self._tls = tls or tls_config()  # the argument, else RALLYPOINT_TLS_*
        bind_host, _ = split_host_port(bind)
        check_server(self._tls, f"the manager server of replica {replica_id}", bind_host, self._token, is_loopback(bind_host))
        self._on_kill = on_kill or _default_kill
        self._on_peer_down = on_peer_down
        # Quorum leases: on unless turned off here or by RALLYPOINT_LEASES=0. They need the stream,
        # and someone to fail a round a member left (the Manager's FailFast, via on_lease_left).
        self._leasing = liveness and on_lease_left is not None and (
            leases if leases is not None else os.environ.get("RALLYPOINT_LEASES", "1") != "0")
        self._lease = LeaseHolder()
        self._reports = StatsBatch()  # step stats of leased rounds, reported every report_every steps
        self._on_lease_left = on_lease_left

        # Loop-thread state.
        self._rounds: dict[int, _QuorumRound] = {}
        self._votes = CommitVotes(world_size, replica_id, self._superseded, on_decided=self._decided)
        # The next round handed out with a passed vote, on a lease (manager/_next_round.py);
        # RALLYPOINT_NEXT_ROUND=0 turns it off (every rank asks for every round, as before).
        self._hand_out = os.environ.get("RALLYPOINT_NEXT_ROUND", "1") != "0"
        self._next_asks: dict[int, dict[int, bool]] = {}
        self._issued_stats: dict[int, dict[str, Any] | None] = {}
        self._issued_results: ResultCache = {}  # a handed-out round's result per group rank
        self._leased_results: ResultCache = {}  # the one-rank path's (LeasedRounds)
        self._metadata: dict[int, str] = {}
        # Which process speaks for each group rank (see manager/_votes.py); rank 0's own
        # process calls in-process with the server's key.
        self._rank_keys: dict[int, str] = {}
        self._local_key = new_rank_key()
        # The group's store's digest of a rank's key, if readable: a first key must match it.
        self._published_key = published_rank_key
        self._inflight: set[_QuorumRound] = set()
        self._tasks: set[asyncio.Task] = set()

        self._lighthouse = LighthouseClient(lighthouse_addr, connect_timeout=self._connect_timeout, token=self._token,
                                            tls=self._tls)
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"rallypoint-manager-{replica_id}")
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._vote_socket: VoteSocketServer | None = None
        self.peer_cap: PeerCap | None = None  # the gRPC port's per-peer connection cap, once serving
        self._thread = threading.Thread(target=self._thread_main, name=f"rallypoint-manager-{replica_id}", daemon=True)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_main, name=f"rallypoint-manager-heartbeat-{replica_id}", daemon=True
        )
        self._liveness: LivenessStream | None = None
        try:
            self._thread.start()
            if not self._ready.wait(startup_timeout):
                raise TimeoutError(f"[{replica_id}] manager server did not start within {startup_timeout}s on {bind}")
            if self._error is not None:
                raise self._error
            self._heartbeat_thread.start()
            if liveness:
                self._liveness = LivenessStream(
                    lighthouse_addr,
                    replica_id,
                    self.address(),
                    token=self._token,
                    tls=self._tls,
                    ping_interval=max(self._heartbeat_interval, 0.05),
                    on_peer_down=self._peer_down,
                    held_lease=self._lease.held if self._leasing else None,
                    on_lease_revoke=self._lease_revoked,
                )
                self._liveness.start(timeout=min(self._connect_timeout, 5.0))
        except BaseException:
            self.shutdown()
            raise
        log.info("[%s] manager server listening on %s (group world size %d)", replica_id, self.address(), world_size)

    # ------------------------------------------------------------------ threads
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                log.exception("[%s] manager server loop crashed", self.replica_id)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # Every ManagerService method needs the job token when one is set: Kill ends the
        # replica and ShouldCommit votes decide whether a step commits.
        interceptors: list[grpc.aio.ServerInterceptor] = [TokenInterceptor(self._token)] if self._token else []
        raise_open_file_limit()  # idle sockets from anyone must not exhaust our descriptors
        # At most so many connections per source address; admitted calls prove a connection.
        self.peer_cap = cap = PeerCap(name=f"manager server of replica {self.replica_id}")
        interceptors.append(cap.interceptor())
        server = grpc.aio.server(options=server_options() + cap.options(), interceptors=interceptors)
        server.add_generic_rpc_handlers([self._handlers()])
        try:
            try:
                port = add_port(server, self._bind, self._tls)
            except RuntimeError as e:
                raise OSError(f"[{self.replica_id}] cannot bind the manager server to {self._bind}: {e}") from None
            if not port:
                raise OSError(f"[{self.replica_id}] cannot bind the manager server to {self._bind} (address in use?)")
            self._port = port
            await server.start()
            if self.world_size > 1 and self._tls.scheme() == "http" and vote_socket_enabled():
                # Ranks > 0 vote here instead of over gRPC (manager/_vote_socket.py); not over TLS.
                self._vote_socket = VoteSocketServer(self._token, self._socket_vote, self.replica_id)
                await self._vote_socket.start(split_host_port(self._bind)[0])
            self._ready.set()
            await self._stop.wait()
        finally:
            self._fail_all(grpc.StatusCode.UNAVAILABLE, f"manager server of replica {self.replica_id} is shutting down")
            if self._vote_socket is not None:
                await self._vote_socket.stop()
            await server.stop(grace=0.5 if self._ready.is_set() else None)

    def _heartbeat_main(self) -> None:
        failing = False
        timeout = max(1.0, min(5.0, 10 * self._heartbeat_interval))
        while not self._stopped.is_set():
            stream = self._liveness
            if stream is not None and stream.connected and not stream.unsupported:
                # The stream's pings are heartbeats: no second one per interval (the lighthouse's
                # load at 1,000 groups); the unary heartbeat resumes whenever the stream is down.
                self._stopped.wait(self._heartbeat_interval)
                continue
            try:
                self._lighthouse.heartbeat(self.replica_id, timeout=timeout)
                if failing:
                    log.info("[%s] heartbeats reach the lighthouse again", self.replica_id)
                failing = False
            except Exception as e:
                if self._stopped.is_set():
                    return
                if not failing:
                    log.warning("[%s] heartbeat to the lighthouse at %s failed: %s", self.replica_id, self.lighthouse_addr, e)
                failing = True
            self._stopped.wait(self._heartbeat_interval)

    def _peer_down(self, replica_id: str, reason: str) -> None:
        log.warning("[%s] lighthouse reports replica %s down: %s", self.replica_id, replica_id, reason)
        if self._on_peer_down is not None:
            self._on_peer_down(replica_id, reason)

    # ------------------------------------------------------------------ gRPC
    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "torchft.ManagerService",
            {
                "Quorum": unary_handler(self._quorum, pb.ManagerQuorumRequest, _raw),
                "CheckpointMetadata": unary_handler(self._checkpoint_metadata, pb.CheckpointMetadataRequest, _raw),
                "ShouldCommit": unary_handler(self._should_commit, pb.ShouldCommitRequest, _raw),
                "Kill": unary_handler(self._kill, pb.KillRequest, _raw),
            },
        )

    async def _too_long(self, context: grpc.aio.ServicerContext, field: str, value: str, limit: int) -> None:
        """INVALID_ARGUMENT naming ``field`` if ``value`` exceeds ``limit`` UTF-8 bytes."""
        size = utf8_len(value)
        if size > limit:
            log.warning("[%s] refused a request from %s: %s is %d bytes (limit %d)",
                        self.replica_id, context.peer(), field, size, limit)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{field} is {size} bytes; the limit is {limit}")

    async def _quorum(self, req: pb.ManagerQuorumRequest, context: grpc.aio.ServicerContext) -> pb.ManagerQuorumResponse:
        rank, peer = req.group_rank, context.peer()
        try:
            self._rank_in_range(rank, "quorum")
            await self._too_long(context, "checkpoint_metadata", req.checkpoint_metadata, MAX_CHECKPOINT_METADATA_BYTES)
            stats = self._checked_stats(_header(context, rules.STEP_STATS_HEADER), rank, "quorum", peer)
            await self._checked_claim(_header(context, RANK_KEY_HEADER), rank, "quorum", peer)
            result = await self._join_quorum(req, context.time_remaining(), stats)
        except _Failure as f:
            await context.abort(f.code, f.message)
        trailing = [*(stripe_metadata(result) or ()), *((INJECT_KEY, result.inject),) * bool(result.inject)]
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return result_to_pb(result)

    async def _join_quorum(self, req: pb.ManagerQuorumRequest, remaining: float | None,
                           stats: dict[str, Any] | None = None) -> QuorumResult:
        """One rank's part of a quorum round (gRPC and in-process callers alike), with its
        checked step stats; raises :class:`_Failure`. Cancelling the caller withdraws the rank."""
        rank = req.group_rank
        rnd = self._rounds.get(req.step)
        why = rank_handle_refusal(req.reconfigure_handle, rank,
                                  {g: r.reconfigure_handle for g, r in rnd.requests.items()} if rnd else {})
        if why is not None:  # torchft 0.3's handle: checked before anything changes
            log.warning("[%s] refused quorum for group rank %d: %s", self.replica_id, rank, why)
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, f"replica {self.replica_id}: {why}")
        self._metadata[rank] = req.checkpoint_metadata
        issued = self._issued_quorum(req, stats)
        quorum, inject = (issued, b"") if issued is not None else await self._gathered(req, rnd, remaining, stats)
        why = rules.group_size_error(quorum.quorum_id, {m.replica_id: m.world_size for m in quorum.members})
        if why is not None:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            result = compute_quorum_result(quorum, self.replica_id, rank, req.init_sync)
        except ValueError as e:
            raise _Failure(grpc.StatusCode.NOT_FOUND, str(e)) from None
        if result.heal:
            log.info("[%s] group rank %d heals: step %d < max_step %d, source replica rank %s",
                     self.replica_id, rank, req.step, result.max_step, result.recover_src_replica_rank)
        return dataclasses.replace(result, inject=inject) if inject else result

    async def _gathered(self, req: pb.ManagerQuorumRequest, rnd: _QuorumRound | None, remaining: float | None,
                        stats: dict[str, Any] | None) -> tuple[Quorum, bytes]:
        """The quorum of the group's round at ``req.step`` once every rank asked (from the
        lease, or the lighthouse's answer), and the injections that came with it; cancelling
        the caller withdraws its rank."""
        rank = req.group_rank
        now = time.monotonic()
        if rnd is None:
            others = {s: sorted(r.requests) for s, r in self._rounds.items()}
            if others:
                log.warning("[%s] group rank %d asks for step %d while ranks are waiting at other steps %s; "
                            "the ranks of one replica group must be at the same step", self.replica_id, rank, req.step, others)
            rnd = self._rounds[req.step] = _QuorumRound(step=req.step, first_at=now)
            # Every commit vote follows a quorum: a new round is a new attempt, so a
            # remembered decision (e.g. a failed step being retried) must not answer it.
            self._votes.forget_decisions()
        rnd.requests[rank] = req
        rnd.deadlines[rank] = now + remaining if remaining is not None else None
        rnd.stats[rank] = stats
        log.debug("[%s] quorum request from group rank %d at step %d (%d/%d)", self.replica_id, rank, req.step, len(rnd.requests), self.world_size)
        if len(rnd.requests) == self.world_size and not rnd.fired:
            rnd.fired = True
            del self._rounds[req.step]
            if not self._from_lease(rnd):
                self._inflight.add(rnd)
                task = asyncio.ensure_future(self._ask_lighthouse(rnd))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(functools.partial(_discard, self._inflight, rnd))
        try:
            quorum: Quorum = await asyncio.shield(rnd.result)
        except asyncio.CancelledError:
            # The caller went away before the group was complete: withdraw it.
            if not rnd.fired and rnd.requests.get(rank) is req:
                del rnd.requests[rank]
                rnd.deadlines.pop(rank, None)
                rnd.stats.pop(rank, None)
                if not rnd.requests and self._rounds.get(rnd.step) is rnd:
                    del self._rounds[rnd.step]
            raise
        return quorum, rnd.inject

    def _injections(self, rnd: _QuorumRound, trailing: Any) -> None:
        """Fault injections the lighthouse handed this group with its answer: checked, then
        passed to every rank with its result (``rallypoint inject``); and its lease grant."""
        rnd.grant = parse_lease(trailing)
        raw = next((v for k, v in trailing or () if k == INJECT_KEY), b"")
        try:
            if parse_injections(raw):
                rnd.inject = bytes(raw)
        except ValueError as e:
            log.warning("[%s] ignored malformed injections from the lighthouse: %s", self.replica_id, e)

    async def _ask_lighthouse(self, rnd: _QuorumRound) -> None:
        now = time.monotonic()
        budget = rules.lighthouse_budget(rnd.deadlines.values(), now, self._quorum_timeout, DEFAULT_QUORUM_TIMEOUT_S)
        group = rules.aggregate_requests(rnd.step, self.world_size, [
            rules.RankRequest(g, r.shrink_only, r.commit_failures, r.init_sync, rnd.stats.get(g))
            for g, r in rnd.requests.items()], rnd.first_at, now)
        log.info("[%s] all %d ranks joined step %d; asking the lighthouse (timeout %.1fs)", self.replica_id, self.world_size, rnd.step, budget)
        assert self._loop is not None
        end = now + budget
        ask = functools.partial(self._lighthouse.quorum, self.replica_id, address=self.address(),
                                store_address=self.store_addr, step=rnd.step, world_size=self.world_size,
                                shrink_only=group.shrink_only, data=json.dumps(group.data),
                                commit_failures=group.commit_failures,
                                on_trailing=functools.partial(self._injections, rnd),
                                reconfigure_handles=group_handles(
                                    {g: r.reconfigure_handle for g, r in rnd.requests.items()}, self.world_size))
        attempt = 0
        while True:
            try:
                quorum = await self._loop.run_in_executor(
                    self._pool, lambda: ask(timeout=max(end - time.monotonic(), 0.001)))
                break
            except ConnectionError as e:
                # torchft's quorum_retries: retry a failed (not timed-out) call within the budget.
                pause = rules.retry_pause(attempt, self._quorum_retries, time.monotonic(), end)
                if pause is None or self._stopped.is_set():
                    error: Exception = e
                else:
                    attempt += 1
                    log.warning("[%s] lighthouse quorum failed (%s); retry %d/%d", self.replica_id, e, attempt, self._quorum_retries)
                    await asyncio.sleep(pause)
                    continue
            except Exception as e:
                error = e
            self._fan_out_failure(rnd, error)
            return
        log.info("[%s] quorum %d formed with %d members", self.replica_id, quorum.quorum_id, len(quorum.members))
        grant = rnd.grant
        if self._leasing and grant is not None and grant.quorum_id == quorum.quorum_id \
                and self._lease.grant(quorum, grant.report_every):
            log.info("[%s] quorum %d is leased: later steps start without asking the lighthouse", self.replica_id,
                     quorum.quorum_id)
        if not rnd.result.done():
            rnd.result.set_result(quorum)

    def _fan_out_failure(self, rnd: _QuorumRound, e: Exception) -> None:
        """Every rank waiting on ``rnd`` gets the lighthouse's error now."""
        code = (grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError)
                else grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.UNAVAILABLE)
        msg = f"replica {self.replica_id}: lighthouse quorum for step {rnd.step} failed: {e}"
        log.warning("[%s] %s", self.replica_id, msg)
        if not rnd.result.done():
            rnd.result.set_exception(_Failure(code, msg))

    async def _checkpoint_metadata(
        self, req: pb.CheckpointMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        if req.rank not in self._metadata:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"replica {self.replica_id} has no checkpoint metadata for group rank {req.rank}: "
                f"that rank has not sent a quorum request yet (known ranks: {sorted(self._metadata)})",
            )
        return pb.CheckpointMetadataResponse(checkpoint_metadata=self._metadata[req.rank])

    async def _kill(self, req: pb.KillRequest, context: grpc.aio.ServicerContext) -> pb.KillResponse:
        await self._too_long(context, "msg", req.msg, MAX_REASON_BYTES)
        log.warning("[%s] got Kill: %s", self.replica_id, req.msg)
        assert self._loop is not None
        await self._loop.run_in_executor(self._pool, self._on_kill, req.msg)
        return pb.KillResponse()

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for rnd in list(self._rounds.values()) + list(self._inflight):
            if not rnd.result.done():
                rnd.result.set_exception(_Failure(code, message))
        self._votes.fail_all(lambda: _Failure(code, message))
        self._rounds.clear()
        self._issued = None

    # ------------------------------------------------------------------ API
    def address(self) -> str:
        """``http://hostname:port`` (torchft's spelling; ``https://`` over TLS)."""
        host = self.hostname
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self._tls.scheme()}://{host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving, say goodbye to the lighthouse, join every thread. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._liveness is not None:
            self._liveness.close("manager server shutdown", timeout=min(timeout, 5.0))
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("[%s] manager server thread did not stop within %.1fs", self.replica_id, timeout)
        if self._heartbeat_thread.ident is not None:
            self._heartbeat_thread.join(timeout)
        self._lighthouse.close()  # cancels an in-flight lighthouse Quorum
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ManagerServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
