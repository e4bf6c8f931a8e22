"""The ``rallypoint`` command line: the parser of every subcommand, apart from
:mod:`rallypoint.cli` (which runs them) so that module stays small.

Conventions every subcommand follows: a replica is named with ``--replica`` (``kill``
also takes it as its positional argument, its older spelling); ``--timeout`` bounds the
whole call, connecting included; ``--log-level`` is accepted before or after the
subcommand; every subcommand has a description and every option a help string
(tests/test_cli_help.py walks the parser to check).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_LIGHTHOUSE = "http://localhost:29510"
DEFAULT_STATE = "rallypoint-lighthouse.db"
#: What ``--job`` means, in one line of each subcommand's help.
JOB_HELP = ("the job to act on: one lighthouse serves many jobs (training runs), each with its own quorum, state, "
            "metrics and token (default: $RALLYPOINT_JOB, else 'default')")


def _lighthouse_env() -> str:
    """The lighthouse a client subcommand calls without ``--lighthouse``."""
    return os.environ.get("RALLYPOINT_LIGHTHOUSE") or os.environ.get("TORCHFT_LIGHTHOUSE") or DEFAULT_LIGHTHOUSE


def _flag(parser: argparse.ArgumentParser, name: str, **kw: object) -> None:
    """Add ``--a-b`` with torchft's ``--a_b`` spelling as an alias."""
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append(f"--{name.replace('-', '_')}")
    parser.add_argument(*spellings, **kw)  # type: ignore[arg-type]


LOG_LEVEL_HELP = "logging level: DEBUG, INFO, WARNING or ERROR (default: $RALLYPOINT_LOG_LEVEL, else INFO)"
REPLICA_HELP = "the replica, by its id as `rallypoint status` lists it"
#: The CLI's descriptions, one per subcommand (``run``'s is in rallypoint.supervisor.args).
DESCRIPTIONS = {
    "lighthouse": "Run the lighthouse: the service that forms quorums of replica groups, grants them leases, "
                  "forwards kills and injections, and serves the dashboard (/status, /metrics, /events, /goodput). "
                  "Accepts torchft_lighthouse's flags, in either spelling (--min-replicas or --min_replicas). "
                  "Prints one JSON line with its addresses when ready; SIGTERM or SIGINT stops it.",
    "status": "Print one job's quorum as a table: the last quorum, the last decision, the lease, and one row per "
              "replica (in the quorum or not, step, heartbeat age, state, straggler score, manager address). "
              "Exits 1 when the lighthouse cannot be reached within --timeout.",
    "goodput": "Print one job's goodput ledger: where each replica group's time went (productive, healing, "
               "restarting, ...), the job's goodput, and the goodput model's estimate (--tau, --delta).",
    "kill": "Ask a replica's manager to exit, through the lighthouse (which forwards the kill to the manager's "
            "address). The replica is named by --replica ID or, as before, by the positional REPLICA_ID. "
            "Exits 1 when the lighthouse knows no such replica or cannot be reached within --timeout.",
}


