"""Durable checkpoints in one process: the pure plan (table tests), and G writers driven
by stand-in Managers (the same state and hooks as a Manager, no network) for the
layout, DCP compatibility, restore, pruning and the faults of issue 38."""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from rallypoint.checkpoint import DurableCheckpoint
from rallypoint.checkpoint.plan import first_mismatch, is_due, plan_share, prune, split_keys, writer_index
from rallypoint.manager._state import UserState

# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("sizes,writers,expected", [
    ({"a": 10, "b": 10, "c": 10}, 3, [["a"], ["b"], ["c"]]),
    ({"a": 100, "b": 60, "c": 50, "d": 10}, 2, [["a", "d"], ["b", "c"]]),
    ({"a": 5, "b": 5}, 1, [["a", "b"]]),
    ({"a": 1}, 3, [["a"], [], []]),
    ({"x": 7, "y": 7, "z": 7, "w": 7}, 2, [["w", "y"], ["x", "z"]]),  # ties: by name, lowest share
])
def test_split_keys_balances_bytes_deterministically(sizes: dict[str, int], writers: int,
                                                     expected: list[list[str]]) -> None:
    assert split_keys(sizes, writers) == expected
    assert split_keys(dict(reversed(list(sizes.items()))), writers) == expected  # order of the dict is irrelevant


def test_split_keys_each_key_once_and_close_to_even() -> None:
    sizes = {f"layer{i}.weight": 1000 + 7 * i for i in range(30)}
    for writers in (1, 2, 3, 6):
        shares = split_keys(sizes, writers)
        assert sorted(k for s in shares for k in s) == sorted(sizes)
        loads = [sum(sizes[k] for k in s) for s in shares]
        assert max(loads) - min(loads) <= max(sizes.values())


@pytest.mark.parametrize("step,every,last,due", [
    (0, 20, None, False), (20, 20, None, True), (20, 20, 20, False), (40, 20, 20, True), (21, 20, None, False),
    (5, 1, 4, True),
])
def test_is_due(step: int, every: int, last: int | None, due: bool) -> None:
    assert is_due(step, every, last) is due


def test_writer_index_and_plan_share() -> None:
    assert [writer_index(r, g, 2) for r in range(3) for g in range(2)] == [0, 1, 2, 3, 4, 5]
    sizes = {"a": 4, "b": 3, "c": 2, "d": 1}
    shares = [plan_share(10, sizes, r, 2, g, 2, "att") for r in range(2) for g in range(2)]
    assert [s.keys for s in shares] == [("a",), ("b",), ("c",), ("d",)]
    assert {s.writers for s in shares} == {4}
    with pytest.raises(ValueError):
        plan_share(10, sizes, 2, 2, 0, 1, "att")


@pytest.mark.parametrize("complete,incomplete,keep,delete", [
    ([60, 40, 20], [], 2, [20]),
    ([60, 40, 20], [], 0, []),
    ([60], [40, 80], 1, [40]),  # 80 may still be being written
    ([], [20], 1, []),  # nothing complete: nothing is deleted
])
def test_prune(complete: list[int], incomplete: list[int], keep: int, delete: list[int]) -> None:
    assert prune(complete, incomplete, keep) == delete


@pytest.mark.parametrize("template,saved,empty,why", [
    ({"a": (2,), "b": None}, {"a": (2,), "b": None}, set(), None),
    ({"a": (2,)}, {"a": (3,)}, set(), "key 'a' has shape (3,) in the checkpoint but (2,) here"),
    ({"a": (2,), "b": (1,)}, {"a": (2,)}, set(), "key 'b' is missing from the checkpoint"),
    ({"a": (2,)}, {"a": (2,), "z": (1,)}, set(), "key 'z' is in the checkpoint but not in this job's state"),
    ({"m.w": (2,)}, {"m.w": (2,), "o.state.0.buf": (2,)}, {"o.state"}, None),  # optimizer before its first step
])
def test_first_mismatch(template: dict, saved: dict, empty: set[str], why: str | None) -> None:
    assert first_mismatch(template, saved, empty) == why


# ----------------------------------------------------------------------------- stand-in managers


