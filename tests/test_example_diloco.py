"""examples/train_diloco.py as a user runs it (followed through
``examples/demo/instrumented.py --per-sync``): a lighthouse and two replica groups
(plain ``python``, no torchrun) training with Streaming DiLoCo, a delayed and
int8-quantized exchange and local mixing; both must finish every inner step having
committed the same syncs and holding bit-identical global parameters, while their
local parameters differ (they trained on different data shards)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_diloco.py"
INSTRUMENTED = REPO / "examples" / "demo" / "instrumented.py"


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_replica_groups_agree_on_global_parameters(lighthouse: Any, procs: Any, tmp_path: Path) -> None:
    steps, sync_every, fragments = 24, 4, 2
    lh = lighthouse(min_replicas=2, join_timeout_ms=30_000)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), NUM_REPLICA_GROUPS="2", PYTHONPATH=str(REPO))
    progress = [tmp_path / f"progress{g}.jsonl" for g in range(2)]
    children = [
        procs([str(INSTRUMENTED), "--per-sync", "--max-seconds", "100", "--progress", str(progress[g]),
               str(EXAMPLE), "--steps", str(steps), "--sync-every", str(sync_every), "--fragments", str(fragments),
               "--fragment-sync-delay", "1", "--alpha", "0.5", "--quantize", "--min-replicas", "2",
               "--timeout", "20"],
              name=f"diloco{g}", env=dict(env, REPLICA_GROUP_ID=str(g)))
        for g in range(2)
    ]
    deadline = time.monotonic() + 150
    for c in children:
        rc = c.wait(max(1.0, deadline - time.monotonic()))
        assert rc == 0, f"{c.name} rc={rc}; stderr:\n{c.stderr_text()[-3000:]}"
    rows = [read_rows(p) for p in progress]
    exits = [[r for r in rs if r["event"] == "exit"] for rs in rows]
    assert all(len(e) == 1 for e in exits), rows
    e0, e1 = exits[0][0], exits[1][0]
    expected_syncs = steps // (sync_every // fragments)
    for e in (e0, e1):
        assert e["rc"] == 0 and e["inner_step"] == steps, e
        assert e["syncs"] == expected_syncs, e
        assert e["participants"] == 2, e
    assert e0["step"] == e1["step"]
    assert e0["global_sha256"] == e1["global_sha256"], "replica groups disagree on the global parameters"
    assert e0["sha256"] != e1["sha256"], "local parameters identical: the groups did not train apart"
    # every committed sync: the same global parameters on both groups at the same manager step
    syncs = [{r["step"]: r["global_sha256"] for r in rs if r["event"] == "sync"} for rs in rows]
    assert syncs[0] == syncs[1]
    assert len(set(syncs[0].values())) == expected_syncs  # the global parameters moved at every sync
    for c in children:
        out = "\n".join(c.rest_of_stdout())
        assert f"{steps} inner steps, manager step {e0['step']}" in out, out

