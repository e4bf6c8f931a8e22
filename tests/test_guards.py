"""The silent-data-corruption guards: the pure decisions (``rallypoint.manager.guards``) as
tables, and the tensor side (``rallypoint.manager._sdc``): the gradient norm with a real
exponent bit flip, the parameter hash against a pure-Python reference and a single flipped
bit, and the exchange over a real 3-rank gloo group (threads in this process, a TCPStore on
port 0). Every wait has a timeout; the file runs in a few seconds."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_threads import gloo_group, on_ranks

from rallypoint.manager import _sdc
from rallypoint.manager.guards import (
    GradNormOptions,
    HashVerdict,
    Verdict,
    grad_norm_verdict,
    next_history,
    param_hash_verdict,
    repeat_offenders,
    should_check_params,
)

NAN, INF = math.nan, math.inf
HIST = [1.0] * 10  # a baseline of accepted norms around 1


# ------------------------------------------------------------------------ grad_norm_verdict
# (norms, history, expected bad ranks, expected basis, ambiguous, expected strikes)
CASES: list[tuple[str, dict[int, float], list[float], set[int], str, bool, set[int]]] = [
    ("all agree", {0: 1.0, 1: 1.3, 2: 0.9}, [], set(), "", False, set()),
    ("nan", {0: 1.0, 1: NAN, 2: 1.1}, [], {1}, "none", False, {1}),
    ("inf", {0: 1.0, 1: 1.2, 2: INF}, [], {2}, "none", False, {2}),
    ("-inf", {0: -INF, 1: 1.2, 2: 1.0}, [], {0}, "none", False, {0}),
    ("high outlier vs peers", {0: 1.0, 1: 12.3, 2: 1.0}, [], {1}, "peers", False, {1}),
    ("low outlier vs peers", {0: 1.0, 1: 0.05, 2: 1.0, 3: 1.1}, [], {1}, "peers", False, {1}),
    ("zeroed gradients", {0: 1.0, 1: 0.0, 2: 1.0}, [], {1}, "peers", False, {1}),
    ("huge outlier does not drag the good ones", {0: 1.0, 1: 1.0, 2: 1e30}, [], {2}, "peers", False, {2}),
    ("spread but within 10x of the median", {0: 1.0, 1: 5.0, 2: 40.0}, [], set(), "", False, set()),
    ("nan and outlier", {0: NAN, 1: 1.0, 2: 1.0, 3: 50.0}, [], {0, 3}, "peers", False, {0, 3}),
    ("job-wide jump vs history is not corruption", {0: 30.0, 1: 31.0, 2: 29.0}, HIST, set(), "", False, set()),
    ("two agree, far from history", {0: 30.0, 1: 31.0}, HIST, set(), "", False, set()),
    ("two disagree, no history: both, ambiguous", {0: 1.0, 1: 20.0}, [], {0, 1}, "none", True, set()),
    ("two disagree, short history: both", {0: 1.0, 1: 20.0}, [1.0] * 4, {0, 1}, "none", True, set()),
    ("two disagree, history decides", {0: 1.0, 1: 20.0}, HIST, {1}, "history", False, {1}),
    ("two disagree, history decides low", {0: 0.01, 1: 1.2}, HIST, {0}, "history", False, {0}),
    ("two disagree, both far from history", {0: 100.0, 1: 0.001}, HIST, {0, 1}, "none", True, set()),
    ("2-2 split, no history: all", {0: 1.0, 1: 1.0, 2: 1e3, 3: 1e3}, [], {0, 1, 2, 3}, "none", True, set()),
    ("2-2 split, history decides", {0: 1.0, 1: 1.0, 2: 1e3, 3: 1e3}, HIST, {2, 3}, "history", False, {2, 3}),
    ("nan + two disagreeing finite", {0: NAN, 1: 1.0, 2: 1e3}, [], {0, 1, 2}, "none", True, set()),
    ("one group alone: only nan/inf", {0: 1e30}, HIST, set(), "", False, set()),
    ("one group alone, nan: failed but no strike", {0: NAN}, HIST, {0}, "none", False, set()),
    ("every group nan: diverged model, no strike", {0: NAN, 1: NAN, 2: INF}, HIST, {0, 1, 2}, "none", False, set()),
    ("median zero carries no ratio", {0: 0.0, 1: 0.0, 2: 5.0}, [], set(), "", False, set()),
    ("all zero", {0: 0.0, 1: 0.0}, [], set(), "", False, set()),
    ("no groups", {}, [], set(), "", False, set()),
]


@pytest.mark.parametrize("name,norms,history,bad,basis,ambiguous,strikes", CASES, ids=[c[0] for c in CASES])
def test_grad_norm_verdict_table(
    name: str, norms: dict[int, float], history: list[float], bad: set[int], basis: str, ambiguous: bool, strikes: set[int]
) -> None:
    v = grad_norm_verdict(norms, history)
    assert v.bad == bad, v.reasons
    assert set(v.reasons) == bad
    assert v.fail_step == bool(bad) and v.ok == (not bad)
    assert v.basis == basis
    assert v.ambiguous == ambiguous
    assert v.strikes == strikes


def test_grad_norm_verdict_reasons() -> None:
    v = grad_norm_verdict({0: 1.0, 1: 12.3, 2: 1.0, 3: NAN, 4: INF})
    assert v.reasons[3] == "nan" and v.reasons[4] == "inf"
    assert v.reasons[1].startswith("outlier vs peers (x12.3 median 1")
    assert v.reference == 1.0
    v = grad_norm_verdict({0: 1.0, 1: 20.0}, HIST)
    assert v.reasons[1].startswith("outlier vs history (x20 median 1 of last 10 steps")
    v = grad_norm_verdict({0: 1.0, 1: 20.0})
    assert "no majority or history" in v.reasons[0] and v.reasons[0] == v.reasons[1]


def test_grad_norm_verdict_options() -> None:
    tight = GradNormOptions(ratio=2.0)
    assert grad_norm_verdict({0: 1.0, 1: 3.0, 2: 1.0}, options=tight).bad == {1}
    assert grad_norm_verdict({0: 1.0, 1: 3.0, 2: 1.0}).ok
    # check_low off: a vanished gradient (sparse update) is not an outlier, a huge one is
    sparse = GradNormOptions(check_low=False)
    assert grad_norm_verdict({0: 1.0, 1: 0.0, 2: 1.0}, options=sparse).ok
    assert grad_norm_verdict({0: 1.0, 1: 0.001, 2: 1.0}, options=sparse).ok
    assert grad_norm_verdict({0: 0.0, 1: 1.0}, options=sparse).ok
    assert grad_norm_verdict({0: 0.0, 1: 1.0, 2: 1.0, 3: 99.0}, options=sparse).bad == {3}
    # min_peers=2 never finds a majority of two; min_history tunes when history counts
    assert grad_norm_verdict({0: 1.0, 1: 20.0}, [1.0] * 2, GradNormOptions(min_history=2)).bad == {1}
    for bad_opts in (dict(ratio=1.0), dict(ratio=math.inf), dict(min_peers=1), dict(min_history=0)):
        with pytest.raises(ValueError):
            GradNormOptions(**bad_opts)  # type: ignore[arg-type]


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of float32 ``t`` with bit ``bit`` of element ``index`` flipped (a real bit flip)."""
    out = t.clone()
    flat = out.view(-1).view(torch.int32)
    flat[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
    return out


def _replica_grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(256, 128, generator=g) * 1e-3, torch.randn(128, generator=g) * 1e-3]