class FakeManager:
    """What DurableCheckpoint uses of a Manager: its registered state, counters, hooks and
    the last round's record (replica rank ``rr`` of ``ws`` groups)."""

    def __init__(self, rr: int, ws: int, width: int = 8, seed: int = 0, adam: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
        self.opt: torch.optim.Optimizer = (torch.optim.Adam(self.model.parameters(), lr=0.01) if adam else
                                           torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9))
        self.step_hooks: list[Any] = []
        self._user_state = UserState()
        self._user_state.register("default", self._load, self._save)
        self.step, self.rr, self.ws = 0, rr, ws
        self.replica_id, self.group_rank, self.group_world_size = f"g{rr}", 0, 1

    def _save(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def _load(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.step * self.ws}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])

    def current_step(self) -> int:
        return self.step

    def step_record(self) -> Any:
        if self.step == 0:
            return None  # no round finished yet
        return types.SimpleNamespace(outcome="committed", replica_rank=self.rr, replica_world_size=self.ws,
                                     quorum_id=1, participants=tuple(f"g{i}" for i in range(self.ws)))

    def train(self) -> None:
        g = torch.Generator().manual_seed(self.step)
        self.opt.zero_grad()
        self.model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
        self.opt.step()
        self.step += 1

    def boundary(self) -> None:  # what Manager.start_quorum does
        for h in self.step_hooks:
            h.at_boundary()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def run_job(path: Path | str, groups: int, steps: int, every: int = 2, keep: int = 0,
            **kw: Any) -> tuple[list[FakeManager], list[DurableCheckpoint]]:
    ms = [FakeManager(i, groups) for i in range(groups)]
    cks = [DurableCheckpoint(m, str(path), every=every, keep=keep, commit_timeout=kw.pop("commit_timeout", 10), **kw)
           for m in ms]
    for m in ms:
        m.boundary()  # the first round: restore
    for _ in range(steps):
        for m in ms:
            m.train()
            m.boundary()
        for c in cks:
            assert c.wait(30)
    return ms, cks


def test_three_groups_write_a_third_each_and_plain_dcp_reads_it(tmp_path: Path) -> None:
    ms, cks = run_job(tmp_path, 3, 4, every=2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]  # keep=1, after 4 was complete
    folder = tmp_path / "step_00000004"
    assert (folder / ".rallypoint-complete").exists() and (folder / ".metadata").exists()
    written = [c.stats()["bytes"] for c in cks]
    assert all(b > 0 for b in written) and max(written) < sum(written)  # each wrote a part
    assert [c.stats()["commits"] for c in cks] == [2, 0, 0]  # writer 0 commits
    fresh = FakeManager(0, 1, seed=5)
    sd = {"user": {"default": {"model": fresh.model.state_dict()}}}
    dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    for a, b in zip(sd["user"]["default"]["model"].values(), ms[0].model.state_dict().values()):
        assert torch.equal(a, b)


def test_restore_loads_model_optimizer_and_step(tmp_path: Path) -> None:
    ms, _ = run_job(tmp_path, 2, 6, every=3)
    other = FakeManager(0, 2, seed=9)
    ck = DurableCheckpoint(other, str(tmp_path), every=3)
    other.boundary()
    assert ck.restored_step == 6 and other.step == 6
    assert all(torch.equal(a, b) for a, b in zip(other.params(), ms[0].params()))
    # The optimizer's momentum came back (its integer keys too): the next step matches.
    ms[0].train()
    other.train()
    assert all(torch.equal(a, b) for a, b in zip(other.params(), ms[0].params()))


def test_kill_all_restore_brings_adams_moments_back(tmp_path: Path) -> None:
    """Every group is lost after step 6 (checkpointed at 4): fresh processes whose Adam has no
    state yet restore step 4 with exp_avg, exp_avg_sq and step equal to those at the commit."""
    ms = [FakeManager(i, 2, adam=True) for i in range(2)]
    cks = [DurableCheckpoint(m, str(tmp_path), every=4, keep=0, commit_timeout=10) for m in ms]
    at4: list[dict[int, dict[str, torch.Tensor]]] = []
    for m in ms:
        m.boundary()
    for _ in range(6):
        for m in ms:
            m.train()
            m.boundary()
            if m.step == 4:
                at4.append({i: {k: v.clone() for k, v in st.items()} for i, st in m.opt.state_dict()["state"].items()})
        for c in cks:
            assert c.wait(30)
    fresh = FakeManager(1, 2, seed=7, adam=True)
    assert not fresh.opt.state  # before its first step
    ck = DurableCheckpoint(fresh, str(tmp_path), every=4)
    fresh.boundary()
    assert ck.restored_step == 4 and fresh.step == 4
    got = fresh.opt.state_dict()["state"]
    assert sorted(got) == sorted(at4[0]) and len(got) == 4
    for i, want in at4[0].items():
        assert set(got[i]) == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in want.items():
            assert torch.equal(got[i][k], v), (i, k)


