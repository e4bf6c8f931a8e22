"""Shared by the ``rallypoint run`` tests: process helpers (is a pid alive, its children,
the ``strays`` fixture that kills by pid what the code under test failed to stop), how a
test starts a supervised group and reads its events, and the Manager-trained script."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from conftest import Proc, wait_until
from rallypoint.supervisor.envs import PROGRESS_ENV

def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Strays(list):
    """Pids a test saw (ranks, their children, store hosts), with their start times."""

    def append(self, pid: int) -> None:  # type: ignore[override]
        super().append((pid, _start_time(pid)))

    def extend(self, pids) -> None:  # type: ignore[override]
        for pid in pids:
            self.append(pid)


@pytest.fixture
def strays():
    """SIGKILLs at teardown, by pid, what the code under test failed to stop (only a
    process with the same start time: a pid may have been reused since)."""
    seen = Strays()
    yield seen
    for pid, started in seen:
        if started is not None and _start_time(pid) == started and pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", PROGRESS_ENV)}
    return {**env, **extra}


def run_group(procs, *args: str, name: str, env: dict[str, str] | None = None) -> Proc:
    return procs(["-m", "rallypoint", "run", *args], name=name, env=env or _env())


def events(proc: Proc, kind: str) -> list[dict]:
    out = []
    for line in proc.stderr_text().splitlines():
        if f'"event": "{kind}"' in line:
            out.append(json.loads(line[line.index("{"):]))
    return out


TRAIN = textwrap.dedent(
    """
    import json, logging, os, sys, time
    started = time.time()  # this process's start, before the heavy imports
    from datetime import timedelta
    import torch
    from torch import nn
    import rallypoint as torchft

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    out, steps = sys.argv[1], int(sys.argv[2])
    gid, rank = os.environ["REPLICA_GROUP_ID"], int(os.environ["RANK"])
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(100 * int(gid) + 10 * rank + inc)  # every start differs: the heal must copy
    model = nn.Linear(3, 1)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
                              load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                              hostname="127.0.0.1", timeout=timedelta(seconds=20),
                              quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=20))
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))

    def save(name, **kw):
        path = os.path.join(out, f"{name}.g{gid}.r{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "inc": inc, "step": manager.current_step(), **kw}, f)
        os.replace(path + ".tmp", path)

    def hang_here():
        save("hanging", t=time.time())
        time.sleep(10**6)

    def last_step():  # the test may move the end (a file "steps"): a value ahead of every rank
        try:
            with open(os.path.join(out, "steps")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return steps

    marker, first = os.path.join(out, f"hang.g{gid}.r{rank}"), True
    while manager.current_step() < last_step():
        try:
            os.rename(marker, marker + ".taken")  # once: the next incarnation does not hang again
            hang_here()
        except FileNotFoundError:
            pass
        optimizer.zero_grad()
        ddp(torch.ones(4, 3) * (rank + 1)).sum().backward()
        committed = optimizer.step()  # rallypoint's wrapper says whether the step committed
        save("state")
        if first and committed:
            save(f"first{inc}", started=started, t=time.time())  # the first commit of this start
            first = False
        time.sleep(0.05)
    save("final", w=model.weight.tolist(), b=model.bias.tolist())
    manager.shutdown()
    """
)


TRAIN_STEPS = 12


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def two_training_groups(procs, lighthouse, tmp_path: Path, group1_args: tuple[str, ...] = (),
                        steps: int = TRAIN_STEPS) -> list[Proc]:
    """Two replica groups of two ranks training TRAIN with a Manager each (min 2 replicas);
    ``group1_args``: more flags for group 1's ``rallypoint run``. Group 0 never restarts in
    these tests, so it keeps no warm standbys: each one imports torch and torch._dynamo
    (about 5 s of CPU here), which on a 2-core machine only slows the group under test."""
    lh = lighthouse(min_replicas=2, join_timeout_ms=10_000)
    (tmp_path / "train.py").write_text(TRAIN)
    env = _env(RALLYPOINT_LIGHTHOUSE=lh.address())
    return [run_group(procs, "--nproc-per-node", "2", "--replica-group-id", str(g), "--restart-backoff", "0.1",
                      "--grace-period", "5", *(group1_args if g == 1 else ("--no-standby",)), str(tmp_path / "train.py"),
                      str(tmp_path), str(steps), name=f"group{g}", env=env) for g in range(2)]


def at_step_2(tmp_path: Path, rank: int) -> dict:
    """Group 1 ``rank``'s state once it committed step 2 (well before the end)."""
    def reached() -> dict | None:
        s = read_json(tmp_path / f"state.g1.r{rank}")
        return s if s is not None and s["step"] >= 2 else None

    state = wait_until(reached, timeout=60, what=f"group 1 rank {rank} to commit step 2")
    assert state["step"] < TRAIN_STEPS - 2, "trained too fast to hit it mid-way"
    return state


def both_groups_finish_alike(tmp_path: Path, sups: list[Proc], steps: int = TRAIN_STEPS, inc: int = 1) -> dict:
    """Both supervisors exit 0; every rank ends at the last step, group 1's in incarnation
    ``inc`` (restarted that many times), group 0's in incarnation 0, with identical
    weights across groups."""
    for s in sups:
        assert s.wait(90) == 0, s.stderr_text()[-5000:]
    final = {(g, r): json.loads((tmp_path / f"final.g{g}.r{r}").read_text()) for g in range(2) for r in range(2)}
    assert {f["step"] for f in final.values()} == {steps}
    assert [final[(1, r)]["inc"] for r in range(2)] == [inc, inc] and [final[(0, r)]["inc"] for r in range(2)] == [0, 0]
    for r in range(2):
        assert (final[(0, r)]["w"], final[(0, r)]["b"]) == (final[(1, r)]["w"], final[(1, r)]["b"])
    assert events(sups[0], "restart") == []
    return final


def first_commits(tmp_path: Path, inc: int, timeout: float = 60) -> list[dict]:
    """The first commit of each rank of group 1's incarnation ``inc`` (pid, time), once
    both made one: the restarted group healed and trains."""
    def both() -> list[dict] | None:
        recs = [read_json(tmp_path / f"first{inc}.g1.r{r}") for r in range(2)]
        return recs if all(recs) else None  # type: ignore[return-value]

    return wait_until(both, timeout=timeout, what=f"group 1's incarnation {inc} to commit")  # type: ignore[no-any-return]


def end_soon(tmp_path: Path) -> int:
    """Moves the end of a run started with ``steps=10_000`` to a few steps past every
    rank's current step (they read the file each step); returns that last step."""
    steps = max(read_json(tmp_path / f"state.g{g}.r{r}")["step"] for g in range(2) for r in range(2)) + 6  # type: ignore[index]
    (tmp_path / "steps").write_text(str(steps))
    return steps


#: The watchdog's timeout in the hang tests.
HANG_TIMEOUT = 3.0


def hang_restart_facts(restart: dict, sup: Proc, tmp_path: Path, hung_at: float, cold: bool) -> dict:
    """The checks common to a hung and a stopped rank of group 1 (``restart``: its restart
    event; ``hung_at``: when its progress stopped, on this clock): cause ``hang``, naming
    a rank of the group silent for the timeout; the group was restarted within the
    timeout plus a few seconds and committed again. Returns the event plus the measured
    time to participate again."""
    inc = restart["incarnation"]
    assert (restart["cause"], restart["exit_code"], restart["signal"]) == ("hang", None, None), restart
    assert restart["rank"] in (0, 1) and restart["rank"] == restart["hung_ranks"][0], restart
    assert HANG_TIMEOUT <= restart["silent_s"] < HANG_TIMEOUT + 2 and restart["last_step"] >= 1, restart
    assert restart["progress"] is True
    assert restart["warm_ranks"] == ([] if cold else [0, 1]), restart
    err = sup.stderr_text()
    assert f"rank {restart['rank']} hung: no progress for" in err, err[-5000:]
    first = [json.loads((tmp_path / f"first{inc}.g1.r{r}").read_text()) for r in range(2)]
    # The supervisor's part: the hang seen after the timeout, the group back (its standbys
    # handed their go, or new processes) soon after. (A standby still importing when its
    # go comes starts the script later; the time to participate again is printed.)
    assert restart["silent_s"] + restart["restart_s"] < HANG_TIMEOUT + 3, restart
    participating = max(f["t"] for f in first) - hung_at
    return {**restart, "participating_after_s": round(participating, 2)}
