"""Many jobs on one lighthouse (``RALLYPOINT_JOB``): the pure rules as tables, then real
lighthouses on 127.0.0.1:0 -- jobs with the same replica ids never meet, each job's
quorum_id and state are its own (across a restart too), per-job tokens admit only their
job, bad input and a flood in one job change nothing in another, torchft's clients land
in ``default``, and real replica processes of two jobs train side by side."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from rallypoint._net.job import DEFAULT_JOB, JOB_KEY, check_job, job_metadata, job_name, job_of
from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.jobs import (JobConfig, admit, etcd_namespace, merge_metrics, parse_jobs, secured,
                                        state_path)

Q = timedelta(seconds=10)


# ---------------------------------------------------------------------------- pure rules
@pytest.mark.parametrize("name,ok", [
    ("default", True), ("llama-7b", True), ("a", True), ("A.b_c-9", True), ("9lives", True), ("x" * 63, True),
    ("", False), ("x" * 64, False), ("-lead", False), (".hidden", False), ("a/b", False), ("a b", False),
    ("ünï", False), ("a\n", False), ("../etc", False),
])
def test_job_names(name: str, ok: bool) -> None:
    if ok:
        assert check_job(name) == name
    else:
        with pytest.raises(ValueError, match="job"):
            check_job(name)


def test_job_name_from_argument_environment_and_default() -> None:
    assert job_name(None, {}) == DEFAULT_JOB
    assert job_name(None, {"RALLYPOINT_JOB": "bert"}) == "bert"
    assert job_name("gpt", {"RALLYPOINT_JOB": "bert"}) == "gpt"
    with pytest.raises(ValueError, match="RALLYPOINT_JOB"):
        job_name(None, {"RALLYPOINT_JOB": ""})
    assert job_metadata(DEFAULT_JOB) == []  # a default-job client's calls are what they were
    assert job_metadata("bert") == [(JOB_KEY, "bert")]


@pytest.mark.parametrize("metadata,expect", [
    (None, "default"), ([], "default"), ([("authorization", "Bearer x")], "default"),
    ([(JOB_KEY, "bert")], "bert"), ([(JOB_KEY, b"bert")], "bert"), ([(JOB_KEY, "bert"), (JOB_KEY, "bert")], "bert"),
    ([(JOB_KEY, "bert"), (JOB_KEY, "gpt")], ValueError), ([(JOB_KEY, "a/b")], ValueError), ([(JOB_KEY, "")], ValueError),
])
def test_job_of_metadata(metadata: Any, expect: Any) -> None:
    if expect is ValueError:
        with pytest.raises(ValueError):
            job_of(metadata)
    else:
        assert job_of(metadata) == expect


def test_jobs_file() -> None:
    jobs = parse_jobs(json.dumps({"jobs": {"llama": {"token": "s3cret", "min_replicas": 2}, "default": {"open": True},
                                           "bert": {}}}))
    assert jobs == {"llama": JobConfig("s3cret", False, 2), "default": JobConfig(None, True, None), "bert": JobConfig()}


@pytest.mark.parametrize("text,match", [
    ("not json", "not valid JSON"), ("[]", "must be an object"), ('{"jobs": []}', "must be an object"),
    ('{"jobs": {}, "extra": 1}', "must be an object"), ('{"jobs": {"a/b": {}}}', "not a job name"),
    ('{"jobs": {"a": 3}}', "job 'a' must be an object"), ('{"jobs": {"a": {"tokn": "x"}}}', "unknown keys"),
    ('{"jobs": {"a": {"token": ""}}}', "empty"), ('{"jobs": {"a": {"token": 5}}}', "string"),
    ('{"jobs": {"a": {"token": "x", "open": true}}}', "choose one"), ('{"jobs": {"a": {"open": "yes"}}}', "true or false"),
    ('{"jobs": {"a": {"min_replicas": 0}}}', "min_replicas"), ('{"jobs": {"a": {"min_replicas": true}}}', "min_replicas"),
    ('{"jobs": {"a": {"min_replicas": 1.5}}}', "min_replicas"),
])
def test_bad_jobs_files_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_jobs(text)


_JOBS = {"a": JobConfig(token="tok-a"), "open": JobConfig(open=True), "plain": JobConfig()}


@pytest.mark.parametrize("job,header,lighthouse_token,jobs,expect", [
    # nothing configured: every job is open, as before jobs
    ("a", None, None, {}, None), ("x", "Bearer junk", None, {}, None),
    # a job's own token, the operator's, and the others
    ("a", "Bearer tok-a", None, _JOBS, None), ("a", "Bearer tok-a", "op", _JOBS, None), ("a", "Bearer op", "op", _JOBS, None),
    ("a", "Bearer tok-b", "op", _JOBS, "wrong token"), ("a", None, "op", _JOBS, "no token"),
    ("a", "bearer  tok-a ", None, _JOBS, None), ("a", "Basic tok-a", None, _JOBS, "no token"),
    # a job without a token of its own takes the operator's...
    ("plain", "Bearer op", "op", _JOBS, None), ("plain", "Bearer tok-a", "op", _JOBS, "wrong token"),
    ("unknown", "Bearer op", "op", _JOBS, None), ("default", None, "op", {}, "no token"),
    # ...and without one, is refused: a credential once configured guards every job
    ("plain", "Bearer tok-a", None, _JOBS, "job without a token"), ("default", None, None, _JOBS, "job without a token"),
    # unless the jobs file says it is open (torchft's clients send no token)
    ("open", None, None, _JOBS, None), ("open", None, "op", _JOBS, None),
])
def test_admission(job: str, header: str | None, lighthouse_token: str | None, jobs: dict, expect: str | None) -> None:
    assert admit(job, header, lighthouse_token, jobs) == expect
    assert secured(lighthouse_token, jobs) == (lighthouse_token is not None or any(c.token for c in jobs.values()))


@pytest.mark.parametrize("base,job,expect", [
    (":memory:", "a", ":memory:"), ("/s/lh.db", "default", "/s/lh.db"), ("/s/lh.db", "llama", "/s/lh.job-llama.db"),
    ("state", "b", "state.job-b"),
])
def test_state_paths(base: str, job: str, expect: str) -> None:
    assert state_path(base, job) == expect


def test_etcd_namespaces() -> None:
    assert etcd_namespace("default") == ""  # a lighthouse's keys from before jobs are the default job's
    assert etcd_namespace("llama") == "jobs/llama/"


def test_metrics_of_every_job_merge_under_one_family_labelled_by_job() -> None:
    per_job = []
    for job, n in (("a", 1), ("b", 2), ("default", 3)):
        r = CollectorRegistry()
        Gauge("g", "a gauge", registry=r).set(n)
        Counter("c", "a counter", ["why"], registry=r).labels(why="x").inc(n)
        per_job.append((job, list(r.collect())))
    fams = {f.name: f for f in merge_metrics(per_job)}
    # The default job's series are what they were before jobs: no label.
    assert [(s.labels, s.value) for s in fams["g"].samples] == [({"rallypoint_job": "a"}, 1), ({"rallypoint_job": "b"}, 2),
                                                               ({}, 3)]
    totals = [s for s in fams["c"].samples if s.name == "c_total"]
    assert [(s.labels, s.value) for s in totals] == [({"rallypoint_job": "a", "why": "x"}, 1),
                                                     ({"rallypoint_job": "b", "why": "x"}, 2), ({"why": "x"}, 3)]


# ---------------------------------------------------------------------------- one lighthouse, several jobs
def _quorum(lh: Any, rid: str, job: str | None = None, token: str | None = None, **kw: Any) -> Any:
    with LighthouseClient(lh.local_address(), token=token, job=job) as c:
        return c.quorum(replica_id=rid, timeout=Q, **kw)


def _code(fn: Any) -> tuple[grpc.StatusCode, str]:
    """The status code of the call ``fn`` makes (raw gRPC, or as LighthouseClient translates it)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()  # type: ignore[attr-defined]
    except PermissionError as e:
        return grpc.StatusCode.UNAUTHENTICATED, str(e)
    except ValueError as e:
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    except KeyError as e:
        return grpc.StatusCode.NOT_FOUND, str(e)
    except ConnectionError as e:
        found = re.search(r"failed \((\w+)\)", str(e))
        return getattr(grpc.StatusCode, found.group(1) if found else "UNKNOWN"), str(e)
    raise AssertionError("the call succeeded")