def test_incomplete_or_corrupt_newest_is_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    run_job(tmp_path, 2, 6, every=2)
    (tmp_path / "step_00000006" / ".rallypoint-complete").unlink()  # never committed
    data = sorted((tmp_path / "step_00000004").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:10])  # truncated
    m = FakeManager(0, 2, seed=3)
    ck = DurableCheckpoint(m, str(tmp_path), every=2)
    with caplog.at_level(logging.WARNING, logger="rallypoint.checkpoint"):
        m.boundary()
    assert ck.restored_step == 2 and m.step == 2
    text = caplog.text
    assert "step_00000006: no commit marker" in text
    assert "step_00000004: data file" in text and "truncated" in text


def test_a_different_model_refuses_naming_the_first_mismatching_key(tmp_path: Path) -> None:
    run_job(tmp_path, 1, 2, every=2)
    m = FakeManager(0, 1, width=16)
    DurableCheckpoint(m, str(tmp_path), every=2)
    with pytest.raises(ValueError, match=r"key 'user.default.model.0.bias' has shape \(8,\) in the checkpoint"):
        m.boundary()


def test_a_missing_share_leaves_the_step_incomplete_and_the_next_one_completes(tmp_path: Path) -> None:
    ms = [FakeManager(i, 2) for i in range(2)]
    cks = [DurableCheckpoint(m, str(tmp_path), every=2, commit_timeout=0.5) for m in ms]
    for m in ms:
        m.boundary()
    for step in range(1, 5):
        for i, m in enumerate(ms):
            m.train()
            if not (step == 2 and i == 1):  # group 1 does not write step 2
                m.boundary()
        for c in cks:
            assert c.wait(30)
    assert not (tmp_path / "step_00000002").exists()  # incomplete, pruned once 4 was complete
    assert (tmp_path / "step_00000004" / ".rallypoint-complete").exists()
    assert cks[0].stats()["failures"] == 1 and cks[0].stats()["last_complete_step"] == 4


def test_unwritable_path_is_logged_once_counted_and_training_goes_on(tmp_path: Path, caplog) -> None:
    # A path under a regular file: unwritable for root too (ENOTDIR), so this runs everywhere.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.ERROR, logger="rallypoint.checkpoint"):
        ms, cks = run_job(blocker / "ckpt", 1, 6, every=2)
    assert ms[0].step == 6
    # The restore's listing at the start, then the checkpoints of steps 2, 4 and 6.
    assert cks[0].stats()["failures"] == 4 and cks[0].stats()["writes"] == 0
    assert caplog.text.count("ENOTDIR") == 1
    assert blocker.read_text() == "not a folder"


def test_a_vanished_path_is_counted_and_the_last_complete_checkpoint_kept(tmp_path: Path, caplog) -> None:
    target = tmp_path / "ckpt"
    ms = [FakeManager(0, 1)]
    ck = DurableCheckpoint(ms[0], str(target), every=2)
    ms[0].boundary()
    for _ in range(2):
        ms[0].train()
        ms[0].boundary()
    assert ck.wait(30) and ck.stats()["last_complete_step"] == 2
    # The folder is replaced by a file: every later write fails (ENOTDIR), training goes on.
    import shutil

    shutil.move(str(target), str(tmp_path / "kept"))
    target.write_text("not a folder")
    with caplog.at_level(logging.ERROR, logger="rallypoint.checkpoint"):
        for _ in range(4):
            ms[0].train()
            ms[0].boundary()
            assert ck.wait(30)
    assert ms[0].step == 6 and ck.stats()["failures"] == 2
    assert caplog.text.count("durable checkpoint") == 1
    assert (tmp_path / "kept" / "step_00000002" / ".rallypoint-complete").exists()


