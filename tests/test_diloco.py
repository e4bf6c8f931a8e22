"""DiLoCo / Streaming DiLoCo against a reference written plainly here, with real
Managers (replica threads, a real lighthouse, gloo on 127.0.0.1); failures, healing
and upscale with real processes (``tests/diloco_worker.py``)."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable

import pytest
import torch
from torch import nn

from diloco_worker import DiLoCoReplicas, leave_together, make_manager, run_threads
from rallypoint.integrations import _buckets
from rallypoint.integrations.local_sgd import DiLoCo

log = logging.getLogger("test_diloco")

INNER_LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9
STEPS = 12


# ---------------------------------------------------------------- the plain reference
def init_params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (4,), (2, 4), (2,)]  # fragment 0: W1, b1; fragment 1: W2, b2
    return [(torch.randn(s, generator=g) * 0.5).double() for s in shapes]


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(5, 3, generator=g).double(), torch.randn(5, 2, generator=g).double()


def inner_step(ps: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               grad_at: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One SGD step on the mean squared error of ``tanh(x W1^T + b1) W2^T + b2``, with
    the gradient taken at ``grad_at`` (default: ``ps`` itself)."""
    at = [p.clone().requires_grad_(True) for p in (grad_at if grad_at is not None else ps)]
    w1, b1, w2, b2 = at
    loss = ((torch.tanh(x @ w1.T + b1) @ w2.T + b2 - y) ** 2).mean()
    grads = torch.autograd.grad(loss, at)
    return [(p - INNER_LR * g).detach() for p, g in zip(ps, grads)]


def reference(n_frags: int, sync_every: int, delay: int, alpha: float, init: list[torch.Tensor],
              fail_rounds: set[int] = frozenset(), nesterov: bool = True,
              first_grad_at: list[list[torch.Tensor]] | None = None,
              steps: list[int] | None = None) -> tuple[list, list]:
    """The DiLoCo rule for 2 replicas, step by step: returns (local params per replica,
    global params). Both replicas start from ``init``; ``first_grad_at[r]``: where replica
    r's first gradient was taken (its own initialisation, before the start round gave it
    ``init``). ``steps`` receives the committed syncs after every inner step: the
    manager step torchft reports."""
    frag_of = [[0, 1], [2, 3]] if n_frags == 2 else [[0, 1, 2, 3]]
    H = sync_every // n_frags
    local = [[p.clone() for p in init] for _ in range(2)]
    glob = [p.clone() for p in init]
    buf: dict[int, torch.Tensor] = {}
    rnd, attempt, c, mean_delta = 0, 0, 0, None
    for s in range(STEPS):
        for r in range(2):
            at = first_grad_at[r] if first_grad_at is not None and s == 0 else None
            local[r] = inner_step(local[r], *batch(r, s), grad_at=at)
        c += 1
        f = frag_of[rnd % n_frags]
        if c == H - delay:
            mean_delta = {i: ((glob[i] - local[0][i]) + (glob[i] - local[1][i])) / 2 for i in f}
        if c == H:
            c = 0
            failed = attempt in fail_rounds
            attempt += 1
            if failed:  # restored from the backup; the same fragment is retried
                for r in range(2):
                    for i in f:
                        local[r][i] = glob[i].clone()
                if steps is not None:
                    steps.append(rnd)
                continue
            for i in f:
                g = mean_delta[i]
                if nesterov:
                    buf[i] = g.clone() if i not in buf else MOMENTUM * buf[i] + g
                    upd = g + MOMENTUM * buf[i]
                else:
                    upd = g
                glob[i] = glob[i] - OUTER_LR * upd
                for r in range(2):
                    local[r][i] = (1 - alpha) * glob[i] + alpha * local[r][i]
            rnd += 1
        if steps is not None:
            steps.append(rnd)
    return local, glob


# ---------------------------------------------------------------- the implementation
def build(seed: int) -> tuple[nn.Module, list[nn.Module]]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), init_params(seed)):
            p.copy_(v)
    return model, [model[0], model[2]]