def test_jobs_with_the_same_replica_ids_never_share_a_quorum(lighthouse) -> None:
    lh = lighthouse(min_replicas=2, join_timeout_ms=100, jobs={"b": JobConfig(min_replicas=1)})
    # Job a needs 2 (the lighthouse's default); b needs 1 (its jobs-file entry). Same ids in each.
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(a0=_quorum(lh, "rep-0", "a", step=5)))
    t.start()
    qb = _quorum(lh, "rep-0", "b", step=1)  # b forms alone while a's rep-0 waits for a second member
    assert [m.replica_id for m in qb.members] == ["rep-0"] and qb.members[0].step == 1
    assert t.is_alive(), "job a formed a quorum of one below its min_replicas"
    qa1 = _quorum(lh, "rep-1", "a", step=5)
    t.join(10)
    assert sorted(m.replica_id for m in qa1.members) == ["rep-0", "rep-1"]
    assert out["a0"].quorum_id == qa1.quorum_id
    assert {m.step for m in qa1.members} == {5}  # b's rep-0 (step 1) is not a's
    assert lh.status(job="a")["quorum_id"] == qa1.quorum_id
    assert lh.status(job="b")["quorum_id"] == qb.quorum_id == 1
    assert lh.status()["quorum_id"] == 0  # the default job saw nothing
    assert sorted(lh.jobs.names()) == ["a", "b", "default"]
    assert lh.job_core("b").options.min_replicas == 1 and lh.job_core("a").options.min_replicas == 2


