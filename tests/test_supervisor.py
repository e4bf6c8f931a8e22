"""``rallypoint run``, the per-replica-group launcher (warm standbys: ``test_supervisor_standby.py``).

The rules (restart, backoff, crash loop, each rank's environment, the command line) are
pure functions tested with tables; the rest runs ``python -m rallypoint run`` as a user
does, on real processes: a group's environment and torch's own ``init_process_group``
across a restart, two Manager-trained groups where one rank is SIGKILLed (the group
restarts cold and heals) and then one hangs in its training loop (the hang watchdog
restarts the group), a crash loop, SIGTERM to the supervisor, SIGKILL of the
supervisor, and usage errors. Every wait has a deadline; every process is killed by pid at teardown.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Proc, wait_until
from supervisor_util import (  # noqa: F401 - strays is a fixture
    HANG_TIMEOUT, _env, at_step_2, both_groups_finish_alike, children_of, end_soon, events, first_commits,
    hang_restart_facts, pid_alive, read_json, run_group, strays, two_training_groups,
)
from rallypoint.supervisor.args import RunConfig, UsageError, add_run_parser, config_from_args
from rallypoint.supervisor.envs import LIFELINE_ENV, PROGRESS_ENV, GroupSpec, log_prefix, rank_env
from rallypoint.supervisor.policy import (
    DONE, FAILED, RUNNING, Decision, RestartPolicy, after_failure, backoff, describe_exit, first_failure,
    group_state, hung_ranks, made_progress, parse_progress, poll_period, progress_change_time, stop_exit_code, watch_wait,
)  # fmt: skip

# ----------------------------------------------------------------------- the rules

P = RestartPolicy(max_restarts=2, backoff_s=0.5, backoff_cap_s=3.0, min_healthy_s=60.0)


@pytest.mark.parametrize("rc, text", [
    (0, "exit code 0"), (3, "exit code 3"), (-9, "signal SIGKILL"), (-15, "signal SIGTERM"), (-200, "signal 200"),
])  # fmt: skip
def test_describe_exit(rc, text) -> None:
    assert describe_exit(rc) == text


@pytest.mark.parametrize("codes, state", [
    ([None, None], RUNNING), ([0, None], RUNNING), ([0, 0], DONE), ([0], DONE),
    ([1, None], FAILED), ([None, -9], FAILED), ([0, 2], FAILED),
])  # fmt: skip
def test_group_state(codes, state) -> None:
    assert group_state(codes) == state


@pytest.mark.parametrize("exits, first", [
    ([], None), ([(1, 0)], None), ([(1, 0), (0, -9), (1, 1)], (0, -9)), ([(1, 3), (0, -15)], (1, 3)),
])  # fmt: skip
def test_first_failure(exits, first) -> None:
    assert first_failure(exits) == first


@pytest.mark.parametrize("committed, uptime, seen, progressed", [
    (True, 0.1, True, True),      # a committed step is progress, however short the life
    (False, 600, True, False),    # a script that reports steps: uptime alone is none
    (False, 600, False, True),    # one that never reported any (no Manager): uptime counts
    (False, 59.9, False, False),
])  # fmt: skip
def test_made_progress(committed, uptime, seen, progressed) -> None:
    assert made_progress(committed, uptime, seen, P) is progressed


@pytest.mark.parametrize("streak, wait", [(0, 0.0), (1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (100, 3.0)])
def test_backoff_doubles_and_is_capped(streak, wait) -> None:
    assert backoff(P, streak) == wait


@pytest.mark.parametrize("policy, streak_before, progressed, restart, wait, streak", [
    (P, 0, False, True, 0.5, 1),
    (P, 1, False, True, 1.0, 2),
    (P, 2, False, False, 0.0, 3),   # a third restart in a row without progress: give up
    (P, 2, True, True, 0.0, 0),     # progress resets the streak, and a healthy group restarts at once
    (RestartPolicy(max_restarts=0), 0, False, False, 0.0, 1),
    (RestartPolicy(max_restarts=0), 0, True, True, 0.0, 0),
])  # fmt: skip
def test_after_failure(policy, streak_before, progressed, restart, wait, streak) -> None:
    d = after_failure(policy, streak_before, progressed)
    assert (d.restart, d.backoff_s, d.streak) == (restart, wait, streak)
    assert isinstance(d, Decision)
    if not restart:
        assert "crash loop" in d.reason and f"--max-restarts {policy.max_restarts}" in d.reason


@pytest.mark.parametrize("now, last_change, timeout, hung", [
    (100.0, [None, None], 3.0, []),          # no report yet: the clock has not started
    (100.0, [97.5, 99.0], 3.0, []),
    (100.0, [97.0, 99.0], 3.0, [0]),         # exactly the timeout
    (100.0, [None, 90.0], 3.0, [1]),         # one rank reported, the other not yet
    (100.0, [96.0, 95.0, 99.9], 3.0, [1, 0]),  # longest silent first
    (100.0, [95.0, 95.0], 3.0, [0, 1]),      # ties: the lower rank
    (100.0, [0.0, 0.0], 0.0, []),            # 0: the watchdog is off
])  # fmt: skip
def test_hung_ranks(now, last_change, timeout, hung) -> None:
    assert hung_ranks(now, last_change, timeout) == hung


@pytest.mark.parametrize("text, parsed", [
    (b"5\n", (5, False)), (b"12 done\n", (12, True)), (b"", (None, False)), (b"x\n", (None, False)),
    (b"3 what\n", (3, False)),
])  # fmt: skip
def test_parse_progress(text, parsed) -> None:
    assert parse_progress(text) == parsed


@pytest.mark.parametrize("timeout, period", [(0.0, None), (300.0, 0.5), (3.0, 0.3), (1.0, 0.1), (0.1, 0.05)])
def test_poll_period(timeout, period) -> None:
    assert poll_period(timeout) == pytest.approx(period) if period else poll_period(timeout) is None


@pytest.mark.parametrize("now, last_change, timeout, wait", [
    (100.0, [None], 0.0, None),              # off: sleep until an event
    (100.0, [None, None], 300.0, 0.5),       # nobody timed yet: the poll period
    (100.0, [99.0, None], 300.0, 0.5),
    (100.0, [97.2, 99.0], 3.0, 0.2),         # rank 0's deadline comes before the next poll
    (100.0, [96.0], 3.0, 0.0),               # past it
])  # fmt: skip
def test_watch_wait(now, last_change, timeout, wait) -> None:
    got = watch_wait(now, last_change, timeout)
    assert got == pytest.approx(wait) if wait is not None else got is None


@pytest.mark.parametrize("now, previous_poll, age, changed_at", [
    (100.0, 99.5, 0.2, 99.8),    # the file's age says when
    (100.0, 99.5, 5.0, 99.5),    # older than the last poll that saw it unchanged: a wall clock jump
    (100.0, 99.5, -2.0, 100.0),  # from the future: now
])  # fmt: skip
def test_progress_change_time(now, previous_poll, age, changed_at) -> None:
    assert progress_change_time(now, previous_poll, age) == pytest.approx(changed_at)


def test_stop_exit_code() -> None:
    assert (stop_exit_code(signal.SIGTERM), stop_exit_code(signal.SIGINT)) == (143, 130)


def test_rank_env() -> None:
    base = {"PATH": "/bin", "RALLYPOINT_TOKEN": "t", "RALLYPOINT_TLS_CA": "/ca.pem", "RANK": "9",
            PROGRESS_ENV: "/stale", LIFELINE_ENV: "99"}
    spec = GroupSpec(nproc=2, master_addr="127.0.0.1", master_port=29500, group_id="3", lighthouse="lh:29510",
                     max_restarts=4)
    env = rank_env(base, spec, rank=1, incarnation=2, progress_path="/run/p.2.1", lifeline_fd=7)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "REPLICA_GROUP_ID",
                                "RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE", "TORCHELASTIC_USE_AGENT_STORE",
                                PROGRESS_ENV, LIFELINE_ENV, "OMP_NUM_THREADS")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "4",
        "REPLICA_GROUP_ID": "3", "RALLYPOINT_LIGHTHOUSE": "lh:29510", "TORCHFT_LIGHTHOUSE": "lh:29510",
        "TORCHELASTIC_USE_AGENT_STORE": "True", PROGRESS_ENV: "/run/p.2.1", LIFELINE_ENV: "7", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    assert env["RALLYPOINT_TOKEN"] == "t" and env["RALLYPOINT_TLS_CA"] == "/ca.pem" and env["PATH"] == "/bin"
    # A TORCHFT_LIGHTHOUSE already set is the user's; unset extras do not leak in from an outer supervisor.
    env = rank_env({**base, "TORCHFT_LIGHTHOUSE": "mine", "OMP_NUM_THREADS": "4"},
                   GroupSpec(nproc=1, master_addr="h", master_port=1), rank=0, incarnation=0)
    assert env["TORCHFT_LIGHTHOUSE"] == "mine" and env["OMP_NUM_THREADS"] == "4"
    assert PROGRESS_ENV not in env and LIFELINE_ENV not in env and "REPLICA_GROUP_ID" not in env
    assert "RALLYPOINT_LIGHTHOUSE" not in env


def test_log_prefix() -> None:
    assert (log_prefix("7", 1), log_prefix(None, 0), log_prefix("r0", "store")) == ("[g7 r1] ", "[r0] ", "[gr0 store] ")


def test_the_variable_names_agree_across_layers() -> None:
    """The Manager and the rank bootstrap may not import the supervisor: each spells the
    variable itself."""
    from rallypoint.manager import _progress
    from rallypoint.supervisor import _rank

    assert _progress.PROGRESS_ENV == PROGRESS_ENV and _rank.LIFELINE_ENV == LIFELINE_ENV


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rallypoint")
    add_run_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["run", *argv])


def test_command_line_with_torchruns_spellings(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = config_from_args(_parse(["--standalone", "--nnodes", "1", "--nproc_per_node", "4", "--max_restarts", "7",
                                   "--replica-group-id", "g2", str(script), "--lr", "0.1", "--nproc-per-node", "9"]))
    assert cfg == RunConfig(nproc=4, target=str(script), module=False, script_args=["--lr", "0.1", "--nproc-per-node", "9"],
                            group_id="g2", policy=RestartPolicy(max_restarts=7))
    assert cfg.hang_timeout_s == 300.0
    assert config_from_args(_parse(["--hang-timeout", "0", str(script)])).hang_timeout_s == 0.0
    assert config_from_args(_parse(["--hang_timeout", "2.5", str(script)])).hang_timeout_s == 2.5
    cfg = config_from_args(_parse(["-m", "json.tool", "x"]))
    assert (cfg.module, cfg.target, cfg.script_args) == (True, "json.tool", ["x"])


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0", "SCRIPT"], "--nproc-per-node must be at least 1"),
    (["missing.py"], "'missing.py' does not exist"),
    (["DIR"], "is a directory"),
    (["-m", "no_such_module_xyz.train"], "no module named 'no_such_module_xyz'"),
    (["--nnodes", "2", "SCRIPT"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--master-port", "70000", "SCRIPT"], "not in 0..65535"),
    (["--grace-period", "-1", "SCRIPT"], "--grace-period must not be negative"),
    (["--hang-timeout", "-1", "SCRIPT"], "--hang-timeout must not be negative"),
    (["--hang-timeout", "nan", "SCRIPT"], "--hang-timeout must not be negative"),
])  # fmt: skip
def test_usage_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    argv = [str(script) if a == "SCRIPT" else str(tmp_path) if a == "DIR" else a for a in argv]
    with pytest.raises(UsageError, match=message):
        config_from_args(_parse(argv))


def test_progress_reporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Manager's side: nothing without the variable; the first commit at once, then at
    most one write per MIN_INTERVAL_S, atomically; ``done`` at shutdown."""
    from rallypoint.manager import _progress

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    _progress.committed(1)  # no supervisor: nothing happens
    path = tmp_path / "progress.0.0"
    monkeypatch.setenv(PROGRESS_ENV, str(path))
    _progress.committed(5)
    assert path.read_text() == "5\n"
    _progress.committed(6)  # within MIN_INTERVAL_S: skipped
    assert path.read_text() == "5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.0.0"]
    _progress.finished(6)  # the Manager shuts down: never throttled
    assert path.read_text() == "6 done\n"
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path / "gone" / "p"))
    _progress.committed(7)  # a folder that is gone: no error


