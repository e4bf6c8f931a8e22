"""Run an example training script with the records the demo and the tests follow.

The examples (``examples/train_ddp.py``, ``train_hsdp.py``, ``train_diloco.py``) are
written for a user to copy and carry no test plumbing; each takes an optional ``hook``
in ``main``. This script loads an example, passes it a :class:`Recorder` as that hook,
and runs it with the remaining command line::

    rallypoint run --nproc-per-node 2 --replica-group-id 0 examples/demo/instrumented.py \\
        --progress 'g{group}.r{rank}.i{restart}.jsonl' --stop-file STOP examples/train_ddp.py --steps 100

The recorder appends one JSON line per event to ``--progress`` (``ready``, then ``step``
per step -- or ``sync`` per committed sync with ``--per-sync``, for DiLoCo -- and
``exit``): the step, whether it committed, the participants, a sha256 of this rank's
parameters (replicas holding identical values have identical hashes), heals with their
timings; it stops the example once the step reaches the number in ``--stop-file`` or
after ``--max-seconds`` (exit code 3). Used by ``examples/demo_training.py``,
``examples/chaos_drills.py`` and the example tests.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

PLACEHOLDERS = {"{rank}": ("RANK", "0"), "{group}": ("REPLICA_GROUP_ID", "0"),
                "{restart}": ("TORCHELASTIC_RESTART_COUNT", "0")}
FRAGMENT_KEY = "StreamingDiLoCoFragment_"  # the state DiLoCo registers: the global parameters


def expand_placeholders(path: str, environ: Any = None) -> str:
    """``path`` with ``{rank}`` (``RANK``), ``{group}`` (``REPLICA_GROUP_ID``) and
    ``{restart}`` (``TORCHELASTIC_RESTART_COUNT``) replaced from the environment, each ``0``
    when unset: every rank gets the same command line, so this is how each rank and each
    restart gets a file of its own. Other text, braces included, is kept as it is."""
    env = os.environ if environ is None else environ
    for key, (var, default) in PLACEHOLDERS.items():
        path = path.replace(key, env.get(var) or default)
    return path


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes in order (a sharded parameter: this rank's shard)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class HealTimer(logging.Handler):
    """Times a heal's state transfer from the manager's log records ("healing to step
    ..." then "received the state of step ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started: float | None = None
        self.received: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "healing to step" in msg:
            self.started, self.received = record.created, None
        elif "received the state of step" in msg:
            self.received = record.created


class Recorder:
    """The example's hook: writes the progress records and says when to stop."""

    def __init__(self, progress: str | None, stop_file: str | None, max_seconds: float, per_sync: bool) -> None:
        self.f = open(expand_placeholders(progress), "a", buffering=1) if progress else None
        self.stop_file, self.per_sync = stop_file, per_sync
        self.deadline = time.monotonic() + max_seconds if max_seconds else None
        self.fixed = {"group": int(os.environ.get("REPLICA_GROUP_ID", 0)), "rank": int(os.environ.get("RANK", 0)),
                      "pid": os.getpid()}
        self.timer = HealTimer()
        self.heals: list[dict[str, Any]] = []
        self.reported_heals = 0
        self.expired = False
        self.inner_step = self.syncs = 0
        self.last_step = -1
        self.step_started = time.time()

    def write(self, **rec: Any) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"t": time.time(), **self.fixed, **rec}) + "\n")
            self.f.flush()

    def _install(self, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Note each heal: a state entry of our own, loaded with the rest of a heal."""
        manager_log = logging.getLogger("rallypoint.manager")
        for handler in logging.getLogger().handlers:  # the console keeps its level ...
            handler.setLevel(logging.getLogger().level)
        manager_log.addHandler(self.timer)
        manager_log.setLevel(min(manager_log.getEffectiveLevel(), logging.INFO))  # ... the timer needs INFO

        def healed(_: Any) -> None:
            now, t = time.time(), self.timer
            transfer = t.received - t.started if t.started is not None and t.received is not None else None
            size = tensor_bytes(model.state_dict()) + tensor_bytes(optimizer.state_dict())
            self.heals.append({"t": now, "bytes": size, "transfer_s": transfer, "step_s": now - self.step_started})

        manager.register_state_dict_fn("instrumented_heals", healed, dict)

    def _global_sha256(self, manager: Any) -> str | None:
        user = manager._manager_state_dict()["user"]  # test plumbing: what a healing peer would receive
        keys = sorted((k for k in user if k.startswith(FRAGMENT_KEY)), key=lambda k: int(k[len(FRAGMENT_KEY):]))
        if not keys:
            return None
        return tensors_sha256(user[k]["original_parameters"][n] for k in keys
                              for n in sorted(user[k]["original_parameters"]))

    def __call__(self, event: str, *, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss: torch.Tensor | None = None, committed: bool | None = None, **_: Any) -> bool:
        step = manager.current_step()
        rec: dict[str, Any] = {"event": event, "step": step, "participants": manager.num_participants(),
                               "batches_committed": manager.batches_committed(), "heals": len(self.heals)}
        if loss is not None:
            rec["loss"] = round(float(loss.detach()), 5)
        if event == "ready":
            self._install(manager, model, optimizer)
            self.last_step = step
            rec["replica_id"] = manager.replica_id
        elif event == "step":
            self.inner_step += 1
            rec["committed"] = committed
            if self.per_sync:
                if step == self.last_step:
                    return self._should_stop(step)
                rec["event"], self.syncs = "sync", self.syncs + 1
            if len(self.heals) > self.reported_heals:
                rec["heal"], self.reported_heals = self.heals[-1], len(self.heals)
        else:
            rec.update(rc=3 if self.expired else 0, syncs=self.syncs)
        self.last_step = step
        rec.update(inner_step=self.inner_step, sha256=tensors_sha256(model.parameters()))
        if self.per_sync:
            rec["global_sha256"] = self._global_sha256(manager)
        self.write(**rec)
        self.step_started = time.time()
        return self._should_stop(step)

    def _should_stop(self, step: int) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.expired = True
            return True
        if not self.stop_file or not os.path.exists(self.stop_file):
            return False
        with open(self.stop_file) as f:
            text = f.read().strip()
        return bool(text) and step >= int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--progress", default=None, help="append JSON lines here; {rank}, {group}, {restart} filled in")
    ap.add_argument("--stop-file", default=None, help="stop once the step reaches the number in this file")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="give up after this long (0: never); rc 3")
    ap.add_argument("--per-sync", action="store_true", help="one record per committed sync, not per step (DiLoCo)")
    ap.add_argument("example", help="the example script, e.g. examples/train_ddp.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the example's own arguments")
    opts = ap.parse_args()
    spec = importlib.util.spec_from_file_location("example", opts.example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv = [opts.example, *opts.args]
    recorder = Recorder(opts.progress, opts.stop_file, opts.max_seconds, opts.per_sync)
    try:
        module.main(recorder)
    except KeyboardInterrupt:
        return 130
    return 3 if recorder.expired else 0


if __name__ == "__main__":
    sys.exit(main())