@pytest.mark.parametrize("bit,flagged", [(30, True), (29, False), (28, False), (27, False), (26, False), (24, False)])
def test_exponent_bit_flip(bit: int, flagged: bool) -> None:
    """One flipped exponent bit of one gradient element on one of three groups, on real
    tensors: 1e-3 has the biased exponent 117 (0b01110101), so flipping bit 30 multiplies it by
    2**128 (the norm explodes: flagged), while bits 29/28/27 divide it by 2**64/2**32/2**16 and
    bits 26/24 multiply it by 256/4: one element of 32k moves the norm by less than 10x, and
    the verdict must not fail the step for it."""
    grads = {r: _replica_grads(r) for r in range(3)}
    grads[1][0].view(-1)[1234] = 1e-3
    clean = {r: _sdc.grad_norm(g) for r, g in grads.items()}
    assert grad_norm_verdict(clean).ok
    norms = dict(clean)
    norms[1] = _sdc.grad_norm([_flip(grads[1][0], 1234, bit), grads[1][1]])
    factor = norms[1] / clean[1]
    assert math.isfinite(norms[1])
    assert (factor > 10) == flagged, factor
    v = grad_norm_verdict(norms, HIST)
    if flagged:
        assert factor > 1e30
        assert v.bad == {1} and v.basis == "peers" and v.strikes == {1}, v.reasons
    else:
        assert v.ok, v.reasons


