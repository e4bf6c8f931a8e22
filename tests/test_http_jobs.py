"""The lighthouse's HTTP face when it serves many jobs (``create_app(..., jobs=, admit=)``).

Two layers: the routing and credential rules in-process over a fake job table (httpx's
ASGI transport; no socket), then the same promises against a real ``LighthouseServer``
with a jobs file, where the jobs exist because a replica group of each called over gRPC.
The promise under test throughout: a job A token never reads or changes job B.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest

from test_http import TIMEOUT, FakeView, run

from rallypoint._net.inject import Injection
from rallypoint.lighthouse import jobs as rules
from rallypoint.lighthouse._jobs_http import NO_JOB_ADMITTED
from rallypoint.lighthouse.http import create_app
from rallypoint.lighthouse.jobs import JobConfig

OPERATOR = "operator-token"
TOKEN_A = "token-of-a"
TOKEN_B = "token-of-b"
CONFIGS = {"a": JobConfig(token=TOKEN_A), "b": JobConfig(token=TOKEN_B), "default": JobConfig(open=True)}


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


# ------------------------------------------------------------------ in-process, a fake job table


class JobView(FakeView):
    """A FakeView that knows its job's name (so a response shows whose data it is) and
    records injections."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job
        self.injections: list[tuple[str, str]] = []

    def status(self) -> dict[str, Any]:
        return {"quorum_id": 1, "replicas": [{"replica_id": f"{self.job}-rep"}], "owner": self.job}

    def inject_refusal(self, kind: str, authorization: str | None) -> str | None:
        return None  # these tests are about which job a request reaches; the gate: test_attacks_lighthouse

    def inject(self, name: str, inj: Injection) -> str:
        self.injections.append((name, inj.kind))
        return name

    def goodput(self, tau_s: float | None = None, delta_s: float | None = None, series: bool = True) -> dict:
        return {"goodput": 0.5, "owner": self.job}


class FakeEntry:
    def __init__(self, name: str) -> None:
        self.name = name
        self.view = JobView(name)


class FakeTable:
    """What create_app uses of a JobTable."""

    def __init__(self, names: Iterable[str], configs: dict[str, JobConfig]) -> None:
        self._jobs = {n: FakeEntry(n) for n in names}
        self.configs = dict(configs)

    def get(self, name: str) -> FakeEntry | None:
        return self._jobs.get(name)

    def names(self) -> list[str]:
        return sorted(self._jobs)

    def summary(self) -> list[dict]:
        return [{"job": n, "quorum_id": 1} for n in self.names()]

    def render_metrics(self, names: Iterable[str] | None = None) -> bytes:
        wanted = self.names() if names is None else sorted(set(names) & set(self._jobs))
        return "".join(f'rallypoint_up{{rallypoint_job="{n}"}} 1.0\n' for n in wanted).encode()


def call(app: Any, method: str, url: str, token: str | None = None, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lighthouse",
                                     timeout=TIMEOUT) as c:
            return await c.request(method, url, headers=bearer(token), **kw)

    return run(go)


@pytest.fixture
def table() -> FakeTable:
    return FakeTable(["a", "b", "default"], CONFIGS)


@pytest.fixture
def app(table: FakeTable) -> Any:
    return create_app(table.get("default").view, OPERATOR, jobs=table,  # type: ignore[union-attr]
                      admit=lambda job, header: rules.admit(job, header, OPERATOR, table.configs))


def test_query_picks_the_job(app: Any) -> None:
    for job in ("a", "b"):
        r = call(app, "GET", f"/status?job={job}", OPERATOR)
        assert r.status_code == 200, r.text
        assert r.json()["owner"] == job and r.json()["job"] == job
        assert call(app, "GET", f"/goodput?job={job}", OPERATOR).json()["owner"] == job
    r = call(app, "GET", "/status")  # no job: the default job (open in CONFIGS)
    assert r.status_code == 200 and r.json()["owner"] == "default" and r.json()["job"] == "default"


