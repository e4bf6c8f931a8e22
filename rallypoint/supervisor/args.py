"""``rallypoint run``'s command line: the subparser (torchrun's spellings accepted) and its
validation into a ``RunConfig``. A bad flag, a missing script or ``--nproc-per-node`` < 1
is a usage error (exit 2) before anything starts."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from rallypoint.supervisor.policy import RestartPolicy

USAGE_EXIT = 2
HANG_TIMEOUT_S = 300.0
STANDBY_DELAY_S = 10.0
RDZV_TIMEOUT_S = 600.0
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2")

DESCRIPTION = """\
Start the ranks of one replica group (where torchrun was) and keep the group running:
when any rank exits non-zero or by a signal, the others are stopped (SIGTERM, SIGKILL
after --grace-period) and all ranks start again, with a fresh TORCHELASTIC_RESTART_COUNT
(at once after progress, after a backoff otherwise), from warm standby processes that
have imported torch, rallypoint and --preload already (--no-standby: new processes); the
restarted group heals from its peers. The supervisor hosts the group's store
(MASTER_ADDR/MASTER_PORT), a fresh one for each restart (a spare waits on a second port,
so the ports alternate; with --master-port, that port is reopened). It gives up (exit 1)
after --max-restarts restarts in a row without a committed step (a crash loop). A rank
whose committed step (reported by its Manager) has not changed for --hang-timeout
seconds is hung: its stacks (and its group's) are dumped to the log and the group is
restarted as for a crash. Restarts are logged as JSON lines and reported to the
lighthouse (its /events). SIGTERM or SIGINT stops the ranks (SIGTERM, then SIGKILL
after --grace-period) and exits 128+signal; the supervisor exits 0 when every rank
exited 0. A usage error exits 2 before anything starts.

A replica group that spans hosts: run `rallypoint run --nnodes N --rdzv-endpoint HOST:PORT`
on each of its N nodes, as torchrun (--node-rank R on every node or on none). The nodes'
supervisors meet through torch.distributed.elastic's rendezvous (c10d by default: the node
whose --local-addr is the endpoint's host hosts it); node rank 0 hosts the group's store.
A rank that fails or hangs on any node restarts the group on every node; a node that is
lost (its host gone) makes the others wait, up to --rdzv-timeout, for it or a replacement
with the same --node-rank. Nodes that disagree (--nnodes, --nproc-per-node, a --node-rank
claimed twice) exit 2; a rendezvous that cannot form in time exits 1."""


class UsageError(ValueError):
    """A command line that cannot run; the message says why and what to do."""


@dataclass(frozen=True)
class RunConfig:
    """A validated ``rallypoint run`` command line."""

    nproc: int
    target: str  # the script's path, or the module's name with ``module``
    module: bool
    script_args: list[str] = field(default_factory=list)
    group_id: str | None = None
    lighthouse: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    grace_s: float = 10.0
    hang_timeout_s: float = HANG_TIMEOUT_S
    policy: RestartPolicy = RestartPolicy()
    standby: bool = True
    preload: tuple[str, ...] = ()
    standby_delay_s: float = STANDBY_DELAY_S
    nnodes: int = 1
    node_rank: int = -1  # -1: not given (the rendezvous numbers the nodes)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_timeout_s: float = RDZV_TIMEOUT_S
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    local_addr: str = ""
    extra_env: tuple[tuple[str, str], ...] = ()  # for every rank: --checkpoint-* as RALLYPOINT_CHECKPOINT_*

    @property
    def multinode(self) -> bool:
        """Does the group span more than one node (a rendezvous between supervisors)?"""
        return self.nnodes > 1


def _flag(p: argparse.ArgumentParser, name: str, **kw: object) -> None:
    """``--a-b`` plus torchrun's ``--a_b`` spelling."""
    spellings = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    p.add_argument(*spellings, **kw)  # type: ignore[arg-type]


def add_run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to the ``rallypoint`` parser."""
    p = sub.add_parser("run", help="launch one replica group and restart it when a rank fails (replaces torchrun)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = RestartPolicy()
    _flag(p, "nproc-per-node", type=int, default=1, metavar="N", help="ranks in this replica group (1)")
    _flag(p, "replica-group-id", default=os.environ.get("REPLICA_GROUP_ID"), metavar="ID",
          help="this group's REPLICA_GROUP_ID (default: $REPLICA_GROUP_ID)")
    _flag(p, "lighthouse", default=None, metavar="ADDR",
          help="the lighthouse's gRPC address, as RALLYPOINT_LIGHTHOUSE (default: the environment's)")
    _flag(p, "max-restarts", type=int, default=d.max_restarts, metavar="K",
          help=f"give up after K restarts in a row without a committed step ({d.max_restarts})")
    _flag(p, "restart-backoff", type=float, default=d.backoff_s, metavar="S",
          help=f"seconds before a restart, doubled per restart without progress ({d.backoff_s:g})")
    _flag(p, "restart-backoff-cap", type=float, default=d.backoff_cap_s, metavar="S",
          help=f"the longest backoff ({d.backoff_cap_s:g})")
    _flag(p, "min-healthy-s", type=float, default=d.min_healthy_s, metavar="S",
          help="for scripts that report no committed steps (no Manager): an incarnation that ran this "
               f"long counts as progress ({d.min_healthy_s:g})")
    _flag(p, "grace-period", type=float, default=10.0, metavar="S",
          help="seconds between SIGTERM and SIGKILL when stopping ranks (10)")
    _flag(p, "hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="S",
          help="a rank whose committed step has not changed for S seconds is hung: dump its stacks and restart "
               "the group. The clock starts at the rank's first committed step in each start (imports, the "
               "first quorum and the first heal are not timed; a heal later on must fit in S). "
               f"0: no watchdog ({HANG_TIMEOUT_S:g})")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a warm standby process per rank (torch, rallypoint and --preload imported, waiting) "
                        "that takes the rank's place when the group restarts; --no-standby: restart cold (on)")
    _flag(p, "preload", default="", metavar="MOD1,MOD2",
          help="modules the standbys import ahead of time besides torch and rallypoint (the script's heavy "
               "imports: transformers, your model package); found from the script's folder too")
    _flag(p, "standby-delay", type=float, default=STANDBY_DELAY_S, metavar="S",
          help="start the standbys once every rank has committed a step, or S seconds after the group started, "
               f"whichever is first, so their imports do not slow the group's own start ({STANDBY_DELAY_S:g})")
    _flag(p, "master-addr", default="127.0.0.1", metavar="HOST",
          help="MASTER_ADDR the ranks reach the group's store at, and the only address it listens on (127.0.0.1; "
               "with --nnodes > 1 the store of node rank 0 is used, at its --local-addr)")
    _flag(p, "master-port", type=int, default=0, metavar="PORT", help="the store's port (0: one the OS picks)")
    _flag(p, "checkpoint-dir", default=None, metavar="DIR",
          help="durable checkpoints: the folder or fsspec URL shared by every group, set as RALLYPOINT_CHECKPOINT_DIR "
               "for the ranks; their Managers checkpoint there and restore the newest complete one at start "
               "(docs/checkpoint.md)")
    _flag(p, "checkpoint-every", type=int, default=None, metavar="N",
          help="with --checkpoint-dir: every N committed steps (RALLYPOINT_CHECKPOINT_EVERY; 100)")
    _flag(p, "checkpoint-keep", type=int, default=None, metavar="K",
          help="with --checkpoint-dir: complete checkpoints kept, 0: all (RALLYPOINT_CHECKPOINT_KEEP; 3)")
    p.add_argument("--standalone", action="store_true", help="accepted for torchrun compatibility; no effect")
    p.add_argument("--nnodes", default="1", metavar="N",
                   help="nodes (hosts) in this replica group, N or N:N (1); more than 1 needs --rdzv-endpoint")
    _flag(p, "node-rank", type=int, default=None, metavar="R",
          help="this node's rank in the group, 0..N-1, on every node or on none (none: the rendezvous numbers them)")
    _flag(p, "rdzv-endpoint", default="", metavar="HOST:PORT",
          help="where the nodes of the group meet (c10d: the host of this address hosts the rendezvous store)")
    _flag(p, "rdzv-backend", default="c10d", choices=RDZV_BACKENDS, help="torch elastic's rendezvous backend (c10d)")
    _flag(p, "rdzv-id", default=None, metavar="ID",
          help="the rendezvous' id, the same on every node of the group (rallypoint-<replica group id>)")
    _flag(p, "rdzv-timeout", type=float, default=RDZV_TIMEOUT_S, metavar="S",
          help=f"give up (exit 1) when the group's nodes have not all met within S seconds ({RDZV_TIMEOUT_S:g})")
    _flag(p, "rdzv-conf", default="", metavar="K=V,...",
          help="torch's rendezvous settings (join_timeout, keep_alive_interval, is_host, ...) plus sync_interval, "
               "the rendezvous' poll in seconds (0.02)")
    _flag(p, "local-addr", default=None, metavar="HOST",
          help="the address the other nodes reach this node at (its store, the rendezvous); default: the host's "
               "fully qualified name")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module, as python -m does")
    p.add_argument("target", metavar="script.py", help="the training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _check_target(target: str, module: bool) -> None:
    if module:
        # Only the top-level package: finding a submodule imports its parents (maybe torch).
        top = target.split(".", 1)[0]
        if not top or importlib.util.find_spec(top) is None:
            raise UsageError(f"no module named {top!r} (from -m {target}); is it installed, or on PYTHONPATH?")
        return
    if not os.path.isfile(target):
        what = "is a directory" if os.path.isdir(target) else "does not exist"
        raise UsageError(f"script {target!r} {what} (relative to {os.getcwd()}); pass the path of a Python file, "
                         "or -m module")


def _check_preload(raw: str, target: str, module: bool) -> tuple[str, ...]:
    """``--preload a,b.c``: dotted names whose top-level package can be found (on the
    path, or beside the script, where the standby looks too). Found, not imported: the
    supervisor imports no user code."""
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    where = [] if module else [os.path.dirname(os.path.abspath(target))]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--preload: {name!r} is not a module name")
        top = name.split(".", 1)[0]
        if importlib.machinery.PathFinder.find_spec(top, [*where, *sys.path]) is None \
                and importlib.util.find_spec(top) is None:
            raise UsageError(f"--preload: no module named {top!r}; is it installed, or beside the script?")
    return names


def parse_nnodes(raw: str) -> int:
    """``--nnodes N`` or ``N:N`` (torchrun's elastic ``MIN:MAX``, fixed here: a replica
    group has a fixed shape; elasticity is across groups)."""
    lo, sep, hi = str(raw).partition(":")
    try:
        n, m = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(f"--nnodes {raw!r} is not a number of nodes (N or N:N)") from None
    if n != m:
        raise UsageError(f"--nnodes {raw}: a replica group has a fixed number of nodes (N or N:N); the job grows "
                         "and shrinks by whole replica groups instead")
    if n < 1:
        raise UsageError(f"--nnodes must be at least 1, not {raw}")
    return n


def parse_rdzv_conf(raw: str) -> dict[str, str]:
    """``--rdzv-conf k1=v1,k2=v2`` (torchrun's form)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf: {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    for key in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "keep_alive_interval",
                "keep_alive_max_attempt", "sync_interval"):
        if key in out:
            try:
                ok = float(out[key]) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise UsageError(f"--rdzv-conf {key}={out[key]!r} is not a non-negative number")
    return out


def _node_flags(args: argparse.Namespace) -> dict[str, object]:
    """The multi-node part of the command line, validated."""
    nnodes = parse_nnodes(args.nnodes)
    node_rank = -1 if args.node_rank is None else args.node_rank
    if nnodes == 1:
        if node_rank > 0:
            raise UsageError(f"--node-rank {node_rank} with --nnodes 1: a group of one node has only node rank 0")
        return {}
    if not args.rdzv_endpoint:
        raise UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node of the group "
                         "(c10d: the host of one of them)")
    if args.rdzv_backend in ("etcd", "etcd-v2") and importlib.util.find_spec("etcd") is None:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend} needs the python-etcd package (torch's etcd rendezvous "
                         "client): pip install python-etcd; or use --rdzv-backend c10d")
    if not -1 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    if not args.rdzv_timeout > 0:
        raise UsageError(f"--rdzv-timeout must be positive, not {args.rdzv_timeout}")
    from rallypoint.supervisor.nodes import split_endpoint

    try:
        host, port = split_endpoint(args.rdzv_endpoint)
    except ValueError:
        raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT") from None
    if not host or not 0 <= port <= 65535:
        raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT")
    group = args.replica_group_id
    rdzv_id = args.rdzv_id or f"rallypoint-{group if group is not None else 'default'}"
    import socket

    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_backend": args.rdzv_backend,
            "rdzv_endpoint": f"{host}:{port}" if ":" not in host else f"[{host}]:{port}", "rdzv_id": rdzv_id,
            "rdzv_timeout_s": args.rdzv_timeout, "rdzv_conf": parse_rdzv_conf(args.rdzv_conf),
            "local_addr": args.local_addr or socket.getfqdn()}