def test_bit_30_flip_overflows_float32_but_reports_finite() -> None:
    """Bit 30 of a ~1e-3 float makes it ~3e35: its square overflows float32 (the fused fast
    path says Inf) but the norm is finite, so the reason is 'outlier', not 'inf'."""
    g = _replica_grads(0)
    bad = [_flip(g[0], 7, 30), g[1]]
    assert not math.isfinite(float(_sdc.grad_norm_tensor(bad)))
    n = _sdc.grad_norm(bad)
    ref = math.sqrt(sum(float((t.double() ** 2).sum()) for t in bad))
    assert math.isfinite(n) and n == pytest.approx(ref, rel=1e-9)
    v = grad_norm_verdict({0: _sdc.grad_norm(g), 1: n, 2: _sdc.grad_norm(_replica_grads(2))})
    assert v.bad == {1} and v.reasons[1].startswith("outlier vs peers")


def test_next_history() -> None:
    ok = grad_norm_verdict({0: 1.0, 1: 3.0, 2: 2.0})
    assert next_history((5.0,), {0: 1.0, 1: 3.0, 2: 2.0}, ok) == (5.0, 2.0)
    failed = grad_norm_verdict({0: 1.0, 1: 30.0, 2: 2.0})
    assert next_history((5.0,), {0: 1.0, 1: 30.0, 2: 2.0}, failed) == (5.0,)
    assert next_history((1.0, 2.0, 3.0), {0: 4.0}, Verdict(), size=3) == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        next_history((), {}, Verdict(), size=0)


# -------------------------------------------------------------------------------- strikes
def test_repeat_offenders() -> None:
    r = repeat_offenders({}, ["b"], step=10)
    assert r.strikes == {"b": (10,)} and r.evict == frozenset()
    r = repeat_offenders(r.strikes, ["b"], step=10)  # the same step counts once
    assert r.strikes == {"b": (10,)} and not r.evict
    r = repeat_offenders(r.strikes, ["a", "b"], step=50)
    assert r.evict == {"b"} and r.strikes == {"a": (50,)}  # the evicted start clean
    r = repeat_offenders(r.strikes, ["a"], step=150)  # outside the window: a fresh first strike
    assert not r.evict and r.strikes == {"a": (150,)}
    r = repeat_offenders(r.strikes, [], step=260)  # old strikes expire
    assert r.strikes == {} and not r.evict
    r = repeat_offenders({}, ["x"], step=1, limit=1)
    assert r.evict == {"x"}
    r = repeat_offenders({"y": (1, 2)}, [], step=3, limit=3, window=5)
    assert r.strikes == {"y": (1, 2)} and not r.evict
    r = repeat_offenders(r.strikes, ["y"], step=5, limit=3, window=5)
    assert r.evict == {"y"}
    with pytest.raises(ValueError):
        repeat_offenders({}, [], step=1, limit=0)
    with pytest.raises(ValueError):
        repeat_offenders({}, [], step=1, window=0)


