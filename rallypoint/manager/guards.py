"""Silent-data-corruption guards: the decisions, as pure functions over plain data.

A replica group that computes wrong numbers without crashing (a flipped bit in a gradient, a
parameter that drifted from its peers) must never get its numbers committed. Two checks:

- **gradient norm** (every step, before the gradients are averaged): each participating group
  contributes the L2 norm of its own local gradients, one float; :func:`grad_norm_verdict`
  says which groups are bad and whether the step must fail (nothing committed, anywhere);
- **parameter hash** (every ``--sdc-check-every`` committed steps): after a commit every group
  must hold bit-identical parameters; :func:`param_hash_verdict` names the minority to heal
  from the majority, or fails the step when there is no majority.

:func:`repeat_offenders` is the strike bookkeeping (a group flagged again within a window is
evicted and must heal before it contributes again) and :func:`next_history` keeps the window
of accepted norms the gradient check compares against.

No torch, no I/O, no clock: the manager (``manager.py``) feeds these with the numbers that
``_sdc.py`` computes and exchanges, and acts on the answers; tests call them with tables.
Replica groups are named by their replica rank in the step's quorum (``int``) where a
verdict is about one step, and by replica id (``str``) where state outlives a quorum (strikes).

The principle behind every rule here: silent corruption hits **one** group (rarely two at
once); a change that every group sees alike (a loss spike, a divergence to NaN, a new phase
of training) is the data or the model, not corruption, and must not be blamed on anyone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "GradNormOptions",
    "HashVerdict",
    "StrikeResult",
    "Verdict",
    "grad_norm_verdict",
    "next_history",
    "param_hash_verdict",
    "repeat_offenders",
    "should_check_params",
]


# ---------------------------------------------------------------------------- gradient norm
@dataclass(frozen=True)
class GradNormOptions:
    """Thresholds of the gradient-norm check.

    ``ratio``: a finite norm is an outlier when it is more than ``ratio`` times the reference
    norm, or less than ``1/ratio`` of it. 10x by default: one exponent bit flipped in one
    gradient element moves the norm by many orders of magnitude (a flip of bit 30 of a float32
    turns 0.01 into ~3e36), while replicas of the same model on batches of the same data
    agree within a small factor; 10x leaves room for noisy small batches.

    ``min_peers``: the cross-replica test needs at least this many finite norms (3: with two,
    a disagreement cannot say which one is wrong; the history decides instead).

    ``min_history``: the history test needs at least this many accepted norms (a median over
    fewer steps is not yet a baseline, e.g. during the first steps of training).

    ``check_low``: whether a norm far *below* the reference is an outlier too (gradients
    zeroed by a broken kernel or a dropped batch); off for models whose gradients are
    legitimately zero on some groups (sparse updates).
    """

    ratio: float = 10.0
    min_peers: int = 3
    min_history: int = 5
    check_low: bool = True

    def __post_init__(self) -> None:
        if not (self.ratio > 1.0 and math.isfinite(self.ratio)):
            raise ValueError(f"GradNormOptions.ratio must be a finite number > 1, got {self.ratio!r}")
        if self.min_peers < 2:
            raise ValueError(f"GradNormOptions.min_peers must be >= 2, got {self.min_peers!r}")
        if self.min_history < 1:
            raise ValueError(f"GradNormOptions.min_history must be >= 1, got {self.min_history!r}")


@dataclass(frozen=True)
class Verdict:
    """The gradient-norm check's answer for one step.

    ``bad``: the replica ranks flagged; ``reasons``: one line per flagged rank (for events and
    logs); ``basis``: what the outliers were measured against (``"peers"``, ``"history"``,
    ``"none"`` when only NaN/Inf or an unresolvable disagreement flagged anyone, ``""`` when
    nothing was flagged); ``reference``: that reference norm; ``ambiguous``: flagged because
    groups disagree and nothing can say which one is wrong (no majority, no history).
    ``strikes``: the ranks that earn a strike (see :func:`repeat_offenders`): the bad ones,
    except when the verdict cannot attribute the fault (ambiguous, or every group flagged).
    """

    bad: frozenset[int] = frozenset()
    reasons: Mapping[int, str] = field(default_factory=dict)
    basis: str = ""
    reference: float | None = None
    ambiguous: bool = False
    participants: int = 0

    @property
    def fail_step(self) -> bool:
        """True when the step must fail everywhere: nothing is committed."""
        return bool(self.bad)

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def strikes(self) -> frozenset[int]:
        if self.ambiguous or len(self.bad) >= self.participants:
            return frozenset()
        return self.bad


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2.0


def _band(value: float, ref: float, opts: GradNormOptions) -> float | None:
    """``value / ref`` when ``value`` is outside the band around ``ref``, else None.

    A reference of 0 (or below) cannot carry a ratio: nothing is compared against it (a
    zero median means most groups have no gradient at all this step; blaming the one that
    has some would fail every step of a sparse model)."""
    if not ref > 0.0:
        return None
    x = value / ref
    if x > opts.ratio or (opts.check_low and x < 1.0 / opts.ratio):
        return x
    return None


def _agree(values: Sequence[float], opts: GradNormOptions) -> bool:
    """Whether all ``values`` lie within one factor of ``ratio`` of each other.

    Zeros: with ``check_low`` a zero next to a positive norm disagrees with it (a group whose
    gradients vanished); without, zeros are left out (sparse updates)."""
    vals = list(values) if opts.check_low else [v for v in values if v > 0.0]
    if not vals:
        return True
    lo, hi = min(vals), max(vals)
    if hi <= 0.0:
        return True
    return lo > 0.0 and hi / lo <= opts.ratio


def grad_norm_verdict(
    norms: Mapping[int, float],
    history: Sequence[float] = (),
    options: GradNormOptions | None = None,
) -> Verdict:
    """Which groups' gradients are bad this step, and whether the step must fail.

    ``norms``: replica rank -> the L2 norm of that group's local gradients this step (before
    averaging), for the groups that *contribute* gradients (a spare that contributes zeros
    must be left out, or its zero norm is a low outlier). ``history``: recent accepted norms,
    e.g. the medians of the last N committed steps (:func:`next_history`).

    Rules, in order:

    1. A NaN or Inf norm is bad, always (reason ``"nan"``/``"inf"``).
    2. When the finite norms all lie within ``ratio`` of each other, nothing more is flagged,
       even when all of them moved far from the history. Why: a change that every group sees
       alike is the data or the model (a loss spike, a learning-rate phase), not silent
       corruption, which hits one group; flagging everyone would fail every step after a
       legitimate jump and stall the job.
    3. With at least ``min_peers`` finite norms, the reference is their median (each group's
       own norm included, so one huge outlier cannot drag the reference of the good ones,
       as "the median of the others" would with three groups): the groups outside
       ``[median/ratio, median*ratio]`` are outliers, provided the groups inside are a strict
       majority of the finite ones ("outlier vs peers (x12.3 median ...)"). A median of 0
       (most groups have no gradient at all) carries no ratio: nothing is flagged.
    4. Otherwise (two groups, or no majority), with at least ``min_history`` accepted norms,
       the reference is the history's median: the groups outside its band are outliers,
       provided at least one group is inside it ("outlier vs history ...").
    5. Otherwise the groups disagree and nothing can say which is wrong: the step fails,
       every finite group is flagged and ``ambiguous`` is set. In particular **two groups with
       no history** that disagree beyond ``ratio`` are both flagged and the step fails. Why:
       committing would average a possibly corrupt gradient into every replica's parameters,
       which no later check can undo, while a failed step costs one step; naming both tells
       the operator which pair to look at; and no strike is given (:attr:`Verdict.strikes` is
       empty) because blaming one by chance could evict the healthy group. Once the history
       holds ``min_history`` committed steps, rule 4 decides such cases, so this costs at most
       a few early steps.

    Every group that is flagged fails the step (:attr:`Verdict.fail_step`); only the
    attributable ones earn strikes (:attr:`Verdict.strikes`): not those of an ambiguous
    verdict, and nobody when every group is flagged (all NaN is a diverged model, not
    corruption).

    A single group (``len(norms) == 1``) is only checked for NaN/Inf: alone, a corrupt
    gradient and a loss spike look the same, and failing steps on the history alone could
    stall a job forever after a legitimate jump.
    """
    opts = options or GradNormOptions()
    reasons: dict[int, str] = {}
    finite: dict[int, float] = {}
    for rank, value in norms.items():
        v = float(value)
        if math.isnan(v):
            reasons[rank] = "nan"
        elif math.isinf(v):
            reasons[rank] = "inf"
        else:
            finite[rank] = v

    basis = "none" if reasons else ""
    reference: float | None = None
    ambiguous = False
    values = list(finite.values())
    n = len(values)
    if n >= 2 and not _agree(values, opts):
        decided = False
        if n >= opts.min_peers:
            med = _median(values)
            out = {r: x for r, v in finite.items() if (x := _band(v, med, opts)) is not None}
            if not med > 0.0:
                decided = True  # most groups have no gradient: a zero carries no ratio
            elif n - len(out) > n / 2:
                for r, x in out.items():
                    reasons[r] = f"outlier vs peers (x{x:.3g} median {med:.3g})"
                if out:
                    basis, reference = "peers", med
                decided = True
        if not decided and len(history) >= opts.min_history:
            med = _median([float(h) for h in history])
            out = {r: x for r, v in finite.items() if (x := _band(v, med, opts)) is not None}
            if med > 0.0 and len(out) < n:
                for r, x in out.items():
                    reasons[r] = f"outlier vs history (x{x:.3g} median {med:.3g} of last {len(history)} steps)"
                if out:
                    basis, reference = "history", med
                decided = True
        if not decided:
            ambiguous, basis = True, "none"
            lo, hi = min(values), max(values)
            for r in finite:
                reasons[r] = (
                    f"groups disagree (norms {lo:.3g} .. {hi:.3g}, over x{opts.ratio:g}) "
                    "with no majority or history to tell which is wrong"
                )
    return Verdict(
        bad=frozenset(reasons),
        reasons=reasons,
        basis=basis,
        reference=reference,
        ambiguous=ambiguous,
        participants=len(norms),
    )


def next_history(
    history: Sequence[float], norms: Mapping[int, float], verdict: Verdict, size: int = 50
) -> tuple[float, ...]:
    """The history after a step: with the median of the step's accepted (finite, unflagged)
    norms appended when the step passed the check, the last ``size`` entries kept.

    Why the median: it is the group-size-independent figure the history rule compares one
    group against, and a failed step adds nothing, so a corrupt norm never becomes normal.
    The caller appends only for steps that were committed."""
    if size < 1:
        raise ValueError(f"history size must be >= 1, got {size!r}")
    kept = list(history)
    if verdict.ok:
        good = [float(v) for r, v in norms.items() if r not in verdict.bad and math.isfinite(float(v))]
        if good:
            kept.append(_median(good))
    return tuple(kept[-size:])


# -------------------------------------------------------------------------------- strikes
@dataclass(frozen=True)
class StrikeResult:
    """``strikes``: replica id -> the steps at which it was flagged, within the window
    (evicted groups start clean); ``evict``: the groups to evict and heal now."""

    strikes: Mapping[str, tuple[int, ...]]
    evict: frozenset[str]


def repeat_offenders(
    strikes: Mapping[str, Sequence[int]],
    flagged: Iterable[str],
    step: int,
    limit: int = 2,
    window: int = 100,
) -> StrikeResult:
    """Strike bookkeeping: a group flagged ``limit`` times within ``window`` steps is evicted.

    ``strikes``: the previous answer's ``strikes``; ``flagged``: the replica ids that earned a
    strike at ``step`` (:attr:`Verdict.strikes` or :attr:`HashVerdict.flagged`, mapped from
    replica ranks to ids). Why a window: one cosmic-ray flip a week is not a broken GPU, two
    within a few minutes are. An evicted group's strikes are cleared: it comes back only after
    healing from a healthy peer, with fresh state. The caller never evicts below
    ``min_replicas`` (that is the quorum's rule, not this bookkeeping's).
    """
    if limit < 1:
        raise ValueError(f"strike limit must be >= 1, got {limit!r}")
    if window < 1:
        raise ValueError(f"strike window must be >= 1, got {window!r}")
    oldest = step - window + 1
    out: dict[str, tuple[int, ...]] = {}
    for rid, steps in strikes.items():
        recent = tuple(s for s in steps if oldest <= s <= step)
        if recent:
            out[rid] = recent
    for rid in sorted(set(flagged)):
        prev = out.get(rid, ())
        if step not in prev:
            out[rid] = prev + (step,)
    evict = frozenset(rid for rid, steps in out.items() if len(steps) >= limit)
    for rid in evict:
        del out[rid]
    return StrikeResult(strikes=out, evict=evict)


# ----------------------------------------------------------------------------- param hash
@dataclass(frozen=True)
class HashVerdict:
    """The parameter-hash check's answer.

    ``majority``: the hash a strict majority holds (None when there is none); ``minority``:
    the ranks that differ from it, to be evicted and healed from a majority member;
    ``flagged``: the ranks named in the event (the minority, or every rank when there is no
    majority); ``reasons``: one line per flagged rank; ``fail_step``: no majority, nobody
    holds trusted parameters, nothing may be committed.
    """

    majority: int | None
    minority: frozenset[int] = frozenset()
    flagged: frozenset[int] = frozenset()
    reasons: Mapping[int, str] = field(default_factory=dict)
    fail_step: bool = False

    @property
    def ok(self) -> bool:
        """All hashes equal."""
        return not self.flagged


def param_hash_verdict(hashes: Mapping[int, int]) -> HashVerdict:
    """Compare the groups' 64-bit parameter hashes (replica rank -> hash) after a commit.

    Every group that committed must hold bit-identical parameters (they applied the same
    averaged gradients to the same state). All equal: ok. A hash held by a strict majority
    wins: the others are the minority, named to be evicted and healed from the majority (the
    step itself stands: the majority's parameters are the committed ones). No strict majority
    (two groups that differ, a 2-2 split, all different): nobody can be trusted as a healing
    source, so the step fails and every group is flagged. With one group there is nothing to
    compare: ok.
    """
    if not hashes:
        return HashVerdict(majority=None)
    counts: dict[int, int] = {}
    for h in hashes.values():
        counts[int(h)] = counts.get(int(h), 0) + 1
    n = len(hashes)
    top, top_count = max(counts.items(), key=lambda kv: kv[1])
    if top_count == n:
        return HashVerdict(majority=top)
    if top_count * 2 > n:
        minority = frozenset(r for r, h in hashes.items() if int(h) != top)
        reasons = {
            r: f"parameter hash {int(hashes[r]):#018x} differs from the majority's {top:#018x} "
            f"({top_count} of {n} groups)"
            for r in minority
        }
        return HashVerdict(majority=top, minority=minority, flagged=minority, reasons=reasons)
    reasons = {
        r: f"parameter hash {int(h):#018x}: groups disagree and no hash is held by a majority of {n}"
        for r, h in hashes.items()
    }
    return HashVerdict(majority=None, flagged=frozenset(hashes), reasons=reasons, fail_step=True)


def should_check_params(step: int, every: int) -> bool:
    """Whether the parameter hashes are compared after committed step ``step``.

    ``every``: ``--sdc-check-every`` committed steps; 0 turns the check off. Step 0 (nothing
    committed yet; the groups were just synchronised from one source) is never checked."""
    if every < 0:
        raise ValueError(f"--sdc-check-every must be >= 0 (0 = off), got {every!r}")
    return every > 0 and step > 0 and step % every == 0
