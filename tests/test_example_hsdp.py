"""examples/train_hsdp.py as a user runs it: two replica groups, each one ``rallypoint run
--nproc-per-node 2`` (followed through ``examples/demo/instrumented.py``). Rank r of both
groups ends holding the same shard; one group healed from the other at the start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "REPLICA_GROUP_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def run_job(lh: Any, tmp_path: Path, name: str, steps: int, *extra: str,
            outs: dict[int, str] | None = None) -> dict[tuple[int, int], list[dict]]:
    """Both groups of ``train_hsdp.py`` until ``steps``; each rank's progress rows (and
    each group's output in ``outs``)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("RALLYPOINT_CHECKPOINT")}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), NUM_REPLICA_GROUPS="2", PYTHONUNBUFFERED="1")
    progress = tmp_path / f"{name}.g{{group}}.r{{rank}}.jsonl"
    procs = {}
    try:
        for g in (0, 1):
            procs[g] = subprocess.Popen(
                [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", "--replica-group-id", str(g),
                 "--max-restarts", "0", str(REPO / "examples" / "demo" / "instrumented.py"),
                 "--progress", str(progress), "--max-seconds", "90",
                 str(REPO / "examples" / "train_hsdp.py"), "--steps", str(steps), "--min-replicas", "2", *extra],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        got = {g: p.communicate(timeout=150)[0] for g, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for g, p in procs.items():
        assert p.returncode == 0, got[g][-4000:]
        assert f"group {g}: stopped at step {steps}" in got[g], got[g][-4000:]
    if outs is not None:
        outs.update(got)
    return {(g, r): [json.loads(line) for line in (tmp_path / f"{name}.g{g}.r{r}.jsonl").read_text().splitlines()]
            for g in (0, 1) for r in (0, 1)}


def test_train_hsdp_two_groups_of_two_ranks(lighthouse, tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    rows = run_job(lh, tmp_path, "run", 5)
    exits = {gr: [row for row in r if row["event"] == "exit"][-1] for gr, r in rows.items()}
    assert all(e["step"] == 5 and e["rc"] == 0 for e in exits.values()), exits
    for r in (0, 1):  # rank r of both groups holds the same shard
        assert exits[(0, r)]["sha256"] == exits[(1, r)]["sha256"], exits
    assert exits[(0, 0)]["sha256"] != exits[(0, 1)]["sha256"]
    # init_sync: one group healed from the other at step 0, on every rank.
    assert sorted(exits[(g, 0)]["heals"] + exits[(g, 1)]["heals"] for g in (0, 1)) == [0, 2], exits


def test_train_hsdp_checkpoints_and_a_new_job_resumes_from_it(lighthouse, tmp_path: Path) -> None:
    """``--checkpoint-dir DIR --checkpoint-every 2``: the job writes step 4 (every rank its
    shards); the whole job stops; a new job (a new lighthouse too) resumes at step 4 on
    every rank, both groups from the checkpoint (no peer heal), AdamW's moments included,
    and trains on to step 7."""
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    first = run_job(lighthouse(min_replicas=2, join_timeout_ms=5000), tmp_path, "first", 5, *flags)
    marker = json.loads((ckpt / "step_00000004" / ".rallypoint-complete").read_text())
    assert marker["writers"] == 4, marker  # 2 groups x 2 ranks
    model_bytes = max(row["heal"]["bytes"] for r in first.values() for row in r if "heal" in row)
    at4 = {gr: [row for row in r if row["event"] == "step" and row["step"] == 4][-1]["sha256"]
           for gr, r in first.items()}
    outs: dict[int, str] = {}
    second = run_job(lighthouse(min_replicas=2, join_timeout_ms=5000), tmp_path, "second", 7, *flags, outs=outs)
    for gr, r in second.items():
        steps = [row for row in r if row["event"] == "step"]
        assert steps and steps[0]["step"] == 5, (gr, [x["step"] for x in steps])  # resumed at 4
        assert steps[0]["sha256"] != at4[gr]  # and trained on from there
        exit_row = [row for row in r if row["event"] == "exit"][-1]
        assert exit_row["step"] == 7 and exit_row["heals"] == 1, exit_row
        # The one load is the restore (no transfer from a peer), and it brought AdamW's two
        # moments with the model: three times the bytes of the first job's step-0 heal (the
        # model alone: an optimizer with no state yet).
        load = steps[0]["heal"]
        assert load["transfer_s"] is None and load["bytes"] >= 3 * model_bytes, (load, model_bytes)
    for r in (0, 1):  # rank r of both groups restored the same shard and trained on in step
        assert [x["sha256"] for x in second[(0, r)] if x["event"] == "step"] == \
            [x["sha256"] for x in second[(1, r)] if x["event"] == "step"]
    for g, text in outs.items():  # every key came back (AdamW's moments into an optimizer with no state yet)
        assert "not restored" not in text and "skipping checkpoint" not in text, text[-4000:]
