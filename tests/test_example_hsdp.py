"""examples/train_hsdp.py as a user runs it: two replica groups, each one ``rallypoint run
--nproc-per-node 2`` (followed through ``examples/demo/instrumented.py``). Rank r of both
groups ends holding the same shard; one group healed from the other at the start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "REPLICA_GROUP_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def test_train_hsdp_two_groups_of_two_ranks(lighthouse, tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), NUM_REPLICA_GROUPS="2", PYTHONUNBUFFERED="1")
    progress = tmp_path / "g{group}.r{rank}.jsonl"
    procs = {}
    try:
        for g in (0, 1):
            procs[g] = subprocess.Popen(
                [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", "--replica-group-id", str(g),
                 "--max-restarts", "0", str(REPO / "examples" / "demo" / "instrumented.py"),
                 "--progress", str(progress), "--max-seconds", "90",
                 str(REPO / "examples" / "train_hsdp.py"), "--steps", "5", "--min-replicas", "2"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        outs = {g: p.communicate(timeout=150)[0] for g, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for g, p in procs.items():
        assert p.returncode == 0, outs[g][-4000:]
        assert f"group {g}: stopped at step 5" in outs[g], outs[g][-4000:]
    exits = {}
    for g in (0, 1):
        for r in (0, 1):
            rows = [json.loads(line) for line in (tmp_path / f"g{g}.r{r}.jsonl").read_text().splitlines()]
            exits[(g, r)] = [row for row in rows if row["event"] == "exit"][-1]
    assert all(e["step"] == 5 and e["rc"] == 0 for e in exits.values()), exits
    for r in (0, 1):  # rank r of both groups holds the same shard
        assert exits[(0, r)]["sha256"] == exits[(1, r)]["sha256"], exits
    assert exits[(0, 0)]["sha256"] != exits[(0, 1)]["sha256"]
    # init_sync: one group healed from the other at step 0, on every rank.
    assert sorted(exits[(g, 0)]["heals"] + exits[(g, 1)]["heals"] for g in (0, 1)) == [0, 2], exits
