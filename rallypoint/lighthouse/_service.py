"""The lighthouse's gRPC handlers: torchft's ``LighthouseService`` plus rallypoint's
``Attach`` liveness stream, status, kill, inject and event reports.

Each handler validates, finds the call's job (the ``rallypoint-job`` metadata, see
:mod:`rallypoint.lighthouse.jobs`), then delegates to that job's core. The calls a replica
group makes (Quorum, Heartbeat, Attach, ReportEvent) start serving a job on its first call;
Status, KillReplica and Inject only see jobs that exist. Credentials are checked before any
handler runs, per job (:class:`JobTokenInterceptor`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import grpc

from rallypoint._net.inject import INJECT_KEY, encode_injections
from rallypoint._net.job import job_of
from rallypoint._net.lease import LEASE_KEY, encode_grant
from rallypoint._net.limits import MAX_REASON_BYTES, clip
from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint._net.rpc import unary_handler
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse import reports, validate
from rallypoint.lighthouse._jobtable import Job, JobTable, TooManyJobs
from rallypoint.lighthouse._view import _raw
from rallypoint.lighthouse.core import OUTBOX_LIMIT, LighthouseCore, ReplicaDead, _Attachment
from rallypoint.lighthouse.injections import UnknownReplica, check_request, refusal_detail
from rallypoint.lighthouse.jobs import refusal_hint
from rallypoint.lighthouse.owners import caller_of

log = logging.getLogger("rallypoint.lighthouse")
# A stream must say hello promptly, or it is a confused client holding a slot.
HELLO_TIMEOUT_S = 10.0


class JobTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before any handler runs, every call whose credential does not admit it to
    the job it names: ``admit(job, authorization) -> None | why`` (:func:`jobs.admit`). A
    call naming an invalid job is refused too (INVALID_ARGUMENT). ``on_reject(job, why)``
    is told of each refusal (metrics)."""

    def __init__(self, admit: Callable[[str, str | bytes | None], str | None],
                 on_reject: Callable[[str | None, str], None] | None = None) -> None:
        self._admit = admit
        self._on_reject = on_reject
        self._log_throttle = Throttle(1.0)  # a flood of refusals cannot flood the log

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        metadata = details.invocation_metadata or ()
        got: str | bytes | None = None
        for key, value in metadata:
            if key == "authorization":
                got = value
        job: str | None
        try:
            job = job_of(metadata)
        except ValueError as e:
            job, why, code, hint = None, "invalid job", grpc.StatusCode.INVALID_ARGUMENT, str(e)
        else:
            why = self._admit(job, got)  # type: ignore[assignment]
            if why is None:
                return await continuation(details)
            code, hint = grpc.StatusCode.UNAUTHENTICATED, refusal_hint(job, why)
        left_out = self._log_throttle.ready()
        if left_out is not None:
            log.warning("refused %s for job %r: %s%s", details.method, job, why, left_out_note(left_out, "other refusals"))
        if self._on_reject is not None:
            self._on_reject(job, why)

        async def deny(_requests: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, hint)

        # A streaming handler for every method, unary ones included: it never reads the
        # request, so a refused caller cannot make the server take in (and hold) a large
        # message first. The wire framing is the same for both kinds.
        return grpc.stream_stream_rpc_method_handler(deny)