# ----------------------------------------------------------------------------- param hash
HASH_CASES: list[tuple[str, dict[int, int], int | None, set[int], set[int], bool]] = [
    ("none", {}, None, set(), set(), False),
    ("one", {0: 7}, 7, set(), set(), False),
    ("all equal", {0: 7, 1: 7, 2: 7}, 7, set(), set(), False),
    ("one of three differs", {0: 7, 1: 9, 2: 7}, 7, {1}, {1}, False),
    ("two of five differ", {0: 7, 1: 9, 2: 7, 3: 7, 4: 8}, 7, {1, 4}, {1, 4}, False),
    ("two differ", {0: 7, 1: 9}, None, set(), {0, 1}, True),
    ("2-2 split", {0: 7, 1: 7, 2: 9, 3: 9}, None, set(), {0, 1, 2, 3}, True),
    ("all different", {0: 1, 1: 2, 2: 3}, None, set(), {0, 1, 2}, True),
    ("full 64-bit values", {0: 2**64 - 1, 1: 2**64 - 1, 2: 2**63}, 2**64 - 1, {2}, {2}, False),
]


@pytest.mark.parametrize("name,hashes,majority,minority,flagged,fail", HASH_CASES, ids=[c[0] for c in HASH_CASES])
def test_param_hash_verdict(
    name: str, hashes: dict[int, int], majority: int | None, minority: set[int], flagged: set[int], fail: bool
) -> None:
    v = param_hash_verdict(hashes)
    assert isinstance(v, HashVerdict)
    assert v.majority == majority
    assert v.minority == minority and v.flagged == flagged and set(v.reasons) == flagged
    assert v.fail_step == fail and v.ok == (not flagged)


def test_param_hash_verdict_reason() -> None:
    v = param_hash_verdict({0: 0xAB, 1: 0xCD, 2: 0xAB})
    assert v.reasons[1] == (
        "parameter hash 0x00000000000000cd differs from the majority's 0x00000000000000ab (2 of 3 groups)"
    )


@pytest.mark.parametrize(
    "step,every,expected",
    [(0, 10, False), (10, 10, True), (11, 10, False), (20, 10, True), (5, 0, False), (1, 1, True), (0, 0, False)],
)
def test_should_check_params(step: int, every: int, expected: bool) -> None:
    assert should_check_params(step, every) is expected


def test_should_check_params_rejects_negative() -> None:
    with pytest.raises(ValueError):
        should_check_params(10, -1)


# ------------------------------------------------------------------------------ grad_norm
def test_grad_norm_matches_float64() -> None:
    g = torch.Generator().manual_seed(3)
    ts: list[torch.Tensor | None] = [torch.randn(100, 7, generator=g), None, torch.randn(3, generator=g, dtype=torch.float64)]
    ref = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts if t is not None))
    assert _sdc.grad_norm(ts) == pytest.approx(ref, rel=1e-6)
    assert _sdc.grad_norm_tensor(ts).dtype == torch.float64
    assert _sdc.grad_norm([]) == 0.0 and _sdc.grad_norm([None]) == 0.0
    # half precision: a float16 sum of squares would overflow, ours does not
    h = torch.full((4,), 60000.0, dtype=torch.float16)
    assert _sdc.grad_norm([h]) == pytest.approx(120000.0, rel=1e-3)
    # a sparse gradient (nn.Embedding(sparse=True)) counts its values
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([3.0, 4.0]), (5,), check_invariants=True)
    assert _sdc.grad_norm([sp]) == pytest.approx(5.0)


def test_grad_norm_nan_inf() -> None:
    a = torch.ones(10)
    assert math.isnan(_sdc.grad_norm([a, torch.tensor([1.0, NAN])]))
    assert _sdc.grad_norm([a, torch.tensor([INF, 1.0])]) == INF
    assert math.isnan(_sdc.grad_norm([torch.tensor([INF]), torch.tensor([NAN])]))
    assert _sdc.grad_norm([torch.tensor([-INF], dtype=torch.bfloat16)]) == INF


# ------------------------------------------------------------------------------ param hash
M64 = (1 << 64) - 1


