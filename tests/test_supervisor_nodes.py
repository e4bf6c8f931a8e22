"""``rallypoint run --nnodes N``'s decisions, as tables: the command line, what the nodes
of a rendezvous round agree on (``nodes.plan_round``), the facts a node sends and how a
peer's are checked, the host-loss rule, and each rank's environment on a node."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rallypoint.supervisor.args import UsageError, add_run_parser, config_from_args, parse_nnodes, parse_rdzv_conf
from rallypoint.supervisor.envs import GroupSpec, rank_env
from rallypoint.supervisor.nodes import (
    GAVE_UP_EXIT, NODE_INFO_MAX_BYTES, USAGE_EXIT, NodeError, NodeInfo, plan_round, split_endpoint, stale_peers,
)  # fmt: skip


def info(node_rank: int = -1, nnodes: int = 2, nproc: int = 2, addr: str = "10.0.0.1", port: int = 29500,
         last: int = -1, host: str = "h") -> NodeInfo:
    return NodeInfo(nnodes=nnodes, nproc=nproc, node_rank=node_rank, addr=addr, store_port=port,
                    last_incarnation=last, hostname=host)


# --- plan_round ----------------------------------------------------------------------------

@pytest.mark.parametrize("infos, me, group_rank, master, incarnation, order", [
    # --node-rank on every node: group rank = node rank, whatever the rendezvous order
    ([info(1, addr="b", port=2), info(0, addr="a", port=1)], 0, 1, ("a", 1), 0, (1, 0)),
    ([info(1, addr="b", port=2), info(0, addr="a", port=1)], 1, 0, ("a", 1), 0, (1, 0)),
    # on none: the rendezvous' order
    ([info(addr="a", port=1), info(addr="b", port=2)], 1, 1, ("a", 1), 0, (0, 1)),
    # the incarnation follows the node that ran the most; a replacement node brings none
    ([info(0, last=3), info(1, last=-1)], 1, 1, ("10.0.0.1", 29500), 4, (0, 1)),
    ([info(0, last=2, nnodes=3), info(2, last=2, nnodes=3), info(1, last=1, nnodes=3)], 1, 2,
     ("10.0.0.1", 29500), 3, (0, 2, 1)),
])  # fmt: skip
def test_plan_round(infos, me, group_rank, master, incarnation, order) -> None:
    plan = plan_round(infos, me)
    assert (plan.group_rank, (plan.master_addr, plan.master_port), plan.incarnation, plan.order) == (
        group_rank, master, incarnation, order)
    assert plan.world_size == len(infos) * infos[0].nproc
    # every node computes the same group from the same facts
    assert {(plan_round(infos, i).order, plan_round(infos, i).incarnation) for i in range(len(infos))} == {
        (order, incarnation)}


def test_global_ranks_follow_the_nodes_before() -> None:
    plan = plan_round([info(0, nproc=8), info(1, nproc=8)], 1)
    assert [plan.global_rank(r) for r in (0, 7)] == [8, 15] and plan.world_size == 16


@pytest.mark.parametrize("infos, match", [
    ([info(0, nnodes=2), info(1, nnodes=3, host="n2")], r"different --nnodes \(2 met\): node 0 on h \(10.0.0.1\) --nnodes 2, node 1 on n2 \(10.0.0.1\) --nnodes 3"),
    ([info(0, nproc=2), info(1, nproc=4)], "different --nproc-per-node .* --nproc-per-node 4"),
    ([info(0), info(-1, host="n2")], "no --node-rank but others have one"),
    ([info(0, host="a", addr="x"), info(0, host="b", addr="y")], r"--node-rank 0 is claimed twice: by a \(x\) and by b"),
    ([info(0), info(2)], "--node-rank 2 is not below --nnodes 2"),
])  # fmt: skip
def test_nodes_that_disagree_are_a_usage_error(infos, match) -> None:
    for me in range(len(infos)):
        with pytest.raises(NodeError, match=match) as e:
            plan_round(infos, me)
        assert e.value.code == USAGE_EXIT


# --- the facts on the wire -----------------------------------------------------------------

def test_node_info_round_trip() -> None:
    i = info(1, last=7, host="gpu01")
    assert NodeInfo.from_json(i.to_json(), "x") == i


@pytest.mark.parametrize("raw, match", [
    (b"x" * (NODE_INFO_MAX_BYTES + 1), "at most"),
    (b"{not json", "not JSON"),
    (b"[]", "malformed"),
    (info().to_json().replace(b'"nproc":2', b'"nproc":0'), "malformed"),
    (info().to_json().replace(b'"nproc":2', b'"nproc":"2"'), "malformed"),
    (info().to_json().replace(b'"store_port":29500', b'"store_port":70000'), "malformed"),
    (info().to_json().replace(b'"addr":"10.0.0.1"', b'"addr":""'), "malformed"),
    (info().to_json()[:-1] + b',"extra":1}', "malformed"),
])  # fmt: skip
def test_bad_node_facts_are_refused_naming_the_sender(raw: bytes, match: str) -> None:
    with pytest.raises(NodeError, match=match) as e:
        NodeInfo.from_json(raw, "rendezvous rank 3")
    assert "rendezvous rank 3" in str(e.value) and e.value.code == GAVE_UP_EXIT


# --- the host-loss rule ----------------------------------------------------------------------

def test_a_peer_whose_beat_stops_is_lost_after_the_timeout() -> None:
    seen = [(None, 0.0)] * 3
    seen, lost = stale_peers([b"1", b"1", b"1"], seen, 0.0, 5.0, me=0)
    assert lost == []
    seen, lost = stale_peers([b"9", b"4", b"1"], seen, 4.9, 5.0, me=0)  # node 2 silent 4.9 s
    assert lost == []
    seen, lost = stale_peers([b"9", b"5", b"1"], seen, 5.0, 5.0, me=0)
    assert lost == [2]
    # this node's own key never makes it lost (it stops beating while it restarts)
    _, lost = stale_peers([b"9", b"5", b"2"], seen, 100.0, 5.0, me=0)
    assert lost == [1]


@pytest.mark.parametrize("endpoint, parsed", [
    ("node0:29400", ("node0", 29400)), ("node0", ("node0", 29400)), ("[::1]:5", ("::1", 5)),
    ("::1", ("::1", 29400)), ("10.0.0.1:0", ("10.0.0.1", 0)),
])  # fmt: skip
def test_split_endpoint(endpoint: str, parsed: tuple[str, int]) -> None:
    assert split_endpoint(endpoint) == parsed


# --- the command line ----------------------------------------------------------------------

def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rallypoint")
    add_run_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["run", *argv])


def test_multinode_command_line_in_torchruns_spellings(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = config_from_args(_parse(["--nnodes", "2:2", "--node_rank", "1", "--rdzv_endpoint", "n0:29400",
                                   "--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=5,is_host=0",
                                   "--local_addr", "n1", "--nproc_per_node", "8", "--replica-group-id", "3",
                                   str(script)]))
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint, cfg.rdzv_id, cfg.local_addr, cfg.rdzv_conf, cfg.nproc,
            cfg.multinode) == (2, 1, "n0:29400", "rallypoint-3", "n1", {"join_timeout": "5", "is_host": "0"}, 8, True)
    assert cfg.rdzv_timeout_s == 600.0
    one = config_from_args(_parse(["--nnodes", "1", str(script)]))
    assert not one.multinode and one.rdzv_endpoint == ""


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--nnodes", "1:4", "--rdzv-endpoint", "h:1"], "fixed number of nodes"),
    (["--nnodes", "x"], "not a number of nodes"),
    (["--nnodes", "0"], "at least 1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], r"--node-rank 2 is not in 0..1"),
    (["--nnodes", "1", "--node-rank", "1"], "only node rank 0"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:99999"], "not HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"], "--rdzv-timeout must be positive"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout"], "not KEY=VALUE"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "sync_interval=-1"], "not a non-negative number"),
])  # fmt: skip
def test_multinode_usage_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(UsageError, match=message):
        config_from_args(_parse([*argv, str(script)]))


def test_parse_helpers() -> None:
    assert [parse_nnodes(x) for x in ("1", "3", "4:4")] == [1, 3, 4]
    assert parse_rdzv_conf(" a=1 , b = x,") == {"a": "1", "b": "x"}


def test_rank_env_on_node_1_of_2() -> None:
    spec = GroupSpec(nproc=2, master_addr="10.0.0.1", master_port=5000, group_id="3", nnodes=2, group_rank=1,
                     run_id="rallypoint-3")
    env = rank_env({}, spec, rank=1, incarnation=4)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "ROLE_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")} == {
        "RANK": "3", "LOCAL_RANK": "1", "ROLE_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "5000", "TORCHELASTIC_RESTART_COUNT": "4", "TORCHELASTIC_RUN_ID": "rallypoint-3",
    }  # fmt: skip


@pytest.mark.skipif(__import__("importlib").util.find_spec("etcd") is not None, reason="python-etcd is installed here")
def test_an_etcd_rendezvous_without_its_client_is_a_usage_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(UsageError, match="needs the python-etcd package"):
        config_from_args(_parse(["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "etcd-v2", str(script)]))