def test_a_cached_store_connection_survives_a_store_reset() -> None:
    """Between incarnations the supervisor gives its group a fresh store at the same
    address. Other groups' ranks keep a cached connection to it (their process groups
    rendezvous in an up-to-date member's store): their next configure reconnects instead
    of failing on the dead connection (which stalled whole quorums)."""
    import gc
    from datetime import timedelta

    from torch.distributed import TCPStore

    from rallypoint.process_groups._store import StoreClients, fresh_prefix_store

    t = timedelta(seconds=5)
    for _attempt in range(5):
        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port, clients = server.port, StoreClients()
        _, first = fresh_prefix_store(f"127.0.0.1:{port}/rallypoint/1/0", rank=0, quorum_id=1, group_rank=0,
                                      timeout=t, clients=clients)
        del server
        gc.collect()
        try:  # what `reset` does; the released port may be taken meanwhile: then again on a new one
            server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            break
        except RuntimeError:
            continue
    else:
        raise AssertionError("the released port was taken 5 times in a row")
    store, prefix = fresh_prefix_store(f"127.0.0.1:{port}/rallypoint/2/0", rank=0, quorum_id=2, group_rank=0,
                                       timeout=t, clients=clients)
    store.set("k", "v")
    assert server.get(f"{prefix}/k") == b"v" and prefix.endswith("/a1")