def test_a_token_reads_a_and_nothing_of_b(app: Any, table: FakeTable) -> None:
    assert call(app, "GET", "/status?job=a", TOKEN_A).status_code == 200
    assert call(app, "GET", "/events?job=a", TOKEN_A).status_code == 200
    for method, url in [("GET", "/status?job=b"), ("GET", "/events?job=b"), ("GET", "/goodput?job=b"),
                        ("GET", "/metrics?job=b"), ("POST", "/replica/b-rep/kill?job=b"),
                        ("POST", "/inject?job=b")]:
        for token in (TOKEN_A, None, "nonsense"):
            body = b'{"kind": "slow", "replica": "b-rep"}' if "inject" in url else None
            r = call(app, method, url, token, content=body)
            assert r.status_code == 401, (method, url, token, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["detail"] == rules.refusal_hint("b", "wrong token" if token else "no token", http=True)
            assert TOKEN_A not in r.text and TOKEN_B not in r.text
    view_b = table.get("b").view  # type: ignore[union-attr]
    assert view_b.kills == [] and view_b.injections == [] and view_b.event_calls == []


def test_kill_and_inject_reach_the_picked_job(app: Any, table: FakeTable) -> None:
    table.get("a").view.managers["a-rep"] = "http://host-a:1"  # type: ignore[union-attr]
    r = call(app, "POST", "/replica/a-rep/kill?job=a", TOKEN_A, json={"reason": "test"})
    assert r.status_code == 200, r.text
    r = call(app, "POST", "/inject?job=a", TOKEN_A, json={"kind": "slow", "replica": "a-rep"})
    assert r.status_code == 200, r.text
    assert table.get("a").view.kills == [("a-rep", "test")]  # type: ignore[union-attr]
    assert table.get("a").view.injections == [("a-rep", "slow")]  # type: ignore[union-attr]
    assert table.get("b").view.kills == [] and table.get("default").view.kills == []  # type: ignore[union-attr]
    r = call(app, "POST", "/replica/nobody/kill?job=a", OPERATOR)
    assert r.status_code == 404 and "'a'" in r.json()["detail"]


@pytest.mark.parametrize("name", ["-x", "a b", "x" * 64, "ä", "a/b"])
def test_bad_job_name_is_400(app: Any, name: str) -> None:
    r = call(app, "GET", "/status", OPERATOR, params={"job": name})
    assert r.status_code == 400, r.text
    assert "not a job name" in r.json()["detail"]


def test_unknown_job_is_404_for_who_may_see_it_401_for_others(app: Any, table: FakeTable) -> None:
    r = call(app, "GET", "/status?job=zzz", OPERATOR)
    assert r.status_code == 404 and r.json()["detail"].startswith("no such job 'zzz' on this lighthouse")
    assert call(app, "POST", "/inject?job=zzz", OPERATOR, json={"kind": "slow"}).status_code == 404
    # a job token learns nothing of which other jobs exist
    assert call(app, "GET", "/status?job=zzz", TOKEN_A).status_code == 401
    assert table.get("zzz") is None  # HTTP never creates a job


def test_jobs_lists_only_admitted(app: Any) -> None:
    assert [j["job"] for j in call(app, "GET", "/jobs", OPERATOR).json()] == ["a", "b", "default"]
    assert [j["job"] for j in call(app, "GET", "/jobs", TOKEN_A).json()] == ["a", "default"]
    assert [j["job"] for j in call(app, "GET", "/jobs").json()] == ["default"]  # default is open


def test_jobs_and_metrics_refuse_a_credential_no_job_admits() -> None:
    table = FakeTable(["a", "default"], {"a": JobConfig(token=TOKEN_A)})
    app = create_app(table.get("default").view, OPERATOR, jobs=table)  # type: ignore[union-attr]  # default admit
    for path in ("/jobs", "/metrics"):
        for token in (None, "nonsense"):
            r = call(app, "GET", path, token)
            assert r.status_code == 401 and r.json()["detail"] == NO_JOB_ADMITTED, (path, token, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    assert [j["job"] for j in call(app, "GET", "/jobs", TOKEN_A).json()] == ["a"]
    # an open lighthouse (no credential at all): every job
    table = FakeTable(["a", "default"], {})
    app = create_app(table.get("default").view, None, jobs=table)  # type: ignore[union-attr]
    assert [j["job"] for j in call(app, "GET", "/jobs").json()] == ["a", "default"]


def test_metrics_show_only_admitted_jobs(app: Any) -> None:
    text = call(app, "GET", "/metrics", TOKEN_A).text
    assert 'rallypoint_job="a"' in text and 'rallypoint_job="default"' in text
    assert 'rallypoint_job="b"' not in text
    text = call(app, "GET", "/metrics", OPERATOR).text
    assert all(f'rallypoint_job="{j}"' in text for j in ("a", "b", "default"))
    text = call(app, "GET", "/metrics?job=a", OPERATOR).text
    assert 'rallypoint_job="a"' in text and 'rallypoint_job="b"' not in text


def test_without_jobs_the_app_is_single_job() -> None:
    """jobs=None: the token as before; ``job=default`` (what the dashboard sends) is the
    view itself, any other job a 404 rather than the default job's data under its name."""
    view = FakeView()
    app = create_app(view, OPERATOR)
    assert call(app, "GET", "/status", OPERATOR).json() == view.status()  # unchanged: no "job" added
    assert call(app, "GET", "/status?job=default", OPERATOR).json() == view.status()
    assert call(app, "GET", "/status?job=other", OPERATOR).status_code == 404
    assert call(app, "GET", "/status?job=-bad", OPERATOR).status_code == 400
    assert call(app, "GET", "/status?job=other", "wrong").status_code == 401  # the token first, as before
    assert call(app, "GET", "/jobs", OPERATOR).status_code == 404  # no such route
    assert call(app, "GET", "/metrics", OPERATOR).status_code == 200


# ------------------------------------------------------------------ a real lighthouse with a jobs file


@pytest.fixture
def served(lighthouse: Any, client: Any) -> Iterator[tuple[Any, httpx.Client]]:
    """A real lighthouse (operator token, jobs a and b with their own tokens) where a replica
    of each job has sent a heartbeat (which creates the job), and an httpx client of it."""
    lh = lighthouse(min_replicas=1, http_bind="127.0.0.1:0", token=OPERATOR,
                    jobs={"a": JobConfig(token=TOKEN_A), "b": JobConfig(token=TOKEN_B)})
    client(lh, token=TOKEN_A, job="a").heartbeat("rep-a")
    client(lh, token=TOKEN_B, job="b").heartbeat("rep-b")
    with httpx.Client(base_url=lh.http_address(), timeout=TIMEOUT) as http:
        yield lh, http


def _events(http: httpx.Client, job: str) -> list[dict]:
    r = http.get("/events", params={"job": job, "limit": 1000}, headers=bearer(OPERATOR))
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_live_job_token_reads_its_job_only(served: tuple[Any, httpx.Client]) -> None:
    _lh, http = served
    r = http.get("/status", params={"job": "a"}, headers=bearer(TOKEN_A))
    assert r.status_code == 200, r.text
    assert [x["replica_id"] for x in r.json()["replicas"]] == ["rep-a"]
    status_b = http.get("/status", params={"job": "b"}, headers=bearer(OPERATOR))
    assert [x["replica_id"] for x in status_b.json()["replicas"]] == ["rep-b"]
    events_b = _events(http, "b")

    assert http.get("/status", params={"job": "b"}, headers=bearer(TOKEN_A)).status_code == 401
    r = http.post("/replica/rep-b/kill", params={"job": "b"}, headers=bearer(TOKEN_A), json={"reason": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
    r = http.post("/inject", params={"job": "b"}, headers=bearer(TOKEN_A), json={"kind": "slow", "replica": "rep-b"})
    assert r.status_code == 401, r.text

    assert _events(http, "b") == events_b  # nothing recorded for b
    after = http.get("/status", params={"job": "b"}, headers=bearer(OPERATOR)).json()
    assert [x["replica_id"] for x in after["replicas"]] == ["rep-b"]
    assert after["quorum_id"] == status_b.json()["quorum_id"]


def test_live_operator_reads_every_job_and_jobs_lists_admitted(served: tuple[Any, httpx.Client]) -> None:
    _lh, http = served
    for job in ("a", "b", "default"):
        assert http.get("/status", params={"job": job}, headers=bearer(OPERATOR)).status_code == 200, job
    assert {j["job"] for j in http.get("/jobs", headers=bearer(OPERATOR)).json()} >= {"a", "b", "default"}
    listed = http.get("/jobs", headers=bearer(TOKEN_A))
    assert listed.status_code == 200 and [j["job"] for j in listed.json()] == ["a"], listed.text
    assert http.get("/jobs").status_code == 401
    assert http.get("/jobs", headers=bearer("nonsense")).status_code == 401


def test_live_metrics_are_labelled_and_filtered(served: tuple[Any, httpx.Client]) -> None:
    _lh, http = served
    r = http.get("/metrics", headers=bearer(TOKEN_A))
    assert r.status_code == 200, r.text
    assert 'rallypoint_job="a"' in r.text and 'rallypoint_job="b"' not in r.text
    r = http.get("/metrics", headers=bearer(OPERATOR))
    assert 'rallypoint_job="a"' in r.text and 'rallypoint_job="b"' in r.text
    assert http.get("/metrics").status_code == 401


def test_live_bad_and_unknown_job(served: tuple[Any, httpx.Client]) -> None:
    lh, http = served
    r = http.get("/status", params={"job": "no good"}, headers=bearer(OPERATOR))
    assert r.status_code == 400 and "not a job name" in r.json()["detail"]
    r = http.get("/status", params={"job": "zzz"}, headers=bearer(OPERATOR))
    assert r.status_code == 404 and "no such job 'zzz' on this lighthouse" in r.json()["detail"]
    r = http.get("/jobs", headers=bearer(OPERATOR))
    assert "zzz" not in {j["job"] for j in r.json()}  # HTTP created nothing
