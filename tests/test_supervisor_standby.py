"""``rallypoint run``'s warm standbys: a process per rank that has imported torch,
rallypoint and ``--preload`` ahead of a failure and becomes the rank at the restart.

The rules (when standbys start, when a dead one is replaced, when to stop making them)
are pure functions tested with tables; the bootstrap is tested on its own (go, end of
input, a bad go); the rest runs ``python -m rallypoint run`` on real processes: a restart
that takes the ready standbys (same pids, torch already imported, the new environment,
the script's argv, stdin at /dev/null) and starts new ones, one of which dies and is
replaced before the next restart, a ``--preload`` that fails (standbys given up, the ranks restart cold), SIGKILL
and SIGTERM to the supervisor (no standby outlives it), and two Manager-trained groups
where a killed, then a hung, then a SIGSTOPped rank's group comes back from its standbys
each time and heals. Every wait has a
deadline; every process is killed by pid at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import Proc, wait_until
from supervisor_util import (  # noqa: F401 - strays is a fixture
    HANG_TIMEOUT, _env, at_step_2, both_groups_finish_alike, children_of, end_soon, events, first_commits,
    hang_restart_facts, pid_alive, read_json, run_group, strays, two_training_groups,
)
from rallypoint.supervisor.args import UsageError, add_run_parser, config_from_args
from rallypoint.supervisor.envs import READY_ENV
from rallypoint.supervisor.policy import STANDBY_DEATHS_MAX, standby_refill_delay, standby_start_due

# ----------------------------------------------------------------------- the rules


@pytest.mark.parametrize("now, started, reported, delay, due", [
    (100.0, 99.0, True, 10.0, True),     # every rank committed: start them now
    (100.0, 99.0, False, 10.0, False),   # still starting: wait, its imports need the CPU
    (100.0, 90.0, False, 10.0, True),    # no reports (no Manager): after the delay
    (100.0, 100.0, False, 0.0, True),    # --standby-delay 0: at once
])  # fmt: skip
def test_standby_start_due(now, started, reported, delay, due) -> None:
    assert standby_start_due(now, started, reported, delay) is due


@pytest.mark.parametrize("deaths, delay", [(0, 0.5), (1, 0.5), (2, 1.0), (STANDBY_DEATHS_MAX, None), (99, None)])
def test_standby_refill_delay(deaths, delay) -> None:
    assert standby_refill_delay(deaths) == delay


def _parse(argv: list[str]):
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    return add_run_parser(sub).parse_args(argv)


def test_standby_flags(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text("")
    (tmp_path / "mymodel.py").write_text("")
    cfg = config_from_args(_parse([str(tmp_path / "s.py")]))
    assert (cfg.standby, cfg.preload, cfg.standby_delay_s) == (True, (), 10.0)
    cfg = config_from_args(_parse(["--no-standby", "--preload", "json, mymodel,os.path", "--standby-delay", "0",
                                   str(tmp_path / "s.py")]))
    assert (cfg.standby, cfg.preload, cfg.standby_delay_s) == (False, ("json", "mymodel", "os.path"), 0.0)


@pytest.mark.parametrize("flags, message", [
    (["--preload", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["--preload", "two words"], "'two words' is not a module name"),
    (["--standby-delay", "-1"], "--standby-delay must not be negative"),
])  # fmt: skip
def test_standby_usage_errors(tmp_path: Path, flags, message) -> None:
    (tmp_path / "s.py").write_text("")
    with pytest.raises(UsageError, match=message):
        config_from_args(_parse([*flags, str(tmp_path / "s.py")]))


# ----------------------------------------------------------------------- the store's spare


def test_next_switches_to_an_empty_spare_store_at_once(tmp_path: Path) -> None:
    """``next`` answers with the spare's port (another one), whose store is empty, at once;
    the old store is recycled in the background into the next spare, empty and normally on
    its old port, so the group's store alternates between two ports."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from rallypoint.supervisor._procs import StoreHost

    err = open(tmp_path / "err", "wb")
    host = StoreHost("127.0.0.1", 0, "[store] ", err, threading.Lock(), on_exit=lambda rc: None, rundir=str(tmp_path))
    try:
        a = host.port(60)
        host.spare()
        TCPStore("127.0.0.1", a, is_master=False, timeout=timedelta(seconds=5)).set("stale", "1")
        ports = [a]
        for _ in range(3):
            ports.append(host.next(60))
            client = TCPStore("127.0.0.1", ports[-1], is_master=False, timeout=timedelta(seconds=5))
            assert not client.check(["stale"])  # a fresh store
            client.set("stale", "1")
        # Never the store just left; normally two ports in turn (a released port another
        # process took meanwhile is replaced by a new one, so this does not assert two).
        assert all(p != q for p, q in zip(ports, ports[1:])), ports
    finally:
        host.close()
        err.close()