def positive_seconds(text: str) -> float:
    """``--timeout``'s type: seconds, more than 0 (a usage error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _timeout(parser: argparse.ArgumentParser, default: float) -> None:
    parser.add_argument("--timeout", type=positive_seconds, default=default, metavar="S",
                        help=f"seconds the whole command may take, connecting to the lighthouse included ({default:g})")


def replica_of(args: argparse.Namespace) -> str:
    """``kill``'s replica: ``--replica`` or the positional ``REPLICA_ID`` (its older
    spelling); a usage error (exit 2) for neither or two different ones."""
    positional, flag = getattr(args, "replica_id", None), getattr(args, "replica", None)
    if positional is not None and flag is not None and positional != flag:
        args.usage_parser.error(f"two replicas named: {positional!r} and --replica {flag!r}; give one")
    replica = flag if flag is not None else positional
    if not replica:
        args.usage_parser.error("name the replica: --replica ID")
    return str(replica)


def _build_parser() -> argparse.ArgumentParser:
    from rallypoint import __version__

    p = argparse.ArgumentParser(prog="rallypoint", description="Fault-tolerant data-parallel training for PyTorch.")
    p.add_argument("--version", action="version", version=f"rallypoint {__version__}")
    p.add_argument("--log-level", default=os.environ.get("RALLYPOINT_LOG_LEVEL", "INFO"), metavar="LEVEL", help=LOG_LEVEL_HELP)
    sub = p.add_subparsers(dest="command", required=True)

    lh = sub.add_parser("lighthouse", help="run the lighthouse (quorum) service",
                        description=DESCRIPTIONS["lighthouse"])
    _flag(lh, "min-replicas", type=int, required=True, help="fewest replica groups a new quorum may have")
    _flag(lh, "join-timeout-ms", type=int, default=60_000, help="how long to wait for healthy stragglers (60000)")
    _flag(lh, "heartbeat-timeout-ms", type=int, default=5_000, help="silence after which a replica is dead (5000)")
    _flag(lh, "quorum-tick-ms", type=int, default=None, help="cap on the wait between evaluations (default: none; evaluation is event driven)")
    _flag(lh, "bind", default="[::]:29510", help="gRPC address ([::]:29510)")
    _flag(lh, "http-bind", default="[::]:29511", help="HTTP dashboard address ([::]:29511); 'off' disables it")
    _flag(lh, "state", default=DEFAULT_STATE, help=f"SQLite state file ({DEFAULT_STATE}); ':memory:' keeps nothing across restarts; "
          "etcd://host:port[,host:port...]/prefix keeps it in etcd, where several lighthouses elect a leader (HA)")
    _flag(lh, "token-file", default=None, metavar="PATH",
          help="file holding the token every call must send as 'authorization: Bearer TOKEN' (default: "
               "$RALLYPOINT_TOKEN); the file should be readable by this user only")
    _flag(lh, "token", default=None,
          help="the token itself (discouraged: every user of the host sees a command line; use --token-file or "
               "$RALLYPOINT_TOKEN)")
    _flag(lh, "allow-inject", action="store_true", default=None,
          help="accept fault injections (`rallypoint inject`, POST /inject) from the operator's or the job's token "
               "holders; off by default (default: $RALLYPOINT_ALLOW_INJECT=1); managers need "
               "RALLYPOINT_ALLOW_INJECT=1 too")
    _flag(lh, "forget-after-ms", type=int, default=None, help="forget replicas silent this long (10 x heartbeat timeout)")
    _flag(lh, "tls-cert", default=None, help="PEM certificate chain: serve gRPC and HTTP over TLS (default: $RALLYPOINT_TLS_CERT)")
    _flag(lh, "tls-key", default=None, help="PEM private key of --tls-cert (default: $RALLYPOINT_TLS_KEY)")
    _flag(lh, "tls-client-ca", default=None,
          help="PEM CA: demand client certificates signed by it, i.e. mutual TLS (default: $RALLYPOINT_TLS_CLIENT_CA)")
    _flag(lh, "tls-ca", default=None,
          help="PEM CA that signed the managers' certificates, for forwarded kills (default: $RALLYPOINT_TLS_CA)")
    _flag(lh, "require-tls", action="store_true", default=None,
          help="refuse to start without a TLS certificate (default: $RALLYPOINT_REQUIRE_TLS)")
    _flag(lh, "stragglers", choices=("report", "evict"), default="report",
          help="what to do with a replica group persistently slower than its peers: 'report' flags it in "
               "/status, /metrics and the event log; 'evict' also leaves it out of quorums for a cool-down (report)")
    _flag(lh, "straggler-threshold", type=float, default=1.5,
          help="a step is slow when the group's compute time is at least this times the median of the others (1.5)")
    _flag(lh, "straggler-window", type=int, default=8, help="steps remembered per group (8)")
    _flag(lh, "straggler-votes", type=int, default=5,
          help="slow steps within the window that make a straggler (5; at most --straggler-window)")
    _flag(lh, "straggler-cooldown-s", type=float, default=10.0,
          help="first eviction's cool-down, doubling on repeats up to 30 s (10)")
    _flag(lh, "etcd-ttl-s", type=float, default=2.0,
          help="with --state etcd://...: the leader's etcd lease, so the time before a standby replaces a dead "
               "leader (2; etcd may raise it to its minimum)")
    _flag(lh, "etcd-ca", default=None,
          help="with --state etcd://...: PEM CA that signed etcd's certificate; reach etcd over TLS "
               "(default: $RALLYPOINT_ETCD_CA; --require-tls refuses etcd without it)")
    _flag(lh, "etcd-cert", default=None, help="PEM client certificate for etcd (default: $RALLYPOINT_ETCD_CERT)")
    _flag(lh, "etcd-key", default=None, help="PEM private key of --etcd-cert (default: $RALLYPOINT_ETCD_KEY)")
    _flag(lh, "etcd-user", default=None, help="etcd user to authenticate as (default: $RALLYPOINT_ETCD_USER)")
    _flag(lh, "etcd-password-file", default=None,
          help="file holding --etcd-user's password on one line (default: $RALLYPOINT_ETCD_PASSWORD_FILE)")
    _flag(lh, "leases", choices=("on", "off"), default="on",
          help="grant quorums as leases, so that replica groups start steps without asking until membership "
               "must change (on; see rallypoint/lighthouse/LEASES.md); 'off': every step asks, as in torchft")
    _flag(lh, "jobs", default=None, metavar="FILE",
          help="JSON file naming the jobs this lighthouse serves and each job's token, e.g. "
               '{"jobs": {"llama": {"token": "..."}, "default": {"open": true}}}. A job is one training run '
               "(its replica groups set RALLYPOINT_JOB) with its own quorum, state and metrics; without this file "
               "every job takes --token (default: jobs are created by their first call, all under --token)")
    _flag(lh, "max-jobs", type=int, default=None,
          help="most jobs this lighthouse serves; the first call of one more is refused (64)")
    lh.set_defaults(usage_parser=lh)  # option errors found after parsing print this command's usage

    st = sub.add_parser("status", help="print the lighthouse's quorum as a table", description=DESCRIPTIONS["status"])
    st.add_argument("--lighthouse", default=None, help=f"gRPC or HTTP address (default: $RALLYPOINT_LIGHTHOUSE, $TORCHFT_LIGHTHOUSE or {DEFAULT_LIGHTHOUSE})")
    st.add_argument("--json", action="store_true", help="print the raw status document")
    _timeout(st, 5.0)
    st.add_argument("--job", default=None, help=JOB_HELP)
    st.set_defaults(usage_parser=st)

    gp = sub.add_parser("goodput", help="print the goodput ledger: where each replica group's time went",
                        description=DESCRIPTIONS["goodput"])
    gp.add_argument("--lighthouse", default=None, help="gRPC or HTTP address (default: as for status)")
    gp.add_argument("--json", action="store_true", help="print the ledger document (GET /goodput has its time series too)")
    gp.add_argument("--tau", type=float, default=None,
                    help="checkpoint interval for the goodput model, seconds (default: one committed step)")
    gp.add_argument("--delta", type=float, default=None,
                    help="time to save one checkpoint for the goodput model, seconds (default: 0)")
    _timeout(gp, 5.0)
    gp.add_argument("--job", default=None, help=JOB_HELP)
    gp.set_defaults(usage_parser=gp)

    from rallypoint.supervisor.args import add_run_parser

    add_run_parser(sub)

    kl = sub.add_parser("kill", help="ask a replica's manager to exit (forwarded by the lighthouse)",
                        description=DESCRIPTIONS["kill"])
    kl.add_argument("replica_id", nargs="?", default=None, metavar="REPLICA_ID",
                    help="the replica (the older spelling of --replica)")
    kl.add_argument("--replica", default=None, metavar="ID", help=REPLICA_HELP)
    kl.add_argument("--lighthouse", default=None, help="gRPC address of the lighthouse (default: as for status)")
    kl.add_argument("--reason", default="killed from the command line",
                    help="why, as the manager logs it ('killed from the command line')")
    _timeout(kl, 15.0)
    kl.add_argument("--job", default=None, help=JOB_HELP)
    kl.set_defaults(usage_parser=kl)

    from rallypoint._net.inject import KINDS

    ij = sub.add_parser("inject", help="inject a fault into a replica group (carried out at its next step boundary)",
                        description="Needs a lighthouse started with --allow-inject, managers with "
                                    "RALLYPOINT_ALLOW_INJECT=1, and RALLYPOINT_TOKEN set to the job's token or the "
                                    "operator's (lighthouse-restart: the operator's).")
    ij.add_argument("kind", choices=KINDS, help="the fault to inject")
    ij.add_argument("--replica", default=None, metavar="ID", help=REPLICA_HELP + ", or the REPLICA_GROUP_ID it "
                                                                  "starts with (not for lighthouse-restart)")
    ij.add_argument("--at-step", type=int, default=None, metavar="S", help="carry it out at the first step boundary at or after S")
    ij.add_argument("--for", dest="for_s", type=float, default=None,
                    help="seconds a hang or slowdown lasts (default: for good)")
    ij.add_argument("--factor", type=float, default=None, help="slow: how many times longer each step takes (3)")
    ij.add_argument("--bit", type=int, default=None, help="bitflip-*: which bit to flip (30): of the gradient's first non-zero element, of the parameter's element 0")
    ij.add_argument("--lighthouse", default=None, help="gRPC address of the lighthouse (default: as for status)")
    _timeout(ij, 10.0)
    ij.add_argument("--job", default=None, help=JOB_HELP)
    ij.set_defaults(usage_parser=ij)
    for command in sub.choices.values():  # `rallypoint status --log-level DEBUG` as well as before the subcommand
        command.add_argument("--log-level", default=argparse.SUPPRESS, metavar="LEVEL", help=LOG_LEVEL_HELP)
    return p