def diloco_replica(lh: Any, r: int, n_frags: int, sync_every: int, delay: int, alpha: float, seed: int,
                   hook: Callable[..., None] | None = None, timeout_s: float = 10.0, **kw: Any) -> dict[str, Any]:
    model, halves = build(seed)
    frags = halves if n_frags == 2 else [model]
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    outers = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True) for f in frags]
    m, pg = make_manager(lh.address(), f"replica_{r}", 2, timeout_s=timeout_s)
    try:
        d = DiLoCo(m, frags, inner, outers, sync_every=sync_every, fragment_sync_delay=delay,
                   fragment_update_alpha=alpha, **kw)
        entered: dict[str, Any] = {}
        steps: list[int] = []

        def first_step(*_: Any) -> None:
            # Registered after DiLoCo's own pre-hook: runs after the start round.
            if not entered:
                entered.update(step=m.current_step(), model=[p.detach().clone() for p in model.parameters()],
                               backup=[t.clone() for f in d._fragments for t in f.backup.values()])

        with d:
            hooks = [inner.register_step_pre_hook(first_step),
                     inner.register_step_post_hook(lambda *_: steps.append(m.current_step()))]
            if hook:
                hooks.append(inner.register_step_post_hook(lambda *_: hook(r, m, d, model)))
            for s in range(STEPS):
                x, y = batch(r, s)
                inner.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                inner.step()
            for h in hooks:
                h.remove()
        return {"model": [p.detach().clone() for p in model.parameters()],
                "glob": [t.clone() for f in d._fragments for t in f.backup.values()],
                "step": m.current_step(), "steps": steps, "entered": entered,
                "batches": m.batches_committed()}
    finally:
        leave_together()
        m.shutdown(wait=False)
        pg.shutdown()


def run_pair(lighthouse: Any, n_frags: int, sync_every: int, delay: int, alpha: float,
             seeds: tuple[int, int] = (1, 1), **kw: Any) -> list[dict[str, Any]]:
    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    return run_threads([
        (lambda r=r: diloco_replica(lh, r, n_frags, sync_every, delay, alpha, seeds[r], **kw)) for r in range(2)
    ])


def assert_matches(out: list[dict[str, Any]], local: list, glob: list, tol: float = 1e-12) -> None:
    for r in range(2):
        for got, want in zip(out[r]["glob"], glob):
            assert torch.allclose(got, want, rtol=0, atol=tol), (r, got, want)
        for got, want in zip(out[r]["model"], local[r]):
            assert torch.allclose(got, want, rtol=0, atol=tol), (r, got, want)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("n_frags,sync_every,delay,alpha,buckets", [
    (1, 3, 0, 0.0, False),
    (2, 4, 0, 0.0, False),
    (2, 4, 1, 0.5, True),
    (2, 6, 2, 0.0, False),
    (2, 6, 1, 1.0, False),
])
def test_golden_trajectory(lighthouse, n_frags: int, sync_every: int, delay: int, alpha: float,
                           buckets: bool) -> None:
    """Parameters, global parameters and the manager step after every inner step equal
    the plain reference; the step counts committed syncs only (torchft's count: the
    start round is not one), and so does batches_committed."""
    kw: dict[str, Any] = {}
    if buckets:  # 40 bytes: every parameter gets a bucket of its own (several per fragment)
        kw = {"use_bucketization": True, "bucket_cap_mb": 40 / 2**20}
    out = run_pair(lighthouse, n_frags, sync_every, delay, alpha, **kw)
    steps: list[int] = []
    local, glob = reference(n_frags, sync_every, delay, alpha, init_params(1), steps=steps)
    assert_matches(out, local, glob)
    syncs = STEPS // (sync_every // n_frags)
    assert steps[-1] == syncs
    assert [o["steps"] for o in out] == [steps] * 2
    assert [o["entered"]["step"] for o in out] == [0, 0]  # after the start round
    assert [o["batches"] for o in out] == [2 * syncs] * 2  # 2 replicas per committed sync
    # The trajectory really moved the global parameters away from the initial ones.
    assert all(not torch.allclose(g, i) for g, i in zip(glob, init_params(1)))


