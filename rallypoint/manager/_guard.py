"""The silent-corruption guard a ``Manager`` holds: the gradient-norm check (every round)
and the parameter-hash check (every ``sdc_check_every`` committed steps), carried out in
``should_commit`` before the group's vote.

How a round is checked: :meth:`SdcGuard.observe` takes the L2 norm of every tensor the
round sends to ``allreduce`` (the replica's own gradients, before they are averaged); in
``should_commit`` every member of the quorum exchanges one row ``[norm valid, norm, hash
valid, hash hi, hash lo]`` with ONE small SUM allreduce on the cross-replica process group
(``_sdc.exchange``), and all of them apply the same pure rules (``guards.py``) to the same
rows, so they reach the same verdict without another round trip. Under rallypoint's DDP
the rows ride in the last gradient bucket's own allreduce (:meth:`SdcGuard.post_riding`,
through ``Manager.allreduce_last``; :mod:`._ride`), or, where that bucket cannot carry them
(bf16/fp16 gradients, a large CPU bucket), their allreduce is posted right behind it
(:meth:`SdcGuard.post_early`, through ``Manager.gradients_posted``); either way
``should_commit`` only reads the result:

- a NaN/Inf or outlier gradient norm fails the step everywhere (every group's rank votes
  false, nothing is committed) and names the group; a group flagged again within the
  strike window is made to heal: in the next round it sends zeros and votes false while the
  others commit (their mean keeps its usual divisor, so every replica applies the same
  update whatever strike records each holds), falls one step behind and heals from a
  healthy peer;
- parameter hashes that differ: a minority votes false (the majority commits), falls behind
  and heals from the majority; without a majority (two groups) the step fails everywhere,
  every group is named, and that step is not checked again (nothing says who is right).

Every member takes part in the exchange, healing and spare ones too (their rows are marked
invalid), so the collective always matches. Every replica group of the job must use the
same settings: a group that skips the exchange leaves its peers waiting for the collective
until the timeout. Off by default (the exchange is one more collective per step, and a
torchft replica in the quorum would not take part).

Parameters are what :meth:`SdcGuard.register_params` was given (rallypoint's
``DistributedDataParallel`` registers its module's): not the whole state, because buffers
such as BatchNorm statistics legitimately differ between replicas.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from rallypoint.manager import _ride, guards
from rallypoint.manager._sdc import (SdcExchangeError, grad_norm_tensor, halves_to_u64, param_hash, start_exchange,
                                     u64_to_halves)
from rallypoint.manager.recovery import QuorumResult

#: Environment switches (the Manager's arguments win): the gradient check on/off, and the
#: parameter check's interval in committed steps (0: off).
GRAD_CHECK_ENV = "RALLYPOINT_SDC_CHECK"
CHECK_EVERY_ENV = "RALLYPOINT_SDC_CHECK_EVERY"
SDC_PREFIX = "silent data corruption"


class _Early:
    """An exchange posted behind the round's last gradient bucket (:meth:`SdcGuard.post_early`)."""

    def __init__(self, values: list[float], do_hash: bool, step: int, device: torch.device | None) -> None:
        self.values, self.do_hash, self.step, self.device = values, do_hash, step, device
        self.pending: Any = None
        self.error: Exception | None = None


