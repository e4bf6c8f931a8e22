"""Healing into a warm process (``rallypoint/transports/_pool.py``): a receive ``into=`` a
state goes into buffers kept from the last receive, is verified whole, and only then lands
in the caller's tensors by swapping memory (no copy). What a user checks: the model and the
optimizer hold the sent values, through the very objects they held; the second heal
reuses the first's buffers; a heal that breaks leaves the model exactly as it was; a tensor
that does not own its storage is copied into without touching its neighbours."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint.transports._pool import ReceivePool, can_swap, pool_enabled, swap_into
from rallypoint.transports.http import HTTPTransport, TransferError
from test_pg_transport import tensors_of

TEN = timedelta(seconds=10)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.fixture
def pair() -> Iterator[tuple[HTTPTransport, HTTPTransport]]:
    src = HTTPTransport(TEN, bind="127.0.0.1:0")
    dst = HTTPTransport(TEN, bind="127.0.0.1:0")
    yield src, dst
    src.shutdown()
    dst.shutdown()


def test_heals_land_in_the_models_own_tensors_and_reuse_the_buffers(pair: tuple[HTTPTransport, HTTPTransport]) -> None:
    src, dst = pair
    assert dst.receive_pool is not None and pool_enabled({})
    model, opt = _trained(0)
    sender_model, sender_opt = _trained(1)
    params = list(model.parameters())
    moments = [opt.state[p]["exp_avg"] for p in params]
    for step in (1, 2, 3):
        for p in sender_model.parameters():  # the sender trains on between heals
            p.data.add_(0.5)
        src.send_checkpoint([1], step, _state(sender_model, sender_opt), TEN)
        ptrs = [p.data_ptr() for p in params]
        dst.recv_checkpoint(0, src.metadata(), step, TEN, into=_state(model, opt))
        src.disallow_checkpoint()
        # the parameters and the optimizer's moments themselves (not copies) hold the sent values
        for mine, theirs in zip(model.parameters(), sender_model.parameters()):
            assert torch.equal(mine, theirs)
        assert list(model.parameters()) == params and [opt.state[p]["exp_avg"] for p in params] == moments
        for mine, theirs in zip(moments, [sender_opt.state[p]["exp_avg"] for p in sender_model.parameters()]):
            assert torch.equal(mine, theirs)
        assert [p.data_ptr() for p in params] != ptrs  # landed by swapping memory, not copied
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(_state(model, opt)))
    assert dst.receive_pool.reused_bytes >= 2 * state_bytes * 0.9  # heals 2 and 3 took the kept buffers
    assert dst.receive_pool.kept_bytes() <= state_bytes
    model(torch.randn(4, 64)).sum().backward()  # autograd still works on the healed parameters
    opt.step()


def test_a_heal_that_breaks_leaves_the_model_as_it_was(pair: tuple[HTTPTransport, HTTPTransport]) -> None:
    src, dst = pair
    model, opt = _trained(0)
    sender_model, sender_opt = _trained(1)
    src.send_checkpoint([1], 1, _state(sender_model, sender_opt), TEN)
    dst.recv_checkpoint(0, src.metadata(), 1, TEN, into=_state(model, opt))  # buffers are kept now
    src.disallow_checkpoint()
    before = [t.clone() for t in tensors_of(_state(model, opt))]

    class Broken(HTTPTransport):
        def _pieces(self, *a: Any, **kw: Any) -> Any:  # the last piece of every body has a flipped bit
            pieces = list(super()._pieces(*a, **kw))
            last = bytearray(pieces[-1])
            last[len(last) // 2] ^= 0x10
            yield from [*pieces[:-1], memoryview(last)]

    bad = Broken(TEN, bind="127.0.0.1:0")
    try:
        bad.send_checkpoint([1], 2, _state(*_trained(2)), TEN)
        with pytest.raises(TransferError, match="checksum mismatch"):  # in the data, after the header
            dst.recv_checkpoint(0, bad.metadata(), 2, timedelta(seconds=3), into=_state(model, opt))
    finally:
        bad.shutdown()
    after = tensors_of(_state(model, opt))
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_view_is_copied_into_and_its_neighbours_stay() -> None:
    flat = torch.arange(10.0)
    view = flat[2:6]
    assert not can_swap(view, torch.zeros(4))  # an offset into a larger storage
    assert not can_swap(flat[::2], torch.zeros(5))  # not contiguous
    assert not can_swap(torch.zeros(4), torch.zeros(5))  # sizes differ
    shared = torch.zeros(4).share_memory_()
    assert not can_swap(shared, torch.zeros(4)) and not can_swap(torch.zeros(4), shared)
    a, b = torch.zeros(4), torch.ones(4)
    assert can_swap(a, b)
    alias = a.detach()
    swap_into(a, b)
    assert torch.equal(alias, torch.ones(4)) and torch.equal(b, torch.zeros(4))  # every alias sees it


def test_a_view_target_over_http_is_filled_without_touching_the_rest(pair: tuple[HTTPTransport, HTTPTransport]) -> None:
    src, dst = pair
    flat = torch.zeros(1000)
    target = {"w": flat[100:600].view(20, 25), "b": torch.zeros(7)}
    sent = {"w": torch.randn(20, 25), "b": torch.randn(7)}
    src.send_checkpoint([1], 4, sent, TEN)
    out = dst.recv_checkpoint(0, src.metadata(), 4, TEN, into=target)
    assert out["w"] is target["w"] and torch.equal(flat[100:600].view(20, 25), sent["w"])
    assert not flat[:100].any() and not flat[600:].any()
    assert torch.equal(target["b"], sent["b"])


def test_the_pool_keeps_one_receive_worth_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ReceivePool()
    assert pool.take(torch.float32, (4,)) is None
    for n in (4, 4, 8):
        pool.give(torch.zeros(n))
    pool.trim(48)  # this receive used 48 bytes: a 16-byte and the 32-byte buffer... at most 48 kept
    assert pool.kept_bytes() <= 48
    got = pool.take(torch.float32, (2, 2))
    assert got is not None and got.shape == (2, 2) and got.dtype == torch.float32 and pool.reused_bytes == 16
    pool.clear()
    assert pool.kept_bytes() == 0
    monkeypatch.setenv("RALLYPOINT_HEAL_BUFFERS", "0")
    t = HTTPTransport(TEN, bind="127.0.0.1:0")
    try:
        assert t.receive_pool is None
    finally:
        t.shutdown()


def test_a_kept_buffer_comes_back_as_itself_or_as_a_view_of_its_bytes() -> None:
    """The same dtype and shape (a heal of an unchanged layout) gets the kept tensor back
    without a view; another dtype or shape of the same byte size gets its bytes; a tensor
    that is not the whole of its storage is not kept (swapping it would hand out memory
    that something else lives in)."""
    pool = ReceivePool()
    kept = torch.arange(8, dtype=torch.float32)
    pool.give(kept)
    assert pool.take(torch.float32, (8,)) is kept
    pool.give(kept)
    as_ints = pool.take(torch.int16, (4, 4))
    assert as_ints is not None and as_ints.shape == (4, 4) and as_ints.data_ptr() == kept.data_ptr()
    assert pool.take(torch.int16, (4, 4)) is None  # handed out once
    pool.give(torch.zeros(16)[4:12])  # a slice: not the whole of its storage
    pool.give(torch.zeros(16)[:8])  # the start of a storage: not the whole of it either
    pool.give(torch.zeros(4, 4).t())  # not contiguous
    assert pool.kept_bytes() == 0


def test_a_deferred_receive_touches_nothing_until_it_lands(pair: tuple[HTTPTransport, HTTPTransport]) -> None:
    from rallypoint.transports.wire import Landing, WireError

    src, dst = pair
    model, opt = _trained(0)
    sender_model, sender_opt = _trained(1)
    for step in (1, 2):
        src.send_checkpoint([1], step, _state(sender_model, sender_opt), TEN)
        before = [t.clone() for t in tensors_of(_state(model, opt))]
        landing = dst.recv_checkpoint(0, src.metadata(), step, TEN, into=_state(model, opt), defer_landing=True)
        src.disallow_checkpoint()
        assert isinstance(landing, Landing)
        assert all(torch.equal(a, b) for a, b in zip(tensors_of(_state(model, opt)), before))  # not yet
        params = list(model.parameters())
        out = landing.land()
        assert out["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()  # the model's own memory
        assert list(model.parameters()) == params
        for mine, theirs in zip(model.parameters(), sender_model.parameters()):
            assert torch.equal(mine, theirs)
        with pytest.raises(WireError, match="landed already"):
            landing.land()
    assert dst.receive_pool is not None and dst.receive_pool.reused_bytes > 0  # the second took the first's


@pytest.mark.parametrize("readable", [True, False])
def test_heals_on_the_quorum_thread_land_warm_in_the_models_own_tensors(lighthouse: Any, readable: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default for plain state: heals overlap forward on the quorum thread. Replica b
    fails a step now and then (as after a transient error) and heals from a without
    restarting: each heal is received and verified on the quorum thread, then swapped into
    b's own parameters on its training thread; from the second heal on into the buffers the
    first left; both end bit-identical. A healer whose state_dict refuses to be read off the
    training thread (``readable=False``) still heals, into fresh memory as before."""
    import threading

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    lh = lighthouse(min_replicas=2, join_timeout_ms=2000)
    target, fail_at = 14, {3, 6, 9}
    both = threading.Barrier(2, timeout=60)

    def run(name: str, fails: set[int]) -> dict[str, Any]:
        model, opt = _trained(0)
        pg = ProcessGroupGloo(timeout=TEN)
        def state() -> dict[str, Any]:
            if not readable and name == "qb" and threading.current_thread().name.startswith("rallypoint-quorum"):
                raise RuntimeError("not on the quorum thread")
            return _state(model, opt)

        m = Manager(pg, lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
                    state, min_replica_size=2, rank=0, world_size=1, hostname="127.0.0.1",
                    store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id=name, timeout=TEN,
                    quorum_timeout=timedelta(seconds=30), connect_timeout=TEN)
        params = list(model.parameters())
        gen = torch.Generator().manual_seed(hash(name) % 1000)
        swapped = 0
        try:
            both.wait()
            deadline = time.monotonic() + 90
            while m.current_step() < target and time.monotonic() < deadline:
                ptrs = [p.data_ptr() for p in params]
                m.start_quorum()
                opt.zero_grad()
                model(torch.randn(4, 64, generator=gen)).sum().backward()
                for p in params:
                    m.allreduce(p.grad).wait()  # waits for the quorum (and a quorum-thread fetch) first
                if m.current_step() in fails and m.errored() is None:
                    fails = fails - {m.current_step()}
                    m.report_error(RuntimeError("injected: a transient failure"))
                if m.should_commit():
                    opt.step()
                swapped += [p.data_ptr() for p in params] != ptrs and m.step_records()[-1].healing
            assert list(model.parameters()) == params  # the same parameter objects throughout
            pool = m._transport.receive_pool
            return {"step": m.current_step(), "on_training_thread": m.heal_on_training_thread,
                    "heals": sum(1 for r in m.step_records() if r.healing), "swapped": swapped,
                    "reused": pool.reused_bytes if pool is not None else 0,
                    "params": [p.detach().clone() for p in params]}
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    import concurrent.futures as cf
    import time

    with cf.ThreadPoolExecutor(2) as ex:
        fa, fb = ex.submit(run, "qa", set()), ex.submit(run, "qb", fail_at)
        a, b = fa.result(timeout=150), fb.result(timeout=150)
    assert a["step"] == b["step"] >= target, (a["step"], b["step"])
    assert b["on_training_thread"] is False and a["heals"] == 0
    assert b["heals"] >= 3, b["heals"]
    if readable:
        assert b["swapped"] >= 3 and b["reused"] > 0  # heals after the first took the buffers the first left
    else:
        assert b["swapped"] == 0 and b["reused"] == 0  # copied in by load_state_dict, as before
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