def test_the_store_host_moves_when_its_port_was_taken() -> None:
    """``reset`` reopens on the same port; when another process took it in between, on a
    new one (reported, so the next incarnation's ranks get it) instead of failing."""
    from rallypoint.supervisor._store_host import reopen

    opened: list[int] = []

    def open_store(port: int) -> Any:
        if port == 4000:
            raise RuntimeError("The server socket has failed to listen on any local network address: "
                               "address already in use")
        opened.append(port)
        return type("Store", (), {"port": 5123 if port == 0 else port})()

    assert reopen(open_store, 4001)[1] == 4001 and opened == [4001]
    assert reopen(open_store, 4000)[1] == 5123 and opened == [4001, 0]


def test_the_store_listens_only_on_the_group_address(tmp_path: Path) -> None:
    """The group's store is reachable at the address the ranks use (``--master-addr``), and
    not on the host's other addresses (here: 127.0.0.1 while it listens on 127.0.0.2)."""
    import io
    import socket
    import threading

    from rallypoint.supervisor._procs import StoreHost

    store = StoreHost("127.0.0.2", 0, "[store] ", io.BytesIO(), threading.Lock(), on_exit=lambda rc: None,
                      rundir=str(tmp_path / "run"))
    try:
        port = store.port(60)
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        store.close()


