"""``DurableCheckpoint``: asynchronous checkpoints split across replica groups.

Turned on with one line, ``rallypoint.DurableCheckpoint(manager, "/ckpt", every=100)``,
or with no code change by ``RALLYPOINT_CHECKPOINT_DIR`` (``RALLYPOINT_CHECKPOINT_EVERY``,
``RALLYPOINT_CHECKPOINT_KEEP``): the Manager then builds one itself.

When: the Manager calls :meth:`DurableCheckpoint.at_boundary` at the start of every
round (``start_quorum``, on the training thread): the previous round has committed and
the optimizer has stepped, so the live state is exactly the state of
``manager.current_step()``, the state a heal would send. At a committed step that is a
multiple of ``every``, every rank of every group of that round's quorum stages its share
(a CPU copy of its keys: the only stall) and hands it to its writer thread.

Who writes what: see :mod:`rallypoint.checkpoint.plan` (``G * W`` writers, split by
bytes, the same plan everywhere) and :mod:`rallypoint.checkpoint.storage` (one DCP
checkpoint per step; writer 0 commits it).

Restore: at the first round, before the first quorum, every rank loads the newest
complete checkpoint, skipping a corrupt or incomplete newer one with a warning that
names it. A whole job that starts again therefore starts at that step on every group,
and the first quorum finds them equal (no heal). A group that starts while live peers
are ahead loads it too, and its first quorum then finds it behind and heals it from
them as always: the peers' newer state wins. A checkpoint of a different model refuses
to load, naming the first key that differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rallypoint.checkpoint import stage as _stage
from rallypoint.checkpoint._fill import fill_missing
from rallypoint.checkpoint import storage
from rallypoint.checkpoint.plan import first_mismatch, is_due, plan_share
from rallypoint.checkpoint.storage import ERRORS
from rallypoint.checkpoint.writer import Job, Writer

log = logging.getLogger("rallypoint.checkpoint")

ENV_DIR, ENV_EVERY, ENV_KEEP = "RALLYPOINT_CHECKPOINT_DIR", "RALLYPOINT_CHECKPOINT_EVERY", "RALLYPOINT_CHECKPOINT_KEEP"
ENV_COMMIT_TIMEOUT = "RALLYPOINT_CHECKPOINT_COMMIT_TIMEOUT_SEC"
DEFAULT_EVERY, DEFAULT_KEEP = 100, 3
#: How often (seconds) a rank that is not the committer looks for the marker of its last
#: write between intervals (a small read on the training thread), for ``/status``.
NOTE_EVERY_S = 5.0


class DurableCheckpoint:
    """Checkpoint ``manager``'s registered state to ``path`` every ``every`` committed
    steps, keeping the newest ``keep`` complete checkpoints; restore the newest complete
    one when the job starts.

    Args:
        manager: the :class:`rallypoint.Manager` whose state (what heals send) is saved.
        path: a folder, or an fsspec URL (``s3://bucket/run``) where its backend is installed.
        every: the interval in committed steps.
        keep: complete checkpoints kept (older ones are deleted once a newer one is complete; 0: all).
        commit_timeout: how long writer 0 waits for the other shares before the step stays incomplete.
        restore: load the newest complete checkpoint at the first round.
    """

    def __init__(self, manager: Any, path: str, every: int = DEFAULT_EVERY, keep: int = DEFAULT_KEEP, *,
                 commit_timeout: float = 600.0, restore: bool = True) -> None:
        if int(every) < 1:
            raise ValueError(f"every must be at least 1 step, got {every}")
        hooks = getattr(manager, "step_hooks", None)
        if not isinstance(hooks, list):
            raise TypeError("DurableCheckpoint needs a rallypoint Manager (one with step_hooks)")
        other: DurableCheckpoint | None = next((h for h in hooks if isinstance(h, DurableCheckpoint)), None)
        if other is not None:
            raise ValueError(f"this Manager already checkpoints to {other.path!s} (RALLYPOINT_CHECKPOINT_DIR?): "
                             "one DurableCheckpoint per Manager")
        self.manager = manager
        self.path: str = str(path)
        self.every, self.keep = int(every), int(keep)
        self.label = f"replica {getattr(manager, 'replica_id', '?')} rank {getattr(manager, 'group_rank', 0)}"
        self._store = storage.Store(self.path)
        self._writer = Writer(self._store, self.keep, float(commit_timeout), self.label)
        self._restore_first = bool(restore)
        self._started = False
        self._last_written: int | None = None
        self.restored_step: int | None = None
        self._buffers: dict[str, Any] = {}  # staging memory, reused (stage.stage)
        self._checked_at = float("-inf")  # when _report last looked for a commit marker
        hooks.append(self)

    @classmethod
    def from_env(cls, manager: Any, environ: Mapping[str, str] = os.environ) -> DurableCheckpoint | None:
        """The checkpointer ``RALLYPOINT_CHECKPOINT_DIR`` asks for (None when unset), with
        ``RALLYPOINT_CHECKPOINT_EVERY`` (100), ``RALLYPOINT_CHECKPOINT_KEEP`` (3) and
        ``RALLYPOINT_CHECKPOINT_COMMIT_TIMEOUT_SEC`` (600)."""
        path = environ.get(ENV_DIR, "").strip()
        if not path:
            return None
        every = _env_int(environ, ENV_EVERY, DEFAULT_EVERY, 1)
        keep = _env_int(environ, ENV_KEEP, DEFAULT_KEEP, 0)
        commit = _env_int(environ, ENV_COMMIT_TIMEOUT, 600, 1)
        return cls(manager, path, every=every, keep=keep, commit_timeout=float(commit))

    # ------------------------------------------------------------------ the Manager's hook
    def at_boundary(self) -> None:
        """Called by the Manager at the start of each round, on the training thread:
        restore at the first, save when the last committed step is due."""
        try:
            if not self._started:
                self._started = True
                if self._restore_first and self.manager.step_record() is None:  # not when attached mid-run
                    self.restore()
                    return
            try:
                self.maybe_save()
            except ERRORS as e:  # noqa: BLE001  (a checkpoint never fails a training step)
                self._writer.failed("checkpointing", e)
        finally:
            self._report()

    def _report(self) -> None:
        """Hand :meth:`report` to the last round's record: the Manager sends it with the
        next quorum request's step stats (called before it reads them), and the
        lighthouse shows it in ``/status``, ``/metrics`` and the dashboard."""
        now = time.monotonic()
        if now - self._checked_at >= NOTE_EVERY_S:  # a rank that is not the committer: has it landed?
            self._checked_at = now
            self._note_complete()
        last = getattr(self.manager, "step_record", lambda: None)()
        if last is not None and isinstance(getattr(last, "extra", None), dict):
            last.extra["ckpt"] = self.report()

    def close(self, timeout: float = 30.0) -> None:
        """Write the last committed step when it is due (a run that ends at step 100 with
        ``every=100`` keeps it), let the writes in flight finish (bounded), then stop the
        writer thread. The Manager's ``shutdown`` calls it."""
        if self._started:
            try:
                self.maybe_save()
            except ERRORS as e:  # noqa: BLE001
                self._writer.failed("checkpointing", e)
        self._writer.close(timeout)

    # ------------------------------------------------------------------ saving
    def maybe_save(self) -> bool:
        """Stage and queue this rank's share when the last round committed a due step."""
        m = self.manager
        rec = m.step_record()
        step = int(m.current_step())
        if rec is None or rec.outcome != "committed" or rec.replica_rank is None:
            return False
        if not is_due(step, self.every, self._last_written):
            return False
        self._note_complete()
        if self._writer.busy():
            self._writer.counters.skipped += 1
            log.warning("[%s] step %d not checkpointed: the previous write is still in flight", self.label, step)
            return False
        self._last_written = step
        t0 = time.monotonic()
        try:
            state = m._user_state.snapshot(m.state_dict)  # what a heal sends
            flat, paths, _, int_keyed = _stage.flatten(state)
            attempt = hashlib.sha1(f"{step}|{rec.quorum_id}|{','.join(rec.participants)}".encode()).hexdigest()[:10]
            share = plan_share(step, _stage.sizes_of(flat), int(rec.replica_rank), int(rec.replica_world_size),
                               int(m.group_rank), int(m.group_world_size), attempt, _stage.sharded_keys(flat))
            data, nbytes = _stage.stage(flat, share.keys, self._buffers)
        except ERRORS as e:  # noqa: BLE001
            self._writer.failed(f"staging step {step}", e)
            return False
        stall = time.monotonic() - t0
        c = self._writer.counters
        c.stall_s += stall
        c.last_stall_s = stall
        return self._writer.submit(Job(share, data, {k: paths[k] for k in share.keys}, nbytes,
                                       tuple(rec.participants), sorted(int_keyed)))

    def wait(self, timeout: float = 60.0) -> bool:
        """Wait for this rank's write in flight (tests, benchmarks, the end of a run)."""
        return self._writer.wait(timeout)

    def _note_complete(self) -> None:
        """A rank that is not the committer learns of a commit by its marker."""
        c = self._writer.counters
        s = self._last_written
        if s is not None and c.last_complete_step != s:
            try:  # the marker only (small): this runs on the training thread
                marker = json.loads(self._store.read(self._store.child(self._store.step_dir(s), storage.MARKER)))
                c.last_complete_step, c.last_complete_time = s, float(marker.get("time", time.time()))
            except (OSError, ValueError):
                pass  # not complete (yet)

    # ------------------------------------------------------------------ restoring
    def newest_complete(self) -> tuple[int, dict[str, Any]] | None:
        """The newest complete checkpoint ``(step, marker)``; newer incomplete or corrupt
        ones are skipped with a warning naming them."""
        try:
            steps = self._store.steps()
        except ERRORS as e:  # noqa: BLE001
            self._writer.failed("listing checkpoints", e)
            return None
        for s in steps:
            folder = self._store.step_dir(s)
            marker, why = storage.check_complete(self._store, folder)
            if marker is not None:
                return s, marker
            log.warning("[%s] skipping checkpoint %s: %s", self.label, folder, why)
        return None

    def restore(self) -> int | None:
        """Load the newest complete checkpoint into the Manager's registered state (and its
        step counters); returns its step, or None when there is none. Raises ``ValueError``
        naming the first mismatching key when it was written by a different model."""
        m = self.manager
        found = self.newest_complete()
        while found is not None:
            step, marker = found
            folder = self._store.step_dir(step)
            snapshot = m._user_state.snapshot(m.state_dict)
            template, _, empty, _ = _stage.flatten(snapshot)
            md = storage.read_metadata(self._store, self._store.child(folder, storage.METADATA))
            saved = {k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
                     for k, v in md.state_dict_metadata.items()}
            ours = {k: v for k, v in _stage.shapes_of(template).items() if not k.startswith("torchft.")}
            why = first_mismatch(ours, {k: v for k, v in saved.items() if not k.startswith("torchft.")}, empty)
            if why is not None:
                raise ValueError(f"[{self.label}] checkpoint {folder} was not written by this model: {why}; "
                                 f"move it away or point {ENV_DIR} elsewhere")
            sharded = bool(_stage.sharded_keys(template))
            left: list[str] = []
            try:
                if sharded:  # each rank reads its own shards into the live DTensors
                    # Keys the live state lacks yet (an optimizer before its first step) get room first.
                    left = fill_missing(snapshot, template, md, sorted(
                        k for k in saved if k not in template and not k.startswith("torchft.")))
                    loaded = load_into(self._store, folder, snapshot)
                    _stage.int_keys_back(loaded, marker.get("int_keyed", []))  # the keys fill_missing made
                else:
                    loaded = load_checkpoint(self._store, folder)
                    _stage.int_keys_back(loaded, marker.get("int_keyed", []))
            except ERRORS as e:  # noqa: BLE001
                log.warning("[%s] skipping checkpoint %s: it failed to load: %s: %s", self.label, folder,
                            type(e).__name__, e)
                found = self._older_complete(step)
                continue
            if left:
                log.warning("[%s] %d key(s) of %s not restored: the job's sharded state has no place for them "
                            "(first: %s: no live DTensor of its shape)", self.label, len(left), folder, left[0])
            m._user_state.apply(loaded, m.load_state_dict)
            self.restored_step = self._last_written = step
            c = self._writer.counters
            c.last_complete_step, c.last_complete_time = step, float(found[1].get("time", time.time()))
            log.info("[%s] restored checkpoint step %d from %s", self.label, step, folder)
            return step
        log.info("[%s] no complete checkpoint in %s: starting from the current state", self.label, self.path)
        return None

    def _older_complete(self, than: int) -> tuple[int, dict[str, Any]] | None:
        for s in self._store.steps():
            if s < than:
                marker, why = storage.check_complete(self._store, self._store.step_dir(s))
                if marker is not None:
                    return s, marker
                log.warning("[%s] skipping checkpoint %s: %s", self.label, self._store.step_dir(s), why)
        return None

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Counters for ``/status`` and ``/metrics``: writes, bytes, stall, failures,
        skipped intervals, the last complete step and its age."""
        d = self._writer.counters.as_dict()
        d["every"] = self.every
        return d

    def report(self) -> dict[str, Any]:
        """The compact ``ckpt`` object of the step stats (see
        :func:`rallypoint.manager.rules.check_ckpt`): the last complete step and its age
        (absent before one), shares written, their bytes, the staging stall, failures and
        skipped intervals of this rank."""
        c = self._writer.counters
        out: dict[str, Any] = {"writes": c.writes, "bytes": c.bytes, "failures": c.failures, "skipped": c.skipped,
                               "stall_s": round(c.stall_s, 6)}
        if c.last_complete_step is not None:
            out["step"] = int(c.last_complete_step)
            if c.last_complete_time is not None:
                out["age_s"] = round(max(0.0, time.time() - c.last_complete_time), 3)
        return out


def attach_from_env(manager: Any) -> DurableCheckpoint | None:
    """What ``Manager.__init__`` calls when ``RALLYPOINT_CHECKPOINT_DIR`` is set: the
    checkpointer of :meth:`DurableCheckpoint.from_env`; bad settings shut the half-built
    Manager down (its server and threads) before the ``ValueError`` that names them."""
    try:
        return DurableCheckpoint.from_env(manager)
    except BaseException:
        manager.shutdown(wait=False)
        raise


def load_checkpoint(store: storage.Store, folder: str) -> dict[str, Any]:
    """Every key of the DCP checkpoint in ``folder``, as the nested state it was saved from."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # What torch's own dcp_to_torch_save does: the planner rebuilds the state from the metadata.
    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=store.reader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return out


def load_into(store: storage.Store, folder: str, state: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint in ``folder`` into ``state`` in place (DTensors read only their
    own shards; keys the state lacks are left out); returns ``state``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=store.reader(folder), no_dist=True)
    return state


def _env_int(environ: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None
    if value < least:
        raise ValueError(f"{name}={value} must be at least {least}")
    return value


__all__ = ["DurableCheckpoint", "attach_from_env", "ENV_DIR", "ENV_EVERY", "ENV_KEEP", "load_checkpoint", "load_into"]
