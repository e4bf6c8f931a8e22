"""`rallypoint run`'s events reach the lighthouse's event log (``ReportEvent``).

What an operator relies on: a restart reported by a supervisor shows up in ``/events``
(and so on the dashboard) under the group's label with its fields; malformed or oversized
reports and callers without the token are refused with nothing recorded; a flood from one
group is rate-limited without touching other groups; and the supervisor's side never
blocks or raises, whether the lighthouse is absent, unreachable, silent, or torchft's
(which has no such RPC).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from rallypoint._net.limits import MAX_EVENT_DETAILS_BYTES, MAX_REPLICA_ID_BYTES
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint.lighthouse import reports
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.lighthouse.state import StateStore
from rallypoint.lighthouse.validate import InvalidRequest
from rallypoint.supervisor._report import EventReporter, flat_details, group_label

from conftest import reserved_port, wait_until

TOKEN = "events-token-42"
METHOD = "/rallypoint.RallypointLighthouse/ReportEvent"
RESTART = {"incarnation": 2, "failed_incarnation": 1, "rank": 0, "cause": "exit code 3", "exit_code": 3,
           "signal": None, "uptime_s": 12.5, "progress": True, "streak": 0, "backoff_s": 0.5, "restart_s": 1.25}
#: Every wait on a thread or a call in this file ends by then.
WAIT_S = 10.0


# --------------------------------------------------------------------- helpers
def run_events(lh: LighthouseServer, group: str | None = None) -> list[Any]:
    """The supervisor events in ``lh``'s log (oldest first)."""
    assert lh.core is not None
    events = lh.core.store.events(limit=10_000, replica_id=group)
    return [e for e in events if e.kind.startswith(reports.KIND_PREFIX)]


@pytest.fixture
def raw_call(closers: list[Callable[[], None]]) -> Callable[..., Callable[..., rpb.ReportEventResponse]]:
    """``raw_call(lh)`` -> the ReportEvent method over a plain channel (no token)."""

    def make(lh: LighthouseServer) -> Callable[..., rpb.ReportEventResponse]:
        channel = grpc.insecure_channel(lh.local_address().removeprefix("http://"))
        closers.append(channel.close)
        return channel.unary_unary(METHOD, request_serializer=rpb.SupervisorEvent.SerializeToString,
                                   response_deserializer=rpb.ReportEventResponse.FromString)

    return make


