"""torch >= 2.14 and torchft-nightly (0.3) groups with our Manager, ours with theirs.

Each case runs one scenario of ``tests/pg_reconfigure_next.py`` in a subprocess (its
replicas are threads) and checks its JSON result:

- torch's own groups created with ``enable_reconfigure=True``, reconfigured by our
  Manager's configure step: 3 ranks, shrunk to 2 in another order, grown to 3, and again
  after an abort; rank order = handle order (allgather), sums right;
- torchft-nightly's ProcessGroupGloo the same way, and one of ours in one communicator
  with two of theirs (handles and rendezvous interoperate);
- our ProcessGroupGloo given to torchft-nightly's Manager (and lighthouse): it trains;
- our Manager and lighthouse with native groups and with torchft-nightly's groups (once
  the ManagerClient carries handles).

On torch 2.13 every case skips (no native reconfigure; torchft-nightly's modules need
2.14). Run them with the torch 2.14 venv::

    make test-newest PYTEST_ARGS=tests/test_pg_reconfigure_native.py   # .venv-newest, torch 2.14.1

torchft-nightly is looked up in ``$RALLYPOINT_TORCHFT_NIGHTLY`` or ``<sys.prefix>/torchft-nightly``
(the folder that holds ``torchft/``); cases that need it skip when it is absent.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "pg_reconfigure_next.py"

pytestmark = pytest.mark.skipif(
    not hasattr(dist.ProcessGroup, "reconfigure"),
    reason="needs torch >= 2.14 (native reconfigure); run with the torch 2.14 venv",
)


def nightly_path() -> Path | None:
    """The folder holding torchft-nightly's ``torchft`` package, or None."""
    env = os.environ.get("RALLYPOINT_TORCHFT_NIGHTLY")
    for p in ([Path(env)] if env else []) + [Path(sys.prefix) / "torchft-nightly"]:
        if (p / "torchft" / "process_group.py").is_file():
            return p
    return None


def _client_takes_handles() -> bool:
    from rallypoint.manager.client import ManagerClient

    return "reconfigure_handle" in inspect.signature(ManagerClient._quorum).parameters


needs_nightly = pytest.mark.skipif(nightly_path() is None, reason="torchft-nightly is not installed "
                                   "(set RALLYPOINT_TORCHFT_NIGHTLY to the folder that contains torchft/)")
needs_handles = pytest.mark.skipif(not _client_takes_handles(),
                                   reason="the ManagerClient has no reconfigure_handle yet (branch `handles`)")


def run(scenario: str, nightly: bool = False, timeout: float = 240.0) -> dict[str, Any]:
    path = [str(nightly_path())] if nightly else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), scenario], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{scenario} did not finish within {timeout}s:\n{err[-4000:]}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{scenario} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _check_generations(gens: list[dict[str, Any]]) -> None:
    for g in gens:
        members = g["members"]
        want_sum = float(sum(m + 1 for m in members))
        for r in g["results"]:
            assert r["action"] == "reconfigure", g
            assert r["size"] == len(members) and r["sum"] == want_sum, g
            assert r["order"] == members, g  # rank = position of the handle in the quorum's list
            assert r["errored"] == "None", g


def test_native_reconfigurable_groups_through_our_managers_configure_step() -> None:
    res = run("native_groups")
    assert res["held_as"] == ["NativeGroup"] * 3  # torch's group, given errored()
    assert [g["members"] for g in res["generations"]] == [[0, 1, 2], [2, 0], [1, 2, 0], [0, 1, 2]]
    _check_generations(res["generations"])  # the last one after an abort


@needs_nightly
def test_torchft_nightly_groups_through_our_configure_step_and_in_one_communicator_with_ours() -> None:
    res = run("nightly_groups", nightly=True)
    assert res["torchft"].startswith(str(nightly_path()))
    _check_generations(res["generations"])
    _check_generations(res["mixed"])  # theirs, ours, theirs: one communicator


@needs_nightly
def test_our_group_trains_under_torchft_nightlys_manager() -> None:
    res = run("ours_in_their_manager", nightly=True)
    for r in res["replicas"]:
        assert r["commits"] == [True, True, True] and r["means"] == [1.5, 1.5, 1.5], res
        assert r["size"] == 2 and r["exact_prefix"], res  # built by reconfigure(), not configure()
    assert sorted(r["rank"] for r in res["replicas"]) == [0, 1]


def _check_our_managers(res: dict[str, Any]) -> None:
    for r in res["replicas"]:
        assert r["commits"] == [True] * 4 and r["means"] == [1.5] * 4, res
        assert r["action"] == "reconfigure" and r["error"] == "None", res
        # One rebuild for the one quorum (the handle-change rule itself is table-tested in
        # tests/test_reconfigure_handles.py: torch's native handle changes at every reconfigure).
        assert r["rebuilds"] == 1, res


@needs_handles
def test_our_manager_trains_with_native_reconfigurable_groups() -> None:
    _check_our_managers(run("native_in_our_manager"))


@needs_handles
@needs_nightly
def test_our_manager_trains_with_torchft_nightlys_groups() -> None:
    _check_our_managers(run("theirs_in_our_manager", nightly=True))