def _splitmix_weight(j: int) -> int:
    z = (_sdc._SEED + (j + 1) * _sdc._GOLDEN) & M64
    z = ((z ^ (z >> 30)) * _sdc._MIX1) & M64
    z = ((z ^ (z >> 27)) * _sdc._MIX2) & M64
    return (z ^ (z >> 31)) | 1


def _reference_hash(tensors: list[torch.Tensor]) -> int:
    """The hash's definition in plain Python integers (see ``_sdc.param_hash``)."""
    weights = [_splitmix_weight(j) for j in range(_sdc.BLOCK_WORDS)]
    acc = 0
    for t in tensors:
        data = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
        acc = (acc * _sdc._P + len(data)) & M64
        data += b"\0" * (-len(data) % 8)
        words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
        for start in range(0, len(words), _sdc.BLOCK_WORDS):
            block = words[start : start + _sdc.BLOCK_WORDS]
            s = sum((w ^ (w >> 32)) * weights[j] for j, w in enumerate(block)) & M64
            acc = (acc * _sdc._P + s) & M64
    return acc


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 33, generator=g), torch.randn(7, generator=g), torch.randn(5, generator=g).to(torch.bfloat16)]


def test_param_hash_matches_the_reference() -> None:
    """Wrapping int64 arithmetic in torch equals the definition in exact integers: the value
    is a function of the bytes alone (so every process, machine and device agrees)."""
    ps = _params()
    assert _sdc.param_hash(ps) == _reference_hash(ps)
    big = [torch.arange(2 * _sdc.BLOCK_WORDS + 3, dtype=torch.int64) * 0x9E3779B97F4A7C1, torch.tensor([True, False, True])]
    assert _sdc.param_hash(big) == _reference_hash(big)
    assert _sdc.param_hash([]) == 0


def test_param_hash_golden_value() -> None:
    """Pinned: a change of the algorithm (or of how torch wraps int64) shows up here, not as
    replicas that disagree after an upgrade of some of them."""
    t = torch.arange(20, dtype=torch.float32) / 7
    assert _sdc.param_hash([t]) == _reference_hash([t]) == 0xFCE667980145B1EF


def test_param_hash_is_independent_of_the_kernel_split() -> None:
    t = torch.randn(5 * _sdc.BLOCK_WORDS * 2 + 11, generator=torch.Generator().manual_seed(1))
    values = {_sdc.param_hash_tensor([t], max_blocks=mb).item() for mb in (1, 2, 3, 64)}
    assert len(values) == 1


def test_param_hash_equal_for_equal_bytes() -> None:
    a, b = _params(0), [p.clone() for p in _params(0)]
    assert _sdc.param_hash(a) == _sdc.param_hash(b)
    # non-contiguous and misaligned views hash like their contiguous copies
    m = torch.randn(40, 30)
    assert _sdc.param_hash([m.t()]) == _sdc.param_hash([m.t().contiguous()])
    flat = torch.randn(1001)
    view = flat[1:1000]  # 4-byte offset: not 8-byte aligned
    assert _sdc.param_hash([view]) == _sdc.param_hash([view.clone()])


def test_param_hash_sensitive_to_order_and_split() -> None:
    a, b = torch.randn(16), torch.randn(16)
    assert _sdc.param_hash([a, b]) != _sdc.param_hash([b, a])
    assert _sdc.param_hash([a, b]) != _sdc.param_hash([torch.cat([a, b])])
    assert _sdc.param_hash([torch.zeros(3)]) != _sdc.param_hash([torch.zeros(4)])