def test_fsspec_url(tmp_path: Path) -> None:
    """A path with a scheme goes through fsspec and DCP's fsspec reader/writer."""
    url = f"file://{tmp_path}/remote"
    ms, cks = run_job(url, 2, 2, every=2)
    assert cks[0].stats()["last_complete_step"] == 2
    assert (tmp_path / "remote" / "step_00000002" / ".rallypoint-complete").exists()
    m = FakeManager(0, 2, seed=4)
    DurableCheckpoint(m, url, every=2)
    m.boundary()
    assert m.step == 2 and all(torch.equal(a, b) for a, b in zip(m.params(), ms[0].params()))


def test_from_env(tmp_path: Path) -> None:
    m = FakeManager(0, 1)
    assert DurableCheckpoint.from_env(m, {}) is None
    ck = DurableCheckpoint.from_env(m, {"RALLYPOINT_CHECKPOINT_DIR": str(tmp_path), "RALLYPOINT_CHECKPOINT_EVERY": "7",
                                        "RALLYPOINT_CHECKPOINT_KEEP": "0"})
    assert ck is not None and (ck.every, ck.keep, ck.path) == (7, 0, str(tmp_path)) and m.step_hooks == [ck]
    with pytest.raises(ValueError, match="RALLYPOINT_CHECKPOINT_EVERY=0 must be at least 1"):
        DurableCheckpoint.from_env(m, {"RALLYPOINT_CHECKPOINT_DIR": "x", "RALLYPOINT_CHECKPOINT_EVERY": "0"})
    for c in m.step_hooks:
        c.close(1)


# ----------------------------------------------------------------------------- a real Manager


def _solo_manager(lh: Any, model: nn.Module) -> Any:
    from datetime import timedelta

    import rallypoint

    t = timedelta(seconds=5)
    return rallypoint.Manager(rallypoint.ProcessGroupGloo(timeout=t), lambda sd: model.load_state_dict(sd),
                              model.state_dict, min_replica_size=1, hostname="127.0.0.1", store_addr="127.0.0.1",
                              lighthouse_addr=lh.address(), replica_id="solo", timeout=t, quorum_timeout=t,
                              connect_timeout=t)


def _steps(m: Any, model: nn.Module, n: int) -> None:
    for _ in range(n):
        m.start_quorum()
        for p in model.parameters():
            g = torch.ones_like(p)
            m.allreduce(g).wait()
        if m.should_commit():
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * (m.current_step() + 1))


def test_public_durable_checkpoint_on_a_manager(tmp_path: Path, lighthouse, monkeypatch) -> None:
    """``rallypoint.DurableCheckpoint(manager, path, every, keep)`` on a real Manager: the
    step-3 state is written when round 4 starts (after the optimizer stepped), and a new
    Manager restores it at its first round, step counter included."""
    import rallypoint

    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "RALLYPOINT_CHECKPOINT_DIR"):
        monkeypatch.delenv(k, raising=False)
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    model = nn.Linear(3, 2)
    m = _solo_manager(lh, model)
    try:
        ck = rallypoint.DurableCheckpoint(m, str(tmp_path), every=3, keep=1)
        _steps(m, model, 3)
        at3 = [p.detach().clone() for p in model.parameters()]
        _steps(m, model, 1)  # its start_quorum stages step 3
        assert ck.wait(30) and ck.stats()["last_complete_step"] == 3 and ck.stats()["last_stall_s"] > 0
    finally:
        m.shutdown()
    model2 = nn.Linear(3, 2)
    m2 = _solo_manager(lh, model2)
    try:
        monkeypatch.setenv("RALLYPOINT_CHECKPOINT_DIR", str(tmp_path))
        ck2 = rallypoint.DurableCheckpoint.from_env(m2)
        assert ck2 is not None
        m2.start_quorum()
        assert m2.current_step() == 3 and ck2.restored_step == 3
        assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), at3))
    finally:
        m2.shutdown()


def test_plan_share_sharded_keys_go_to_every_rank_of_one_group() -> None:
    sizes = {"w1": 100, "w2": 90, "b": 8, "n": 4}
    shares = {(r, g): plan_share(2, sizes, r, 2, g, 2, "a", {"w1", "w2"}).keys for r in range(2) for g in range(2)}
    assert shares[(0, 0)] == ("b", "w1") and shares[(0, 1)] == ("n", "w1")  # both ranks of group 0: w1's shards
    assert shares[(1, 0)] == ("w2",) and shares[(1, 1)] == ("w2",)


