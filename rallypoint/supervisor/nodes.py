"""The decisions of a replica group that spans hosts, as pure functions over plain data
(no sockets, no clocks): what each node's supervisor tells the others in a rendezvous
round, how the round's facts become this node's place in the group, and when a peer node
counts as lost. ``_rendezvous.py`` is the shell that moves these facts through
torch.distributed.elastic's rendezvous; ``tests/test_supervisor_nodes.py`` calls these
with tables.

Vocabulary: a *node* is one host's ``rallypoint run`` and its ``--nproc-per-node`` ranks;
``--nnodes`` nodes make one replica group. Every rendezvous round starts one incarnation
of the whole group: its number is one more than the highest incarnation any node of the
round ran (a replacement node brings none), so every node's ranks see the same
``TORCHELASTIC_RESTART_COUNT``. The node of group rank 0 (``--node-rank 0``, or the
rendezvous' rank 0 when no node passed ``--node-rank``) hosts the store the ranks meet in
(``MASTER_ADDR``/``MASTER_PORT``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

NODE_INFO_MAX_BYTES = 4096  # one node's facts on the wire; a bigger value is refused unread
ADDR_MAX = 255  # a host name's longest legal spelling
GAVE_UP_EXIT = 1
USAGE_EXIT = 2


class NodeError(Exception):
    """The nodes of one round cannot form the group: ``code`` is the exit code (2: the
    command lines disagree, a usage error; 1: gave up), the message names the node and
    the flag."""

    def __init__(self, message: str, code: int = USAGE_EXIT) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class NodeInfo:
    """What one node's supervisor tells the others in a round: its command line's group
    shape (``nnodes``, ``nproc``, ``node_rank``: -1 when not given), where its store
    listens (``addr``, ``store_port``: the group's store when this node turns out to be
    group rank 0), the last incarnation it ran (-1: none) and its host name for messages."""

    nnodes: int
    nproc: int
    node_rank: int
    addr: str
    store_port: int
    last_incarnation: int
    hostname: str

    def to_json(self) -> bytes:
        """The wire form (compact JSON)."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, who: str) -> NodeInfo:
        """Parse a peer's facts; ``NodeError`` (exit 1) naming ``who`` when they are too
        big, not JSON, or a field is missing or of the wrong type or range."""
        if len(raw) > NODE_INFO_MAX_BYTES:
            raise NodeError(f"{who} sent {len(raw)} bytes of node facts (at most {NODE_INFO_MAX_BYTES})", GAVE_UP_EXIT)
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NodeError(f"{who} sent node facts that are not JSON: {e}", GAVE_UP_EXIT) from None
        ints = ("nnodes", "nproc", "node_rank", "store_port", "last_incarnation")
        if not isinstance(d, dict) or set(d) != set(ints) | {"addr", "hostname"} \
                or not all(type(d[k]) is int for k in ints) \
                or not all(isinstance(d[k], str) and 0 < len(d[k]) <= ADDR_MAX for k in ("addr", "hostname")) \
                or not (d["nnodes"] >= 1 and d["nproc"] >= 1 and d["node_rank"] >= -1
                        and 0 < d["store_port"] <= 65535 and d["last_incarnation"] >= -1):
            raise NodeError(f"{who} sent malformed node facts: {raw[:200]!r}", GAVE_UP_EXIT)
        return cls(**d)


@dataclass(frozen=True)
class RoundPlan:
    """This node's place in the incarnation a round starts: its ``group_rank`` among
    ``nnodes`` nodes of ``nproc`` ranks each, the ``incarnation`` number, and where the
    ranks meet (``master_addr``/``master_port``: group rank 0's store). ``order[g]`` is
    the rendezvous rank of group rank ``g`` (to find a node's facts by group rank)."""

    group_rank: int
    nnodes: int
    nproc: int
    incarnation: int
    master_addr: str
    master_port: int
    order: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """Ranks in the whole replica group."""
        return self.nnodes * self.nproc

    def global_rank(self, local_rank: int) -> int:
        """``RANK`` of this node's ``local_rank``, as torchrun numbers it."""
        return global_rank(self.group_rank, self.nproc, local_rank)


def global_rank(group_rank: int, nproc: int, local_rank: int) -> int:
    """torchrun's ``RANK``: the node's ranks follow those of the nodes before it."""
    return group_rank * nproc + local_rank


def _node(i: int, info: NodeInfo) -> str:
    """How messages name a node: its --node-rank when it has one, and where it runs."""
    return (f"node {info.node_rank}" if info.node_rank >= 0 else f"node #{i}") + f" on {info.hostname} ({info.addr})"