def test_param_hash_every_single_bit_flip() -> None:
    """Every bit of a small odd-sized tensor (tail word included), and bits across the blocks
    of a larger one: one flipped bit always changes the hash."""
    small = torch.randn(37, generator=torch.Generator().manual_seed(5))  # 148 bytes
    h0 = _sdc.param_hash([small])
    seen = {h0}
    raw = small.view(torch.uint8)
    for i in range(raw.numel()):
        for bit in range(8):
            f = raw.clone()
            f[i] ^= 1 << bit
            h = _sdc.param_hash([f.view(torch.float32)])
            assert h != h0, (i, bit)
            seen.add(h)
    assert len(seen) == 1 + raw.numel() * 8  # no two flips collide either
    big = torch.randn(3 * _sdc.BLOCK_WORDS * 2 + 5, generator=torch.Generator().manual_seed(6))
    hb = _sdc.param_hash([torch.ones(3), big])
    for idx in (0, 1, _sdc.BLOCK_WORDS * 2 - 1, _sdc.BLOCK_WORDS * 2, big.numel() - 1):
        for bit in (0, 22, 23, 30, 31):
            assert _sdc.param_hash([torch.ones(3), _flip(big, idx, bit)]) != hb, (idx, bit)


def test_param_hash_sign_bits_of_two_words() -> None:
    """The weakness of a plain wrapping sum (2**63 + 2**63 == 0 mod 2**64) does not apply to
    the top bits of two words in different blocks: the block sums are multiplied by distinct
    powers of P."""
    t = torch.randn(4 * _sdc.BLOCK_WORDS)
    h0 = _sdc.param_hash([t])
    f = _flip(_flip(t, 1, 31), 2 * _sdc.BLOCK_WORDS + 1, 31)  # bit 63 of two words
    assert _sdc.param_hash([f]) != h0


# ------------------------------------------------------------------------- u64 conversions
@pytest.mark.parametrize("h", [0, 1, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1])
def test_u64_round_trips(h: int) -> None:
    hi, lo = _sdc.u64_to_halves(h)
    assert _sdc.halves_to_u64(hi, lo) == h
    assert _sdc.i64_to_u64(_sdc.u64_to_i64(h)) == h
    assert -(2**63) <= _sdc.u64_to_i64(h) < 2**63


def test_u64_rejects() -> None:
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            _sdc.u64_to_halves(bad)
        with pytest.raises(ValueError):
            _sdc.u64_to_i64(bad)
    for half in (0.5, -1.0, 2.0**32, NAN):
        with pytest.raises(ValueError):
            _sdc.halves_to_u64(half, 0.0)


# -------------------------------------------------------------------------------- exchange
WORLD = 3
TIMEOUT = timedelta(seconds=10)


def _on_ranks(fn: Callable[[int], Any], n: int = WORLD, timeout: float = 15.0) -> dict[int, Any]:
    return on_ranks(fn, n, timeout)


@pytest.fixture(scope="module")
def gloo3() -> Any:
    """A real 3-rank gloo group (one per thread) on a TCPStore that picked its own port."""
    yield from gloo_group(WORLD, "sdc", TIMEOUT)


def test_exchange_floats_over_gloo(gloo3: dict[int, Any]) -> None:
    rows_in = {0: [1.25, -0.0, 3e-300], 1: [NAN, INF, -INF], 2: [1e308, 0.1, 2.0**-1074]}
    out = _on_ranks(lambda r: _sdc.exchange(gloo3[r], r, WORLD, rows_in[r], TIMEOUT))
    for r in range(WORLD):
        rows = out[r]
        assert rows[0] == [1.25, 0.0, 3e-300] and rows[2] == [1e308, 0.1, 2.0**-1074]  # exact
        assert math.isnan(rows[1][0]) and rows[1][1:] == [INF, -INF]  # NaN/Inf stay in their row


HASHES = {0: 2**64 - 1, 1: 2**63 + 12345, 2: 2**53 + 1}


def test_exchange_hash_as_float_halves(gloo3: dict[int, Any]) -> None:
    """A 64-bit hash rides in the float64 exchange as two exact 32-bit halves, next to the norm."""
    out = _on_ranks(
        lambda r: _sdc.exchange(gloo3[r], r, WORLD, [0.5 * r, *_sdc.u64_to_halves(HASHES[r])], 5.0)
    )
    for r in range(WORLD):
        got = {q: _sdc.halves_to_u64(row[1], row[2]) for q, row in enumerate(out[r])}
        assert got == HASHES
        assert [row[0] for row in out[r]] == [0.0, 0.5, 1.0]
    # whereas a hash squeezed into one float64 would lose its low bits
    assert int(float(HASHES[2])) != HASHES[2]