def checkpoint_env(directory: str | None, every: int | None, keep: int | None) -> dict[str, str]:
    """The ranks' ``RALLYPOINT_CHECKPOINT_*`` for ``--checkpoint-dir/-every/-keep``
    (``UsageError`` for an interval below 1, a negative keep, or either without a folder)."""
    if directory is None:
        if every is not None or keep is not None:
            raise UsageError("--checkpoint-every and --checkpoint-keep need --checkpoint-dir")
        return {}
    if not directory.strip():
        raise UsageError("--checkpoint-dir is empty")
    env = {"RALLYPOINT_CHECKPOINT_DIR": directory}
    if every is not None:
        if every < 1:
            raise UsageError(f"--checkpoint-every must be at least 1, not {every}")
        env["RALLYPOINT_CHECKPOINT_EVERY"] = str(every)
    if keep is not None:
        if keep < 0:
            raise UsageError(f"--checkpoint-keep must not be negative, not {keep}")
        env["RALLYPOINT_CHECKPOINT_KEEP"] = str(keep)
    return env


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Validate the parsed command line; ``UsageError`` names the problem."""
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    nodes = _node_flags(args)
    if not 0 <= args.master_port <= 65535:
        raise UsageError(f"--master-port {args.master_port} is not in 0..65535")
    for flag, value in (("--max-restarts", args.max_restarts), ("--restart-backoff", args.restart_backoff),
                        ("--restart-backoff-cap", args.restart_backoff_cap), ("--min-healthy-s", args.min_healthy_s),
                        ("--grace-period", args.grace_period), ("--hang-timeout", args.hang_timeout),
                        ("--standby-delay", args.standby_delay)):
        if not value >= 0:  # NaN too
            raise UsageError(f"{flag} must not be negative, not {value}")
    if args.replica_group_id is not None and not str(args.replica_group_id).strip():
        raise UsageError("--replica-group-id is empty")
    _check_target(args.target, args.module)
    preload = _check_preload(args.preload, args.target, args.module)
    return RunConfig(
        nproc=args.nproc_per_node,
        target=args.target,
        module=args.module,
        script_args=list(args.script_args),
        group_id=args.replica_group_id,
        lighthouse=args.lighthouse,
        master_addr=args.master_addr,
        master_port=args.master_port,
        grace_s=args.grace_period,
        hang_timeout_s=args.hang_timeout,
        policy=RestartPolicy(max_restarts=args.max_restarts, backoff_s=args.restart_backoff,
                             backoff_cap_s=args.restart_backoff_cap, min_healthy_s=args.min_healthy_s),
        standby=args.standby,
        preload=preload,
        standby_delay_s=args.standby_delay,
        extra_env=tuple(sorted(checkpoint_env(args.checkpoint_dir, args.checkpoint_every,
                                              args.checkpoint_keep).items())),
        **nodes,  # type: ignore[arg-type]
    )


__all__ = ["RDZV_BACKENDS", "RDZV_TIMEOUT_S", "parse_nnodes", "parse_rdzv_conf", "HANG_TIMEOUT_S", "STANDBY_DELAY_S", "RunConfig", "USAGE_EXIT", "UsageError", "add_run_parser", "checkpoint_env", "config_from_args"]
