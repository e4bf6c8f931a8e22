"""LocalSGD against a plain reference (two replica threads with real Managers, a real
lighthouse and gloo), and a failed sync that keeps the local parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diloco_worker import leave_together, make_manager, run_threads
from rallypoint.integrations.local_sgd import LocalSGD

LR, STEPS, SYNC_EVERY = 0.1, 7, 3


def init_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 3, generator=g).double(), torch.randn(2, generator=g).double()]


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * replica + step)
    return torch.randn(4, 3, generator=g).double(), torch.randn(4, 2, generator=g).double()


def reference(fail_syncs: set[int] = frozenset()) -> list[list[torch.Tensor]]:
    """Plain SGD per replica; every SYNC_EVERY steps both replicas take the mean."""
    ps = [[p.clone() for p in init_params()] for _ in range(2)]
    syncs = 0
    for s in range(STEPS):
        for r in range(2):
            w, b = [p.clone().requires_grad_(True) for p in ps[r]]
            x, y = batch(r, s)
            loss = ((x @ w.T + b - y) ** 2).mean()
            gw, gb = torch.autograd.grad(loss, [w, b])
            ps[r] = [(w - LR * gw).detach(), (b - LR * gb).detach()]
        if (s + 1) % SYNC_EVERY == 0:
            if syncs not in fail_syncs:
                mean = [(a + b) / 2 for a, b in zip(ps[0], ps[1])]
                ps = [[t.clone() for t in mean] for _ in range(2)]
            syncs += 1
    return ps


def replica(lh: Any, r: int, fail_sync: int | None) -> tuple[list[torch.Tensor], int, list[bool]]:
    model = nn.Linear(3, 2).double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), init_params()):
            p.copy_(v)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    m, pg = make_manager(lh.address(), f"replica_{r}", 2, use_async_quorum=True, init_sync=False)
    m.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    results: list[bool] = []
    try:
        with LocalSGD(m, model, opt, sync_every=SYNC_EVERY) as lsgd:
            real_sync = lsgd.sync

            def sync() -> bool:
                orig = m.allreduce
                if fail_sync is not None and len(results) == fail_sync:
                    def failing(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                        work = orig(t, *a, **k)  # the real exchange: t becomes the mean

                        class Failing:
                            def wait(self, *wa: Any) -> Any:
                                out = work.wait(*wa)
                                m.report_error(RuntimeError("injected failure after the exchange"))
                                return out

                        return Failing()
                    m.allreduce = failing  # type: ignore[method-assign]
                try:
                    ok = real_sync()
                finally:
                    m.allreduce = orig  # type: ignore[method-assign]
                results.append(ok)
                return ok

            lsgd.sync = sync  # type: ignore[method-assign]
            for s in range(STEPS):
                x, y = batch(r, s)
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], m.current_step(), results
    finally:
        leave_together()
        m.shutdown(wait=False)
        pg.shutdown()


def test_local_sgd_golden_and_failed_sync(lighthouse) -> None:
    """Three runs' worth in one: syncs 0 and 1 of a 7-step run commit and match the
    reference; then a run where sync 0 fails on both replicas keeps each replica's
    local parameters (nothing committed lost) and sync 1 commits the average."""
    for fail in (None, 0):
        lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
        out = run_threads([(lambda r=r: replica(lh, r, fail)) for r in range(2)])
        want = reference(set() if fail is None else {0})
        for r in range(2):
            params, step, results = out[r]
            assert results == ([True, True] if fail is None else [False, True]), results
            assert step == (2 if fail is None else 1)
            for got, exp in zip(params, want[r]):
                assert torch.allclose(got, exp, rtol=0, atol=1e-12), (fail, r, got, exp)
        # After the last sync (step 6) one more local step ran on different data.
        assert not torch.allclose(out[0][0][0], out[1][0][0])