def test_exchange_ints_exact(gloo3: dict[int, Any]) -> None:
    out = _on_ranks(lambda r: _sdc.exchange_ints(gloo3[r], r, WORLD, [_sdc.u64_to_i64(HASHES[r]), -r], TIMEOUT))
    for r in range(WORLD):
        assert {q: _sdc.i64_to_u64(row[0]) for q, row in enumerate(out[r])} == HASHES
        assert [row[1] for row in out[r]] == [0, -1, -2]


def test_exchange_real_hashes_and_verdict(gloo3: dict[int, Any]) -> None:
    """End to end: three groups hash their parameters, one has a flipped bit, the exchange
    tells everyone, and every group reaches the same verdict naming that group."""
    base = _params(1)

    def group(r: int) -> HashVerdict:
        ps = [p.clone() for p in base]
        if r == 2:
            ps[0] = _flip(ps[0], 17, 3)
        mine = _sdc.param_hash(ps)
        rows = _sdc.start_exchange(gloo3[r], r, WORLD, list(_sdc.u64_to_halves(mine))).wait(TIMEOUT)
        return param_hash_verdict({q: _sdc.halves_to_u64(*row) for q, row in enumerate(rows)})

    out = _on_ranks(group)
    assert all(v.minority == {2} and not v.fail_step for v in out.values())
    assert len({v.majority for v in out.values()}) == 1


def test_exchange_timeout_then_completes(gloo3: dict[int, Any]) -> None:
    """A rank that never joins: the others' wait ends at the timeout with a clear error.
    (The late rank then joins, which completes the collective, so the group stays usable.)"""
    pending = {r: _sdc.start_exchange(gloo3[r], r, WORLD, [1.0]) for r in (0, 1)}
    with pytest.raises(_sdc.SdcExchangeError, match="replica rank 0 of 3.*step must fail"):
        pending[0].wait(0.2)
    late = _sdc.start_exchange(gloo3[2], 2, WORLD, [1.0])
    assert late.wait(TIMEOUT) == [[1.0]] * 3
    assert pending[1].wait(TIMEOUT) == [[1.0]] * 3


def _quorum(r: int, step: int) -> Any:
    from rallypoint.manager.recovery import QuorumResult

    return QuorumResult(quorum_id=7, replica_rank=r, replica_world_size=WORLD, recover_src_manager_address="",
                        recover_src_replica_rank=None, recover_dst_replica_ranks=[], store_address="",
                        max_step=step, max_replica_rank=None, max_world_size=WORLD, heal=False, commit_failures=0,
                        replica_ids=[f"g{q}" for q in range(WORLD)])


class _Posted:
    """What the Manager's FailFast gives the guard: ``add_work(start)`` posts."""

    def add_work(self, start: Callable[[], Any]) -> Any:
        return start()


def test_guard_exchange_posted_behind_the_gradients(gloo3: dict[int, Any]) -> None:
    """``post_early`` (the DDP wrapper's last bucket) posts the row at once; tensors
    allreduced after it (a logged loss) do not count; ``check`` then only waits, and every
    group reaches the same verdict naming the corrupt one. A round without an early post
    still exchanges in ``check`` (the fallback every other integration uses)."""
    import logging

    from rallypoint.manager._guard import SdcGuard

    log = logging.LoggerAdapter(logging.getLogger("test"), {})
    guards_ = {r: SdcGuard(True, 0, log) for r in range(WORLD)}
    for r, g in guards_.items():
        g.new_round()
        g.observe(torch.full((1000,), 1e6 if r == 2 else 0.01), contributes=True)

    def early(r: int) -> tuple[str | None, dict[str, Any]]:
        g = guards_[r]
        g.post_early(gloo3[r], _quorum(r, 5), True, f"g{r}", _Posted())
        g.observe(torch.full((4,), 1e9), contributes=True)  # after the ride: not this round's
        return g.check(gloo3[r], _quorum(r, 5), True, TIMEOUT, f"g{r}")

    out = _on_ranks(early)
    for r in range(WORLD):
        why, done = out[r]
        assert why is not None and "g2 (outlier" in why, why
        assert done["sdc_bad"] == ["g2"] and guards_[r].early_exchanges == 1
    for r, g in guards_.items():  # the next round, with no early post: exchanged in check
        g.new_round()
        g.observe(torch.full((1000,), 0.01 * (r + 1)), contributes=True)
    out = _on_ranks(lambda r: guards_[r].check(gloo3[r], _quorum(r, 6), True, TIMEOUT, f"g{r}"))
    assert all(why is None for why, _ in out.values()), out
    assert all(g.early_exchanges == 1 for g in guards_.values())


