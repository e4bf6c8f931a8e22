"""``rallypoint run``: the per-replica-group launcher, where ``torchrun`` was.

It starts ``--nproc-per-node`` ranks with torchrun's environment plus rallypoint's, hosts
the group's store (in one small child process, ``_store_host.py``: this package imports
no torch), treats the group as the unit of failure (one rank fails: the others are
stopped and every rank starts again), restarts a group with a hung rank (no committed step
for ``--hang-timeout``; its stacks are dumped to the log first), gives up on a crash loop,
and stops cleanly on SIGTERM/SIGINT. No rank or store host outlives the supervisor.

Modules: ``policy`` (the restart, backoff and crash-loop rules, pure), ``envs`` (each
rank's environment, pure), ``args`` (the command line), ``supervisor`` (the main loop),
``_procs`` (process plumbing), ``_rank`` (each rank's bootstrap), ``_store_host``.

Not built yet, with a seam left for it: warm standbys (``Supervisor._start_rank``,
``_rank.py``).
"""