def test_bucket_plan_and_every_bucket_averaged(lighthouse) -> None:
    """Several buckets in one fragment; each is written back (not only the last one).
    A run where only one bucket was averaged would leave the replicas' global
    parameters differing from the reference (and from each other: the data differ)."""
    tensors = [torch.zeros(s, dtype=torch.float64) for s in [(4, 3), (4,), (2, 4), (2,)]]
    plan = _buckets.plan_buckets(tensors, 40)
    assert [b.indices for b in plan] == [[0], [1], [2], [3]]
    plan = _buckets.plan_buckets(tensors, 16 * 8)
    assert [b.indices for b in plan] == [[0, 1], [2, 3]]
    out = run_pair(lighthouse, 1, 2, 1, 0.0, use_bucketization=True, bucket_cap_mb=16 * 8 / 2**20)
    local, glob = reference(1, 2, 1, 0.0, init_params(1))
    assert_matches(out, local, glob)


@pytest.mark.parametrize("who", ["both", "one"])
def test_failed_sync_restores_backup_and_next_sync_works(lighthouse, who: str) -> None:
    """An error reported while fragment 1's exchange is in flight (round 2): that
    round does not commit, the fragment is back on its backup (= the global value of the
    last commit), the step does not advance; the next rounds commit. When only one
    replica fails it falls behind by a step and heals from its peer at the next quorum."""
    n_frags, sync_every, delay = 2, 4, 1
    H = sync_every // n_frags
    seen: dict[int, list] = {0: [], 1: []}
    prepared = {0: 0, 1: 0}

    def hook(r: int, m: Any, d: DiLoCo, model: nn.Module) -> None:
        if d._local_step == H - delay:
            prepared[r] += 1
            if prepared[r] == 2 and (who == "both" or r == 1):
                m.report_error(RuntimeError("injected failure"))
        if d._local_step == 0:  # a round just ended
            f = d._fragments[1]
            seen[r].append((m.current_step(), [p.detach().clone() for p in model[2].parameters()],
                            [t.clone() for t in f.backup.values()]))

    before = reference(n_frags, sync_every, delay, 0.0, init_params(1), fail_rounds=set())
    # "one": the replica that healed forward ends with one more sync than its peer, whose
    # allreduce can only time out (the peer has finished): a short timeout, not 10 s.
    out = run_pair(lighthouse, n_frags, sync_every, delay, 0.0, hook=hook, timeout_s=10.0 if who == "both" else 4.0)
    for r in (0, 1) if who == "both" else (1,):
        step, params, backup = seen[r][1]  # round 2 (fragment 1) failed
        assert step == 1, seen[r]
        assert all(torch.equal(p, b) for p, b in zip(params, backup))  # restored from the backup
        init = init_params(1)[2:]
        assert all(torch.equal(b, i) for b, i in zip(backup, init))  # fragment 1's last commit: step 0
        # the next round committed (the lone failer healed to its peer's step 3 first)
        assert seen[r][2][0] == (2 if who == "both" else 3)
    if who == "one":
        assert seen[0][1][0] == 2  # the peer's round 2 committed
    if who == "both":
        steps: list[int] = []
        local, glob = reference(n_frags, sync_every, delay, 0.0, init_params(1), fail_rounds={1}, steps=steps)
        assert_matches(out, local, glob)
        assert not torch.allclose(glob[0], before[1][0])  # the failure changed the trajectory
        assert [o["step"] for o in out] == [5, 5]
        assert [o["steps"] for o in out] == [steps] * 2
    else:
        assert out[0]["step"] == out[1]["step"]
        for a, b in zip(out[0]["glob"], out[1]["glob"]):
            assert torch.equal(a, b)


def test_step0_heal_with_delay_is_not_racy(lighthouse) -> None:
    """Replicas with different initial weights, init_sync, a sync delay: when the first
    inner step begins (after the start round), replica 1 holds replica 0's step-0
    parameters (model and global backup), and the whole run equals the reference
    started from replica 0's initialisation, replica 1's first gradient having been
    taken at its own initialisation (it was computed before the start round)."""
    out = run_pair(lighthouse, 2, 4, 1, 0.0, seeds=(1, 2))
    a, b = init_params(1), init_params(2)
    assert not torch.allclose(a[0], b[0])
    for r in range(2):
        e = out[r]["entered"]
        assert e["step"] == 0
        assert all(torch.equal(p, q) for p, q in zip(e["model"], a))
        assert all(torch.equal(p, q) for p, q in zip(e["backup"], a))
    local, glob = reference(2, 4, 1, 0.0, a, first_grad_at=[a, b])
    assert_matches(out, local, glob)