class _FakeWork:
    def __init__(self, result: bool | Exception) -> None:
        self.result = result

    def wait(self, timeout: timedelta) -> bool:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


class _FakePG:
    def __init__(self, result: bool | Exception) -> None:
        self.result = result
        self.calls: list[tuple[list[torch.Tensor], Any]] = []

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> _FakeWork:
        self.calls.append((tensors, op))
        return _FakeWork(self.result)


def test_exchange_with_any_pg_like() -> None:
    pg = _FakePG(True)
    assert _sdc.exchange(pg, 1, 3, [2.5], 1.0) == [[0.0], [2.5], [0.0]]
    (tensors, op), = pg.calls
    assert op == dist.ReduceOp.SUM and tensors[0].dtype == torch.float64 and tensors[0].shape == (3, 1)
    with pytest.raises(_sdc.SdcExchangeError, match="did not complete within 1 s"):
        _sdc.exchange(_FakePG(False), 0, 2, [1.0], 1.0)
    with pytest.raises(_sdc.SdcExchangeError, match="boom"):
        _sdc.exchange(_FakePG(RuntimeError("boom")), 0, 2, [1.0], 1.0)
    buf = _sdc.exchange_buffer(2, 3, [1.5], dtype=torch.float32)  # to ride in a float32 gradient allreduce
    assert buf.dtype == torch.float32 and buf.tolist() == [[0.0], [0.0], [1.5]]
    out = torch.full((10,), 9.0, dtype=torch.float64)  # into the tail of a given tensor: cleared, own row set
    assert _sdc.exchange_buffer(1, 2, [1.0, 2.0], out=out[6:].view(2, 2)).data_ptr() == out[6:].data_ptr()
    assert out.tolist() == [9.0] * 6 + [0.0, 0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="shape"):
        _sdc.exchange_buffer(0, 3, [1.0, 2.0], out=out[6:].view(2, 2))  # nothing written on a bad shape
    assert out.tolist() == [9.0] * 6 + [0.0, 0.0, 1.0, 2.0]
    with pytest.raises(ValueError):
        _sdc.start_exchange(pg, 3, 3, [1.0])
    with pytest.raises(ValueError):
        _sdc.start_exchange(pg, 0, 3, [])


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hash_and_norm_on_device() -> None:
    """On CUDA the hash and the norm run on the device (their results are 0-d CUDA tensors:
    the host sees 8 bytes) and equal the CPU's values."""
    cpu = _params(2) + [torch.randn(3 * _sdc.BLOCK_WORDS * 2 + 7)]
    cuda = [p.cuda() for p in cpu]
    hd = _sdc.param_hash_tensor(cuda)
    assert hd.device.type == "cuda"
    assert _sdc.i64_to_u64(int(hd.item())) == _sdc.param_hash(cpu)
    flipped = [p.clone() for p in cuda]
    flipped[-1] = _flip(flipped[-1], 5, 30)
    assert _sdc.param_hash(flipped) != _sdc.param_hash(cuda)
    assert _sdc.grad_norm_tensor(cuda).device.type == "cuda"
    assert _sdc.grad_norm(cuda) == pytest.approx(_sdc.grad_norm(cpu), rel=1e-5)