class _Ours:
    receive_pool: Any = ReceivePool()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta, *, into: Any = None,
                        in_place: bool = False, mesh: Any = None, defer_landing: bool = False) -> Any: ...


class _NoDefer:
    receive_pool: Any = ReceivePool()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta, *, into: Any = None,
                        mesh: Any = None) -> Any: ...


class _TorchftLike:
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any: ...


class _NoPool(_Ours):
    receive_pool = None


class _OnDevice(_Ours):
    receives_on_device = True


@pytest.mark.parametrize("transport,want", [
    (_Ours(), True),          # ours, buffers kept: received and checked off the training thread, swapped on it
    (_NoPool(), False),       # RALLYPOINT_HEAL_BUFFERS=0: fresh memory, copied in by load_state_dict
    (_NoDefer(), False),      # a transport that cannot leave the landing for later
    (_TorchftLike(), False),  # torchft's: builds the state itself
    (_OnDevice(), False),     # receives on a device: no second device copy held until the landing
])
def test_which_quorum_thread_heals_land_later(transport: Any, want: bool) -> None:
    import logging

    from rallypoint.manager._heal import Healer

    h = Healer(transport, 0, TEN, TEN, logging.LoggerAdapter(logging.getLogger("t"), {}))
    assert h.lands_later() is want