class _Service:
    """gRPC handlers; each one validates, then delegates to its job's core."""

    def __init__(self, table: JobTable, leads: Callable[[], bool] = lambda: True) -> None:
        self.table = table
        self.leads = leads  # False on an HA standby (and a deposed leader): refuse what needs the leader
        self._log_throttle = Throttle(1.0)

    async def _job(self, context: grpc.aio.ServicerContext, create: bool = True) -> Job:
        """The call's job (the interceptor has checked its name and credential already;
        a lighthouse without credentials checks the name here). ``create``: start serving
        a job on its first call, else NOT_FOUND."""
        try:
            name = job_of(context.invocation_metadata())
        except ValueError as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = self.table.get(name)
        if job is not None:
            return job
        if not create:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {name!r} on this lighthouse (a job starts with "
                                "its replica groups' first call); check RALLYPOINT_JOB / --job")
            raise AssertionError("unreachable")
        try:
            return await self.table.open(name)
        except TooManyJobs as e:
            self.table.default.metrics.rejected("too_many_jobs")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            raise AssertionError("unreachable")

    def gated(self, fn: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
        """``fn``, refused with UNAVAILABLE ("standby lighthouse") unless this lighthouse
        leads: a client with several lighthouse addresses moves on to the next."""
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not self.leads():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "standby lighthouse: not the leader (HA); "
                                    "ask another lighthouse of the job")
            return await fn(request, context)
        return call

    async def status(self, _request: rpb.StatusRequest, context: grpc.aio.ServicerContext) -> rpb.StatusResponse:
        job = await self._job(context, create=False)
        return rpb.StatusResponse(json=json.dumps(job.view.status()))

    async def kill_replica(
        self, request: rpb.KillReplicaRequest, context: grpc.aio.ServicerContext
    ) -> rpb.KillReplicaResponse:
        try:
            rid = validate.replica_id(request.replica_id)
            why = validate.reason(request.reason)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = await self._job(context, create=False)
        try:
            address = await job.view.kill(rid, why or "killed via the lighthouse")
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown replica {rid!r}: the lighthouse has no manager address for it")
            raise AssertionError("unreachable")
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not reach the manager of replica {rid}: {e}")
            raise AssertionError("unreachable")
        return rpb.KillReplicaResponse(address=address)

    async def report_event(
        self, request: rpb.SupervisorEvent, context: grpc.aio.ServicerContext
    ) -> rpb.ReportEventResponse:
        """A ``rallypoint run`` supervisor's event, into the event log (:mod:`reports`)."""
        try:
            report = reports.supervisor_event(request.group, request.kind, request.details)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = await self._job(context)
        event = job.reports.accept(report, context.peer())
        if event is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"event of group {report.group} dropped: over the lighthouse's rate limit for reported events",
            )
            raise AssertionError("unreachable")
        return rpb.ReportEventResponse(event_id=event.id)

    async def _claim(self, context: grpc.aio.ServicerContext, job: Job, rid: str, what: str) -> None:
        """PERMISSION_DENIED (counted as ``replica_id_taken``) unless the caller may speak
        for replica ``rid`` (:mod:`owners`): a live id is bound to the caller that registered it."""
        caller = caller_of(context.invocation_metadata(), context.peer())
        why = job.core.owners.claim(rid, caller)
        if why is None:
            return
        job.metrics.rejected("replica_id_taken")
        left_out = self._log_throttle.ready()
        if left_out is not None:
            log.warning("refused %s under replica id %r in job %r from %s (%s): the id is bound to another caller%s",
                        what, rid, job.name, context.peer(), caller.describe(), left_out_note(left_out, "other refusals"))
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        raise AssertionError("unreachable")

    async def _invalid(self, context: grpc.aio.ServicerContext, err: Exception, job: Job | None = None) -> None:
        (job or self.table.default).metrics.rejected("invalid_argument")
        left_out = self._log_throttle.ready()  # a flood of bad requests cannot flood the log
        if left_out is not None:
            log.warning("rejected request from %s: %s%s", context.peer(), err, left_out_note(left_out, "other rejections"))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def quorum(self, request: pb.LighthouseQuorumRequest, context: grpc.aio.ServicerContext) -> bytes:
        try:
            member = validate.quorum_request(request)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = await self._job(context)
        await self._claim(context, job, member.replica_id, "a Quorum")
        core = job.core
        try:
            validate.handle_collision(member, core.pending)  # torchft 0.3: no handle twice in a quorum
        except validate.InvalidRequest as e:
            await self._invalid(context, e, job)
        log.debug("[%s] quorum request at step %d (job %s)", member.replica_id, member.step, job.name)
        try:
            answer = await core.request_quorum(member)
        except ReplicaDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            raise AssertionError("unreachable")
        trailing = []
        injections = core.injections.take(member.replica_id)
        if injections:  # `rallypoint inject`: carried out by the group at its next step boundary
            trailing.append((INJECT_KEY, encode_injections(injections)))
        leased = core.leases.holds(member.replica_id)
        if leased:  # the quorum just answered is leased (LEASES.md); nothing revoked it since
            trailing.append((LEASE_KEY, encode_grant(leased, core.leases.report_every)))
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return answer

    async def inject(self, request: rpb.InjectRequest, context: grpc.aio.ServicerContext) -> rpb.InjectResponse:
        try:
            name, inj = check_request(request.json)
        except ValueError as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = await self._job(context, create=False)
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        why = job.view.inject_refusal(inj.kind, header)
        if why is not None:
            left_out = self._log_throttle.ready()
            if left_out is not None:
                log.warning("refused a %s injection into job %r from %s: %s%s", inj.kind, job.name, context.peer(), why,
                            left_out_note(left_out, "other refusals"))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal_detail(why, inj.kind, job.name))
            raise AssertionError("unreachable")
        try:
            rid = job.view.inject(name, inj)
        except UnknownReplica as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            raise AssertionError("unreachable")
        except (ValueError, RuntimeError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable")
        return rpb.InjectResponse(id=inj.id, replica_id=rid)

    async def heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        try:
            rid = validate.replica_id(request.replica_id)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        job = await self._job(context)
        await self._claim(context, job, rid, "a Heartbeat")
        job.core.heartbeat(rid)
        return pb.LighthouseHeartbeatResponse()

    async def attach(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        """Hold a replica's liveness stream; its end without a goodbye is a crash."""
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await self._invalid(context, validate.InvalidRequest(f"no hello within {HELLO_TIMEOUT_S:.0f}s"))
            return
        if first is not grpc.aio.EOF:
            try:
                first = _attach_request(first)
            except validate.InvalidRequest as e:
                await self._invalid(context, e)
                return
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await self._invalid(context, validate.InvalidRequest("the first Attach message must be a hello"))
            return
        try:
            rid = validate.replica_id(first.hello.replica_id, "hello.replica_id")
            validate.address(first.hello.address, "hello.address")
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            return
        job = await self._job(context)
        await self._claim(context, job, rid, "an Attach")
        core = job.core
        att = core.attach(rid, first.hello.address, first.hello.leases, max(0, first.hello.lease_quorum_id))
        log.info("[%s] liveness stream attached from %s (job %s)", rid, context.peer(), job.name)
        clean, reason = False, "connection lost"
        invalid: validate.InvalidRequest | None = None
        reader = asyncio.ensure_future(self._read(context, att, core))
        writer: asyncio.Future | None = None
        overflow: asyncio.Future | None = None
        try:
            await context.write(core.welcome())
            # One writer for the stream's life: a push costs a queue get and a write, not
            # a task and a wait per message (a revoke goes to every member at once).
            writer = asyncio.ensure_future(self._write(context, att))
            overflow = asyncio.ensure_future(att.overflow.wait())
            done, _ = await asyncio.wait({reader, writer, overflow}, return_when=asyncio.FIRST_COMPLETED)
            if overflow in done:
                reason = f"dropped: more than {OUTBOX_LIMIT} notices unread (the replica is not reading its stream)"
            elif reader in done:
                clean, reason = reader.result()
            else:
                writer.result()  # raises what broke the write side
        except validate.InvalidRequest as e:
            invalid, reason = e, f"invalid message on the stream: {e}"
        except asyncio.CancelledError:
            # The peer vanished or the server is stopping; the RPC is over either way.
            # Returning (not re-raising) keeps grpc from logging it as unhandled.
            pass
        except Exception as e:  # the write side broke: the peer is gone
            reason = f"stream error: {e!r}"
        finally:
            reader.cancel()
            if writer is not None:
                writer.cancel()
            if overflow is not None:
                overflow.cancel()
            core.detach(att, clean=clean, reason=reason)
        if invalid is not None:
            await self._invalid(context, invalid, job)

    @staticmethod
    async def _write(context: grpc.aio.ServicerContext, att: _Attachment) -> None:
        while True:
            await context.write(await att.outbox.get())

    async def _read(self, context: grpc.aio.ServicerContext, att: _Attachment, core: LighthouseCore) -> tuple[bool, str]:
        while True:
            try:
                msg = await context.read()
            except Exception as e:
                return False, f"connection lost: {e!r}"
            if msg is grpc.aio.EOF:
                return False, "stream closed without a goodbye"
            msg = _attach_request(msg)  # InvalidRequest ends only this caller's stream
            if msg.HasField("goodbye"):
                # Forwarded to every other replica as a PeerDown: bounded first.
                return True, clip(msg.goodbye.reason, MAX_REASON_BYTES) or "goodbye"
            core.heartbeat(att.replica_id)
            if msg.HasField("step_report"):  # a round started on a lease: checked like a Quorum's data
                report = msg.step_report
                if report.step < 0:
                    raise validate.InvalidRequest(f"step_report.step must be >= 0, got {report.step}")
                # Size first; the content is parsed once, by the scorer (malformed: unscored, as a Quorum's step stats).
                core.step_report(att.replica_id, report.step, validate.data_size(report.data, "step_report.data"))


def _attach_request(raw: bytes) -> rpb.AttachRequest:
    """One message of an Attach stream, parsed; InvalidRequest when it is not one."""
    try:
        return rpb.AttachRequest.FromString(raw)
    except Exception as e:  # noqa: BLE001 - DecodeError, RecursionError: all mean "not a message"
        raise validate.InvalidRequest(f"the stream message is not a valid rallypoint.AttachRequest: {e}"[:500]) from None


def _handlers(service: _Service) -> list[grpc.GenericRpcHandler]:
    def invalid() -> None:
        service.table.default.metrics.rejected("invalid_argument")

    lighthouse = grpc.method_handlers_generic_handler(
        "torchft.LighthouseService",
        {
            "Quorum": unary_handler(service.gated(service.quorum), pb.LighthouseQuorumRequest, _raw, invalid),
            "Heartbeat": unary_handler(service.gated(service.heartbeat), pb.LighthouseHeartbeatRequest, _raw, invalid),
        },
    )
    extension = grpc.method_handlers_generic_handler(
        "rallypoint.RallypointLighthouse",
        {
            # Parsed by the handler (_attach_request): malformed bytes are INVALID_ARGUMENT.
            "Attach": grpc.stream_stream_rpc_method_handler(service.gated(service.attach), response_serializer=_raw),
            "Status": unary_handler(service.status, rpb.StatusRequest, _raw, invalid),
            "KillReplica": unary_handler(service.gated(service.kill_replica), rpb.KillReplicaRequest, _raw, invalid),
            "ReportEvent": unary_handler(service.gated(service.report_event), rpb.SupervisorEvent, _raw, invalid),
            "Inject": unary_handler(service.gated(service.inject), rpb.InjectRequest, _raw, invalid),
        },
    )
    return [lighthouse, extension]




__all__ = ["HELLO_TIMEOUT_S", "JobTokenInterceptor"]
