"""The replica group's TCPStore, as torchft users launch it (issue 12).

With ``store_addr``/``store_port`` (or ``MASTER_ADDR``/``MASTER_PORT``) given, every rank
connects to that store, which the caller hosts: the script itself (torchft's tests,
benchmarks and notebooks), torchrun's agent, or ``rallypoint run``. Given none, a group of
one rank hosts its own. Each case runs here the way a user runs it: a plain ``python``
process, ``torchrun``, and a script that passes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import reserved_port
from rallypoint.manager._store import StorePlan, plan_store, store_prefix

# ----------------------------------------------------------------------- decisions

HOST = "node-7"


@pytest.mark.parametrize(
    "addr, port, environ, expected",
    [
        # Nothing given: the group (of one rank) hosts a store on a port the OS picks.
        (None, None, {}, StorePlan(HOST, 0, True, HOST)),
        # The caller's store, as torchft's tests pass it: connect, advertise our hostname
        # (other hosts cannot reach our loopback).
        ("localhost", 29511, {}, StorePlan("localhost", 29511, False, HOST)),
        ("127.0.0.1", "29511", {}, StorePlan("127.0.0.1", 29511, False, HOST)),
        ("10.0.0.5", 29511, {}, StorePlan("10.0.0.5", 29511, False, "10.0.0.5")),
        # torchrun's environment.
        (None, None, {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400"}, StorePlan("10.0.0.9", 29400, False, "10.0.0.9")),
        # Arguments win over the environment.
        ("10.0.0.5", 1234, {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400"},
         StorePlan("10.0.0.5", 1234, False, "10.0.0.5")),
        # A port without an address: a store on this host.
        (None, 29511, {}, StorePlan("127.0.0.1", 29511, False, HOST)),
        # Port 0 means nobody hosts one: we do.
        ("localhost", 0, {}, StorePlan(HOST, 0, True, HOST)),
        (None, None, {"MASTER_ADDR": "10.0.0.9"}, StorePlan(HOST, 0, True, HOST)),
    ],
)  # fmt: skip
def test_plan_store(addr, port, environ, expected) -> None:
    assert plan_store(addr, port, HOST, environ) == expected


@pytest.mark.parametrize(
    "port, environ, message",
    [
        ("http", {}, "not a number"),
        (None, {"MASTER_PORT": "x"}, "not a number"),
        (70000, {}, "not in 0..65535"),
        (-1, {}, "not in 0..65535"),
    ],
)
def test_plan_store_rejects_bad_ports(port, environ, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_store("localhost", port, HOST, environ)


@pytest.mark.parametrize(
    "environ, prefix",
    [({}, "rallypoint/0"), ({"TORCHELASTIC_RESTART_COUNT": "3"}, "rallypoint/3"), ({"TORCHELASTIC_RESTART_COUNT": ""}, "rallypoint/0")],
)
def test_store_prefix_separates_incarnations(environ, prefix) -> None:
    assert store_prefix(environ) == prefix


# ----------------------------------------------------------------------- as users run it

# A torchft user's script, with rallypoint in torchft's place. MODE: "caller" hosts the
# store in the script and passes it (torchft's own tests do this); "none" passes nothing;
# "torchrun" reads everything from torchrun's environment.
SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    import rallypoint as torchft

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    mode, out = sys.argv[1], sys.argv[2]
    kw = {}
    if mode == "caller":
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        kw = dict(store_addr="localhost", store_port=store.port, rank=0, world_size=1)
    elif mode == "none":
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        replica_id="store_test",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=20),
        connect_timeout=timedelta(seconds=20),
        **kw,
    )
    model = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.OptimizerWrapper(manager, opt)
    x = torch.ones(4, 3)
    while manager.current_step() < 3:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"step": manager.current_step(), "weight": model.module.weight.tolist()}, f)
    manager.shutdown()
    """
)


def _run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}"
    return p


def _env(lighthouse_address: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["TORCHFT_LIGHTHOUSE"] = lighthouse_address
    return env


def _results(out: Path, ranks: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("mode, says", [("caller", "hosted by the caller"), ("none", "hosting this replica group's store")])
def test_plain_python_script(lighthouse, tmp_path: Path, mode: str, says: str) -> None:
    """``python train.py``: with the script's own TCPStore (torchft's pattern; rallypoint
    used to die with EADDRINUSE hosting a second one on its port), and with none."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    lh = lighthouse(min_replicas=1)
    p = _run([sys.executable, str(script), mode, str(tmp_path / "out")], _env(lh.address()))
    assert says in p.stderr, p.stderr[-3000:]
    assert "EADDRINUSE" not in p.stderr
    (res,) = _results(tmp_path / "out", 1)
    assert res["step"] == 3


def test_torchrun_two_ranks_share_the_agents_store(lighthouse, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 train.py``: both ranks of the replica
    group connect to torchrun's store (MASTER_ADDR/MASTER_PORT) and train in step.
    ``--standalone`` lets torchrun bind its rendezvous and store to ports the OS picks."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    lh = lighthouse(min_replicas=1)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0", "--monitor-interval", "0.2", str(script), "torchrun", str(tmp_path / "out")]
    p = _run(argv, _env(lh.address()), timeout=180)
    assert "hosted by the caller" in p.stderr, p.stderr[-3000:]
    a, b = _results(tmp_path / "out", 2)
    assert a["step"] == b["step"] == 3
    assert a["weight"] == b["weight"]


def test_unreachable_store_is_a_clear_error(lighthouse, tmp_path: Path) -> None:
    """An address nobody serves fails within connect_timeout, naming the address and
    what to do, instead of hanging or hosting a store nobody else will find."""
    code = textwrap.dedent(
        """
        from datetime import timedelta
        import rallypoint as torchft
        try:
            torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, load_state_dict=None, state_dict=None,
                            store_addr="127.0.0.1", store_port=STORE_PORT, rank=0, world_size=1,
                            connect_timeout=timedelta(seconds=2))
        except ConnectionError as e:
            print("ERROR:", e)
        """
    )
    with reserved_port() as port:  # held, never listening: connections are refused
        p = _run([sys.executable, "-c", code.replace("STORE_PORT", str(port))],
                 _env(lighthouse(min_replicas=1).address()), timeout=60)
    assert f"ERROR: group rank 0: cannot reach the replica group's store at 127.0.0.1:{port}" in p.stdout, p.stdout


def test_group_of_two_without_a_store_is_refused(lighthouse) -> None:
    """Rank 0 of a two-rank group cannot host a store the other rank would never find."""
    from rallypoint import Manager, ProcessGroupGloo

    env_keys = ("MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k) for k in env_keys if k in os.environ}
    try:
        with pytest.raises(ValueError, match="share a TCPStore, and no address was given"):
            Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=None, state_dict=None,
                    rank=0, world_size=2, lighthouse_addr=lighthouse(min_replicas=1).address())
    finally:
        os.environ.update(saved)
