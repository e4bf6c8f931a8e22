"""Sharded state (DTensors, as FSDP2/HSDP hold it): 2 groups x 2 ranks, each rank writes
its own shard of its group's keys (Adam's moments included, restored into an optimizer
that has no state yet); DCP's plain ``dcp.load`` reads the whole tensors, and
each rank restores its own shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp



def test_sharded_state_written_by_every_rank_and_restored(tmp_path: Path) -> None:
    worker = Path(__file__).resolve().parent / "checkpoint_dtensor_worker.py"
    rendezvous = tmp_path / "rendezvous"  # a file: no port to pick
    ckpt = tmp_path / "ckpt"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(rendezvous), str(ckpt)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(4)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(o["equal"] and o["step"] == 2 for o in outs), outs
    # Adam had no state in the fresh job (before its first step): its moments came back anyway.
    assert all(o["moments"] for o in outs), outs
    assert all(o["bytes"] > 0 for o in outs), outs  # every rank wrote a part
    marker = json.loads((ckpt / "step_00000002" / ".rallypoint-complete").read_text())
    assert marker["writers"] == 4
    g = torch.Generator().manual_seed(0)
    w, v = torch.randn(8, 4, generator=g), torch.randn(6, generator=g)
    sd = {"user": {"default": {"w": torch.zeros(8, 4), "v": torch.zeros(6), "bias": torch.zeros(6)}}}
    dcp.load(sd, checkpoint_id=str(ckpt / "step_00000002"), no_dist=True)
    got = sd["user"]["default"]
    assert torch.equal(got["w"], w) and torch.equal(got["v"], v) and torch.equal(got["bias"], v * 2)
