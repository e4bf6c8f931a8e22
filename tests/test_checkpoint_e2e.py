"""Durable checkpoints end to end: real replica groups (``checkpoint_worker.py``) and a
real lighthouse process, every one of them SIGKILLed, then started again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

from conftest import wait_until

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"
GROUPS = ("g0", "g1", "g2")


def lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def last_step(path: Path) -> int:
    steps = [x["step"] for x in lines(path) if "step" in x]
    return max(steps, default=-1)


def start_groups(procs: Callable[..., Any], lh: str, tmp: Path, run: int, pause_at: int, stop_at: int,
                 env: dict[str, str], extra_env: dict[str, dict[str, str]] | None = None) -> list[Any]:
    out = []
    for g in GROUPS:
        e = {**env, **((extra_env or {}).get(g, {}))}
        out.append(procs([str(WORKER), lh, g, str(tmp / f"{g}.{run}.jsonl"), str(pause_at), str(stop_at)],
                         name=f"{g}.{run}", env=e))
    return out


def logs(tmp: Path) -> str:
    return "\n".join(f"=== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.stderr")))


def test_whole_job_killed_resumes_at_last_complete_checkpoint(tmp_path: Path, procs, cli_lighthouse) -> None:
    """3 groups, every=20; SIGKILL every process (the lighthouse too) after step 70; start
    again: every group resumes at 60 with exactly the parameters it committed at 60."""
    ckpt = tmp_path / "ckpt"
    env = {"RALLYPOINT_CHECKPOINT_DIR": str(ckpt), "RALLYPOINT_CHECKPOINT_EVERY": "20",
           "RALLYPOINT_CHECKPOINT_KEEP": "2"}
    lh = cli_lighthouse(min_replicas=3, name="lh1")
    first = start_groups(procs, lh.address, tmp_path, 1, pause_at=72, stop_at=10**6, env=env)
    def at_72() -> bool:
        assert all(p.popen.poll() is None for p in first), logs(tmp_path)
        return all(last_step(tmp_path / f"{g}.1.jsonl") >= 72 for g in GROUPS)

    wait_until(at_72, timeout=180,
               what=f"3 groups at step 72\n{logs(tmp_path)}")
    wait_until(lambda: (ckpt / "step_00000060" / ".rallypoint-complete").exists(), timeout=30,
               what=f"checkpoint 60 complete\n{logs(tmp_path)}")
    for p in [*first, lh.proc]:
        p.kill(signal.SIGKILL)
    for p in [*first, lh.proc]:
        p.wait(10)
    committed_60 = {g: next(x["hash"] for x in lines(tmp_path / f"{g}.1.jsonl") if x.get("step") == 60)
                    for g in GROUPS}
    assert len(set(committed_60.values())) == 1, committed_60
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000040", "step_00000060"]  # keep=2

    lh2 = cli_lighthouse(min_replicas=3, name="lh2")
    second = start_groups(procs, lh2.address, tmp_path, 2, pause_at=10**6, stop_at=64, env=env)
    for p in second:
        assert p.wait(180) == 0, logs(tmp_path)
    for g in GROUPS:
        rec = lines(tmp_path / f"{g}.2.jsonl")
        assert rec[0] == {"resume": 60, "hash": committed_60[g]}, (g, rec[:3])
        assert [x["step"] for x in rec[1:]] == [61, 62, 63, 64], (g, rec)
    ends = {lines(tmp_path / f"{g}.2.jsonl")[-1]["hash"] for g in GROUPS}
    assert len(ends) == 1, ends

    # A plain script, without rallypoint, reads it with torch.distributed.checkpoint.
    script = textwrap.dedent(f"""
        import hashlib, sys, torch, torch.distributed.checkpoint as dcp
        from torch import nn
        assert "rallypoint" not in sys.modules
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        sd = {{"user": {{"default": {{"model": model.state_dict()}}}}}}
        dcp.load(sd, checkpoint_id={str(ckpt / "step_00000060")!r}, no_dist=True)
        model.load_state_dict(sd["user"]["default"]["model"])
        assert "rallypoint" not in sys.modules
        print(hashlib.sha256(repr([p.detach().flatten().tolist() for p in model.parameters()]).encode()).hexdigest()[:16])
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == committed_60["g0"]