def plan_round(infos: Sequence[NodeInfo], me: int) -> RoundPlan:
    """The group every node of a round forms: ``infos[i]`` is the rendezvous rank ``i``'s
    facts, ``me`` this node's rendezvous rank. Every node computes the same plan from the
    same facts, so they agree without another exchange. ``NodeError`` (exit 2) when the
    command lines disagree: another ``--nnodes`` or ``--nproc-per-node``, ``--node-rank``
    on some nodes only, out of range, or claimed twice."""
    mine = infos[me]
    n = len(infos)
    for flag, attr in (("--nnodes", "nnodes"), ("--nproc-per-node", "nproc")):
        values = [getattr(info, attr) for info in infos]
        if len(set(values)) > 1 or (attr == "nnodes" and values[0] != n):
            each = ", ".join(f"{_node(i, info)} {flag} {v}" for i, (info, v) in enumerate(zip(infos, values)))
            raise NodeError(f"the group's nodes were started with different {flag} ({n} met): {each}; start every "
                            f"node of the replica group with the same {flag}")
    given = [info.node_rank >= 0 for info in infos]
    if any(given) and not all(given):
        without = next(i for i, g in enumerate(given) if not g)
        raise NodeError(f"{_node(without, infos[without])} has no --node-rank but others have one; pass "
                        "--node-rank on every node of the group or on none")
    if all(given):
        owner: dict[int, int] = {}
        for i, info in enumerate(infos):
            if info.node_rank >= n:
                raise NodeError(f"{_node(i, info)}: --node-rank {info.node_rank} is not below --nnodes {n}")
            if info.node_rank in owner:
                other = infos[owner[info.node_rank]]
                raise NodeError(f"--node-rank {info.node_rank} is claimed twice: by {other.hostname} ({other.addr}) "
                                f"and by {info.hostname} ({info.addr}); give each node its own --node-rank")
            owner[info.node_rank] = i
        order = tuple(owner[g] for g in range(n))
    else:
        order = tuple(range(n))
    master = infos[order[0]]
    return RoundPlan(group_rank=order.index(me), nnodes=n, nproc=mine.nproc,
                     incarnation=max(info.last_incarnation for info in infos) + 1,
                     master_addr=master.addr, master_port=master.store_port, order=order)


def announcement_conflict(mine: NodeInfo, others: Sequence[NodeInfo]) -> NodeError | None:
    """While nodes wait for a round, each announces its facts; nodes that disagree on
    ``--nnodes`` could otherwise wait forever (torch completes a round by each node's own
    ``--nnodes``, and theirs never agree). The first disagreement with a live node's
    announcement (another ``--nnodes`` or ``--nproc-per-node``, or this node's
    ``--node-rank`` claimed by another host), as the error to exit with; None if none."""
    for other in others:
        for flag, attr in (("--nnodes", "nnodes"), ("--nproc-per-node", "nproc")):
            if getattr(other, attr) != getattr(mine, attr):
                return NodeError(f"the group's nodes were started with different {flag}: {_node(0, mine)} (this node) "
                                 f"{flag} {getattr(mine, attr)}, {_node(1, other)} {flag} {getattr(other, attr)}; "
                                 f"start every node of the replica group with the same {flag}")
        if mine.node_rank >= 0 and other.node_rank == mine.node_rank:
            return NodeError(f"--node-rank {mine.node_rank} is claimed twice: by {mine.hostname} ({mine.addr}, this "
                             f"node) and by {other.hostname} ({other.addr}); give each node its own --node-rank")
    return None


def stale_peers(beats: Sequence[bytes | None], seen: Sequence[tuple[bytes | None, float]], now: float,
                lost_after_s: float, me: int) -> tuple[list[tuple[bytes | None, float]], list[int]]:
    """The host-loss rule. Each node's supervisor rewrites its beat (a counter) in the
    round's store every beat period; ``beats[g]`` is what group rank ``g``'s key holds now
    (None: nothing yet), ``seen[g]`` the value and the (monotonic) time this node last saw
    it change. A peer whose beat has not changed for ``lost_after_s`` is lost (its host,
    or at least its supervisor, is gone). Returns the updated ``seen`` and the lost group
    ranks; never this node (``me``)."""
    out, lost = [], []
    for g, (beat, (old, since)) in enumerate(zip(beats, seen)):
        if beat != old:
            out.append((beat, now))
            continue
        out.append((old, since))
        if g != me and now - since >= lost_after_s:
            lost.append(g)
    return out, lost


def split_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``, or ``host`` alone with torchrun's default port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        return endpoint.strip("[]"), default_port
    return host.strip("[]"), int(port)


def give_up_message(what: str, nnodes: int, timeout_s: float, endpoint: str) -> str:
    """The one line a supervisor logs when the rendezvous gives up: which flag to look at."""
    return (f"rallypoint run: gave up: {what} within --rdzv-timeout {timeout_s:g}s at --rdzv-endpoint "
            f"{endpoint}; check that every node of the group was started, with the same --nnodes {nnodes}, "
            "--rdzv-endpoint and --rdzv-id, and that the endpoint's host:port is reachable from every node")


__all__ = [
    "ADDR_MAX", "announcement_conflict", "GAVE_UP_EXIT", "NODE_INFO_MAX_BYTES", "USAGE_EXIT", "NodeError", "NodeInfo", "RoundPlan",
    "give_up_message", "global_rank", "plan_round", "split_endpoint", "stale_peers",
]