def test_a_replica_process_that_fails_every_third_step_heals_warm_each_time(lighthouse, replicas_factory) -> None:
    """Real processes, the default quorum-thread heal: replica_1 fails every third step on
    its own and heals from a peer at the next quorum, into the buffers its last heal left
    (reused bytes > 0), while replica_2 is SIGKILLed and restarted twice (gloo rounds
    broken under everyone). The three end with identical parameters."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    r = replicas_factory(lh)
    opts = {"delay": 0.01, "width": 20000}
    r.start("replica_0", seed=1, **opts)
    r.start("replica_1", seed=2, fail_every=3, **opts)
    r.start("replica_2", seed=3, **opts)
    r.wait_for("steady training", lambda: min(r.step(f"replica_{i}") for i in range(3)) >= 3, 40)
    for k in range(2):
        victim = r.procs[[key for key in r.procs if key.startswith("replica_2#")][-1]]
        victim.kill()
        victim.wait(10)
        s = r.step("replica_0")
        r.wait_for("the survivors go on", lambda: min(r.step("replica_0"), r.step("replica_1")) >= s + 3, 30)
        r.start("replica_2", seed=3, **opts)
        r.wait_for("replica_2 healed", lambda: r.step("replica_2") >= r.step("replica_0") - 1 >= s + 4, 40)
    r.wait_for("replica_1 healed into its kept buffers",
               lambda: (r.progress("replica_1") or {}).get("heal_reused", 0) > 0, 30)
    target = max(r.step(f"replica_{i}") for i in range(3)) + 4
    r.finish(target, timeout=40)
    r.assert_identical([f"replica_{i}" for i in range(3)], target)
    one = r.progress("replica_1")
    assert one is not None and one["heal_reused"] > 0, one
    assert len(one["failed"]) >= 3, one["failed"]


@pytest.mark.parametrize("case, ok", [
    ("identical", True),
    ("diverged", False),  # same step, different parameters, everyone in the full quorum
    ("lone_tail", True),  # one step behind when its peers stopped: committed the last alone
    ("lone_tail_diverged_before", False),  # ... but already different where they were together
    ("lone_tail_legacy", True),  # the same from a worker that writes history rows only
    ("lone_tail_legacy_diverged_before", False),
    ("lone_tail_legacy_peers_diverged", False),  # x and y, full quorum at step 10, differ there
    ("pair_tail", True),  # z missed the last quorum: x and y committed step 10 without it, z alone
    ("pair_tail_pair_diverged", False),  # ... but x and y differ after committing step 10 together
    ("all_tails_too_long", False),  # the last step all three committed together is 5 steps back
    ("diverged_legacy", False),  # the same from a worker that writes history rows only
])
def test_assert_identical_tells_a_lone_last_step_from_a_divergence(tmp_path, case: str, ok: bool) -> None:
    """The harness's end check (``Replicas.assert_identical``) is not vacuous: a divergence
    fails it, and only replicas that did not commit the final rounds together (a peer
    stopped first) are compared where they last committed one round together."""
    import json

    from replica_worker import Replicas

    r = Replicas(tmp_path, "unused")
    full = [[8, 3, 0], [9, 3, 0], [10, 3, 0]]
    rounds = [[8, 4, 3, 1], [9, 4, 3, 1], [10, 4, 3, 1]]  # [step, quorum id, quorum size, committed]
    rows = {n: {"step": 10, "batches": 30, "hash": "A", "history": full, "rounds": rounds, "failed": [],
                "hashes": {"9": "a9", "10": "A"}} for n in ("x", "y", "z")}
    if case == "diverged":
        rows["z"]["hash"] = "B"
    if case == "diverged_legacy":
        rows["z"].update(hash="B", hashes={"9": "a9", "10": "B"})
    if case.startswith("lone_tail"):
        rows["z"].update(hash="B", batches=28, history=[[9, 3, 0], [9, 3, 0], [10, 1, 0]], failed=[9],
                         rounds=[[9, 4, 3, 1], [9, 4, 3, 0], [10, 5, 1, 1]],
                         hashes={"9": "a9" if case in ("lone_tail", "lone_tail_legacy") else "b9", "10": "B"})
    if case == "lone_tail_legacy_peers_diverged":
        rows["y"].update(hash="C", hashes={"9": "a9", "10": "C"})
    if "legacy" in case:
        for row in rows.values():
            del row["rounds"]
    if case.startswith("pair_tail"):
        for n in ("x", "y"):
            rows[n].update(history=full[:2] + [[10, 2, 0]], rounds=rounds[:2] + [[10, 5, 2, 1]], batches=29)
        rows["z"].update(hash="B", batches=28, history=full[:2] + [[10, 1, 0]], rounds=rounds[:2] + [[10, 6, 1, 1]],
                         hashes={"9": "a9", "10": "B"})
        if case == "pair_tail_pair_diverged":
            rows["y"].update(hash="C", hashes={"9": "a9", "10": "C"})
    if case == "all_tails_too_long":
        for n, q in (("x", 7), ("y", 7), ("z", 8)):
            rows[n].update(rounds=[[5, 4, 3, 1]] + [[s, q, 2 if q == 7 else 1, 1] for s in range(6, 11)],
                           hashes={"5": "a5", "10": "A" if q == 7 else "B"}, hash="A" if q == 7 else "B")
    for n, row in rows.items():
        (tmp_path / f"{n}.json").write_text(json.dumps(row))
    if ok:
        r.assert_identical(["x", "y", "z"], 10)
    else:
        with pytest.raises(AssertionError, match="parameters differ"):
            r.assert_identical(["x", "y", "z"], 10)
