"""The examples run as a user runs them (public API only): ``examples/train_ddp.py`` under
``rallypoint run`` and with plain ``python``; and under ``examples/demo/instrumented.py``,
which the demo and the tests use to follow a run."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ALLOWED = {"__future__", "argparse", "collections", "datetime", "logging", "os", "time", "typing", "torch",
           "rallypoint"}
CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "REPLICA_GROUP_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def _env(lh: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), NUM_REPLICA_GROUPS="1", **extra)
    return env


def _load_instrumented() -> Any:
    spec = importlib.util.spec_from_file_location("instrumented_for_test", EXAMPLES / "demo" / "instrumented.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_examples_import_nothing_from_the_examples_folder() -> None:
    for name in ("train_ddp.py", "train_hsdp.py", "train_diloco.py"):
        text = (EXAMPLES / name).read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module and node.module.split(".")[0] in ALLOWED, (name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in ALLOWED for a in node.names), (name, [a.name for a in node.names])
        assert len(text.splitlines()) <= 160, (name, len(text.splitlines()))
    assert not (EXAMPLES / "_common.py").exists()


def test_progress_path_placeholders() -> None:
    expand = _load_instrumented().expand_placeholders
    env = {"RANK": "1", "REPLICA_GROUP_ID": "2", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert expand("/d/g{group}.r{rank}.i{restart}.jsonl", env) == "/d/g2.r1.i3.jsonl"
    assert expand("/d/p.{rank}.{rank}", {}) == "/d/p.0.0"  # unset: 0, every occurrence
    assert expand("/d/plain.jsonl", env) == "/d/plain.jsonl"  # no placeholder: as it was
    assert expand("/d/{other}{}.jsonl", env) == "/d/{other}{}.jsonl"  # other braces kept


def test_train_ddp_under_rallypoint_run(lighthouse) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    p = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", "--replica-group-id", "0",
         str(EXAMPLES / "train_ddp.py"), "--steps", "5"],
        env=_env(lh), capture_output=True, text=True, timeout=150, cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "group 0: stopped at step 5" in p.stdout + p.stderr, p.stdout + p.stderr[-4000:]


def test_train_ddp_instrumented_with_plain_python(lighthouse, tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    progress = tmp_path / "progress.jsonl"
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo" / "instrumented.py"), "--progress", str(progress),
         "--max-seconds", "60", str(EXAMPLES / "train_ddp.py"), "--steps", "5"],
        env=_env(lh, REPLICA_GROUP_ID="0"), capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "stopped at step 5" in p.stdout, p.stdout
    rows = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    assert [r["event"] for r in rows] == ["ready"] + ["step"] * 5 + ["exit"], rows
    assert [r["step"] for r in rows if r["event"] == "step"] == [1, 2, 3, 4, 5]
    assert all(r["committed"] for r in rows if r["event"] == "step")
    assert rows[-1]["rc"] == 0 and rows[-1]["sha256"] == rows[-2]["sha256"] != rows[0]["sha256"]
