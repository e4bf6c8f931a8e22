"""The examples run as a user would run them (public API only, no torchrun needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_train_ddp_runs_without_torchrun(lighthouse, tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="1")
    progress = tmp_path / "progress.jsonl"
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--steps", "5", "--progress", str(progress),
         "--max-seconds", "60"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "stopped at step 5" in p.stdout, p.stdout
    rows = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    assert rows and rows[-1]["step"] == 5, rows[-3:]
