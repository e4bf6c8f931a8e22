"""Prometheus metrics of the lighthouse.

The lighthouse exports what an operator needs to tell a healthy job from a stuck one
without reading logs: the current quorum (id and size), how long quorums take to form,
how many replicas are alive / asking / attached, why replicas were declared dead, which
quorum rule fired, and how many requests were turned away.

Every :class:`LighthouseMetrics` owns its own :class:`prometheus_client.CollectorRegistry`
instead of the process-global default one: tests (and embedders) run several
lighthouses in one process, and the global registry refuses a second metric with the
same name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Content type of :meth:`LighthouseMetrics.render`. Pinned to the classic text format
#: 0.0.4 (what ``generate_latest`` writes) rather than ``CONTENT_TYPE_LATEST``, whose
#: version changed across prometheus-client releases; every Prometheus scrapes 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Quorum latency buckets, seconds. From 0.5 ms (fast path: every member already
#: asked, quorum forms on the last request) to 60 s (the default join timeout, when a
#: round waits for a straggler), roughly 1-2.5-5 per decade so both ends resolve.
QUORUM_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    45.0,
    60.0,
)

#: Label values created up front (at zero) so that dashboards and alerts see the series
#: before the first event, instead of "no data" that is easy to misread as "fine".
KNOWN_DOWN_REASONS: tuple[str, ...] = ("stream_broken", "goodbye", "heartbeat_expired")
KNOWN_REJECT_REASONS: tuple[str, ...] = ("invalid_argument", "unauthenticated", "rate_limited", "inject_refused")
#: The kinds of event a ``rallypoint run`` supervisor reports (``reports.EVENT_KINDS``).
KNOWN_RUN_EVENTS: tuple[str, ...] = ("restart", "gave_up", "stopped", "started")
REPLICA_STATES: tuple[str, ...] = ("healthy", "participating", "attached")


#: The label value of groups folded away by the goodput ledger (it keeps at most 1024 one by one).
RETIRED_GROUPS = "_retired_"


class _GoodputCollector:
    """The goodput ledger's figures, as last set by :meth:`LighthouseMetrics.set_goodput`.

    A collector rather than Gauge/Counter objects: the ledger's seconds are totals it keeps
    (and restores after a restart), so they are exposed as counters whose value is set, not
    incremented; and groups that come and go leave no stale series behind."""

    def __init__(self) -> None:
        self.ratio: float | None = None
        self.model: float | None = None
        self.seconds: dict[tuple[str, str], float] = {}
        self.failed: dict[tuple[str, str], float] = {}

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily("rallypoint_goodput_ratio",
                              "The job's goodput: productive group-seconds over all settled group-seconds (the "
                              "goodput ledger; no sample before any time is settled)."),
            GaugeMetricFamily("rallypoint_goodput_model_ratio",
                              "The goodput model (1 - (T_detect + T_restart + T_load + tau/2)/MTBF) / (1 + delta/tau) "
                              "evaluated with the ledger's measured parameters."),
            CounterMetricFamily("rallypoint_goodput_seconds",
                                "Settled seconds of each replica group's wall time, by bucket (productive, "
                                "reconfiguration, healing, quorum_wait, failed, detection, excluded, spare, down, "
                                "unreported).", labels=["replica_id", "bucket"]),
            CounterMetricFamily("rallypoint_goodput_failed_seconds",
                                "Seconds of each replica group's failed rounds, by cause.", labels=["replica_id", "cause"]),
        )

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        ratio, model, seconds, failed = self._families()
        if self.ratio is not None:
            ratio.add_metric([], self.ratio)
        if self.model is not None:
            model.add_metric([], self.model)
        for (rid, bucket), value in sorted(self.seconds.items()):
            seconds.add_metric([rid, bucket], value)
        for (rid, cause), value in sorted(self.failed.items()):
            failed.add_metric([rid, cause], value)
        return iter((ratio, model, seconds, failed))


class _CheckpointCollector:
    """Each replica group's durable checkpointing (``checkpoints.CheckpointBook``), as last
    set by :meth:`LighthouseMetrics.set_checkpoints`: the last complete step and its age
    (gauges; no sample before a group's first), and its counters (writes, bytes, the
    staging stall, failures), which the group keeps and reports, so they are set, not
    incremented. Groups that are gone leave no series behind."""

    def __init__(self) -> None:
        self.rows: Mapping[str, Mapping[str, Any]] = {}

    @staticmethod
    def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
        label = ["replica_id"]
        return [
            GaugeMetricFamily("rallypoint_checkpoint_last_complete_step",
                              "The step of the newest complete durable checkpoint a replica group knows of.",
                              labels=label),
            GaugeMetricFamily("rallypoint_checkpoint_age_seconds",
                              "Seconds since that checkpoint was marked complete.", labels=label),
            CounterMetricFamily("rallypoint_checkpoint_writes",
                                "Checkpoint shares a replica group's ranks have written.", labels=label),
            CounterMetricFamily("rallypoint_checkpoint_bytes", "Bytes of those shares.", labels=label),
            CounterMetricFamily("rallypoint_checkpoint_stall_seconds",
                                "Training time a replica group spent staging checkpoint shares (its slowest rank).",
                                labels=label),
            CounterMetricFamily("rallypoint_checkpoint_failures",
                                "Checkpoint writes, commits, listings or loads that failed.", labels=label),
        ]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        step, age, writes, nbytes, stall, failures = fams = self._families()
        for rid, row in sorted(self.rows.items()):
            if row.get("last_complete_step") is not None:
                step.add_metric([rid], float(row["last_complete_step"]))
            if row.get("age_s") is not None:
                age.add_metric([rid], float(row["age_s"]))
            writes.add_metric([rid], float(row.get("writes", 0)))
            nbytes.add_metric([rid], float(row.get("bytes", 0)))
            stall.add_metric([rid], float(row.get("stall_s", 0.0)))
            failures.add_metric([rid], float(row.get("failures", 0)))
        return iter(fams)


class LighthouseMetrics:
    """Prometheus metrics of one lighthouse, on its own CollectorRegistry.

    Several lighthouses may live in one process (tests), so nothing here touches the
    global default registry. The methods are cheap and non-blocking; the server calls
    them on its event-loop thread as things happen.
    """

    registry: CollectorRegistry

    def __init__(self) -> None:
        self._decision_children: dict[str, Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._quorum_id = Gauge(
            "rallypoint_lighthouse_quorum_id",
            "Id of the last quorum formed (increases when membership changes or a member "
            "reported commit failures).",
            registry=r,
        )
        self._quorum_members = Gauge(
            "rallypoint_lighthouse_quorum_members",
            "Number of replica groups in the last quorum formed.",
            registry=r,
        )
        self._quorum_latency = Histogram(
            "rallypoint_lighthouse_quorum_latency_seconds",
            "Time from the first Quorum request of a round to the quorum forming.",
            buckets=QUORUM_LATENCY_BUCKETS,
            registry=r,
        )
        # prometheus_client appends "_total" to counter names on exposition.
        self._heartbeats = Counter(
            "rallypoint_lighthouse_heartbeats",
            "Heartbeats received (a Quorum request also counts as a heartbeat).",
            registry=r,
        )
        self._quorum_requests = Counter(
            "rallypoint_lighthouse_quorum_requests",
            "Quorum requests received.",
            registry=r,
        )
        self._decisions = Counter(
            "rallypoint_lighthouse_decisions",
            "Quorum rule decisions taken, by rule.",
            ["rule"],
            registry=r,
        )
        self._replicas = Gauge(
            "rallypoint_lighthouse_replicas",
            "Replica groups by state: healthy (recent heartbeat), participating "
            "(pending Quorum request), attached (open replica stream).",
            ["state"],
            registry=r,
        )
        self._replica_down = Counter(
            "rallypoint_lighthouse_replica_down",
            "Replica groups declared dead, by reason.",
            ["reason"],
            registry=r,
        )
        self._rejected = Counter(
            "rallypoint_lighthouse_rejected_requests",
            "Requests turned away, by reason.",
            ["reason"],
            registry=r,
        )
        self._run_events = Counter(
            "rallypoint_lighthouse_run_events",
            "Events reported by `rallypoint run` supervisors and recorded, by kind "
            "(a rising restart count is a group that keeps failing).",
            ["kind"],
            registry=r,
        )
        # Straggler scores (stragglers.py). Named as issue 15 names them (no "lighthouse_"
        # infix): they describe the replica groups, not the lighthouse.
        self._straggler_score = Gauge(
            "rallypoint_straggler_score",
            "A replica group's straggler score: the median, over its last --straggler-window steps, of its "
            "compute time over the median of the other groups' (1 = as fast as its peers). Groups without "
            "a score yet have no series.",
            ["replica_id"],
            registry=r,
        )
        self._straggler_evictions = Counter(
            "rallypoint_straggler_evictions",
            "Replica groups left out of quorums for a cool-down as stragglers (--stragglers evict).",
            registry=r,
        )
        self._straggler_excluded = Gauge(
            "rallypoint_straggler_excluded",
            "Replica groups excluded from quorums right now (straggler cool-down).",
            registry=r,
        )
        self._straggler_flagged = Gauge(
            "rallypoint_stragglers",
            "Replica groups currently flagged as stragglers (both policies).",
            registry=r,
        )
        self._score_labels: set[str] = set()
        # The goodput ledger (ledger.py), named as issue 15 names it.
        self._goodput = _GoodputCollector()
        r.register(self._goodput)
        self._checkpoints = _CheckpointCollector()
        r.register(self._checkpoints)
        for kind in KNOWN_RUN_EVENTS:
            self._run_events.labels(kind=kind)
        for state in REPLICA_STATES:
            self._replicas.labels(state=state).set(0)
        for reason in KNOWN_DOWN_REASONS:
            self._replica_down.labels(reason=reason)
        for reason in KNOWN_REJECT_REASONS:
            self._rejected.labels(reason=reason)
        self._lease_grants = Counter(
            "rallypoint_lease_grants_total",
            "Quorums granted as leases (their members start later steps without asking).", registry=r)
        self._lease_revokes = Counter(
            "rallypoint_lease_revokes_total", "Leases revoked, by why (joiner, member_asked, member_gone, ...).",
            ["why"], registry=r)
        self._step_reports = Counter(
            "rallypoint_step_reports_total",
            "Step statistics of rounds started on a lease, received on the liveness streams.", registry=r)

    def set_quorum(self, quorum_id: int, members: int) -> None:
        """Record the quorum just formed (or restored from the state file)."""
        self._quorum_id.set(quorum_id)
        self._quorum_members.set(members)

    def observe_quorum_latency(self, seconds: float) -> None:
        """Record how long a round took, first request to quorum formed.

        A negative value (a clock oddity upstream) is clamped to zero rather than
        raising: metrics must never break the request path.
        """
        self._quorum_latency.observe(max(0.0, float(seconds)))

    def heartbeat(self) -> None:
        """Count one heartbeat."""
        self._heartbeats.inc()

    def quorum_request(self) -> None:
        """Count one Quorum request."""
        self._quorum_requests.inc()

    def decision(self, rule: str) -> None:
        """Count one decision of the quorum rules, labelled by the rule that fired.

        Runs on every quorum request: the labelled child is cached, since
        ``labels()`` costs a lock and a dict build per call."""
        child = self._decision_children.get(rule)
        if child is None:
            child = self._decision_children[rule] = self._decisions.labels(rule=rule)
        child.inc()

    def set_replicas(self, healthy: int, participating: int, attached: int) -> None:
        """Record the current number of replicas in each state."""
        self._replicas.labels(state="healthy").set(healthy)
        self._replicas.labels(state="participating").set(participating)
        self._replicas.labels(state="attached").set(attached)

    def replica_down(self, reason: str) -> None:
        """Count one replica declared dead (``stream_broken``, ``goodbye``, ``heartbeat_expired``, ...)."""
        self._replica_down.labels(reason=reason).inc()

    def rejected(self, reason: str) -> None:
        """Count one request turned away (``invalid_argument``, ``unauthenticated``, ...)."""
        self._rejected.labels(reason=reason).inc()

    def run_event(self, kind: str) -> None:
        """Count one supervisor event recorded (``restart``, ``gave_up``, ...)."""
        self._run_events.labels(kind=kind).inc()

    def lease_granted(self) -> None:
        self._lease_grants.inc()

    def lease_revoked(self, why: str) -> None:
        self._lease_revokes.labels(why=why).inc()

    def step_report(self) -> None:
        self._step_reports.inc()

    def straggler_evicted(self) -> None:
        """Count one straggler eviction."""
        self._straggler_evictions.inc()

    def set_stragglers(self, scores: Mapping[str, float | None], flagged: int, excluded: int) -> None:
        """The score of every group that has one; series of groups no longer scored are
        removed, so ids that come and go (every restart is a new id) do not pile up."""
        current = {rid for rid, score in scores.items() if score is not None}
        for rid in self._score_labels - current:
            self._straggler_score.remove(rid)
        for rid in current:
            self._straggler_score.labels(replica_id=rid).set(scores[rid])  # type: ignore[arg-type]
        self._score_labels = current
        self._straggler_flagged.set(flagged)
        self._straggler_excluded.set(excluded)

    def set_goodput(self, doc: Mapping[str, Any] | None) -> None:
        """The goodput ledger's document (``GoodputBook.summary()``; None leaves the last
        figures). The ``unreported`` bucket's in-progress part is left out: a counter never
        goes down, and that part moves into another bucket at the group's next report."""
        if doc is None:
            return
        g = self._goodput
        model = doc.get("model") or {}
        g.ratio, g.model = doc.get("goodput"), model.get("goodput")
        seconds: dict[tuple[str, str], float] = {}
        failed: dict[tuple[str, str], float] = {}
        for row in doc.get("groups") or ():
            rid = str(row.get("group"))
            for bucket, value in (row.get("buckets") or {}).items():
                if bucket == "unreported":
                    value = max(0.0, value - (row.get("in_progress_s") or 0.0))
                seconds[(rid, bucket)] = float(value)
            for cause, value in (row.get("failed_by_cause") or {}).items():
                failed[(rid, cause)] = float(value)
        retired = (doc.get("total") or {}).get("retired") or {}
        for bucket, value in (retired.get("buckets") or {}).items():
            seconds[(RETIRED_GROUPS, bucket)] = float(value)
        for cause, value in (retired.get("failed_by_cause") or {}).items():
            failed[(RETIRED_GROUPS, cause)] = float(value)
        g.seconds, g.failed = seconds, failed

    def set_checkpoints(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Each group's checkpoint figures (``CheckpointBook.rows``), replacing the last."""
        self._checkpoints.rows = dict(rows)

    def render(self) -> bytes:
        """Prometheus text exposition (format 0.0.4) of this lighthouse's registry."""
        return prometheus_client.generate_latest(self.registry)