def test_group_killed_mid_share_leaves_step_incomplete(tmp_path: Path, procs, cli_lighthouse) -> None:
    """g2 is SIGKILLed after writing its share's data at step 10, before its done-marker:
    step 10 is never marked complete; the survivors' step 20 is."""
    ckpt = tmp_path / "ckpt"
    go = tmp_path / "go"  # every group in the quorum from step 0 on, so g2 writes a share of step 10
    env = {"RALLYPOINT_CHECKPOINT_DIR": str(ckpt), "RALLYPOINT_CHECKPOINT_EVERY": "10",
           "RALLYPOINT_CHECKPOINT_KEEP": "0", "RALLYPOINT_CHECKPOINT_COMMIT_TIMEOUT_SEC": "3",
           "CHECKPOINT_TEST_GO": str(go)}
    lh = cli_lighthouse(min_replicas=2, extra=["--join-timeout-ms", "20000"], name="lh")
    groups = start_groups(procs, lh.address, tmp_path, 1, pause_at=10**6, stop_at=22, env=env,
                          extra_env={"g2": {"RALLYPOINT_CHECKPOINT_TEST_DIE": "share:10",
                                                "RALLYPOINT_ALLOW_INJECT": "1"}})
    wait_until(lambda: all((tmp_path / f"{g}.1.jsonl.ready").exists() for g in GROUPS), timeout=120,
               what=f"3 groups up\n{logs(tmp_path)}")
    go.touch()
    assert groups[2].wait(120) == -signal.SIGKILL, logs(tmp_path)
    s10, s20 = ckpt / "step_00000010", ckpt / "step_00000020"
    # Right after the kill (writer 0 waits 3 s for the missing share): g2's data landed,
    # its done-marker did not, and nothing marks the step complete.
    names = {p.name for p in s10.iterdir()}
    assert any(n.endswith("_2_0.distcp") for n in names), names
    assert not any(n.endswith("-2.metadata") for n in names), names
    for p in groups[:2]:
        assert p.wait(180) == 0, logs(tmp_path)
    g0 = (tmp_path / "g0.1.stderr").read_text()
    assert "step 10 stays incomplete: 1 of 3 shares did not land" in g0
    assert "checkpoint step 10 complete" not in g0
    marker = json.loads((s20 / ".rallypoint-complete").read_text())
    assert marker["step"] == 20 and marker["writers"] == 2, marker
    assert not s10.exists()  # an incomplete step older than a complete one is pruned


def test_train_ddp_under_rallypoint_run_resumes_from_its_checkpoint(tmp_path: Path, lighthouse) -> None:
    """``rallypoint run --checkpoint-dir DIR --checkpoint-every 5 examples/train_ddp.py``: the
    group's two ranks write a share each; run again, it resumes at the last complete step."""
    import os

    repo = Path(__file__).resolve().parent.parent
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    clean = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "REPLICA_GROUP_ID",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "RALLYPOINT_CHECKPOINT_DIR")
    env = {k: v for k, v in os.environ.items() if k not in clean}
    env.update(RALLYPOINT_LIGHTHOUSE=lh.address(), NUM_REPLICA_GROUPS="1")
    ckpt = tmp_path / "ckpt"

    def run(steps: int) -> str:
        p = subprocess.run(
            [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", "--replica-group-id", "0",
             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", str(repo / "examples" / "train_ddp.py"),
             "--steps", str(steps), "--log-level", "INFO"],
            env=env, capture_output=True, text=True, timeout=150, cwd=repo)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-6000:]
        assert f"group 0: stopped at step {steps}" in out, out[-6000:]
        return out

    first = run(12)
    marker = json.loads((ckpt / "step_00000010" / ".rallypoint-complete").read_text())
    assert marker["writers"] == 2, marker  # one group of two ranks: two shares
    assert "restored checkpoint" not in first
    second = run(16)
    assert "restored checkpoint step 10" in second, second[-6000:]
    assert (ckpt / "step_00000015" / ".rallypoint-complete").exists()
