"""``make demo`` as a user runs it: ``examples/demo_training.py``, each replica group one
``rallypoint run``; one rank is SIGKILLed and the supervisor brings its group back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 240


def _running(pid: int) -> bool:
    """A live (not zombie) process of ours with that pid; a reused pid running something
    else does not count."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != b"Z" and (b"rallypoint" in cmdline or b"train_ddp" in cmdline)


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 90)
def test_demo_kill_a_rank_and_rallypoint_run_restarts_the_group() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "RANK", "WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.Popen([sys.executable, str(REPO / "examples" / "demo_training.py"), "--ranks", "1,1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                         env=env, cwd=REPO)
    try:
        out, _ = p.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()  # the demo stops everything it started on SIGTERM
        out, _ = p.communicate(timeout=60)
        pytest.fail(f"the demo took over {DEMO_TIMEOUT_S}s:\n{out[-6000:]}")
    assert p.returncode == 0, out[-6000:]
    assert "replicas identical: yes" in out, out[-4000:]
    # The kill is one rank; the restart is rallypoint run's, from its own restart event.
    assert re.search(r"SIGKILL rank 0 of group 1 \(pid \d+, incarnation 0\)", out), out[-4000:]
    assert re.search(r"rallypoint run of group 1 starts the group again as incarnation 1.*restart event "
                     r"cause='signal SIGKILL', rank 0", out), out[-4000:]
    assert "restarts by rallypoint run: 1;" in out, out[-4000:]
    assert "exit codes of rallypoint run: group 0: 0, group 1: 0" in out, out[-4000:]
    for what in ("survivors commit step", "its manager is ready", "from a live peer", "first commit in the full quorum"):
        assert what in out, (what, out[-4000:])
    # Nothing left behind: the lighthouse, both supervisors, their store hosts and every rank.
    m = re.search(r"processes: (\d+) started, 0 left behind \(pids ([\d ]+)\)", out)
    assert m, out[-2000:]
    pids = [int(x) for x in m.group(2).split()]
    assert len(pids) == int(m.group(1)) >= 8, m.group(0)  # lighthouse, 2 supervisors, 2 stores, 3 ranks (or more)
    assert not [pid for pid in pids if _running(pid)], m.group(0)