DUMPER = textwrap.dedent(
    """
    import os, signal, sys
    def waiting_here():
        sys.stderr.close()  # closes fd 2: the dump has its own descriptor
        sys.stderr = open(os.devnull, "w")
        os.kill(os.getpid(), signal.SIGUSR1)
        print("still alive", flush=True)
    waiting_here()
    """
)


def test_sigusr1_dumps_the_ranks_stacks_even_without_its_stderr(tmp_path: Path) -> None:
    """The rank bootstrap registers a SIGUSR1 stack dump (all threads) on a descriptor of
    its own, so a script that closes or replaces ``sys.stderr`` still gets its dump, and
    the rank lives on after it."""
    (tmp_path / "dumper.py").write_text(DUMPER)
    p = subprocess.run([sys.executable, "-m", "rallypoint.supervisor._rank", str(tmp_path / "dumper.py")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "still alive\n", p.stderr
    assert "most recent call first" in p.stderr and "in waiting_here" in p.stderr, p.stderr


def test_exit_now_says_everything_and_skips_the_teardown() -> None:
    """The helpers' fast exit: what was printed (buffered, to pipes) arrives, the code is
    kept, and no atexit handler runs (nor would the interpreter's teardown)."""
    code = ("import atexit, sys; from rallypoint.supervisor._rank import exit_now; "
            "atexit.register(lambda: print('atexit ran')); print('out', end=''); "
            "sys.stderr.write('err'); exit_now(3)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out", "err")


def test_the_store_host_exits_0_at_the_end_of_its_input_and_removes_the_rundir(tmp_path: Path) -> None:
    """End of stdin (the supervisor finished): the store host removes the supervisor's
    scratch folder and exits 0 (at once: ``exit_now``)."""
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "progress.0.0").write_text("1")
    p = subprocess.Popen([sys.executable, "-m", "rallypoint.supervisor._store_host", "127.0.0.1", "0", str(rundir)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert select.select([p.stdout], [], [], 60)[0], "the store host said nothing in 60 s"
        assert json.loads(p.stdout.readline())["port"] > 0  # it listens (a dead host ends the line: JSONDecodeError)
        p.stdin.close()
        assert p.wait(60) == 0, p.stderr.read() if p.stderr else ""
        assert not rundir.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_the_supervisor_imports_no_torch() -> None:
    code = ("import rallypoint.cli as c, rallypoint.supervisor.supervisor, rallypoint.supervisor._rank, sys; "
            "c._build_parser(); assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


# ----------------------------------------------------------------------- processes


ENV_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "REPLICA_GROUP_ID",
            "RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE", "TORCHELASTIC_RESTART_COUNT", "RALLYPOINT_TOKEN"]
    env = {k: os.environ.get(k) for k in keys}
    env["argv"] = sys.argv[1:]
    env["main"] = __name__
    print("hello from rank", os.environ["RANK"])
    print("to stderr", file=sys.stderr)
    with open(os.path.join(os.environ["OUT"], "env." + os.environ["RANK"]), "w") as f:
        json.dump(env, f)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("as_module", [False, True])
def test_two_ranks_get_the_environment(procs, tmp_path: Path, as_module: bool) -> None:
    """``rallypoint run --nproc-per-node 2 script.py args`` (or ``-m module``): each rank gets
    torchrun's variables plus rallypoint's and the rest of the environment; its lines
    come out prefixed; both exit 0, so does the supervisor."""
    (tmp_path / "envdump.py").write_text(ENV_SCRIPT)
    target = ["-m", "envdump"] if as_module else [str(tmp_path / "envdump.py")]
    env = _env(OUT=str(tmp_path), RALLYPOINT_TOKEN="tok", PYTHONPATH=str(tmp_path))
    sup = run_group(procs, "--nproc-per-node", "2", "--replica-group-id", "5", "--lighthouse", "127.0.0.1:1",
                    *target, "--flag", "x", name="envgroup", env=env)
    assert sup.wait(60) == 0, sup.stderr_text()[-3000:]
    a, b = (json.loads((tmp_path / f"env.{r}").read_text()) for r in range(2))
    for rank, e in enumerate((a, b)):
        assert e["RANK"] == e["LOCAL_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "2"
        assert (e["MASTER_ADDR"], e["REPLICA_GROUP_ID"], e["TORCHELASTIC_RESTART_COUNT"]) == ("127.0.0.1", "5", "0")
        assert e["RALLYPOINT_LIGHTHOUSE"] == e["TORCHFT_LIGHTHOUSE"] == "127.0.0.1:1"
        assert (e["RALLYPOINT_TOKEN"], e["argv"], e["main"]) == ("tok", ["--flag", "x"], "__main__")
    assert a["MASTER_PORT"] == b["MASTER_PORT"] != "0"
    out = sup.rest_of_stdout()
    assert "[g5 r0] hello from rank 0" in out and "[g5 r1] hello from rank 1" in out
    assert "[g5 r1] to stderr" in sup.stderr_text()


TORCH_PG_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    inc, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], dist.get_rank()
    with open(os.path.join(sys.argv[1], f"sum.{inc}.{rank}"), "w") as f:
        f.write(str(t.item()))
    dist.destroy_process_group()
    if inc == "0" and rank == 1:
        sys.exit(7)
    """
)


@pytest.mark.slow
def test_torch_init_process_group_works_across_a_restart(procs, tmp_path: Path) -> None:
    """A script's own ``init_process_group("gloo")`` (env://) rendezvouses in the store the
    supervisor hosts, and again in the next incarnation (fresh keys, same address) after
    rank 1 exits 7: one restart event naming it; then every rank exits 0."""
    (tmp_path / "pg.py").write_text(TORCH_PG_SCRIPT)
    sup = run_group(procs, "--nproc-per-node", "2", "--max-restarts", "1", "--restart-backoff", "0.05",
                    str(tmp_path / "pg.py"), str(tmp_path), name="pggroup")
    assert sup.wait(60) == 0, sup.stderr_text()[-4000:]
    for inc in (0, 1):
        assert [(tmp_path / f"sum.{inc}.{r}").read_text() for r in range(2)] == ["3.0", "3.0"]
    (restart,) = events(sup, "restart")
    assert (restart["rank"], restart["cause"], restart["exit_code"], restart["incarnation"]) == (1, "exit code 7", 7, 1)
    assert restart["progress"] is False and restart["restart_s"] >= 0.05


#: The restarts here are cold (new processes); tests/test_supervisor_standby.py runs the
#: same failures, and a SIGSTOP, restarted from warm standbys (the default).
COLD = ("--no-standby",)


@pytest.mark.slow
def test_a_killed_and_then_a_hung_rank_restart_their_group_cold(procs, lighthouse, tmp_path: Path, strays) -> None:
    """Two replica groups, each ``rallypoint run --nproc-per-node 2`` with a Manager; group
    1 runs with ``--hang-timeout 3`` and no standbys. Two failures, one after the other:

    1. Rank 1 of group 1 is SIGKILLed mid-training: its supervisor stops rank 0 and
       restarts both (incarnation 1), which heal from group 0. The restart event names the
       rank and the signal and counts the first incarnation's commits as progress.
    2. Rank 1 of incarnation 1 sleeps forever in its training loop. Its Manager keeps
       heartbeating, so only the watchdog sees it: the group's stacks are dumped to the log
       (the sleeping frame among them) and the group restarts (incarnation 2) within the
       timeout plus a few seconds and heals.

    Both groups finish at the same step with identical weights."""
    sups = two_training_groups(procs, lighthouse, tmp_path, ("--hang-timeout", str(HANG_TIMEOUT), *COLD),
                               steps=10_000)
    state = at_step_2(tmp_path, 1)
    strays.append(state["pid"])
    os.kill(state["pid"], signal.SIGKILL)
    strays.extend(f["pid"] for f in first_commits(tmp_path, 1))
    (kill,) = events(sups[1], "restart")
    assert (kill["rank"], kill["cause"], kill["signal"], kill["incarnation"]) == (1, "signal SIGKILL", "SIGKILL", 1)
    assert kill["progress"] is True and kill["streak"] == 0 and kill["warm_ranks"] == [], kill

    marked = time.time()
    (tmp_path / "hang.g1.r1").write_text("")
    hanging = wait_until(lambda: read_json(tmp_path / "hanging.g1.r1"), timeout=10, what="rank 1 to hang")
    assert hanging["inc"] == 1 and hanging["t"] - marked < 2.0
    first_commits(tmp_path, 2)
    both_groups_finish_alike(tmp_path, sups, steps=end_soon(tmp_path), inc=2)
    _, hang = events(sups[1], "restart")
    assert hang["incarnation"] == 2 and hang["streak"] == 0, hang
    facts = hang_restart_facts(hang, sups[1], tmp_path, marked, cold=True)
    dump = [line for line in sups[1].stderr_text().splitlines() if line.startswith("[g1 r1] ")]
    assert any("in hang_here" in line for line in dump), "\n".join(dump[-60:])
    assert not (tmp_path / "hang.g1.r1").exists()  # taken once
    print("hang:", json.dumps(facts))


@pytest.mark.slow
def test_a_crash_loop_gives_up_with_a_clear_message(procs, tmp_path: Path) -> None:
    """A script that exits 3 at once: restarted --max-restarts times with backoff, then the
    supervisor gives up (exit 1) saying why, instead of looping forever."""
    (tmp_path / "bad.py").write_text("import sys; print('about to fail'); sys.exit(3)\n")
    sup = run_group(procs, "--nproc-per-node", "2", "--max-restarts", "2", "--restart-backoff", "0.02",
                    str(tmp_path / "bad.py"), name="crashloop")
    assert sup.wait(60) == 1
    err = sup.stderr_text()
    assert "giving up on replica group: crash loop: 3 incarnation(s) in a row failed without progress" in err, err
    assert "--max-restarts 2" in err and "exit code 3" in err
    assert [e["incarnation"] for e in events(sup, "restart")] == [1, 2]
    assert [e["backoff_s"] for e in events(sup, "restart")] == [0.02, 0.04]
    (gave_up,) = events(sup, "gave_up")
    assert (gave_up["failed_incarnation"], gave_up["streak"]) == (2, 3)


SLEEPER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    rank = os.environ["RANK"]
    if rank == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"env.{rank}", "w") as f:
        json.dump(dict(os.environ), f)
    print("ready", os.getpid(), child.pid, flush=True)
    time.sleep(600)
    """
)


def _start_sleepers(procs, tmp_path: Path, strays: list[int]) -> tuple[Proc, list[int], int]:
    """A supervised group of two sleeping ranks, each with a child of its own; returns the
    supervisor, every rank's and rank child's pid, and the store host's pid."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    sup = run_group(procs, "--nproc-per-node", "2", "--replica-group-id", "9", "--grace-period", "0.5",
                    "--no-standby", str(tmp_path / "sleeper.py"), name="sleepers")  # standbys: the other file
    pids: list[int] = []
    for _ in range(2):
        line = sup.wait_line(lambda s: " ready " in s, timeout=60)
        pids += [int(x) for x in line.split()[-2:]]
    strays.extend(pids)
    (store,) = [p for p in children_of(sup.pid) if p not in pids]
    strays.append(store)
    assert all(pid_alive(p) for p in [*pids, store])
    return sup, pids, store


@pytest.mark.slow
def test_sigterm_stops_every_rank_and_exits_143(procs, tmp_path: Path, strays) -> None:
    """SIGTERM to the supervisor: SIGTERM to the ranks, SIGKILL to the one that ignores it
    after the grace period, their own children killed too, the store host stopped; exit
    143 (128 + SIGTERM); nothing left running."""
    sup, pids, store = _start_sleepers(procs, tmp_path, strays)
    sup.kill(signal.SIGTERM)
    assert sup.wait(20) == 143, sup.stderr_text()[-3000:]
    assert not [p for p in [*pids, store] if pid_alive(p)]
    err = sup.stderr_text()
    assert "still running after the 0.5s grace period: SIGKILL" in err and "stopped by SIGTERM" in err
    assert events(sup, "stopped") == [{"event": "stopped", "group": "9", "signal": "SIGTERM"}]


@pytest.mark.slow
def test_a_sigkilled_supervisor_takes_its_ranks_and_store_host_with_it(procs, tmp_path: Path, strays) -> None:
    """SIGKILL to the supervisor: the kernel kills the ranks (PR_SET_PDEATHSIG), the store
    host sees its input end and kills what the ranks started; nothing outlives it."""
    sup, pids, store = _start_sleepers(procs, tmp_path, strays)
    rundir = Path(json.loads((tmp_path / "env.0").read_text())[PROGRESS_ENV]).parent
    assert rundir.is_dir()
    sup.kill(signal.SIGKILL)
    assert sup.wait(10) == -signal.SIGKILL
    wait_until(lambda: not [p for p in [*pids, store] if pid_alive(p)], timeout=10,
               what="every rank, rank child and the store host to die")
    assert not rundir.exists()  # its scratch folder too (the store host removes it)


@pytest.mark.slow
def test_usage_errors_exit_2_before_starting_anything(procs, tmp_path: Path) -> None:
    """A missing script, a bad flag, --nproc-per-node 0: a message and exit 2, quickly (no
    store host is started: it would print its import warnings and take a second)."""
    for i, (argv, message) in enumerate([
        (["--nproc-per-node", "2", str(tmp_path / "missing.py")], "missing.py' does not exist"),
        (["--nproc-per-node", "0", str(tmp_path)], "--nproc-per-node must be at least 1"),
        (["--no-such-flag", "x.py"], "unrecognized arguments: --no-such-flag"),
    ]):  # fmt: skip
        sup = run_group(procs, *argv, name=f"usage{i}")
        assert sup.wait(30) == 2
        err = sup.stderr_text()
        assert message in err and "[store]" not in err and "rallypoint.run" not in err, err
