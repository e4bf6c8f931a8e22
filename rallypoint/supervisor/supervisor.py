"""``rallypoint run``'s main loop, a thin shell around ``policy.py``: start the store host,
start every rank, watch them, and when one fails stop the others and start the group again
(or give up on a crash loop); stop on SIGTERM/SIGINT.

Everything happens on the main thread, which sleeps on one event queue (``Wakeup``): rank
exits (from a waiter thread per rank), signals, the store host's death; with the hang
watchdog on, it also wakes at least every ``policy.POLL_MAX_S`` (and at the next rank's
deadline) to look at the ranks' progress files. Each restart is one structured log line,
``{"event": "restart", ...}``: the failed rank, its cause (exit code, signal or ``hang``),
the incarnations, its uptime, whether it made progress, the backoff and the time from the
failure to the new ranks' start (``restart_s``).

The hang watchdog (``--hang-timeout``): each rank's Manager rewrites its progress file
after a commit (at most once a second, so the clock may start up to a second early); a rank
whose file has not changed for the timeout is hung. Its clock starts at its first report in
each incarnation, so imports, the first quorum and the step-0 heal are not timed; a heal
later in the run, an evaluation or a checkpoint written between commits must fit inside
the timeout. It stops at ``Manager.shutdown()`` (the file says ``done``) and when the rank
exits. On a hang every live rank of the group gets ``SIGUSR1`` (``_rank.py`` makes it dump
all Python stacks to the rank's log: a hang in one rank stalls its peers in collectives
within a progress report or two, so the rank named first is not always the culprit; the
dumps show who waits for whom), the supervisor waits for the dumps (at most ``DUMP_WAIT_S``;
not for a stopped rank, which cannot dump), SIGKILLs the hung rank(s) at once (a rank stuck
in its training thread cannot act on SIGTERM, a SIGSTOPped one not even receive it), stops
the others as after a crash, and restarts the group as after a crash, under the same
crash-loop rule (a hung incarnation has always reported a step, or its clock would not have
started, so it counts as progress). Every stop sends
SIGCONT after SIGTERM, so a stopped rank acts on the SIGTERM at once instead of using up
the grace period.

Exit codes: 0 when every rank exited 0; 128+signal after a requested stop (143 for SIGTERM,
130 for SIGINT); 1 after a crash loop (``--max-restarts``) or when the store cannot be
hosted; 2 for a usage error (nothing started).

Warm standbys (on unless ``--no-standby``; ``_starts.py``): the group's zygote imports
torch, rallypoint and ``--preload`` once; the first start's ranks are forked from it, and
one standby per rank at once (ready: no import). Without a zygote (it failed: said once),
standbys are new processes started once every rank has committed a step (or
``--standby-delay`` after the start). A restart hands each rank's standby its environment
instead of starting a process. A standby that dies while waiting is replaced
(``policy.standby_refill_delay``); the restart line says where each rank came from
(``warm_ranks``: a ready standby; ``forked_ranks``: a fork of the zygote at the restart;
``importing_ranks``: a standby still importing, which finishes at normal priority).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import IO, Any

from rallypoint.supervisor._procs import Lifeline, RankProcess, StoreHost, Wakeup
from rallypoint.supervisor._rendezvous import NodeRendezvous, RdzvConfig
from rallypoint.supervisor._report import EventReporter
from rallypoint.supervisor._starts import ZYGOTE_READY_S, Starts
from rallypoint.supervisor._stopping import RankStopping
from rallypoint.supervisor.args import USAGE_EXIT, RunConfig, UsageError, config_from_args
from rallypoint.supervisor.envs import GroupSpec, log_prefix, rank_env
from rallypoint.supervisor.nodes import NodeInfo, RoundPlan
from rallypoint.supervisor.policy import (
    DONE, FAILED, ZYGOTE_STARTING, after_failure, describe_exit, first_failure, group_state, made_progress,
    standby_start_due, stop_exit_code,
)  # fmt: skip
from rallypoint.supervisor._watch import ProgressWatch

log = logging.getLogger("rallypoint.run")

GAVE_UP_EXIT = 1
STORE_READY_S = 60.0  # the store host imports torch first
STANDBY_POLL_S = 0.2  # how often the loop looks whether the standbys are due


@dataclass(frozen=True)
class _End:
    """How an incarnation ended: ``done``, ``failed`` (``rank``, ``returncode``), ``hang``
    (``rank``, the one silent longest; ``hung``, every rank past the timeout; ``silent_s``;
    ``last_step``), ``signal`` (``signum``: a stop was requested), ``store`` (the store
    host died) or ``peer`` (another node of the group ended the incarnation, or is lost:
    ``reason``)."""

    kind: str
    rank: int = -1
    returncode: int = 0
    signum: int = 0
    hung: tuple[int, ...] = ()
    silent_s: float = 0.0
    last_step: int | None = None
    reason: str = ""


class Supervisor(RankStopping):
    """Runs one replica group until it finishes, is stopped, or crash-loops."""

    def __init__(self, cfg: RunConfig, environ: Mapping[str, str] | None = None,
                 out: IO[bytes] | None = None, err: IO[bytes] | None = None) -> None:
        self.cfg = cfg
        self._environ = dict(os.environ if environ is None else environ) | dict(cfg.extra_env)  # --checkpoint-*
        self._outputs = (out or sys.stdout.buffer, err or sys.stderr.buffer)
        self._locks = (threading.Lock(), threading.Lock())
        self._wake = Wakeup()
        self._lifeline = Lifeline()
        self._rundir = tempfile.mkdtemp(prefix="rallypoint-run-")
        self._store: StoreHost | None = None
        self._spec: GroupSpec | None = None  # set once the store listens; its port may move at a restart
        self._store_port = 0  # this node's store's port now (multi-node: the group's if this is node 0)
        self._joining = False  # multi-node: the next round is being joined already
        self._round_events: list[tuple[Any, ...]] = []  # its outcome, when it came early
        self._ranks: list[RankProcess] = []
        self._stop_signal = 0
        self._streak = 0  # consecutive failed incarnations without progress
        self._reports_seen = False  # has any incarnation reported a committed step?
        self._name = self._group_name = "replica group" + (f" {cfg.group_id}" if cfg.group_id is not None else "")
        self._rdzv: NodeRendezvous | None = None
        self._node = cfg.node_rank  # this node's rank in the group (multi-node; -1 until a round says)
        if cfg.multinode:
            self._name += f" (node {cfg.node_rank if cfg.node_rank >= 0 else '?'} of {cfg.nnodes})"
            self._rdzv = NodeRendezvous(RdzvConfig(cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_id, cfg.nnodes,
                                                   cfg.rdzv_timeout_s, cfg.local_addr, dict(cfg.rdzv_conf)),
                                        self._wake.post)
        self._reporter = EventReporter(cfg.lighthouse or self._environ.get("RALLYPOINT_LIGHTHOUSE")
                                       or self._environ.get("TORCHFT_LIGHTHOUSE"), cfg.group_id, self._environ)
        self._starts = Starts(cfg, self._standby_env, self._wake, self._lifeline, self._outputs, self._locks,
                              self._rundir, self._name)  # the zygote and the standbys (``_starts.py``)
        self._pool = self._starts.pool

    # ------------------------------------------------------------------ outer shell
    def run(self) -> int:
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            self._kill_all()
            self._starts.close()
            self._reporter.close(2.0)
            if self._rdzv is not None:
                self._rdzv.stop_watch()
            if self._store is not None:
                self._store.close()
            for s, h in handlers.items():
                signal.signal(s, h)
            self._lifeline.close()
            self._wake.close()
            shutil.rmtree(self._rundir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._wake.post("signal", signum)

    def _event(self, kind: str, level: int = logging.INFO, **fields: Any) -> None:
        if self.cfg.multinode:
            fields = {**fields, "node": self._node, "nnodes": self.cfg.nnodes}
        log.log(level, "%s", json.dumps({"event": kind, "group": self.cfg.group_id, **fields}))
        self._reporter.post(kind, fields)

    def _progress_path(self, incarnation: int, rank: int) -> str:
        return os.path.join(self._rundir, f"progress.{incarnation}.{rank}")

    def _committed(self, incarnation: int) -> bool:
        """Did any rank of ``incarnation`` report a committed step?"""
        return any(os.path.exists(self._progress_path(incarnation, r)) for r in range(self.cfg.nproc))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> int:
        cfg = self.cfg
        store_addr = cfg.local_addr if cfg.multinode else cfg.master_addr
        try:
            self._store = StoreHost(store_addr, cfg.master_port, log_prefix(cfg.group_id, "store"),
                                    self._outputs[1], self._locks[1],
                                    on_exit=lambda rc: self._wake.post("store_exit", rc), rundir=self._rundir)
            port = self._store_port = self._store.port(STORE_READY_S)
        except (OSError, RuntimeError, ValueError) as e:
            log.error("%s: cannot host the group's store: %s", self._name, e)
            return 1
        if cfg.master_port == 0:
            self._store.spare()
        self._spec = GroupSpec(cfg.nproc, store_addr, port, cfg.group_id, cfg.lighthouse, cfg.policy.max_restarts,
                               nnodes=cfg.nnodes, run_id=cfg.rdzv_id if cfg.multinode else None)
        log.info("%s: %d rank(s) of %s, store %s:%d, lighthouse %s%s", self._name, cfg.nproc, cfg.target,
                 store_addr, port, cfg.lighthouse or "from the environment",
                 f", rendezvous {cfg.rdzv_backend} at {cfg.rdzv_endpoint} (id {cfg.rdzv_id})" if cfg.multinode else "")
        self._event("started", nproc=cfg.nproc, target=os.path.basename(cfg.target), standby=cfg.standby,
                    hang_timeout_s=cfg.hang_timeout_s)
        self._starts.start_zygote(rank_env(self._environ, self._spec, 0, 0, None, self._lifeline.read_fd))
        incarnation, restart = -1 if cfg.multinode else 0, None
        while True:
            if self._store.popen.returncode is not None:
                log.error("%s: the store host exited (code %s); stopping", self._name, self._store.popen.returncode)
                return 1
            if self._rdzv is not None:
                met = self._meet(incarnation)
                if isinstance(met, int):
                    return met
                incarnation = met.incarnation
            if any(self._starts.source(r) == "wait" for r in range(cfg.nproc)) and self._await_zygote():
                return self._stopped()
            started = time.monotonic()
            self._ranks = []
            warm: list[int] = []
            importing: list[int] = []
            forked: list[int] = []
            try:
                for r in range(cfg.nproc):
                    ready = self._pool is not None and self._pool.ready(r)
                    proc = self._start_rank(self._spec, r, incarnation)
                    self._ranks.append(proc)
                    if proc.started < started:
                        (warm if ready else importing).append(r)
                    elif proc.forked:
                        forked.append(r)
            except OSError as e:
                log.error("%s: cannot start rank %d: %s", self._name, len(self._ranks), e)
                return 1
            self._guard()
            if self._rdzv is not None:
                self._rdzv.watch()
            if restart is not None:
                failed_at = restart.pop("t")
                restart["incarnation"] = incarnation
                self._event("restart", logging.WARNING, **restart, restart_s=round(started - failed_at, 3),
                            warm_ranks=warm, importing_ranks=importing, forked_ranks=forked,
                            pids=[r.pid for r in self._ranks])
            end = self._watch(incarnation, started)
            if end.kind == "signal":
                self._stop_signal = end.signum
                self._stop_ranks()  # a node stopped by a signal leaves the rendezvous open, as torchrun's agent
                return self._stopped()
            if end.kind == "done":
                self._finish_ranks()
                log.info("%s: every rank exited 0 (incarnation %d)", self._name, incarnation)
                if self._rdzv is not None:
                    self._rdzv.finish()
                return 0
            if end.kind == "store":
                log.error("%s: the store host exited (code %d); stopping the ranks", self._name, end.returncode)
                if self._rdzv is not None:
                    self._rdzv.end(f"node {self._node}'s store host exited")
                    self._rdzv.close()
                self._stop_ranks()
                return 1
            outcome = self._after_peer(end, incarnation, started) if end.kind == "peer" else \
                self._after_failure(end, incarnation, started)
            if isinstance(outcome, int):
                return outcome
            restart = outcome
            if self._rdzv is None:
                incarnation += 1

    def _meet(self, last: int) -> int | RoundPlan:
        """Multi-node: join the group's next rendezvous round (``last``: the incarnation this
        node ran last, -1 before the first) and take this node's place from it. The
        round's plan, or an exit code (the round could not form, or a stop signal)."""
        assert self._rdzv is not None and self._spec is not None
        cfg = self.cfg
        if not self._joining:
            self._join(last)
        self._joining = False
        log.info("%s: waiting in the rendezvous for the group's %d nodes (at most %gs)", self._name, cfg.nnodes,
                 cfg.rdzv_timeout_s)
        while True:
            early, self._round_events = self._round_events, []
            batch = early or self._wake.wait(None)
            for i, ev in enumerate(batch):
                if ev[0] not in ("round", "round_error"):
                    self._other_event(ev)
                if ev[0] == "signal":
                    self._stop_signal = ev[1]
                    return self._stopped()
                if ev[0] == "store_exit":
                    log.error("%s: the store host exited (code %s); stopping", self._name, ev[1])
                    return 1
                if ev[0] == "round_error":
                    log.error("%s: %s", self._name, ev[1])
                    self._event("gave_up", logging.ERROR, reason=ev[1][:500])
                    return int(ev[2])
                if ev[0] == "round":
                    plan: RoundPlan = ev[1]
                    self._node = plan.group_rank
                    self._name = f"{self._group_name} (node {plan.group_rank} of {plan.nnodes})"
                    self._spec = dataclasses.replace(self._spec, master_addr=plan.master_addr,
                                                     master_port=plan.master_port, group_rank=plan.group_rank)
                    log.info("%s: the group's nodes met: incarnation %d, ranks %d..%d of %d, store %s:%d",
                             self._name, plan.incarnation, plan.global_rank(0), plan.global_rank(cfg.nproc - 1),
                             plan.world_size, plan.master_addr, plan.master_port)
                    for later in batch[i + 1:]:  # this round's watch may have posted already: keep it
                        self._wake.post(*later)
                    return plan

    def _join(self, last: int) -> None:
        """Start joining the next rendezvous round with this node's facts."""
        assert self._rdzv is not None and self._spec is not None
        cfg = self.cfg
        self._round_events = []
        self._rdzv.join(NodeInfo(nnodes=cfg.nnodes, nproc=cfg.nproc, node_rank=cfg.node_rank, addr=self._spec.master_addr,
                                 store_port=self._store_port, last_incarnation=last,
                                 hostname=socket.gethostname()[:255] or "?"))

    def _after_peer(self, end: _End, incarnation: int, started: float) -> int | dict[str, Any]:
        """Multi-node: another node ended the incarnation (a rank failed or hung there, or
        the node is lost): stop this node's ranks and take a fresh store; the next round
        restarts the group. Not a failure of this node: the crash-loop count only resets
        when the incarnation made progress."""
        failed_at = time.monotonic()
        log.warning("%s: %s; stopping this node's ranks to restart the group (incarnation %d)", self._name,
                    end.reason, incarnation)
        # Join the next round first (with a fresh store), then stop the ranks: the round forms meanwhile.
        fresh = self._fresh_store()
        if isinstance(fresh, int):
            self._stop_ranks()
            return fresh
        self._join(incarnation)
        self._joining = True
        self._stop_ranks()
        committed = self._committed(incarnation)
        self._reports_seen = self._reports_seen or committed
        if committed:
            self._streak = 0
        if self._stop_signal:
            return self._stopped()
        return {"failed_incarnation": incarnation, "rank": None, "cause": "peer", "reason": end.reason[:300],
                "uptime_s": round(failed_at - started, 3), "progress": committed, "streak": self._streak,
                "backoff_s": 0.0, "t": failed_at}

    def _fresh_store(self) -> int | None:
        """Fresh keys for the next incarnation: the spare store on the other port, or
        (``--master-port``) the same port reopened. None, or the exit code when it failed."""
        assert self._store is not None and self._spec is not None
        try:
            port = self._store.next(STORE_READY_S) if self.cfg.master_port == 0 else self._store.reset(STORE_READY_S)
        except (RuntimeError, ValueError) as e:
            log.error("%s: cannot reset the group's store: %s", self._name, e)
            return 1
        if port != self._spec.master_port and self.cfg.master_port:
            log.warning("%s: the group's store moved to port %d (port %d was taken)", self._name, port,
                        self._spec.master_port)
        self._store_port = port
        self._spec = dataclasses.replace(self._spec, master_port=port)
        return None

    def _after_failure(self, end: _End, incarnation: int, started: float) -> int | dict[str, Any]:
        """A rank failed: stop the others, apply the restart rule, reset the store and
        wait out the backoff. An exit code, or the facts of the restart to log."""
        failed_at = time.monotonic()
        uptime = failed_at - started
        if end.kind == "hang":
            cause = "hang"
            log.warning("%s: rank %d hung: no progress for %.1fs (last committed step %s) %.1fs into incarnation %d "
                        "(rank(s) %s past --hang-timeout %g); dumping the group's Python stacks to its log, then "
                        "SIGKILL to the hung rank(s) and stopping the others", self._name, end.rank, end.silent_s,
                        end.last_step, uptime, incarnation, list(end.hung), self.cfg.hang_timeout_s)
            if self._rdzv is not None:
                self._rdzv.end(f"node {self._node} rank {end.rank} hung")
            self._dump_stacks()
            for r in end.hung:
                self._ranks[r].signal(signal.SIGKILL, group=True)
        else:
            cause = describe_exit(end.returncode)
            if self._rdzv is not None:  # the other nodes stop their ranks now, not after ours stopped
                self._rdzv.end(f"node {self._node} rank {self._ranks[end.rank].rank} failed ({cause})")
            self._ranks[end.rank].drain(0.5)
            log.warning("%s: rank %d failed (%s) %.1fs into incarnation %d; stopping the other ranks",
                        self._name, end.rank, cause, uptime, incarnation)
        self._stop_ranks()
        committed = self._committed(incarnation)
        self._reports_seen = self._reports_seen or committed
        progressed = made_progress(committed, uptime, self._reports_seen, self.cfg.policy)
        decision = after_failure(self.cfg.policy, self._streak, progressed)
        self._streak = decision.streak
        if self._stop_signal:
            return self._stopped()
        facts = {"incarnation": incarnation + 1, "failed_incarnation": incarnation, "rank": end.rank,
                 "cause": cause, "exit_code": end.returncode if end.returncode >= 0 else None,
                 "signal": cause.split()[1] if end.returncode < 0 else None,
                 "uptime_s": round(uptime, 3), "progress": progressed, "streak": decision.streak}
        if end.kind == "hang":
            facts.update(exit_code=None, signal=None, silent_s=round(end.silent_s, 3), last_step=end.last_step,
                         hung_ranks=list(end.hung))
        if not decision.restart:
            self._event("gave_up", logging.ERROR, **{k: v for k, v in facts.items() if k != "incarnation"})
            log.error("rallypoint run: giving up on %s: %s; the last failure was rank %d (%s) %.1fs after its "
                      "start. See the ranks' output above, fix the cause and start the group again.",
                      self._name, decision.reason, end.rank, cause, uptime)
            if self._rdzv is not None:  # the other nodes waiting for the next round give up too
                self._rdzv.close()
            return GAVE_UP_EXIT
        fresh = self._fresh_store()
        if isinstance(fresh, int):
            return fresh
        log.info("%s: restarting in %.2fs (%s)", self._name, decision.backoff_s, decision.reason)
        if self._sleep(decision.backoff_s):
            return self._stopped()
        return {**facts, "backoff_s": round(decision.backoff_s, 3), "t": failed_at}

    def _start_rank(self, spec: GroupSpec, rank: int, incarnation: int) -> RankProcess:
        """``rank`` of ``incarnation``: from its standby, the zygote or a new process."""
        env = rank_env(self._environ, spec, rank, incarnation, self._progress_path(incarnation, rank),
                       self._lifeline.read_fd)
        prefix = log_prefix(self.cfg.group_id, spec.group_rank * spec.nproc + rank)
        return self._starts.rank(rank, incarnation, env, prefix)

    def _standby_env(self, rank: int) -> dict[str, str]:
        """A standby's environment: the next incarnation's as far as it is known now (the go
        brings the exact one)."""
        assert self._spec is not None
        return rank_env(self._environ, self._spec, rank, (self._ranks[0].incarnation or 0) + 1 if self._ranks else 0,
                        None, self._lifeline.read_fd)

    def _await_zygote(self) -> bool:
        """Wait for the zygote to be ready or fail (at most ``ZYGOTE_READY_S``); True when a
        stop signal came meanwhile. Other events are kept for the loops that handle them."""
        deadline, later = time.monotonic() + ZYGOTE_READY_S, []
        try:
            while self._starts.zygote_state() == ZYGOTE_STARTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._starts.zygote_failed(f"was not ready after {ZYGOTE_READY_S:g}s")
                for ev in self._wake.wait(max(left, 0.0)):
                    self._other_event(ev)
                    if ev[0] == "signal":
                        self._stop_signal = ev[1]
                        return True
                    if ev[0] in ("store_exit", "peer"):
                        later.append(ev)
            return False
        finally:
            for ev in later:
                self._wake.post(*ev)

    def _guard(self) -> None:
        """Tell the store host which process groups to take down if we die."""
        assert self._store is not None
        self._store.guard([r.pid for r in self._ranks] + (self._pool.pids() if self._pool is not None else []))

    def _other_event(self, ev: tuple[Any, ...]) -> None:
        """An event every wait loop handles the same way: a standby's death; a rendezvous
        round's outcome that arrives while the ranks are still being stopped (kept for
        ``_meet``)."""
        if ev[0] == "standby_exit" and self._pool is not None:
            self._pool.died(ev[1], ev[2], time.monotonic())
        elif ev[0] == "zygote":
            self._starts.on_zygote(ev[1], ev[2])
        elif ev[0] in ("round", "round_error"):
            self._round_events.append(ev)

    def _fill_standbys(self, incarnation: int, started: float) -> float | None:
        """Start the standbys if they are due; how long until the next look (None: no need)."""
        pool = self._pool
        if pool is None or not pool.missing():
            return None
        now = time.monotonic()
        reported = all(os.path.exists(self._progress_path(incarnation, r)) for r in range(self.cfg.nproc))
        if not standby_start_due(now, started, reported, self.cfg.standby_delay_s, self._starts.zygote_state()) \
                or pool.due(now) > 0:
            return max(pool.due(now), STANDBY_POLL_S) if reported else STANDBY_POLL_S
        if pool.fill(now):
            self._guard()
        return STANDBY_POLL_S if pool.missing() else None

    def _watch(self, incarnation: int, started: float) -> _End:
        """Until the incarnation ends: a rank exits, a stop is asked for, the store host
        dies, or (the watchdog on) a rank is hung. Starts the standbys when they are due."""
        codes: list[int | None] = [None] * self.cfg.nproc
        order: list[tuple[int, int]] = []
        watch = None
        if self.cfg.hang_timeout_s > 0:
            watch = ProgressWatch([self._progress_path(incarnation, r) for r in range(self.cfg.nproc)],
                                   self.cfg.hang_timeout_s, time.monotonic())
        while True:
            stop = 0
            waits = [w for w in (self._fill_standbys(incarnation, started),
                                 None if watch is None else watch.wait(time.monotonic())) if w is not None]
            for ev in self._wake.wait(min(waits) if waits else None):
                self._other_event(ev)
                if ev[0] == "exit" and ev[1] == incarnation:
                    codes[ev[2]] = ev[3]
                    order.append((ev[2], ev[3]))
                elif ev[0] == "signal":
                    stop = stop or ev[1]
                elif ev[0] == "store_exit":
                    return _End("store", returncode=ev[1])
                elif ev[0] == "peer":
                    if ev[2] != incarnation:  # a previous round's watch, posted as it stopped
                        log.debug("%s: ignored a peer event of incarnation %s: %s", self._name, ev[2], ev[1])
                        continue
                    return _End("peer", reason=ev[1])
            if stop:
                return _End("signal", signum=stop)
            state = group_state(codes)
            if state == FAILED:
                failed = first_failure(order)
                assert failed is not None
                return _End("failed", rank=failed[0], returncode=failed[1])
            if state == DONE:
                return _End("done")
            if watch is not None:
                exited = [rc is not None for rc in codes]
                for r in range(self.cfg.nproc):
                    if exited[r]:
                        watch.forget(r)
                now = time.monotonic()
                hung = watch.check(now, exited)
                if hung:
                    first, t = hung[0], watch.last_change[hung[0]]
                    assert t is not None
                    return _End("hang", rank=first, hung=tuple(hung), silent_s=now - t, last_step=watch.steps[first])

    def _finish_ranks(self) -> None:
        for r in self._ranks:
            r.finish()
        self._starts.reap()  # a subreaper (with a zygote): the ranks' orphans are ours to reap
        if self._store is not None:  # their pids may be reused from now on
            self._store.guard(self._pool.pids() if self._pool is not None else [])

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True (and no wait left) when a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            for ev in self._wake.wait(remaining):
                self._other_event(ev)
                if ev[0] == "signal":
                    self._stop_signal = ev[1]
                    return True
        return False

    def _stopped(self) -> int:
        name = signal.Signals(self._stop_signal).name
        log.info("%s: stopped by %s; every rank has exited", self._name, name)
        self._event("stopped", signal=name)
        return stop_exit_code(self._stop_signal)


def main(args: argparse.Namespace) -> int:
    """``rallypoint run``: validate the command line (exit 2 on a usage error, before
    anything starts), then supervise the group."""
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        print(f"rallypoint run: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    return Supervisor(cfg).run()


__all__ = ["GAVE_UP_EXIT", "Supervisor", "main"]