def test_bad_environment_shuts_the_manager_down(monkeypatch) -> None:
    """What ``Manager.__init__`` calls with ``RALLYPOINT_CHECKPOINT_DIR`` set: a bad
    ``RALLYPOINT_CHECKPOINT_EVERY`` is a ``ValueError`` naming it, after the half-built
    Manager was shut down (its server and threads do not outlive the error)."""
    from rallypoint.checkpoint.durable import attach_from_env

    m = FakeManager(0, 1)
    calls: list[bool] = []
    m.shutdown = lambda wait=True: calls.append(wait)  # type: ignore[attr-defined]
    monkeypatch.setenv("RALLYPOINT_CHECKPOINT_DIR", "/nowhere")
    monkeypatch.setenv("RALLYPOINT_CHECKPOINT_EVERY", "0")
    with pytest.raises(ValueError, match="RALLYPOINT_CHECKPOINT_EVERY=0 must be at least 1"):
        attach_from_env(m)
    assert calls == [False] and m.step_hooks == []


def test_full_disk_is_logged_once_counted_and_the_next_write_after_it_completes(tmp_path: Path, caplog,
                                                                               monkeypatch) -> None:
    """ENOSPC from every share's write (a full disk): one error line naming the cause,
    every failure counted, training goes on, the last complete checkpoint stays; once
    there is space again the next interval completes."""
    import errno

    from rallypoint.checkpoint import storage

    ms, cks = run_job(tmp_path, 2, 2, every=2)
    real = storage._LocalShareWriter.write_data

    def full(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage._LocalShareWriter, "write_data", full)
    with caplog.at_level(logging.ERROR, logger="rallypoint.checkpoint"):
        for _ in range(4):  # steps 3..6: 4 and 6 are due, each fails on both groups
            for m in ms:
                m.train()
                m.boundary()
            for c in cks:
                assert c.wait(30)
    assert [m.step for m in ms] == [6, 6]
    assert [c.stats()["failures"] for c in cks] == [2, 2]
    assert caplog.text.count("(ENOSPC)") == 2  # once per group (each its own process in a job)
    assert sorted(p.name for p in tmp_path.iterdir() if (p / ".rallypoint-complete").exists()) == ["step_00000002"]
    monkeypatch.setattr(storage._LocalShareWriter, "write_data", real)
    for _ in range(2):
        for m in ms:
            m.train()
            m.boundary()
        for c in cks:
            assert c.wait(30)
    assert cks[0].stats()["last_complete_step"] == 8


def test_garbage_in_the_newest_data_is_skipped_for_the_previous_one(tmp_path: Path, caplog) -> None:
    """Data files of the right size but garbage inside: loading fails, the warning names the
    folder, and the previous complete checkpoint is restored."""
    run_job(tmp_path, 2, 4, every=2)
    for f in (tmp_path / "step_00000004").glob("*.distcp"):
        f.write_bytes(b"\x00garbage" * (f.stat().st_size // 8) + b"\x00" * (f.stat().st_size % 8))
    m = FakeManager(0, 2, seed=3)
    ck = DurableCheckpoint(m, str(tmp_path), every=2)
    with caplog.at_level(logging.WARNING, logger="rallypoint.checkpoint"):
        m.boundary()
    assert ck.restored_step == 2 and m.step == 2
    assert "skipping checkpoint" in caplog.text and "step_00000004: it failed to load" in caplog.text


def test_memory_url_an_object_store_without_rename(tmp_path: Path) -> None:
    """fsspec's ``memory://`` (no atomic rename, as on object stores: the marker is one
    upload): written, pruned with keep=1, restored."""
    import fsspec

    url = f"memory://rallypoint-test/{tmp_path.name}"
    try:
        ms, cks = run_job(url, 2, 4, every=2, keep=1)
        assert [c.stats()["failures"] for c in cks] == [0, 0] and cks[0].stats()["last_complete_step"] == 4
        names = [p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(f"/rallypoint-test/{tmp_path.name}",
                                                                              detail=False)]
        assert names == ["step_00000004"]
        m = FakeManager(0, 2, seed=4)
        DurableCheckpoint(m, url, every=2)
        m.boundary()
        assert m.step == 4 and all(torch.equal(a, b) for a, b in zip(m.params(), ms[0].params()))
    finally:
        fsspec.filesystem("memory").rm(f"/rallypoint-test/{tmp_path.name}", recursive=True)
