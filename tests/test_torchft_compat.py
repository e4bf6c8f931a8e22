"""``import rallypoint as torchft``: torchft 0.2's README training loop runs unchanged
(with the arguments torchft itself requires: ``min_replica_size``, and real state
callbacks), configured only by torchft's environment variables."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn, optim

    import rallypoint as torchft
    from rallypoint import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    device = "cpu"
    m = nn.Linear(2, 3)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=lambda sd: m.load_state_dict(sd),
        state_dict=lambda: m.state_dict(),
        min_replica_size=1,
    )
    m = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, optim.AdamW(m.parameters()))

    for i in range(5):
        batch = torch.rand(2, 2, device=device)
        optimizer.zero_grad()
        out = m(batch)
        loss = out.sum()
        loss.backward()
        optimizer.step()

    print("steps", manager.current_step(), "participants", manager.num_participants())
    manager.shutdown()
    """
)


def test_torchft_readme_loop_runs_on_rallypoint(lighthouse, tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    env = {k: v for k, v in os.environ.items() if k not in ("RALLYPOINT_LIGHTHOUSE", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(TORCHFT_LIGHTHOUSE=lh.address(), REPLICA_GROUP_ID="readme", MASTER_ADDR="127.0.0.1")
    script = tmp_path / "readme_loop.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "steps 5 participants 1" in p.stdout, p.stdout + p.stderr[-4000:]
