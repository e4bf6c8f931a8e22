"""The ``rallypoint`` command: help, torchft flag spellings, ``status`` and ``kill``.

Commands run as ``python -m rallypoint ...`` child processes (killed and reaped by pid
at teardown); a few ``status`` variants call ``rallypoint.cli.main`` in-process to keep
the suite fast.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from rallypoint.cli import main

from conftest import ask_concurrently, assert_one_quorum, reserved_port

LIGHTHOUSE_FLAGS = [
    "--min-replicas",
    "--join-timeout-ms",
    "--heartbeat-timeout-ms",
    "--quorum-tick-ms",
    "--bind",
    "--http-bind",
    "--state",
    "--token",
]


def run_cli(rallypoint_cli, *args: str, timeout: float = 20.0) -> tuple[int, str, str]:
    """Run ``python -m rallypoint *args`` to completion: (rc, stdout, stderr)."""
    p = rallypoint_cli(*args)
    rc = p.wait(timeout)
    return rc, "\n".join(p.rest_of_stdout()), p.stderr_text()


@pytest.fixture
def formed(lighthouse, client):
    """A lighthouse whose last quorum is {alpha, beta}."""
    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0")
    assert_one_quorum(ask_concurrently(client(lh), ["alpha", "beta"]), ["alpha", "beta"])
    return lh


@pytest.fixture
def dead_address() -> Iterator[str]:
    """host:port where nothing listens (the port stays reserved, so nothing else takes it)."""
    with reserved_port() as port:
        yield f"127.0.0.1:{port}"


def test_help_lists_subcommands_and_flags(rallypoint_cli):
    rc, out, _ = run_cli(rallypoint_cli, "--help")
    assert rc == 0
    for sub in ("lighthouse", "status", "kill"):
        assert sub in out
    rc, out, _ = run_cli(rallypoint_cli, "lighthouse", "--help")
    assert rc == 0
    for flag in LIGHTHOUSE_FLAGS:
        assert flag in out, f"{flag} missing from `rallypoint lighthouse --help`"


def test_torchft_flag_spellings_are_accepted(rallypoint_cli, client):
    p = rallypoint_cli(
        "lighthouse",
        "--min_replicas", "2",
        "--join_timeout_ms", "1234",
        "--heartbeat_timeout_ms", "4321",
        "--quorum_tick_ms", "50",
        "--bind", "127.0.0.1:0",
        "--http_bind", "off",
        "--state", ":memory:",
        name="lighthouse-torchft-flags",
    )  # fmt: skip
    info = p.json_line(20.0)
    assert info["lighthouse"].startswith("http://127.0.0.1:")
    assert info["http"] is None
    options = client(info["local"]).status()["options"]
    assert options == {"min_replicas": 2, "join_timeout_ms": 1234, "heartbeat_timeout_ms": 4321}


def test_status_table_host_port(rallypoint_cli, formed):
    address = formed.local_address().removeprefix("http://")
    rc, out, err = run_cli(rallypoint_cli, "status", "--lighthouse", address)
    assert rc == 0, err
    assert "alpha" in out and "beta" in out
    assert "REPLICA" in out
    assert f"quorum_id {formed.status()['quorum_id']}" in out


@pytest.mark.parametrize("spelling", ["http", "bare"])
def test_status_in_process_spellings_and_json(formed, capsys, spelling):
    addr = formed.local_address()
    if spelling == "bare":
        addr = addr.removeprefix("http://")
    assert main(["status", "--lighthouse", addr]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert any(line.startswith("alpha") and " yes " in line for line in lines), table
    assert any(line.startswith("beta") and " yes " in line for line in lines), table

    assert main(["status", "--lighthouse", addr, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(r["replica_id"] for r in doc["replicas"]) == ["alpha", "beta"]
    assert [m["replica_id"] for m in doc["quorum"]["members"]] == ["alpha", "beta"]


def test_status_via_http_dashboard_address(formed, capsys):
    # Users may paste the dashboard address; status falls back to GET /status.
    assert main(["status", "--lighthouse", formed.http_address(), "--json", "--timeout", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["replica_id"] for m in doc["quorum"]["members"]] == ["alpha", "beta"]


def test_status_dead_address_fails_fast_and_clearly(rallypoint_cli, dead_address):
    t0 = time.monotonic()
    rc, out, err = run_cli(rallypoint_cli, "status", "--lighthouse", dead_address, "--timeout", "1")
    elapsed = time.monotonic() - t0
    assert rc != 0
    assert out == ""
    assert dead_address in err and "could not connect" in err, err
    assert elapsed < 10.0, f"status against a dead address took {elapsed:.1f}s"


def test_kill_unknown_replica(rallypoint_cli, formed):
    rc, out, err = run_cli(rallypoint_cli, "kill", "nobody", "--lighthouse", formed.local_address())
    assert rc != 0
    assert "nobody" in err and "knows no replica" in err, err


def test_lighthouse_refuses_taken_http_port(rallypoint_cli):
    with reserved_port(listen=True) as port:
        rc, out, err = run_cli(
            rallypoint_cli,
            "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
            "--http-bind", f"127.0.0.1:{port}", "--state", ":memory:",
        )  # fmt: skip
    assert rc != 0
    assert out == ""  # never printed the ready line
    assert f"127.0.0.1:{port}" in err and "in use" in err, err
    assert "Traceback" not in err and "excepthook" not in err, err


# ------------------------------------------------------------------ many jobs on one lighthouse


@pytest.mark.parametrize("command", ["status", "kill", "inject", "goodput"])
def test_job_flag_in_help(command, capsys):
    from rallypoint.cli import JOB_HELP

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--job" in out and " ".join(JOB_HELP.split()) in out


def test_lighthouse_help_names_jobs_flags(capsys):
    from rallypoint.lighthouse.jobs import DEFAULT_MAX_JOBS

    with pytest.raises(SystemExit):
        main(["lighthouse", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--jobs FILE" in out and "--max-jobs" in out
    assert f"refused ({DEFAULT_MAX_JOBS})" in out  # the help states the real default


@pytest.mark.parametrize("content,expected", [
    (None, "cannot read jobs file"),
    ("{not json", "is not valid JSON"),
    ('{"jobs": {"a": {"token": 5}}}', "token must be a string"),
    ('{"jobs": {"bad name": {}}}', "is not a job name"),
    (b"\xff\xfe", "jobs file"),
])
def test_lighthouse_bad_jobs_file_exits_2_naming_it(tmp_path, capsys, content, expected):
    path = tmp_path / "jobs.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    rc = main(["lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off",
               "--state", ":memory:", "--jobs", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert str(path) in err and expected in err, err
    assert "Traceback" not in err


def test_lighthouse_max_jobs_below_one_exits_2(capsys):
    rc = main(["lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off",
               "--state", ":memory:", "--max-jobs", "0"])
    assert rc == 2
    assert "--max-jobs" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["kill", "x"], ["goodput"], ["inject", "slow"]])
def test_bad_job_name_is_a_usage_error(command, dead_address, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--lighthouse", dead_address, "--job", "no good"])
    assert e.value.code == 2
    assert "not a job name" in capsys.readouterr().err


def test_bad_job_env_is_a_usage_error(dead_address, capsys, monkeypatch):
    monkeypatch.setenv("RALLYPOINT_JOB", "-dash")
    with pytest.raises(SystemExit) as e:
        main(["status", "--lighthouse", dead_address])
    assert e.value.code == 2
    assert "RALLYPOINT_JOB" in capsys.readouterr().err


@pytest.fixture
def two_jobs(lighthouse, client):
    """A lighthouse with an operator token, jobs a and b with their own tokens, and one
    replica of each (its heartbeat created the job)."""
    from rallypoint.lighthouse.jobs import JobConfig

    lh = lighthouse(min_replicas=1, http_bind="127.0.0.1:0", token="op-token",
                    jobs={"a": JobConfig(token="tok-a"), "b": JobConfig(token="tok-b")})
    client(lh, token="tok-a", job="a").heartbeat("rep-a")
    client(lh, token="tok-b", job="b").heartbeat("rep-b")
    return lh


@pytest.mark.parametrize("where", ["grpc", "http"])
def test_status_job_flag_picks_the_job(two_jobs, capsys, monkeypatch, where):
    addr = two_jobs.local_address() if where == "grpc" else two_jobs.http_address()
    monkeypatch.setenv("RALLYPOINT_TOKEN", "op-token")
    for job, rep in (("a", "rep-a"), ("b", "rep-b")):
        assert main(["status", "--lighthouse", addr, "--job", job, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [r["replica_id"] for r in doc["replicas"]] == [rep], (job, doc)
    monkeypatch.setenv("RALLYPOINT_JOB", "b")  # the environment, when --job is not given
    assert main(["status", "--lighthouse", addr, "--json"]) == 0
    assert [r["replica_id"] for r in json.loads(capsys.readouterr().out)["replicas"]] == ["rep-b"]


def test_status_job_token_of_another_job_is_refused(two_jobs, capsys, monkeypatch):
    monkeypatch.setenv("RALLYPOINT_TOKEN", "tok-a")
    assert main(["status", "--lighthouse", two_jobs.local_address(), "--job", "b", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "rep-b" not in err and "job 'b'" in err, err


def test_kill_job_flag(two_jobs, capsys, monkeypatch):
    monkeypatch.setenv("RALLYPOINT_TOKEN", "op-token")
    # rep-a exists only in job a: job b knows no such replica
    assert main(["kill", "rep-a", "--lighthouse", two_jobs.local_address(), "--job", "b"]) == 1
    err = capsys.readouterr().err
    assert "knows no replica 'rep-a' in job 'b'" in err, err


EXIT_WITH_A_THREAD_IN_TORCH = """
import logging, sys, threading
from datetime import timedelta
from torch.distributed import TCPStore
from rallypoint.cli import _exit_past_native_threads

logging.basicConfig(level=logging.INFO)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
waiting = threading.Event()

def blocked() -> None:
    waiting.set()
    store.wait(["never"])  # inside torch's C++ code, GIL released, until the 30 s timeout

threading.Thread(target=blocked, daemon=True).start()
assert waiting.wait(10)
logging.getLogger("t").info("logged before the exit")
print("printed before the exit")
_exit_past_native_threads(7)
"""


def test_run_exits_with_its_status_while_a_thread_waits_in_torch(tmp_path) -> None:
    """``rallypoint run`` may end while its rendezvous thread still waits in a torch store:
    the process exits at once with the supervisor's status and its output flushed, not
    with SIGABRT from C++ unwinding that thread at interpreter shutdown."""
    import subprocess
    import sys

    script = tmp_path / "t.py"
    script.write_text(EXIT_WITH_A_THREAD_IN_TORCH)
    started = time.monotonic()
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stderr[-2000:]
    assert time.monotonic() - started < 25  # not after the store's 30 s timeout
    assert "printed before the exit" in p.stdout
    assert "logged before the exit" in p.stderr