def test_quantized_pseudo_gradients_close_to_full_precision(lighthouse) -> None:
    from rallypoint.manager import Manager
    import inspect

    if "should_quantize" not in inspect.signature(Manager.allreduce).parameters:
        pytest.skip("Manager.allreduce has no should_quantize parameter yet")
    full = run_pair(lighthouse, 2, 4, 1, 0.0)
    quant = run_pair(lighthouse, 2, 4, 1, 0.0, should_quantize=True)
    assert [o["step"] for o in quant] == [o["step"] for o in full]
    err = max((q - f).abs().max().item() for q, f in zip(quant[0]["glob"], full[0]["glob"]))
    scale = max(f.abs().max().item() for f in full[0]["glob"])
    msg = (f"quantized vs full precision after {full[0]['step'] - 1} syncs: max abs error {err:.3e}, "
           f"relative to the largest global parameter {err / scale:.3e}")
    log.warning("%s", msg)
    print(msg)
    for a, b in zip(quant[0]["glob"], quant[1]["glob"]):
        assert torch.equal(a, b)  # quantized replicas still agree bit for bit
    assert 0 < err < 1e-2 * scale, (err, scale)


def test_requires_sync_quorum_and_validates(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    model, frags = build(1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    m, pg = make_manager(lh.address(), "solo", 1, use_async_quorum=True)
    try:
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            DiLoCo(m, frags, inner, outer, sync_every=4)
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    m, pg = make_manager(lh.address(), "solo2", 1)
    try:
        with pytest.raises(ValueError, match="multiple"):
            DiLoCo(m, frags, inner, outer, sync_every=5)
        with pytest.raises(ValueError, match="fragment_sync_delay"):
            DiLoCo(m, frags, inner, outer, sync_every=4, fragment_sync_delay=2)
        with pytest.raises(ValueError, match="alpha"):
            DiLoCo(m, frags, inner, outer, sync_every=4, fragment_update_alpha=1.5)
    finally:
        m.shutdown(wait=False)
        pg.shutdown()


# ---------------------------------------------------------------- processes
def _assert_same_state(r: DiLoCoReplicas, names: list[str], target: int) -> None:
    prog = [r.progress(n) for n in names]
    assert all(p is not None for p in prog), r.logs()
    assert [p["step"] for p in prog] == [target] * len(names), (prog, r.logs())
    assert len({p["hash"] for p in prog}) == 1, (prog, r.logs())  # global parameters
    assert len({p["outer"] for p in prog}) == 1, (prog, r.logs())  # outer optimizer state


def test_killed_replica_heals_and_third_replica_joins(lighthouse, tmp_path) -> None:
    """Two replicas train; one is SIGKILLed mid-run, the survivor keeps syncing alone;
    the killed one is restarted (fresh process, other initial weights) while a third
    replica starts at the same time (both start together to pay the process start-up
    once). Both heal the fragments' global parameters and outer optimizer state from
    a live peer; at the end all three hold identical global parameters (hash) and
    identical outer optimizer state (hash) at the same step."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=1000)
    r = DiLoCoReplicas(tmp_path, lh.address())
    try:
        r.start("replica_0", seed=1)
        b = r.start("replica_1", seed=2)
        r.wait_for("both at step 3", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 3, 40)
        os.kill(b.pid, signal.SIGKILL)
        r.wait_dead(b, 5)
        killed_at = r.step("replica_0")
        r.wait_for("survivor syncing alone", lambda: r.step("replica_0") >= killed_at + 2, 20)
        r.start("replica_1", seed=3)  # restarted
        r.start("replica_2", seed=4)  # upscale
        r.wait_for("restarted and new replica healed",
                   lambda: min(r.step("replica_1"), r.step("replica_2")) > killed_at + 2, 40)
        names = ["replica_0", "replica_1", "replica_2"]
        target = max(r.step(n) for n in names) + 3
        r.finish(target, timeout=30)
        _assert_same_state(r, names, target)
        assert all(r.progress(n)["participants"] == 3 for n in names)
    finally:
        r.kill_all()