@pytest.fixture
def reporters() -> Iterator[Callable[..., EventReporter]]:
    """``reporters(addr, group, environ, **kw)`` -> an EventReporter, closed at teardown."""
    made: list[EventReporter] = []

    def make(*a: Any, **kw: Any) -> EventReporter:
        r = EventReporter(*a, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close(1.0)


def event(group: str = "g0", kind: str = "restart", details: Any = RESTART) -> rpb.SupervisorEvent:
    text = details if isinstance(details, str) else json.dumps(details)
    return rpb.SupervisorEvent(group=group, kind=kind, details=text)


# --------------------------------------------------------------------- validation (pure)
def _at_limit() -> str:
    """Details of exactly MAX_EVENT_DETAILS_BYTES (five strings under the per-string limit)."""
    fields = {k: "x" * 800 for k in "abcd"}
    overhead = len(json.dumps({**fields, "e": ""}))
    text = json.dumps({**fields, "e": "y" * (MAX_EVENT_DETAILS_BYTES - overhead)})
    assert len(text) == MAX_EVENT_DETAILS_BYTES
    return text


AT_LIMIT = _at_limit()
VALID = [
    ("a restart", "g0", "restart", json.dumps(RESTART), RESTART),
    ("no details", "g0", "stopped", "", {}),
    ("empty object", "group/with:odd-chars", "gave_up", "{}", {}),
    ("short list", "0", "restart", '{"hung_ranks": [0, 1, 2]}', {"hung_ranks": [0, 1, 2]}),
    ("started", "g", "started", '{"nproc": 8}', {"nproc": 8}),
    ("unicode text", "g", "stopped", '{"signal": "SIGTERM \u2013 requested"}', {"signal": "SIGTERM \u2013 requested"}),
    ("exactly at the limit", "g", "restart", AT_LIMIT, None),
]


@pytest.mark.parametrize("name,group,kind,details,expected", VALID, ids=[v[0] for v in VALID])
def test_valid_reports(name: str, group: str, kind: str, details: str, expected: dict | None) -> None:
    report = reports.supervisor_event(group, kind, details)
    assert (report.group, report.kind, report.log_kind) == (group, kind, "run." + kind)
    assert report.details == (json.loads(details) if expected is None else expected)


INVALID = [
    ("empty group", "", "restart", "{}", "group is empty"),
    ("group too long", "g" * (MAX_REPLICA_ID_BYTES + 1), "restart", "{}", "group is 257 bytes"),
    ("group with a newline", "g\n0", "restart", "{}", "non-printable"),
    ("unknown kind", "g", "crash", "{}", "kind 'crash' is not one of restart, gave_up"),
    ("empty kind", "g", "", "{}", "is not one of"),
    ("huge kind", "g", "k" * 100_000, "{}", "is not one of"),
    ("details over 4 KiB", "g", "restart", json.dumps({"cause": "x" * MAX_EVENT_DETAILS_BYTES}), "the limit is 4096"),
    ("not JSON", "g", "restart", "{cause: 1}", "not valid JSON"),
    ("truncated JSON", "g", "restart", '{"a": 1', "not valid JSON"),
    ("a JSON list", "g", "restart", "[1, 2]", "must be a JSON object"),
    ("a JSON string", "g", "restart", '"restart"', "must be a JSON object"),
    ("nested object", "g", "restart", '{"a": {"b": 1}}', "values must be scalars"),
    ("nested list", "g", "restart", '{"a": [[1]]}', "values must be scalars"),
    ("long list", "g", "restart", json.dumps({"a": list(range(17))}), "17 items"),
    ("too many keys", "g", "restart", json.dumps({f"k{i}": i for i in range(33)}), "33 keys"),
    ("key not an identifier", "g", "restart", '{"a b": 1}', "not an identifier"),
    ("empty key", "g", "restart", '{"": 1}', "not an identifier"),
    ("reserved key kind", "g", "restart", '{"kind": "x"}', "reserved"),
    ("reserved key replica_id", "g", "restart", '{"replica_id": "x"}', "reserved"),
    ("NaN", "g", "restart", '{"uptime_s": NaN}', "only finite numbers"),
    ("Infinity", "g", "restart", '{"uptime_s": -Infinity}', "only finite numbers"),
    ("a float that overflows", "g", "restart", '{"uptime_s": 1e400}', "not a finite number"),
    ("huge integer", "g", "restart", '{"rank": 99999999999999999999999}', "implausibly large"),
    ("string with a newline", "g", "restart", '{"cause": "a\\nforged log line"}', "non-printable"),
    ("string over 1 KiB", "g", "restart", json.dumps({"cause": "x" * 1025}), "1025 bytes"),
    ("deeply nested", "g", "restart", '{"a": ' + "[" * 2000 + "]" * 2000 + "}", "not valid JSON"),
]


@pytest.mark.parametrize("name,group,kind,details,message", INVALID, ids=[v[0] for v in INVALID])
def test_invalid_reports(name: str, group: str, kind: str, details: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        reports.supervisor_event(group, kind, details)
    assert message in str(e.value)
    assert len(str(e.value)) < 600, "the message echoes the caller's input unbounded"


def test_rate_limiter_buckets() -> None:
    rl = reports.RateLimiter(rate=2.0, burst=3, max_keys=2)
    assert [rl.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rl.allow("b", 0.0), "another key has its own bucket"
    assert not rl.allow("a", 0.4) and rl.allow("a", 0.5), "refills at 2/s"
    assert [rl.allow("a", 100.0) for _ in range(4)] == [True, True, True, False], "never more than the burst"
    rl.allow("c", 100.0)
    assert len(rl) == 2, "bounded number of keys"
    with pytest.raises(ValueError):
        reports.RateLimiter(rate=0, burst=1)


def test_intake_drops_and_counts_over_the_limits(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    metrics = LighthouseMetrics()
    with StateStore(":memory:") as store:
        intake = reports.EventIntake(store, metrics, per_group=(1.0, 2), total=(10.0, 3), clock=lambda: now[0])
        r = reports.supervisor_event("g", "restart", "{}")
        with caplog.at_level(logging.WARNING, "rallypoint.lighthouse"):
            got = [intake.accept(r) for _ in range(5)]
        assert [e is not None for e in got] == [True, True, False, False, False]
        assert intake.dropped == 3
        drop_lines = [m for m in caplog.messages if "rate limit" in m]
        assert len(drop_lines) == 1, "the drop line is rate-limited too"
        other = reports.supervisor_event("h", "restart", "{}")
        assert intake.accept(other) is not None, "a flooding group does not starve another"
        assert intake.accept(reports.supervisor_event("i", "restart", "{}")) is None, "the overall limit holds"
        now[0] = 1.0
        assert intake.accept(r) is not None
        kinds = [(e.kind, e.replica_id) for e in store.events(limit=100)]
        assert kinds == [("run.restart", "g")] * 2 + [("run.restart", "h"), ("run.restart", "g")]
    text = metrics.render().decode()
    assert 'rallypoint_lighthouse_rejected_requests_total{reason="rate_limited"} 4.0' in text
    assert 'rallypoint_lighthouse_run_events_total{kind="restart"} 4.0' in text


ODD_FIELDS: list[dict[str, Any]] = [
    RESTART,
    {"hung_ranks": list(range(40)), "last_step": None, "silent_s": float("nan"), "big": 2**80},
    {"cause": "x" * 10_000, "path": object(), "group": "dropped", "kind": "dropped", "bad key": 1, 3: "int key"},
    {f"k{i}": "v" * 300 for i in range(40)},
    {"signal": "SIG\nTERM", "nested": {"a": [1, {"b": 2}]}, "tuple": (1, 2.5, "x")},
]


@pytest.mark.parametrize("fields", ODD_FIELDS, ids=["restart", "lists-nan-bigint", "junk", "too-big", "nested"])
def test_reporter_shapes_any_fields_into_what_the_lighthouse_accepts(fields: dict[str, Any]) -> None:
    shaped = flat_details(fields)
    report = reports.supervisor_event("g", "restart", json.dumps(shaped, separators=(",", ":")))
    assert report.details == shaped
    assert "group" not in shaped and "kind" not in shaped


def test_group_label() -> None:
    assert group_label("3", {"REPLICA_GROUP_ID": "9"}) == "3"
    assert group_label(None, {"REPLICA_GROUP_ID": "9"}) == "9"
    assert ":" in group_label(None, {})  # host:pid
    assert len(group_label("g" * 1000, {}).encode()) <= MAX_REPLICA_ID_BYTES


# --------------------------------------------------------------------- the RPC
def test_report_reaches_events_over_http(lighthouse, client) -> None:
    lh = lighthouse(http_bind="127.0.0.1:0")
    event_id = client(lh).report_event("g7", "restart", RESTART, timeout=5.0)
    assert event_id > 0
    base = lh.http_address()
    assert base is not None
    with httpx.Client(base_url=base, timeout=5.0) as http:
        listed = http.get("/events", params={"replica_id": "g7"}).json()
        metrics = http.get("/metrics").text
    assert [(e["id"], e["kind"], e["replica_id"]) for e in listed] == [(event_id, "run.restart", "g7")]
    assert listed[0]["detail"] == RESTART
    assert 'rallypoint_lighthouse_run_events_total{kind="restart"} 1.0' in metrics


def test_refused_without_the_token_and_nothing_recorded(lighthouse, client, raw_call) -> None:
    lh = lighthouse(token=TOKEN)
    call = raw_call(lh)
    for metadata in (None, [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as e:
            call(event(), timeout=5, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(PermissionError):
        client(lh).report_event("g0", "restart", RESTART)  # no token in the environment
    assert run_events(lh) == []
    assert call(event(), timeout=5, metadata=[("authorization", f"Bearer {TOKEN}")]).event_id > 0
    assert client(lh, token=TOKEN).report_event("g0", "gave_up", {"streak": 3}) > 0
    assert [e.kind for e in run_events(lh)] == ["run.restart", "run.gave_up"]


@pytest.mark.parametrize("bad", [
    event(details=json.dumps({"cause": "x" * (MAX_EVENT_DETAILS_BYTES + 10)})),
    event(details="{not json"),
    event(details="[]"),
    event(kind="reboot"),
    event(group=""),
    event(group="g" * 200_000),
], ids=["oversize", "bad-json", "not-an-object", "unknown-kind", "no-group", "huge-group"])
def test_bad_reports_are_invalid_argument_and_not_recorded(lighthouse, raw_call, bad: rpb.SupervisorEvent) -> None:
    lh = lighthouse()
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh)(bad, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert len(e.value.details()) < 600
    assert run_events(lh) == []


def test_malformed_bytes_are_invalid_argument(lighthouse, closers) -> None:
    lh = lighthouse()
    channel = grpc.insecure_channel(lh.local_address().removeprefix("http://"))
    closers.append(channel.close)
    call = channel.unary_unary(METHOD)  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as e:
        call(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid rallypoint.SupervisorEvent" in e.value.details()
    assert run_events(lh) == []


def test_a_flooding_group_is_rate_limited_and_others_still_get_through(lighthouse, raw_call) -> None:
    lh = lighthouse()
    call = raw_call(lh)
    codes: list[grpc.StatusCode] = []
    t0 = time.monotonic()
    for _ in range(3 * reports.GROUP_BURST):
        try:
            call(event(group="flood"), timeout=5)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    elapsed = time.monotonic() - t0
    accepted = codes.count(grpc.StatusCode.OK)
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert reports.GROUP_BURST <= accepted <= reports.GROUP_BURST + reports.GROUP_RATE_PER_S * elapsed + 1
    assert len(run_events(lh, "flood")) == accepted
    assert call(event(group="quiet"), timeout=5).event_id > 0
    assert len(run_events(lh, "quiet")) == 1


# --------------------------------------------------------------------- the reporter
def test_reporter_delivers_with_the_token_of_its_environment(lighthouse, reporters) -> None:
    lh = lighthouse(token=TOKEN)
    r = reporters(lh.local_address(), "5", {"RALLYPOINT_TOKEN": TOKEN})
    r.post("restart", {**RESTART, "group": "5"})
    r.post("stopped", {"signal": "SIGTERM"})
    r.close(WAIT_S)
    assert (r.sent, r.dropped) == (2, 0)
    assert [(e.kind, e.replica_id, e.detail.get("signal")) for e in run_events(lh)] == [
        ("run.restart", "5", None), ("run.stopped", "5", "SIGTERM")]


def test_reporter_without_the_token_warns_and_never_raises(lighthouse, reporters, caplog) -> None:
    lh = lighthouse(token=TOKEN)
    r = reporters(lh.local_address(), "5", {})
    with caplog.at_level(logging.WARNING, "rallypoint.run"):
        r.post("restart", RESTART)
        r.close(WAIT_S)
    assert (r.sent, r.dropped) == (0, 1)
    assert any("was not reported" in m and "refused" in m for m in caplog.messages), caplog.messages
    assert run_events(lh) == []


def test_reporter_without_a_lighthouse_is_a_no_op() -> None:
    r = EventReporter(None, "g", {})
    r.post("restart", RESTART)
    assert not r.enabled and r._thread is None
    r.close(1.0)
    assert (r.sent, r.dropped) == (0, 0)


@pytest.mark.parametrize("listen", [False, True], ids=["refused", "silent"])
def test_reporter_never_blocks_on_an_unreachable_lighthouse(reporters, listen: bool) -> None:
    """``refused``: nothing listens; ``silent``: a socket accepts connections into its
    backlog and never answers (a hung host), so connecting waits out its timeout."""
    with reserved_port(listen=listen) as port:
        r = reporters(f"127.0.0.1:{port}", "g", {}, send_timeout=1.0)
        t0 = time.monotonic()
        for i in range(200):
            r.post("restart", {"incarnation": i})
        posting = time.monotonic() - t0
        assert posting < 1.0, f"200 posts took {posting:.2f}s"
        assert r.dropped >= 200 - 64 - 1, "the queue is bounded: the oldest are dropped"
        t0 = time.monotonic()
        r.close(0.5)
        closing = time.monotonic() - t0
    assert closing < 2.0, f"close(0.5) took {closing:.2f}s"
    assert r.sent == 0 and not r.enabled
    assert r._thread is not None
    r._thread.join(WAIT_S)
    assert not r._thread.is_alive()
    assert r.dropped == 200, "every event is accounted for"


def test_torchft_lighthouse_unimplemented_stops_reporting(reporters, caplog) -> None:
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer as TorchftLighthouseServer

    from rallypoint.lighthouse.client import LighthouseClient

    lh = TorchftLighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        with LighthouseClient(lh.address(), connect_timeout=5.0) as c:
            with pytest.raises(NotImplementedError, match="torchft"):
                c.report_event("g", "restart", RESTART, timeout=5.0)
        r = reporters(lh.address(), "g", {})
        with caplog.at_level(logging.INFO, "rallypoint.run"):
            r.post("restart", RESTART)
            assert r._thread is not None
            r._thread.join(WAIT_S)  # it stops by itself
            assert not r._thread.is_alive() and not r.enabled
            r.post("restart", RESTART)  # a no-op now
            r.close(1.0)
        notes = [rec for rec in caplog.records if "does not accept reported events" in rec.getMessage()]
        assert len(notes) == 1 and notes[0].levelno == logging.INFO
        assert (r.sent, r.dropped) == (0, 1)
    finally:
        lh.shutdown()


def test_post_from_many_threads_while_closing(lighthouse, reporters) -> None:
    """Posting races closing: nothing raises, nothing hangs, every event is counted once."""
    lh = lighthouse()
    r = reporters(lh.local_address(), "g", {})
    posted = threading.Event()

    def poster() -> None:
        for i in range(20):
            r.post("restart", {"incarnation": i})
            posted.set()

    threads = [threading.Thread(target=poster) for _ in range(4)]
    for t in threads:
        t.start()
    assert posted.wait(WAIT_S)
    t0 = time.monotonic()
    r.close(1.0)  # the group's rate limit keeps most of them from being sent in time
    assert time.monotonic() - t0 < 3.0
    for t in threads:
        t.join(WAIT_S)
    assert r._thread is not None
    r._thread.join(WAIT_S)
    assert not r._thread.is_alive()
    assert 1 <= r.sent <= len(run_events(lh, "g")) <= r.sent + 1  # +1: a call cut off by close may have landed
    assert r.sent + r.dropped <= 80


def test_supervisor_imports_neither_grpc_nor_torch() -> None:
    code = (
        "import sys\n"
        "import rallypoint.supervisor.supervisor, rallypoint.supervisor._report\n"
        "from rallypoint.supervisor._report import EventReporter\n"
        "r = EventReporter('127.0.0.1:1', 'g', {})\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'torchft'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lighthouse_side_of_the_feature_never_imports_torchft() -> None:
    code = (
        "import sys\n"
        "import rallypoint.lighthouse.reports, rallypoint.lighthouse.server, rallypoint.supervisor._report\n"
        "assert 'torchft' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_throttle_logs_once_per_interval_and_counts_the_rest() -> None:
    """The shared log throttle (refused calls, dropped reports, failed sends)."""
    from rallypoint._net.ratelog import Throttle, left_out_note

    t = Throttle(1.0, clock=lambda: 0.0)
    assert [t.ready(now) for now in (0.0, 0.2, 0.9, 1.0, 1.5, 5.0)] == [0, None, None, 2, None, 1]
    assert left_out_note(0) == "" and left_out_note(3, "more") == " (and 3 more left out)"
