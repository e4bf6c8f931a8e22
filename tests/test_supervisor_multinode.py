"""``rallypoint run --nnodes 2`` end to end: replica groups whose nodes are "hosts" on this
machine (each node's supervisor, store and ranks on its own loopback address: 127.0.0.1
for node 0, 127.0.0.2 for node 1), meeting through torch elastic's real c10d rendezvous,
training with a Manager against a real lighthouse. A rank SIGKILLed on node 1 restarts
its group on both nodes; a node's whole supervisor SIGKILLed (its host lost) and a
replacement started a second later brings the group back; nodes that disagree, an
endpoint that never answers and a node that never arrives each end in one clear line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest

from conftest import Proc, wait_until
from supervisor_util import _env, children_of, events, pid_alive, read_json, run_group, strays  # noqa: F401

NODE_ADDRS = ("127.0.0.1", "127.0.0.2")

TRAIN = textwrap.dedent(
    """
    import hashlib, json, logging, os, sys, time
    from datetime import timedelta
    import torch
    from torch import nn
    import rallypoint

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    out, steps = sys.argv[1], int(sys.argv[2])
    gid, rank = os.environ["REPLICA_GROUP_ID"], int(os.environ["RANK"])
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(100 * int(gid) + inc)  # every start differs from the live group: the heal must copy
    model = nn.Linear(3, 1)
    manager = rallypoint.Manager(pg=rallypoint.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                                 load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                                 hostname=os.environ["NODE_ADDR"], timeout=timedelta(seconds=20),
                                 quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=20))
    ddp = rallypoint.DistributedDataParallel(manager, model)
    optimizer = rallypoint.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    def digest():
        flat = [x for p in model.parameters() for x in p.detach().flatten().tolist()]
        return hashlib.sha256(repr(flat).encode()).hexdigest()[:16]

    def save(name, **kw):
        path = os.path.join(out, f"{name}.g{gid}.r{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "inc": inc, "step": manager.current_step(), **kw}, f)
        os.replace(path + ".tmp", path)

    def last_step():  # the test moves the end (a file "steps") once it has seen what it waits for
        try:
            with open(os.path.join(out, "steps")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return steps

    first, failed = True, 0
    history = open(os.path.join(out, f"history.g{gid}.r{rank}"), "a")
    while manager.current_step() < last_step():
        optimizer.zero_grad()
        ddp(torch.ones(4, 3) * (manager.current_step() % 5 + 1)).sum().backward()  # the same data on every rank
        committed = optimizer.step()
        failed += not committed
        if committed:
            history.write(f"{manager.current_step()} {digest()}\\n")
            history.flush()
        save("state", failed=failed)
        if first and committed:
            save(f"first{inc}", t=time.time())
            first = False
        time.sleep(0.05)
    save("final", digest=digest(), failed=failed)
    manager.shutdown()
    """
)


def node(procs, tmp_path: Path, group: int, node_rank: int, endpoint: str, *extra: str, env: dict[str, str],
         name: str | None = None) -> Proc:
    """One node of replica group ``group``: its ``rallypoint run`` on its own address."""
    addr = NODE_ADDRS[node_rank]
    return run_group(procs, "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint,
                     "--local-addr", addr, "--nproc-per-node", "1", "--replica-group-id", str(group),
                     "--rdzv-timeout", "60", "--restart-backoff", "0.1", "--grace-period", "5", *extra,
                     str(tmp_path / "train.py"), str(tmp_path), "10000",
                     name=name or f"g{group}n{node_rank}", env={**env, "NODE_ADDR": addr})


def rendezvous_port(proc: Proc, timeout: float = 60) -> int:
    """The port node 0's supervisor hosts the rendezvous on (it was started with port 0)."""
    def port() -> int | None:
        m = re.search(r"hosts the rendezvous store at [\d.]+:(\d+)", proc.stderr_text())
        return int(m.group(1)) if m else None

    return wait_until(port, timeout=timeout, what=f"{proc.name} to host the rendezvous")  # type: ignore[no-any-return]


def start_group(procs, tmp_path: Path, group: int, env: dict[str, str], *extra: str) -> list[Proc]:
    n0 = node(procs, tmp_path, group, 0, f"{NODE_ADDRS[0]}:0", *extra, env=env)
    port = rendezvous_port(n0)
    return [n0, node(procs, tmp_path, group, 1, f"{NODE_ADDRS[0]}:{port}", *extra, env=env)]


def committed(tmp_path: Path, group: int, rank: int, step: int, inc: int | None = None) -> dict:
    def reached() -> dict | None:
        s = read_json(tmp_path / f"state.g{group}.r{rank}")
        return s if s is not None and s["step"] >= step and (inc is None or s["inc"] == inc) else None

    return wait_until(reached, timeout=90, what=f"group {group} rank {rank} to commit step {step}")  # type: ignore[no-any-return]


def finish_and_compare(tmp_path: Path, sups: list[Proc]) -> dict:
    """End the run a few steps on; every supervisor exits 0 and all four ranks (2 groups ×
    2 nodes) hold identical parameters at the end and at every step they all committed."""
    steps = max(read_json(tmp_path / f"state.g{g}.r{r}")["step"] for g in range(2) for r in range(2)) + 6  # type: ignore[index]
    (tmp_path / "steps").write_text(str(steps))
    for s in sups:
        assert s.wait(120) == 0, f"{s.name}:\n{s.stderr_text()[-6000:]}"
    final = {(g, r): json.loads((tmp_path / f"final.g{g}.r{r}").read_text()) for g in range(2) for r in range(2)}
    assert {f["step"] for f in final.values()} == {steps}, final
    assert len({f["digest"] for f in final.values()}) == 1, final
    hist: dict[tuple[int, int], dict[int, str]] = {}
    for key in final:
        lines = (tmp_path / f"history.g{key[0]}.r{key[1]}").read_text().split()
        hist[key] = dict(zip(map(int, lines[::2]), lines[1::2]))
    common = set.intersection(*(set(h) for h in hist.values()))
    assert len(common) >= 5, hist
    for step in common:
        assert len({h[step] for h in hist.values()}) == 1, (step, {k: h[step] for k, h in hist.items()})
    return final


@pytest.fixture
def setup(procs, lighthouse, tmp_path: Path):
    lh = lighthouse(min_replicas=1, join_timeout_ms=2_000)
    (tmp_path / "train.py").write_text(TRAIN)
    return _env(RALLYPOINT_LIGHTHOUSE=lh.address())


def test_a_rank_killed_on_node_1_restarts_its_group_on_both_nodes(procs, setup, tmp_path: Path, strays) -> None:
    g0 = start_group(procs, tmp_path, 0, setup, "--no-standby")
    g1 = start_group(procs, tmp_path, 1, setup, "--standby-delay", "0")
    state = committed(tmp_path, 1, 1, 3)
    for g in range(2):
        committed(tmp_path, g, 0, 3)
    strays.extend([state["pid"]])
    killed_at = time.time()
    os.kill(state["pid"], signal.SIGKILL)
    for r in range(2):
        committed(tmp_path, 1, r, 1, inc=1)
    firsts = [json.loads((tmp_path / f"first1.g1.r{r}").read_text()) for r in range(2)]
    assert all(f["pid"] != state["pid"] for f in firsts)
    final = finish_and_compare(tmp_path, g0 + g1)
    assert [final[(1, r)]["inc"] for r in range(2)] == [1, 1] and [final[(0, r)]["inc"] for r in range(2)] == [0, 0]
    # node 1 saw its rank die; node 0 stopped its rank for it; both restarted into incarnation 1
    (r1,), (r0,) = events(g1[1], "restart"), events(g1[0], "restart")
    assert (r1["node"], r1["rank"], r1["cause"], r1["signal"], r1["incarnation"]) == (1, 0, "signal SIGKILL", "SIGKILL", 1)
    assert (r0["node"], r0["cause"], r0["incarnation"]) == (0, "peer", 1) and "node 1 rank 0 failed" in r0["reason"]
    assert events(g0[0], "restart") == events(g0[1], "restart") == []
    print(f"kill -> both nodes' ranks restarted: node 0 {r0['restart_s']}s, node 1 {r1['restart_s']}s; "
          f"first commits {[round(f['t'] - killed_at, 2) for f in firsts]}s after the kill")


def test_a_lost_node_is_replaced_and_the_group_comes_back(procs, setup, tmp_path: Path, strays) -> None:
    g0 = start_group(procs, tmp_path, 0, setup, "--no-standby")
    g1 = start_group(procs, tmp_path, 1, setup, "--no-standby")
    state = committed(tmp_path, 1, 1, 3)
    committed(tmp_path, 0, 0, 3)
    before = read_json(tmp_path / "state.g0.r0")["failed"]  # type: ignore[index]
    strays.extend([state["pid"], *children_of(g1[1].popen.pid)])
    g1[1].kill(signal.SIGKILL)  # the whole host of node 1: its supervisor (its ranks die with it)
    wait_until(lambda: not pid_alive(state["pid"]), timeout=10, what="node 1's rank to die with its supervisor")
    time.sleep(1.0)  # the replacement host comes up a second later (the scenario's own timing)
    port = int(g1[1].argv[g1[1].argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])
    replacement = node(procs, tmp_path, 1, 1, f"{NODE_ADDRS[0]}:{port}", "--no-standby", env=setup, name="g1n1b")
    firsts = [committed(tmp_path, 1, r, 1, inc=1) for r in range(2)]
    assert firsts[1]["pid"] != state["pid"]
    final = finish_and_compare(tmp_path, [*g0, g1[0], replacement])
    # node 0 restarted its rank once: for the lost node (its beat stopped, or the replacement waiting in the
    # rendezvous), or because its own rank saw the dead peer first (the in-group allreduce broke)
    (r0,) = events(g1[0], "restart")
    assert r0["incarnation"] == 1 and (r0["cause"] == "peer" or r0["exit_code"] is not None), r0
    assert events(g0[0], "restart") == events(g0[1], "restart") == []
    # the other group went on: at most one of its steps failed while node 1 was gone
    assert final[(0, 0)]["failed"] - before <= 1 and final[(0, 1)]["failed"] - before <= 1, final


SCRIPT = "import time; time.sleep(60)\n"


def _bad_node(procs, tmp_path: Path, node_rank: int, endpoint: str, *extra: str, name: str, timeout: int = 30) -> Proc:
    (tmp_path / "sleep.py").write_text(SCRIPT)
    return run_group(procs, "--nnodes", extra[0] if extra and extra[0].isdigit() else "2", "--node-rank",
                     str(node_rank), "--rdzv-endpoint", endpoint, "--local-addr", NODE_ADDRS[min(node_rank, 1)],
                     "--rdzv-timeout", str(timeout), *[e for e in extra if not e.isdigit()], str(tmp_path / "sleep.py"),
                     name=name)


def _gone(proc: Proc, strays) -> None:
    """Nothing left running: the supervisor's children (store host, ranks) exited with it."""
    kids = children_of(proc.popen.pid)
    strays.extend(kids)
    wait_until(lambda: not any(pid_alive(k) for k in kids), timeout=10, what=f"{proc.name}'s children to exit")


def test_nodes_started_with_different_nnodes_exit_2_naming_the_flag(procs, tmp_path: Path, strays) -> None:
    a = _bad_node(procs, tmp_path, 0, f"{NODE_ADDRS[0]}:0", name="a")
    b = _bad_node(procs, tmp_path, 1, f"{NODE_ADDRS[0]}:{rendezvous_port(a)}", "3", name="b")
    for p in (a, b):
        assert p.wait(60) == 2, p.stderr_text()[-3000:]
        # each names the other node and both values, whoever saw it first
        assert re.search(r"different --nnodes\b.*node [01] on .*--nnodes [23], node [01] on .*--nnodes [23]",
                         p.stderr_text()), p.stderr_text()[-3000:]
        _gone(p, strays)


def test_two_nodes_claiming_one_node_rank_exit_2(procs, tmp_path: Path, strays) -> None:
    a = _bad_node(procs, tmp_path, 0, f"{NODE_ADDRS[0]}:0", name="a")
    b = _bad_node(procs, tmp_path, 0, f"{NODE_ADDRS[0]}:{rendezvous_port(a)}", "--local-addr", NODE_ADDRS[1], name="b")
    for p in (a, b):
        assert p.wait(60) == 2, p.stderr_text()[-3000:]
        assert "--node-rank 0 is claimed twice" in p.stderr_text(), p.stderr_text()[-3000:]


def test_an_endpoint_that_never_answers_gives_up_within_the_timeout(procs, tmp_path: Path, strays) -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind((NODE_ADDRS[0], 0))
        port = s.getsockname()[1]
        t = time.monotonic()
        p = _bad_node(procs, tmp_path, 1, f"{NODE_ADDRS[0]}:{port}", name="lonely", timeout=4)
        assert p.wait(30) == 1, p.stderr_text()[-3000:]
    took = time.monotonic() - t
    err = p.stderr_text()
    assert f"gave up: could not reach the rendezvous endpoint {NODE_ADDRS[0]}:{port} within --rdzv-timeout 4s" in err, err
    assert took < 4 + 20, took  # the timeout, plus the interpreter's start (slow on a loaded 2-core machine)
    _gone(p, strays)


def test_a_node_that_never_arrives_gives_up_within_the_timeout(procs, tmp_path: Path, strays) -> None:
    t = time.monotonic()
    p = _bad_node(procs, tmp_path, 0, f"{NODE_ADDRS[0]}:0", name="alone", timeout=4)
    assert p.wait(30) == 1, p.stderr_text()[-3000:]
    took = time.monotonic() - t
    assert "gave up: the group's 2 nodes did not all arrive within --rdzv-timeout 4s" in p.stderr_text()
    assert took < 4 + 20, took  # the timeout, plus a slow interpreter start under load
    _gone(p, strays)


def test_a_crash_loop_on_one_node_stops_the_whole_group(procs, tmp_path: Path, strays) -> None:
    """The crash-loop rule across nodes: node 1's rank fails at once every time; node 1 gives
    up after --max-restarts and closes the rendezvous; node 0, waiting for the next round,
    learns it and exits 1 too, saying why."""
    (tmp_path / "fail.py").write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["GROUP_RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
    """))
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-timeout", "30", "--max-restarts", "1",
              "--restart-backoff", "0.1", "--no-standby", "--replica-group-id", "7")
    a = run_group(procs, *common, "--node-rank", "0", "--rdzv-endpoint", f"{NODE_ADDRS[0]}:0", "--local-addr",
                  NODE_ADDRS[0], str(tmp_path / "fail.py"), name="a")
    b = run_group(procs, *common, "--node-rank", "1", "--rdzv-endpoint", f"{NODE_ADDRS[0]}:{rendezvous_port(a)}",
                  "--local-addr", NODE_ADDRS[1], str(tmp_path / "fail.py"), name="b")
    assert b.wait(60) == 1, b.stderr_text()[-3000:]
    assert "giving up on replica group 7 (node 1 of 2)" in b.stderr_text(), b.stderr_text()[-3000:]
    assert a.wait(60) == 1, a.stderr_text()[-3000:]
    assert "the group's rendezvous was closed: another node of the group finished or gave up" in a.stderr_text()
    (gave_up,) = events(b, "gave_up")
    assert (gave_up["node"], gave_up["exit_code"], gave_up["streak"]) == (1, 3, 2), gave_up
    for p in (a, b):
        _gone(p, strays)
