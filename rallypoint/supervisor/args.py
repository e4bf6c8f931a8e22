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
exited 0. A usage error exits 2 before anything starts."""


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
          help="MASTER_ADDR the ranks reach the group's store at (127.0.0.1; it listens on every interface)")
    _flag(p, "master-port", type=int, default=0, metavar="PORT", help="the store's port (0: one the OS picks)")
    p.add_argument("--standalone", action="store_true", help="accepted for torchrun compatibility; no effect")
    p.add_argument("--nnodes", default="1", help="accepted for torchrun compatibility; must be 1")
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


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Validate the parsed command line; ``UsageError`` names the problem."""
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    if str(args.nnodes) not in ("1", "1:1"):
        raise UsageError(f"--nnodes {args.nnodes}: rallypoint run starts the ranks of one replica group on one host; "
                         "run one `rallypoint run` per replica group (each its own --replica-group-id)")
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
    )


__all__ = ["HANG_TIMEOUT_S", "STANDBY_DELAY_S", "RunConfig", "USAGE_EXIT", "UsageError", "add_run_parser", "config_from_args"]