def test_per_job_tokens_admit_only_their_job_and_change_nothing_else(lighthouse) -> None:
    jobs = {"a": JobConfig(token="tok-a"), "b": JobConfig(token="tok-b"), "legacy": JobConfig(open=True)}
    lh = lighthouse(min_replicas=1, token="operator", jobs=jobs)
    assert _quorum(lh, "ra", "a", token="tok-a").quorum_id == 1
    assert _quorum(lh, "rb", "b", token="tok-b").quorum_id == 1
    events_b = len(lh.job_core("b").store.events(limit=1000))
    # a's token is refused by b, before any handler runs: b's state is untouched.
    for call in (lambda c: c.quorum(replica_id="evil", timeout=Q), lambda c: c.heartbeat("evil"),
                 lambda c: c.status(), lambda c: c.kill("rb")):
        def attempt(call: Any = call) -> Any:
            with LighthouseClient(lh.local_address(), token="tok-a", job="b", connect_timeout=5) as c:
                return call(c)
        code, details = _code(attempt)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "job 'b'" in details and "tok-b" not in details
    assert "evil" not in lh.job_core("b").heartbeats and "evil" not in lh.job_core("b").pending
    assert len(lh.job_core("b").store.events(limit=1000)) == events_b
    assert lh.status(job="b")["quorum_id"] == 1
    # The operator's token opens every job; an open job needs none.
    assert _quorum(lh, "rb", "b", token="operator", commit_failures=1).quorum_id == 2
    assert _quorum(lh, "tf", "legacy").quorum_id == 1
    # A job the file does not name takes the operator's token, and nobody else's.
    code, _ = _code(lambda: _quorum(lh, "rx", "newjob", token="tok-a"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "newjob" not in lh.jobs.names()
    assert _quorum(lh, "rx", "newjob", token="operator").quorum_id == 1


def test_only_job_tokens_refuse_a_job_without_one(lighthouse) -> None:
    lh = lighthouse(min_replicas=1, jobs={"a": JobConfig(token="tok-a")})
    code, details = _code(lambda: _quorum(lh, "r", None))  # the default job has no token and is not open
    assert code == grpc.StatusCode.UNAUTHENTICATED and "no token on this lighthouse" in details
    assert lh.status()["quorum_id"] == 0
    assert _quorum(lh, "r", "a", token="tok-a").quorum_id == 1


def test_bad_job_names_and_too_many_jobs_are_clear_errors_that_create_nothing(lighthouse) -> None:
    for token in (None, "op"):
        lh = lighthouse(min_replicas=1, max_jobs=3, token=token)
        for bad in ("a/b", "-x", "x" * 64):
            code, details = _code(lambda bad=bad: _raw_quorum(lh, [(JOB_KEY, bad)] + _bearer(token)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a job name" in details
        assert lh.jobs.names() == ["default"]
        assert _quorum(lh, "r", "one", token=token).quorum_id == 1
        assert _quorum(lh, "r", "two", token=token).quorum_id == 1
        code, details = _code(lambda: _quorum(lh, "r", "three", token=token))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-jobs" in details
        assert lh.jobs.names() == ["default", "one", "two"]
        # Status, kill and inject never start a job.
        code, details = _code(lambda: LighthouseClient(lh.local_address(), token=token, job="nope").status())
        assert code == grpc.StatusCode.NOT_FOUND and "no job 'nope'" in details


def _bearer(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def _raw_quorum(lh: Any, metadata: list[tuple[str, str]]) -> Any:
    from rallypoint._proto import torchft_pb2 as pb

    with grpc.insecure_channel(lh.local_address().split("://")[1]) as ch:
        call = ch.unary_unary("/torchft.LighthouseService/Quorum",
                              request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                              response_deserializer=pb.LighthouseQuorumResponse.FromString)
        req = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="r"))
        return call(req, timeout=5, metadata=metadata)


def test_one_jobs_flood_and_bad_input_do_not_stall_anothers_quorums(lighthouse) -> None:
    """Job a: 200 heartbeating members, a quorum that can never form (min_replicas 300),
    and a stream of malformed requests, all from 4 threads. Job b keeps forming quorums
    through it, and its quorum ids go 1, 2, 3... as if a did not exist."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=100, jobs={"a": JobConfig(min_replicas=300)})
    stop = threading.Event()
    errors: list[BaseException] = []

    def flood(k: int) -> None:
        try:
            with LighthouseClient(lh.local_address(), job="a") as c:
                i = 0
                while not stop.is_set():
                    c.heartbeat(f"a-{k}-{i % 50}")
                    code, _ = _code(lambda: c.quorum(replica_id="", timeout=1))  # malformed
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
                    i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    waiting = threading.Thread(target=lambda: _swallow(lambda: _quorum(lh, "a-waits", "a")), daemon=True)
    waiting.start()
    threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        latencies = []
        for i in range(1, 11):  # a commit failure each time: every quorum of b gets a new id
            t0 = time.monotonic()
            q = _quorum(lh, "b-0", "b", step=i, commit_failures=1)
            latencies.append(time.monotonic() - t0)
            assert q.quorum_id == i
        assert len(lh.job_core("a").heartbeats) >= 50, "the flood did not run"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    # Each of b's quorums forms on arrival (its one member asks); a stall would be seconds.
    assert max(latencies) < 1.0, latencies
    assert not any(r.startswith("a-") for r in lh.job_core("b").heartbeats)


def _swallow(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the lighthouse stopping ends the wait
        pass


def test_each_job_keeps_its_own_quorum_id_across_a_restart(lighthouse, tmp_path: Path) -> None:
    state = str(tmp_path / "lh.db")
    lh = lighthouse(min_replicas=1, state=state)
    for i in range(3):
        _quorum(lh, "a-0", "a", step=i, commit_failures=1)  # a new quorum_id each time
    _quorum(lh, "d", None)
    assert (lh.status(job="a")["quorum_id"], lh.status()["quorum_id"]) == (3, 1)
    lh.shutdown()
    assert (tmp_path / "lh.job-a.db").exists()
    lh2 = lighthouse(min_replicas=1, state=state)
    assert lh2.jobs.names() == ["default"]  # a job starts on its first call...
    assert _quorum(lh2, "a-0", "a", step=3, commit_failures=1).quorum_id == 4  # ...from its own state
    assert _quorum(lh2, "d", None, step=1, commit_failures=1).quorum_id == 2


def test_a_torchft_client_lands_in_the_default_job(lighthouse) -> None:
    from torchft._torchft import LighthouseClient as TorchftLighthouseClient

    lh = lighthouse(min_replicas=1, jobs={"default": JobConfig(open=True), "a": JobConfig(token="tok-a")})
    client = TorchftLighthouseClient(addr=lh.address(), connect_timeout=timedelta(seconds=10))
    q = client.quorum(replica_id="tf", timeout=Q)
    assert [p.replica_id for p in q.participants] == ["tf"]
    assert lh.status()["quorum_id"] == 1 and lh.jobs.names() == ["a", "default"]
    assert _quorum(lh, "ours", "a", token="tok-a").quorum_id == 1


def test_two_jobs_of_real_replica_groups_train_side_by_side(lighthouse, tmp_path: Path) -> None:
    """Two jobs, each of two replica processes with the same names (replica_0, replica_1),
    each with its own token, on one lighthouse: each job commits its steps with both of
    its own groups, ends with identical state inside the job, and different state from the
    other job (different seeds)."""
    from replica_worker import Replicas

    jobs = {"a": JobConfig(token="tok-a"), "b": JobConfig(token="tok-b")}
    lh = lighthouse(min_replicas=2, join_timeout_ms=2000, token="operator", jobs=jobs)
    runs = {}
    for job, seed in (("a", 1), ("b", 100)):
        (tmp_path / job).mkdir()
        r = runs[job] = Replicas(tmp_path / job, lh.address(), env={"RALLYPOINT_JOB": job, "RALLYPOINT_TOKEN": f"tok-{job}"})
        r.stop.write_text("8")  # both jobs stop at step 8, however far apart they run
        r.start("replica_0", seed=seed, delay=0.02)
        r.start("replica_1", seed=seed + 1, delay=0.02)
    try:
        for job, r in runs.items():
            r.finish(8, timeout=90)
            r.assert_identical(["replica_0", "replica_1"], 8)
            # [step, participants, spare] per round: the last rounds had both of this job's groups
            assert all(h[1] == 2 for h in r.progress("replica_0")["history"][-3:]), r.progress("replica_0")["history"]
        assert runs["a"].progress("replica_0")["hash"] != runs["b"].progress("replica_0")["hash"]
        assert lh.status()["quorum_id"] == 0  # nothing landed in the default job
    finally:
        for r in runs.values():
            r.kill_all()
