"""A torchft user replaces torchrun with ``rallypoint run`` and keeps torchft's Manager.

Two replica groups, each ``python -m rallypoint run --nproc-per-node 2`` around a script
that trains with ``torchft.Manager`` (torchft 0.2.0's own, as installed; the rallypoint
package never imports it) against rallypoint's lighthouse. torchft's Manager connects to
the group's store at ``MASTER_ADDR``/``MASTER_PORT`` (the supervisor hosts it), takes its
lighthouse from ``TORCHFT_LIGHTHOUSE`` (the supervisor sets it from ``--lighthouse``) and
its rank from ``RANK``/``WORLD_SIZE``. A rank of group 1 is SIGKILLed mid-training: its
supervisor restarts the group (from its standbys), which heals with torchft's own
checkpoint transport from group 0, and both groups end at the same step with identical
weights. torchft's Manager reports no committed steps to the supervisor, so the standbys
start on ``--standby-delay`` and a restart counts as progress only after
``--min-healthy-s``.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from conftest import wait_until
from supervisor_util import _env, events, read_json, run_group, strays  # noqa: F401 - strays is a fixture

pytest.importorskip("torchft")

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from datetime import timedelta
    import torch
    from torch import nn
    from torchft import Manager, Optimizer as OptimizerWrapper, ProcessGroupGloo

    logging.basicConfig(level=logging.WARNING)
    out = sys.argv[1]
    gid, rank = os.environ["REPLICA_GROUP_ID"], int(os.environ["RANK"])
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(100 * int(gid) + 10 * rank + inc)  # every start differs: the heal must copy
    model = nn.Linear(3, 1)
    t = timedelta(seconds=20)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=f"g{gid}", hostname="127.0.0.1", timeout=t, quorum_timeout=t, connect_timeout=t)
    optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))

    def save(name, **kw):
        path = os.path.join(out, f"{name}.g{gid}.r{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "inc": inc, "step": manager.current_step(), **kw}, f)
        os.replace(path + ".tmp", path)

    def last_step():
        try:
            with open(os.path.join(out, "steps")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return 10**6

    while manager.current_step() < last_step():
        optimizer.zero_grad()
        model(torch.ones(4, 3) * (rank + 1)).sum().backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        optimizer.step()
        save("state")
        time.sleep(0.05)
    save("final", w=model.weight.tolist(), b=model.bias.tolist())
    manager.shutdown()
    """
)


@pytest.mark.slow
def test_torchfts_manager_under_rallypoint_run_survives_a_killed_rank(procs, lighthouse, tmp_path: Path,
                                                                      strays) -> None:
    lh = lighthouse(min_replicas=2, join_timeout_ms=10_000)
    (tmp_path / "train_torchft.py").write_text(SCRIPT)
    env = _env()
    sups = [run_group(procs, "--nproc-per-node", "2", "--replica-group-id", str(g), "--lighthouse", lh.address(),
                      "--standby-delay", "0", "--grace-period", "5", *(() if g else ("--no-standby",)),
                      str(tmp_path / "train_torchft.py"),
                      str(tmp_path), name=f"tf{g}", env=env) for g in range(2)]

    def at(step: int, g: int, r: int):
        s = read_json(tmp_path / f"state.g{g}.r{r}")
        return s if s is not None and s["step"] >= step else None

    victim = wait_until(lambda: at(3, 1, 1), timeout=120, what="group 1 rank 1 at step 3")
    strays.append(victim["pid"])
    os.kill(victim["pid"], signal.SIGKILL)
    back = wait_until(lambda: (lambda s: s if s and s["inc"] == 1 and s["step"] > victim["step"] else None)(
        read_json(tmp_path / "state.g1.r1")), timeout=120, what="group 1 to commit again after its restart")
    steps = max(read_json(tmp_path / f"state.g{g}.r{r}")["step"] for g in range(2) for r in range(2)) + 5
    (tmp_path / "steps").write_text(str(steps))
    for s in sups:
        assert s.wait(120) == 0, s.stderr_text()[-5000:]
    final = {(g, r): json.loads((tmp_path / f"final.g{g}.r{r}").read_text()) for g in range(2) for r in range(2)}
    assert {f["step"] for f in final.values()} == {steps}
    assert [final[(1, r)]["inc"] for r in range(2)] == [1, 1] and back["inc"] == 1
    for r in range(2):
        assert (final[(0, r)]["w"], final[(0, r)]["b"]) == (final[(1, r)]["w"], final[(1, r)]["b"])
    (restart,) = events(sups[1], "restart")
    assert (restart["rank"], restart["signal"]) == (1, "SIGKILL"), restart
    assert events(sups[0], "restart") == []
