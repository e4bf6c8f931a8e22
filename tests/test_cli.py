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
