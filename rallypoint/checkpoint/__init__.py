"""Durable checkpoints: at a committed step every ``every`` steps, the replica groups of
the quorum split the state and write their shares asynchronously with
torch.distributed.checkpoint; a commit marker written last makes a checkpoint complete;
a job that starts with no live peer restores the newest complete one.

Modules: ``plan`` (pure: who writes which keys, pruning, the model check), ``stage``
(the CPU copy), ``storage`` (layout, DCP writers, metadata merge, completeness),
``writer`` (the background thread and the commit), ``durable`` (:class:`DurableCheckpoint`).
See docs/checkpoint.md.
"""

from rallypoint.checkpoint.durable import DurableCheckpoint, load_checkpoint

__all__ = ["DurableCheckpoint", "load_checkpoint"]