# ----------------------------------------------------------------------- the bootstrap

PROBE = textwrap.dedent(
    """
    import json, os, sys
    with open(os.path.join(os.environ["OUT"], "probe.json"), "w") as f:
        json.dump({"warm": "torch" in sys.modules, "helper": "helper" in sys.modules, "argv": sys.argv,
                   "main": __name__, "stdin": os.path.realpath("/proc/self/fd/0"),
                   "start_only": os.environ.get("START_ONLY"), "go_only": os.environ.get("GO_ONLY"),
                   "ready_env": os.environ.get("RALLYPOINT_STANDBY_READY"), "path0": sys.path[0]}, f)
    """
)


def _bootstrap(tmp_path: Path, *extra: str) -> subprocess.Popen:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    env = {**os.environ, "OUT": str(tmp_path), "START_ONLY": "1", READY_ENV: str(tmp_path / "ready")}
    return subprocess.Popen([sys.executable, "-m", "rallypoint.supervisor._rank", "--standby", *extra,
                             str(tmp_path / "probe.py"), "a", "--b"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")


@pytest.mark.slow
def test_a_standby_becomes_the_rank_on_its_go(tmp_path: Path) -> None:
    """Ready after its imports (the file), then on its go: the script runs as ``python
    probe.py a --b`` would (``__main__``, its folder first on the path, its argv), with
    torch and ``--preload helper`` (found beside the script) already imported, the go's
    environment only, and stdin at /dev/null."""
    p = _bootstrap(tmp_path, "--preload", "helper")
    try:
        wait_until(lambda: (tmp_path / "ready").exists() or p.poll() is not None, timeout=60, what="the ready file")
        assert p.poll() is None, p.communicate(timeout=5)[1].decode()[-3000:]
        go = {k: v for k, v in os.environ.items()} | {"OUT": str(tmp_path), "GO_ONLY": "2"}
        out, err = p.communicate(json.dumps({"env": go}).encode(), timeout=60)
        assert p.returncode == 0, err.decode()[-3000:]
    finally:
        p.kill()
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe == {"warm": True, "helper": True, "argv": [str(tmp_path / "probe.py"), "a", "--b"],
                     "main": "__main__", "stdin": "/dev/null", "start_only": None, "go_only": "2",
                     "ready_env": None, "path0": str(tmp_path)}


@pytest.mark.slow
def test_a_standby_without_a_valid_go_never_runs_the_script(tmp_path: Path) -> None:
    """The end of input (not needed) exits 0 quietly; a malformed go exits non-zero; in
    neither case does the script run. (The three standbys import at once: the cases are
    independent, and each import is most of a case's time.)"""
    cases = {"eof": (b"", 0), "not_json": (b"{not json", 1), "bad_env": (b'{"env": {"A": 1}}', 1)}
    for name in cases:
        (tmp_path / name).mkdir()
    ps = {name: _bootstrap(tmp_path / name) for name in cases}
    try:
        for name, (go, code) in cases.items():
            _, err = ps[name].communicate(go, timeout=60)
            assert ps[name].returncode == code, (name, err.decode()[-2000:])
            assert not (tmp_path / name / "probe.json").exists(), name
    finally:
        for p in ps.values():
            p.kill()


# ----------------------------------------------------------------------- under rallypoint run

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    warm = "torch" in sys.modules
    out, rank = sys.argv[1], os.environ["RANK"]
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rec = {"rank": int(rank), "inc": inc, "pid": os.getpid(), "warm": warm, "helper": "helper" in sys.modules,
           "argv": sys.argv[1:], "main": __name__, "stdin": os.path.realpath("/proc/self/fd/0"),
           "ready_env": os.environ.get("RALLYPOINT_STANDBY_READY"), "port": os.environ["MASTER_PORT"],
           "rundir": os.path.dirname(os.environ["RALLYPOINT_SUPERVISOR_PROGRESS"])}
    with open(os.path.join(out, f"start.{inc}.{rank}"), "w") as f:
        json.dump(rec, f)
    print("started", json.dumps(rec), flush=True)
    while True:  # exit 7 when the test says so, 0 at the end
        if os.path.exists(os.path.join(out, f"crash.{inc}.{rank}")):
            sys.exit(7)
        if os.path.exists(os.path.join(out, "done")):
            sys.exit(0)
        time.sleep(0.02)
    """
)


def _start(tmp_path: Path, procs, *flags: str, env: dict[str, str] | None = None) -> Proc:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    return run_group(procs, "--nproc-per-node", "2", "--replica-group-id", "5", "--standby-delay", "0",
                     "--grace-period", "2", *flags, str(tmp_path / "worker.py"), str(tmp_path), name="standbys",
                     env=env)


def _started(tmp_path: Path, inc: int, sup: Proc) -> list[dict]:
    def both() -> list[dict] | None:
        recs = [read_json(tmp_path / f"start.{inc}.{r}") for r in range(2)]
        return recs if all(recs) and sup.popen.poll() is None else None

    return wait_until(both, timeout=60, what=f"both ranks of incarnation {inc}")  # type: ignore[no-any-return]


def _standbys(sup: Proc, ranks: list[int]) -> dict[int, str]:
    """The supervisor's standby children: pid -> its ready file. A new process has it in its
    environment; one forked from the zygote (whose ``/proc`` environment is the zygote's)
    is found by the pid a standby writes into its ready file in the supervisor's scratch
    folder (named on the store host's command line)."""
    out = {}
    children = [pid for pid in children_of(sup.pid) if pid not in ranks]
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(READY_ENV.encode() + b"="):
                out[pid] = kv.split(b"=", 1)[1].decode()
        if b"rallypoint.supervisor._store_host" in argv and len(argv) > 5:
            for f in Path(argv[5].decode()).glob("standby.*.ready"):
                try:
                    ready = int(f.read_text())
                except (OSError, ValueError):
                    continue
                if ready in children and pid_alive(ready):
                    out[ready] = str(f)
    return out


def _ready_standbys(sup: Proc, ranks: list[int], n: int = 2, exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    def ready() -> list[int] | None:
        sb = {p: f for p, f in _standbys(sup, ranks).items() if p not in exclude}
        return sorted(sb) if len(sb) == n and all(os.path.exists(f) for f in sb.values()) else None

    return wait_until(ready, timeout=90, interval=0.05, what=f"{n} ready standbys")  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_restart_takes_the_ready_standbys_and_a_standby_that_dies_is_replaced(procs, tmp_path: Path,
                                                                             strays) -> None:
    """Rank 1 exits 7: the group restarts from the two ready standbys (their pids become the
    ranks of incarnation 1, with torch and ``--preload helper`` imported, the new
    incarnation's environment, the same argv, stdin at /dev/null, no standby variables);
    two new standbys follow. Then SIGKILL to one of those: the supervisor says so and
    starts another, and the next restart (rank 0 exits 7) is still warm for both ranks. At
    the end every process is gone and the exit is 0."""
    sup = _start(tmp_path, procs, "--preload", "helper")
    first = _started(tmp_path, 0, sup)
    assert [r["warm"] for r in first] == [True, True]  # forked from the group's zygote (tests/test_zygote.py)
    ranks0 = [r["pid"] for r in first]
    standbys = _ready_standbys(sup, ranks0)
    strays.extend([*ranks0, *standbys])
    (tmp_path / "crash.0.1").write_text("")
    second = _started(tmp_path, 1, sup)
    assert sorted(r["pid"] for r in second) == standbys
    for r in second:
        assert (r["warm"], r["helper"], r["main"], r["stdin"], r["ready_env"]) == (True, True, "__main__", "/dev/null",
                                                                                  None), r
        assert r["argv"] == [str(tmp_path)] and r["port"] != first[0]["port"]  # the spare store
    (restart,) = events(sup, "restart")
    assert (restart["rank"], restart["cause"], restart["warm_ranks"]) == (1, "exit code 7", [0, 1]), restart
    new = _ready_standbys(sup, standbys)
    strays.extend(new)

    victim = new[0]
    os.kill(victim, signal.SIGKILL)
    replacement = _ready_standbys(sup, standbys, n=1, exclude=set(new))
    strays.extend(replacement)
    err = sup.stderr_text()
    assert f"(pid {victim}) exited (signal SIGKILL) after it was ready" in err, err[-3000:]
    (tmp_path / "crash.1.0").write_text("")
    third = _started(tmp_path, 2, sup)
    assert sorted(r["pid"] for r in third) == sorted([new[1], *replacement])
    _, again = events(sup, "restart")
    assert (again["rank"], again["warm_ranks"]) == (0, [0, 1]), again
    last = list(_standbys(sup, [r["pid"] for r in third]))  # ready or still importing
    strays.extend(last)
    (tmp_path / "done").write_text("")
    assert sup.wait(30) == 0, sup.stderr_text()[-4000:]
    assert not [p for p in [*ranks0, *standbys, *new, *replacement, *last] if pid_alive(p)]
    assert not Path(first[0]["rundir"]).exists()
    out = sup.rest_of_stdout()
    assert any(line.startswith("[g5 r1] started") for line in out), out


@pytest.mark.slow
def test_a_failing_preload_gives_up_on_standbys_and_restarts_cold(procs, tmp_path: Path, strays) -> None:
    """``--preload broken`` (a module beside the script that raises): each standby dies
    with a message naming it; after a few the supervisor stops making them, and a restart
    starts both ranks cold, which works."""
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    sup = _start(tmp_path, procs, "--preload", "broken")
    ranks0 = [r["pid"] for r in _started(tmp_path, 0, sup)]
    strays.extend(ranks0)
    wait_until(lambda: "no more standbys" in sup.stderr_text(), timeout=120, interval=0.1,
               what="the supervisor to give up on standbys")
    err = sup.stderr_text()
    assert "standby: cannot preload 'broken': RuntimeError: broken on purpose" in err, err[-3000:]
    assert _standbys(sup, ranks0) == {}
    (tmp_path / "crash.0.1").write_text("")
    second = _started(tmp_path, 1, sup)
    assert [r["warm"] for r in second] == [False, False]
    assert events(sup, "restart")[0]["warm_ranks"] == []
    (tmp_path / "done").write_text("")
    assert sup.wait(30) == 0, sup.stderr_text()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 143)])
def test_no_standby_outlives_its_supervisor(procs, tmp_path: Path, strays, sig: int, code: int) -> None:
    """SIGKILL (the kernel and the lifeline) or SIGTERM (a graceful stop) to the
    supervisor: its ranks and its standbys, ready or still importing, are all gone."""
    sup = _start(tmp_path, procs)
    ranks0 = [r["pid"] for r in _started(tmp_path, 0, sup)]
    standbys = list(wait_until(lambda: (lambda s: s if len(s) == 2 else None)(_standbys(sup, ranks0)), timeout=30,
                               what="two standbys"))
    strays.extend([*ranks0, *standbys])
    sup.kill(sig)
    assert sup.wait(30) == code, sup.stderr_text()[-3000:]
    wait_until(lambda: not [p for p in [*ranks0, *standbys] if pid_alive(p)], timeout=15,
               what="every rank and standby to die")


@pytest.mark.slow
def test_killed_hung_and_stopped_ranks_come_back_from_their_standbys(procs, lighthouse, tmp_path: Path,
                                                                    strays) -> None:
    """Two Manager-trained groups under ``rallypoint run``, group 1 with ``--hang-timeout
    3`` and its standbys (the default). Three failures of its rank 1, one after the other,
    each once the group's standbys are ready (they start after its first commits):

    1. SIGKILL: both ranks of incarnation 1 are the standbys (torch imported), which heal
       from group 0 and train on.
    2. It sleeps forever in its training loop: the watchdog dumps the stacks and restarts
       the group from its new standbys (incarnation 2).
    3. SIGSTOP: the watchdog restarts the group again (incarnation 3); the stopped rank
       cannot dump its stacks or act on SIGTERM and is not waited for, and no rank of
       incarnation 2 is left, stopped or otherwise.

    Both groups finish alike. Prints each failure -> first participating commit time (the
    goal for a hang: within the timeout + 1 s)."""
    sups = two_training_groups(procs, lighthouse, tmp_path, ("--hang-timeout", str(HANG_TIMEOUT)), steps=10_000)
    pids = [at_step_2(tmp_path, r)["pid"] for r in range(2)]
    standbys = _ready_standbys(sups[1], pids)
    strays.extend([*pids, *standbys])
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)
    first = first_commits(tmp_path, 1)
    assert sorted(f["pid"] for f in first) == standbys
    (kill,) = events(sups[1], "restart")
    assert (kill["rank"], kill["signal"], kill["warm_ranks"], kill["progress"]) == (1, "SIGKILL", [0, 1], True), kill
    facts = {"kill": {"restart_s": kill["restart_s"],
                      "kill_to_first_commit_s": round(max(f["t"] for f in first) - killed, 3)}}

    pids = [f["pid"] for f in first]
    standbys = _ready_standbys(sups[1], pids)
    strays.extend(standbys)
    (tmp_path / "hang.g1.r1").write_text("")
    hanging = wait_until(lambda: read_json(tmp_path / "hanging.g1.r1"), timeout=30, what="rank 1 to hang")
    assert hanging["inc"] == 1
    first = first_commits(tmp_path, 2)
    assert sorted(f["pid"] for f in first) == standbys
    _, hang = events(sups[1], "restart")
    assert hang["incarnation"] == 2, hang
    facts["hang"] = hang_restart_facts(hang, sups[1], tmp_path, hanging["t"], cold=False)
    dump = [line for line in sups[1].stderr_text().splitlines() if line.startswith("[g1 r1] ")]
    assert any("in hang_here" in line for line in dump), "\n".join(dump[-60:])

    pids = [f["pid"] for f in first]
    standbys = _ready_standbys(sups[1], pids)
    strays.extend(standbys)
    stopped = time.time()
    os.kill(pids[1], signal.SIGSTOP)
    first = first_commits(tmp_path, 3)
    assert sorted(f["pid"] for f in first) == standbys
    final = both_groups_finish_alike(tmp_path, sups, steps=end_soon(tmp_path), inc=3)
    assert {final[(1, r)]["pid"] for r in range(2)} == set(standbys)
    _, _, stop = events(sups[1], "restart")
    assert stop["incarnation"] == 3, stop
    facts["sigstop"] = hang_restart_facts(stop, sups[1], tmp_path, stopped, cold=False)
    assert not [p for p in pids if pid_alive(p)]
    print("warm restarts:", json.dumps(facts))