class SdcGuard:
    """One rank's corruption checks (see the module docstring)."""

    def __init__(self, grad_check: bool, check_every: int, log: logging.LoggerAdapter,
                 options: guards.GradNormOptions | None = None, strike_limit: int = 2, strike_window: int = 100) -> None:
        if check_every < 0:
            raise ValueError(f"sdc_check_every must be >= 0 (0: off), got {check_every}")
        self.grad_check = bool(grad_check)
        self.check_every = int(check_every)
        self._log = log
        self._options = options or guards.GradNormOptions()
        self._limit, self._window = strike_limit, strike_window
        self._norms: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._history: tuple[float, ...] = ()
        self._strikes: dict[str, tuple[int, ...]] = {}
        self._params: list[torch.Tensor] = []
        self._last_hash_step = -1
        self._sit_out: frozenset[str] = frozenset()  # repeat offenders: sit out the next round and heal
        self._warned_no_params = False
        self._early: _Early | None = None  # this round's exchange, posted behind its last gradient bucket
        self.early_exchanges = 0  # rounds whose exchange rode behind the gradients (tests, logs)
        self.riding_exchanges = 0  # of those, rounds whose rows rode in the last bucket's collective itself
        self._staging = _ride.Staging()
        self.late_exchanges = 0  # rounds whose exchange should_commit posted itself (tests, logs)

    @classmethod
    def from_settings(cls, grad_check: bool | None, check_every: int | None, log: logging.LoggerAdapter) -> "SdcGuard":
        """The Manager's arguments, else ``RALLYPOINT_SDC_CHECK`` (1/true/yes) and
        ``RALLYPOINT_SDC_CHECK_EVERY`` (committed steps; 0: off)."""
        if grad_check is None:
            grad_check = os.environ.get(GRAD_CHECK_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
        if check_every is None:
            raw = os.environ.get(CHECK_EVERY_ENV, "0").strip() or "0"
            try:
                check_every = int(raw)
            except ValueError:
                raise ValueError(f"{CHECK_EVERY_ENV} must be a whole number of steps (0: off), got {raw!r}") from None
        return cls(grad_check, check_every, log)

    def post_early(self, pg: Any, q: QuorumResult, state_ok: bool, replica_id: str, failfast: Any) -> None:
        """Post this round's exchange now, right behind its last gradient bucket (the
        DDP wrapper says when, through ``Manager.gradients_posted``): it rides the same
        queue of collectives as the gradients and is done by the time ``should_commit``
        looks at it, instead of costing a round trip of its own there. Norms of tensors
        allreduced after this (a logged loss) are not part of this round's check. A
        failure to post is kept and reported by :meth:`check_round`."""
        if self._early is not None:
            return
        early = _Early(*self._row(q, state_ok))
        self._early = early
        self.early_exchanges += 1
        try:
            early.pending = self._post(pg, q, early.values, early.device, failfast.add_work, replica_id)
        except Exception as e:  # noqa: BLE001 - reported by check_round, on the training thread
            early.error = e

    def can_ride(self, bucket: torch.Tensor) -> bool:
        """Whether this round's rows can ride in ``bucket``'s allreduce (:mod:`._ride`):
        the checks are on, nothing was exchanged yet this round, and the bucket's dtype can
        carry them. The same on every replica group (same settings, same model)."""
        return self.enabled and self._early is None and _ride.can_ride(bucket)

    def post_riding(self, pg: Any, q: QuorumResult, state_ok: bool, bucket: torch.Tensor, contributes: bool,
                    divisor: int | None, replica_id: str, failfast: Any) -> Any:
        """Post the last gradient bucket's allreduce with this round's rows riding in it
        (:mod:`._ride`; :meth:`can_ride` said yes), taking the bucket's norm on the way
        (``contributes``: as for :meth:`observe`). Returns its work (``averaged()``: the
        tensor holding the mean, see :mod:`._ride`), or None when it was not posted (a
        quorum member is already gone, or the rows could not be made: the failure is
        recorded, and reported by :meth:`check_round`)."""
        world = q.replica_world_size
        try:
            staging = self._staging.load(bucket, world)
            self.observe(staging[: bucket.numel()], contributes)  # the bucket's norm, from its copy
            early = _Early(*self._row(q, state_ok))
            self._staging.put_row(_ride.to_ride_row(early.values), q.replica_rank, world)
        except Exception as e:  # noqa: BLE001 - nothing posted: abort, so the peers' collective fails now too
            self._early = _Early([], False, q.max_step, None)
            self._early.error = e
            failfast.abort(e, "comm")
            return None
        self._early = early
        self.early_exchanges += 1
        self.riding_exchanges += 1
        # Through FailFast: a peer's death while we wait in it aborts it at once.
        work = failfast.add_work(lambda: _ride.RidingWork.post_riding(failfast, pg, staging, bucket, divisor, world))
        if work is None:
            early.error = SdcExchangeError(f"SDC check rows at replica {replica_id} not sent with the gradients: "
                                           "a quorum member is gone")
            return None
        early.pending = _ride.PendingRide(work, q.replica_rank, world)
        return work

    def drop_early(self) -> None:
        """Forget an exchange posted for this round (it is not waited for: the round
        failed, and aborting the process group ends it)."""
        self._early = None

    def check_round(self, pg: Any, q: QuorumResult, state_ok: bool, timeout: timedelta,
                    replica_id: str, failfast: Any) -> dict[str, Any]:
        """:meth:`check`, with its outcome recorded through ``failfast``: a verdict against
        this replica fails its step (cause ``sdc``); a failed exchange aborts the process
        group (the step cannot commit, and peers blocked in it fail now)."""
        try:
            why, done = self.check(pg, q, state_ok, timeout, replica_id, post=failfast.add_work)
        except Exception as e:  # noqa: BLE001
            failfast.abort(e, "comm")
            return {"sdc_checked": ["failed"]}
        if why is not None:
            failfast.report_error(RuntimeError(why), "sdc")
        return done

    def sitting_out(self, replica_id: str) -> bool:
        """This replica sits this round out (a repeat offender: zeros in, no commit)."""
        return replica_id in self._sit_out

    @property
    def enabled(self) -> bool:
        return self.grad_check or self.check_every > 0

    def register_params(self, params: Iterable[torch.Tensor]) -> None:
        """The tensors whose bytes must be identical on every replica after a commit."""
        self._params = [p for p in params]

    def new_round(self) -> None:
        with self._lock:
            self._norms = []
            self._early = None

    def observe(self, tensor: torch.Tensor, contributes: bool) -> None:
        """Note the norm of a tensor about to be allreduced (called before it is posted:
        the collective changes it in place). ``contributes``: it holds this replica's own
        gradient (a healing, spare or sitting-out replica sends zeros: no norm, or its zero
        would look like an outlier)."""
        if self.grad_check and contributes and tensor.is_floating_point() and self._early is None:
            norm = grad_norm_tensor([tensor.detach()])
            with self._lock:
                self._norms.append(norm)

    def _device(self, pg: Any, grads: torch.device | None) -> torch.device | None:
        """Where the exchange's tensor lives: the parameters' (or gradients') device, so an
        NCCL group gets a CUDA tensor; every member decides alike (same model, same group)."""
        if self._params:
            return self._params[0].device
        if grads is not None:
            return grads
        if "nccl" in type(pg).__name__.lower() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _row(self, q: QuorumResult, state_ok: bool) -> tuple[list[float], bool, int, torch.device | None]:
        """This replica's row ``[norm valid, norm, hash valid, hash hi, hash lo]``, whether
        the parameters are hashed this round, the step it is about, and the gradients'
        device (None: none seen)."""
        step = q.max_step
        do_hash = self.check_every > 0 and guards.should_check_params(step, self.check_every) \
            and step != self._last_hash_step
        with self._lock:
            norms, self._norms = self._norms, []
        norm = float(torch.linalg.vector_norm(torch.stack(norms)).item()) if norms else 0.0
        valid_norm = 1.0 if norms else 0.0
        h_hi = h_lo = valid_hash = 0.0
        if do_hash and state_ok:
            if self._params:
                h_hi, h_lo = u64_to_halves(param_hash(self._params))
                valid_hash = 1.0
            elif not self._warned_no_params:
                self._warned_no_params = True
                self._log.warning("sdc_check_every is set but no parameters were registered (register_sdc_params, "
                                  "or rallypoint's DistributedDataParallel): the parameter check is skipped")
        return [valid_norm, norm, valid_hash, h_hi, h_lo], do_hash, step, norms[0].device if norms else None

    def _post(self, pg: Any, q: QuorumResult, values: list[float], grads: torch.device | None, post: Any,
              replica_id: str) -> Any:
        device = self._device(pg, grads)

        def start() -> Any:
            return start_exchange(pg, q.replica_rank, q.replica_world_size, values, device=device)

        # Through FailFast (``post``): a peer's death while we wait in it aborts it at once.
        pending = post(start) if post is not None else start()
        if pending is None:
            raise SdcExchangeError(f"SDC check exchange at replica {replica_id} not started: a quorum member is gone")
        return pending

    def check(self, pg: Any, q: QuorumResult, state_ok: bool, timeout: timedelta,
              replica_id: str, post: Any = None) -> tuple[str | None, dict[str, Any]]:
        """Exchange this round's rows (or wait for the exchange :meth:`post_early` posted)
        and decide. Returns ``(why this replica must vote false, or None; what was
        checked, for the round's record)``. ``state_ok``: its parameters are the step's
        (it did not heal in this round)."""
        early, self._early = self._early, None
        if early is not None:
            if early.error is not None:
                raise early.error
            values, do_hash, step, pending = early.values, early.do_hash, early.step, early.pending
        else:
            values, do_hash, step, grads = self._row(q, state_ok)
            self.late_exchanges += 1
            pending = self._post(pg, q, values, grads, post, replica_id)
        rows = pending.wait(timeout)
        done: dict[str, Any] = {"sdc_checked": ["grad"] + (["param"] if do_hash else [])}
        why: str | None = None
        ids = list(q.replica_ids)

        def name(r: int) -> str:
            return ids[r] if r < len(ids) else f"replica rank {r}"

        sat_out, self._sit_out = self._sit_out, frozenset()
        if replica_id in sat_out:
            why = f"{SDC_PREFIX}: replica {replica_id} was flagged repeatedly and heals from a healthy peer"
        seen = {r: row[1] for r, row in enumerate(rows) if row[0] == 1.0}
        if self.grad_check and seen:
            verdict = guards.grad_norm_verdict(seen, self._history, self._options)
            if verdict.fail_step:
                bad = ", ".join(f"{name(r)} ({verdict.reasons.get(r, '?')})" for r in sorted(verdict.bad))
                why = why or f"{SDC_PREFIX} at step {step} (gradient-norm check): {bad}; the step fails everywhere"
                self._log.warning("%s", why)
                done["sdc_bad"], done["sdc_failed"] = sorted(name(r) for r in verdict.bad), "grad"
                # Strikes count quorums (every retry of a failed step is a new one), so a group
                # that fails the same step again and again is still caught.
                strikes = guards.repeat_offenders(self._strikes, [name(r) for r in verdict.strikes], q.quorum_id,
                                                  self._limit, self._window)
                self._strikes = dict(strikes.strikes)
                if strikes.evict:
                    self._sit_out = frozenset(strikes.evict)
                    self._log.warning("%s flagged %d times within %d quorums: sitting out the next round (contributing "
                                      "zeros, not committing), then healing from a healthy peer",
                                      ", ".join(sorted(strikes.evict)), self._limit, self._window)
            else:
                self._history = guards.next_history(self._history, seen, verdict)
        if do_hash:
            self._last_hash_step = step
            hashes = {r: halves_to_u64(row[3], row[4]) for r, row in enumerate(rows) if row[2] == 1.0}
            hv = guards.param_hash_verdict(hashes)
            if hv.flagged:
                names = ", ".join(f"{name(r)} ({hv.reasons[r]})" for r in sorted(hv.flagged))
                if hv.fail_step or q.replica_rank in hv.minority or "sdc_failed" not in done:
                    done["sdc_bad"], done["sdc_failed"] = sorted(name(r) for r in hv.flagged), "param"
                msg = f"{SDC_PREFIX} at step {step} (parameter check): {names}"
                self._log.warning("%s", msg)
                if hv.fail_step:
                    why = why or msg + "; no majority: the step fails everywhere"
                elif q.replica_rank in hv.minority:
                    why = why or msg + f"; replica {replica_id} heals from the majority"
        if why is not None and not math.isfinite(values[1]):
            done["sdc_norm"] = str(values[1])
        return why, done


__all__ = ["CHECK_EVERY_ENV", "GRAD_CHECK_ENV", "SDC_PREFIX", "SdcGuard"]
