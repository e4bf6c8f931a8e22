"""``ManagerClient``: what every rank of a replica group uses to talk to its group's
``ManagerServer`` (ours or torchft's; the wire is torchft's ``ManagerService``).

Names mirror torchft 0.2.0's Rust client (``_quorum``, ``_checkpoint_metadata``,
``should_commit``). Every call has a timeout, sent as the gRPC deadline (the server
uses it to bound its own lighthouse call). gRPC errors become ``TimeoutError``,
``ConnectionError``, ``KeyError`` (unknown checkpoint metadata) or ``ValueError``
(rejected request), each naming the server and what to do.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import Any

import grpc

from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net.limits import MAX_ADDRESS_BYTES, utf8_len
from rallypoint._net.addr import grpc_target
from rallypoint._net.inject import INJECT_KEY, MAX_INJECT_BYTES
from rallypoint._net.auth import bearer_metadata, job_token
from rallypoint._net.rpc import channel_options, seconds, translate_rpc_error
from rallypoint._net.tls import TlsConfig, tls_config
from rallypoint._net.tls import channel as tls_channel
from rallypoint.manager.recovery import QuorumResult
from rallypoint.manager._next_round import NextRound
from rallypoint.manager._result_pb import result_from_pb, result_to_pb
from rallypoint.manager._votes import RANK_KEY_HEADER, new_rank_key
from rallypoint.manager._vote_socket import VoteSocketClient, VoteSocketError, advertised, answer_error
from rallypoint._net.addr import split_host_port
from rallypoint.manager.rules import STEP_STATS_HEADER, encode_step_stats

log = logging.getLogger("rallypoint.manager.client")


#: The trailing metadata key of a ManagerServer's striping addition (rallypoint.proto's
#: QuorumStripe); torchft's clients ignore it.
STRIPE_KEY = "rallypoint-stripe-bin"
#: The most sources and the largest addition a client takes from one answer.
MAX_STRIPE_SOURCES = 8
MAX_STRIPE_BYTES = 16 * 1024


def stripe_metadata(r: QuorumResult) -> tuple[tuple[str, bytes]] | None:
    """The striping fields of ``r`` as trailing metadata (None when there are none)."""
    if not (r.recover_src_replica_ranks or r.stripe_dst_replica_ranks):
        return None
    n = MAX_STRIPE_SOURCES
    msg = rpb.QuorumStripe(src_replica_ranks=r.recover_src_replica_ranks[:n],
                           src_manager_addresses=r.recover_src_manager_addresses[:n],
                           dst_replica_ranks=r.stripe_dst_replica_ranks)
    return ((STRIPE_KEY, msg.SerializeToString()),)


def with_stripe(r: QuorumResult, trailing: Any) -> QuorumResult:
    """``r`` with the striping fields a rallypoint ManagerServer sent in ``trailing``
    (gRPC trailing metadata); unchanged when there are none, or they are malformed or
    over the size limits (striping is an optimisation: the assigned source suffices)."""
    raw = next((v for k, v in (trailing or ()) if k == STRIPE_KEY), None)
    if not isinstance(raw, bytes) or len(raw) > MAX_STRIPE_BYTES:
        return r
    try:
        msg = rpb.QuorumStripe.FromString(raw)
    except Exception:  # noqa: BLE001 - a malformed addition is ignored
        log.warning("ignoring a malformed striping addition to the quorum answer")
        return r
    srcs = list(msg.src_replica_ranks)[:MAX_STRIPE_SOURCES]
    addrs = list(msg.src_manager_addresses)[:MAX_STRIPE_SOURCES]
    if len(srcs) != len(addrs) or any(utf8_len(a) > MAX_ADDRESS_BYTES for a in addrs) \
            or any(not 0 <= k < r.replica_world_size for k in [*srcs, *msg.dst_replica_ranks]) \
            or (srcs and srcs[0] != r.recover_src_replica_rank):
        log.warning("ignoring an inconsistent striping addition to the quorum answer")
        return r
    return dataclasses.replace(r, recover_src_replica_ranks=srcs, recover_src_manager_addresses=addrs,
                               stripe_dst_replica_ranks=list(msg.dst_replica_ranks)[: r.replica_world_size])


def with_inject(r: QuorumResult, trailing: Any) -> QuorumResult:
    """``r`` with the fault injections a rallypoint ManagerServer passed on in ``trailing``
    (raw; the Manager checks them before carrying them out); over the size limit: none."""
    raw = next((v for k, v in (trailing or ()) if k == INJECT_KEY), None)
    if not isinstance(raw, bytes) or not raw or len(raw) > MAX_INJECT_BYTES:
        return r
    return dataclasses.replace(r, inject=raw)


def quorum_request(
    group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool, commit_failures: int, init_sync: bool,
    reconfigure_handle: str = "",
) -> pb.ManagerQuorumRequest:
    """The ``Quorum`` request one rank sends (over gRPC or in process); ``reconfigure_handle``
    (torchft 0.3): the rank's process group's handle, ``''`` for none."""
    return pb.ManagerQuorumRequest(
        group_rank=group_rank,
        step=step,
        checkpoint_metadata=checkpoint_metadata,
        shrink_only=shrink_only,
        init_sync=init_sync,
        commit_failures=commit_failures,
        reconfigure_handle=reconfigure_handle,
    )


class ManagerClient:
    """Client of a replica group's ``ManagerServer`` (torchft's ``ManagerClient(addr,
    connect_timeout)``). Thread-safe; ``close()`` releases the channel."""

    def __init__(self, addr: str, connect_timeout: float | timedelta = 10.0, *, fail_fast: bool = False,
                 token: str | None = None, tls: TlsConfig | None = None, rank_key: str | None = None) -> None:
        """``token``: the job token sent with every call (default ``RALLYPOINT_TOKEN``).
        ``tls``: the job's TLS settings (default ``RALLYPOINT_TLS_*``).
        ``fail_fast``: do not wait for the connection; a call to a peer that refuses it
        fails at once instead of after ``connect_timeout`` (for a peer that was alive a
        moment ago, such as a heal source: if it refuses now, it died, and waiting would
        stall the whole quorum)."""
        self.addr = addr
        self._connect_timeout = seconds(connect_timeout)
        self._token = job_token(token)
        self._metadata = bearer_metadata(self._token)
        # This client's rank key: the server binds it to the group rank of our first
        # Quorum/ShouldCommit, so no other caller can vote or set checkpoint metadata for it.
        # ``rank_key``: one the rank published in its group's store (a fresh one by default).
        self._rank_key = [(RANK_KEY_HEADER, rank_key or new_rank_key())]
        self._rank_metadata = [*(self._metadata or []), *self._rank_key]
        tls = tls or tls_config()
        self._channel = tls_channel(grpc_target(addr), addr, tls, channel_options())
        # The commit vote over group rank 0's vote socket, once its server names one.
        self._host = split_host_port(grpc_target(addr))[0]
        self._fast: VoteSocketClient | None = None
        self._fast_allowed = not addr.startswith("https://") and not tls.serving
        self._fast_failed: tuple[int, bytes] | None = None  # (port, instance) of a socket that failed
        # Calls made without waiting for readiness fail at once (UNAVAILABLE) when the
        # peer refuses the connection: fail_fast skips this wait and relies on that.
        if not fail_fast:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=self._connect_timeout)
            except grpc.FutureTimeoutError:
                self._channel.close()
                raise ConnectionError(
                    f"could not connect to the manager server at {addr} within {self._connect_timeout:.1f}s; "
                    "is group rank 0 of this replica group running (check MASTER_ADDR / the manager port)?"
                ) from None
        self._quorum_call = self._channel.unary_unary(
            "/torchft.ManagerService/Quorum",
            request_serializer=pb.ManagerQuorumRequest.SerializeToString,
            response_deserializer=pb.ManagerQuorumResponse.FromString,
        )
        self._metadata_call = self._channel.unary_unary(
            "/torchft.ManagerService/CheckpointMetadata",
            request_serializer=pb.CheckpointMetadataRequest.SerializeToString,
            response_deserializer=pb.CheckpointMetadataResponse.FromString,
        )
        self._commit_call = self._channel.unary_unary(
            "/torchft.ManagerService/ShouldCommit",
            request_serializer=pb.ShouldCommitRequest.SerializeToString,
            response_deserializer=pb.ShouldCommitResponse.FromString,
        )
        # The round handed out with the last vote, on a lease (manager/_next_round.py).
        self._next = NextRound()
        self._kill_call = self._channel.unary_unary(
            "/torchft.ManagerService/Kill",
            request_serializer=pb.KillRequest.SerializeToString,
            response_deserializer=pb.KillResponse.FromString,
        )

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: float | timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
        step_stats: dict[str, Any] | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        """Join this step's quorum for ``group_rank``; blocks until the group's quorum
        forms (every rank of the group asked and the lighthouse answered).

        ``reconfigure_handle`` (torchft 0.3's ``_quorum`` argument): this rank's process
        group's ``get_reconfigure_handle()``, ``''`` for none; the result's
        ``reconfigure_handles`` is this group rank's handle in every member, in replica
        order. A server refuses a bad handle (``ValueError`` naming the field).

        ``step_stats``: how this rank's previous round went (see
        :func:`rallypoint.manager.rules.check_step_stats`), sent as the
        ``x-rallypoint-step-stats`` metadata so the lighthouse can score stragglers; a
        rallypoint server refuses bad stats (``ValueError``), torchft's ignores them."""
        secs = seconds(timeout)
        req = quorum_request(group_rank, step, checkpoint_metadata, shrink_only, commit_failures, init_sync,
                             reconfigure_handle)
        metadata = self._rank_metadata
        if step_stats is not None:
            metadata = [*metadata, (STEP_STATS_HEADER, encode_step_stats(step_stats))]
        try:
            resp, call = self._quorum_call.with_call(req, timeout=secs, metadata=metadata)
        except grpc.RpcError as e:
            raise self._translate(e, f"quorum for group rank {group_rank} at step {step}", secs) from None
        trailing = call.trailing_metadata()
        result = with_inject(with_stripe(result_from_pb(resp), trailing), trailing)
        self._next.asked(group_rank, checkpoint_metadata, result)
        return result

    def leased_quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        commit_failures: int = 0,
        init_sync: bool = True,
        step_stats: dict[str, Any] | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult | None:
        """This rank's round at ``step`` without a call, when a rallypoint server handed it
        out with the answer to the last vote (the group is on a lease and the round is the
        next one; see ``manager/_next_round.py``), else None: then ask with :meth:`_quorum`.
        ``step_stats`` then go with this round's vote. ``init_sync`` and
        ``reconfigure_handle`` are the ask's; a handed-out round keeps the lease's."""
        return self._next.take(group_rank, step, checkpoint_metadata, shrink_only, commit_failures, step_stats)

    @property
    def taken(self) -> int:
        """Rounds this client started from a hand-out, without a call (tests and benchmarks)."""
        return self._next.taken

    def _checkpoint_metadata(self, rank: int, timeout: float | timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent with its last quorum request."""
        secs = seconds(timeout)
        try:
            return self._metadata_call(pb.CheckpointMetadataRequest(rank=rank), timeout=secs,
                                       metadata=self._metadata).checkpoint_metadata
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise KeyError(f"manager at {self.addr} has no checkpoint metadata for rank {rank}: {e.details()}") from None
            raise self._translate(e, f"checkpoint metadata of rank {rank}", secs) from None

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: float | timedelta) -> bool:
        """Vote for ``step``; True only if every rank of the group voted True for it. On a
        lease, a rallypoint server hands out the next round with a passed vote (see
        :meth:`leased_quorum`); torchft's server ignores the ask."""
        secs = seconds(timeout)
        asks = self._next.vote_metadata()
        what = f"should_commit of group rank {group_rank} at step {step}"
        fast = self._fast
        if fast is not None:  # the group rank 0's vote socket (manager/_vote_socket.py)
            try:
                answer = fast.vote(group_rank, step, should_commit, [*self._rank_key, *asks], secs)
            except VoteSocketError as e:
                log.info("voting over gRPC: %s", e)
                self._drop_fast()
            except (TimeoutError, ConnectionError) as e:
                self._next.voted(group_rank, step, False, None)
                raise type(e)(f"{what} at manager {self.addr}: {e}") from None
            else:
                if answer.decision is None:
                    self._next.voted(group_rank, step, False, None)
                    raise answer_error(answer, f"{what} at manager {self.addr} (vote socket)")
                self._next.voted(group_rank, step, answer.decision, answer.trailing)
                return answer.decision
        req = pb.ShouldCommitRequest(group_rank=group_rank, step=step, should_commit=should_commit)
        try:
            resp, call = self._commit_call.with_call(req, timeout=secs, metadata=[*self._rank_metadata, *asks])
        except grpc.RpcError as e:
            self._next.voted(group_rank, step, False, None)
            raise self._translate(e, what, secs) from None
        trailing = call.trailing_metadata()
        self._next.voted(group_rank, step, resp.should_commit, trailing)
        self._learn_fast(trailing)
        return resp.should_commit

    def _learn_fast(self, trailing: Any) -> None:
        """Vote over the socket a rallypoint server names in its answer, from the next vote
        on (not over TLS: the socket is plain TCP)."""
        if self._fast is not None or not self._fast_allowed:
            return
        named = advertised(trailing)
        if named is not None and named != self._fast_failed:
            self._fast = VoteSocketClient(self._host, named[0], self._token, named[1])

    def _drop_fast(self) -> None:
        """Back to gRPC (the socket failed before a vote was sent); a socket named later
        with another port or instance (a new group rank 0) is tried, the failed one is not."""
        fast, self._fast = self._fast, None
        if fast is not None:
            self._fast_failed = (fast.port, fast.instance)
            fast.close()

    def kill(self, msg: str, timeout: float | timedelta = 10.0) -> None:
        """Ask the manager server to end its replica's process (with a logged reason)."""
        secs = seconds(timeout)
        try:
            self._kill_call(pb.KillRequest(msg=msg), timeout=secs, metadata=self._metadata)
        except grpc.RpcError as e:
            # The process may die before the answer gets out: that is success.
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise self._translate(e, "kill", secs) from None

    def _translate(self, e: grpc.RpcError, what: str, timeout: float) -> Exception:
        return translate_rpc_error(e, f"{what} at manager {self.addr}", timeout)

    def close(self) -> None:
        """Close the vote socket's connections and the gRPC channel."""
        fast, self._fast = self._fast, None
        if fast is not None:
            fast.close()
        self._channel.close()

    def __enter__(self) -> "ManagerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ManagerClient", "quorum_request", "result_from_pb", "result_to_pb"]
