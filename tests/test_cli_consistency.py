"""The client subcommands behave alike (issue 40, item 7): ``--timeout`` bounds the whole
command, connecting included; ``kill --replica ID`` is ``kill ID``; ``--log-level`` works
after the subcommand; a reader that closes the pipe early (``| head -1``) ends the command
quietly, with 141 (128 + SIGPIPE, what the shell reports for ``cat`` in that place).

Children run as ``python -m rallypoint ...`` under ``subprocess.run`` with a timeout
(or the ``rallypoint_cli`` fixture, which kills and reaps them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint._cli_budget import CLOSED_PIPE_EXIT, MIN_STEP_S, Budget
from rallypoint.cli import main

from conftest import reserved_port
from test_lighthouse_server import FakeManager

#: How long a child Python with rallypoint's imports may take to start on a busy host.
STARTUP_ALLOWANCE_S = 1.5


def rallypoint(*args: str, cwd: Path, stdout: int | None = subprocess.PIPE, env: dict[str, str] | None = None,
               timeout: float = 30.0) -> subprocess.CompletedProcess[bytes]:
    """``python -m rallypoint *args`` to completion (killed after ``timeout``)."""
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=stdout, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture
def dead_address() -> Iterator[str]:
    """host:port where nothing listens (reserved, so nothing else takes it meanwhile)."""
    with reserved_port() as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture
def fake_manager() -> Iterator[FakeManager]:
    m = FakeManager()
    yield m
    m.stop()


# ------------------------------------------------------------------ --timeout bounds the whole call


@pytest.mark.parametrize("now,seconds,parts,left,share", [
    (0.0, 5.0, 1, 5.0, 5.0),
    (2.0, 5.0, 2, 3.0, 1.5),
    (4.99, 5.0, 1, MIN_STEP_S, MIN_STEP_S),  # almost spent: one quick attempt, not a zero-length one
    (9.0, 5.0, 3, MIN_STEP_S, MIN_STEP_S),  # spent
    (0.0, 6.0, 0, 6.0, 6.0),
])
def test_budget_hands_out_what_is_left(now, seconds, parts, left, share):
    clock = iter([0.0, now, now]).__next__
    b = Budget(seconds, clock=clock)
    assert b.left() == pytest.approx(left)
    assert b.share(parts) == pytest.approx(share)


def test_status_dead_address_subprocess_returns_within_its_timeout(tmp_path, dead_address):
    t0 = time.monotonic()
    p = rallypoint("status", "--lighthouse", dead_address, "--timeout", "1", cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    assert b"could not connect" in p.stderr and b"Traceback" not in p.stderr
    assert elapsed < 1.0 + STARTUP_ALLOWANCE_S, f"status --timeout 1 took {elapsed:.1f}s"


@pytest.mark.parametrize("command", [
    ["status"], ["goodput"], ["kill", "--replica", "r1"], ["inject", "slow", "--replica", "r1"],
])
def test_timeout_covers_the_connect(command, dead_address, capsys):
    """``kill --timeout 1`` used to wait 5 s to connect: the connect now shares the budget."""
    t0 = time.monotonic()
    assert main([*command, "--lighthouse", dead_address, "--timeout", "1"]) == 1
    elapsed = time.monotonic() - t0
    assert 0.5 < elapsed < 2.0, f"{command[0]} --timeout 1 took {elapsed:.2f}s"
    err = capsys.readouterr().err
    assert dead_address in err and "could not connect" in err, err  # within what was left of the 1 s


def test_timeout_split_across_an_ha_set(dead_address, capsys):
    """Two dead members: both tried, the whole call still within --timeout."""
    with reserved_port() as other:
        t0 = time.monotonic()
        assert main(["status", "--lighthouse", f"{dead_address},127.0.0.1:{other}", "--timeout", "1"]) == 1
        elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"status of an HA set took {elapsed:.2f}s"
    err = capsys.readouterr().err
    assert dead_address in err and f"127.0.0.1:{other}" in err, err


# ------------------------------------------------------------------ one way to name a replica


def test_kill_replica_flag_works_like_the_positional(tmp_path, cli_lighthouse, client, fake_manager):
    lh = cli_lighthouse(min_replicas=1)
    client(lh.address).quorum("r1", 10.0, address=fake_manager.address)
    for spelling in (["r1"], ["--replica", "r1"], ["r1", "--replica", "r1"]):
        p = rallypoint("kill", *spelling, "--lighthouse", lh.address, "--reason", "via " + " ".join(spelling),
                       "--timeout", "10", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert p.stdout.decode().strip() == f"sent Kill to replica r1 at {fake_manager.address}"
        assert fake_manager.kills.get(timeout=5).msg == "via " + " ".join(spelling)
    p = rallypoint("kill", "--replica", "ghost", "--lighthouse", lh.address, "--timeout", "10", cwd=tmp_path)
    assert p.returncode == 1 and b"knows no replica 'ghost'" in p.stderr, p.stderr


@pytest.mark.parametrize("argv,message", [
    (["kill"], "name the replica: --replica ID"),
    (["kill", "a", "--replica", "b"], "two replicas named"),
])
def test_kill_replica_usage_errors(argv, message, dead_address, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--lighthouse", dead_address])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ --log-level after the subcommand


def test_status_log_level_after_the_subcommand(tmp_path, cli_lighthouse):
    lh = cli_lighthouse(min_replicas=1)
    p = rallypoint("status", "--lighthouse", lh.address, "--log-level", "DEBUG", cwd=tmp_path,
                   env={"RALLYPOINT_LOG_LEVEL": "WARNING"})
    assert p.returncode == 0, p.stderr
    assert b"REPLICA" in p.stdout
    assert b" DEBUG " in p.stderr, p.stderr  # the level took effect: the HTTP probe logs at DEBUG


# ------------------------------------------------------------------ a closed pipe


def test_status_piped_into_head_has_no_traceback(tmp_path, cli_lighthouse):
    lh = cli_lighthouse(min_replicas=1)
    cmd = f"{sys.executable} -m rallypoint status --lighthouse {lh.address} 2>err.txt | head -1"
    p = subprocess.run(["sh", "-c", cmd], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    err = (tmp_path / "err.txt").read_text()
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().startswith("quorum_id ") and p.stdout.count(b"\n") == 1, p.stdout
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_status_into_a_closed_pipe_exits_141_quietly(tmp_path, cli_lighthouse, unbuffered):
    """The reader is gone before the first write: deterministic EPIPE."""
    lh = cli_lighthouse(min_replicas=1)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        p = rallypoint("status", "--lighthouse", lh.address, cwd=tmp_path, stdout=write_end,
                       env={"PYTHONUNBUFFERED": unbuffered})
    finally:
        os.close(write_end)
    assert p.returncode == CLOSED_PIPE_EXIT == 141, p.stderr
    assert p.stderr == b"", p.stderr


def test_help_into_a_closed_pipe_exits_quietly(tmp_path):
    """argparse drops its own failed write (exit 0); whatever is left fails our flush (141)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        p = rallypoint("lighthouse", "--help", cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    assert p.returncode in (0, CLOSED_PIPE_EXIT) and p.stderr == b"", (p.returncode, p.stderr)
