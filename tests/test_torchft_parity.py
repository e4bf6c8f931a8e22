"""The torchft compatibility package (``compat/torchft``) installed as a user installs it.

* It is pip-installed (``--no-deps --target``) into a temporary folder and imported from
  there in subprocesses, never from the checkout: ``import torchft`` is rallypoint's,
  with torchft's module paths and attributes (``torchft.process_group.ManagedProcessGroup``
  after a bare ``import torchft``, as TorchTitan uses it), and a torchft-style training
  loop (lighthouse, Manager, process group, Optimizer, DDP) written against ``torchft``
  commits steps.
* ``tools/torchft_parity.py``: every public name and parameter of torchft 0.2.0's and
  torchft-nightly's trainer-facing modules exists in the compat package, or is listed in
  ``compat/parity.toml`` with the reason it differs; the comparison itself is table-tested.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import torchft_parity as parity  # noqa: E402
from torchft_site import install_compat  # noqa: E402

RUN_TIMEOUT = 180


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("compat") / "site"
    try:
        install_compat(target)
    except RuntimeError as e:
        pytest.fail(str(e))
    assert (target / "torchft" / "__init__.py").is_file()
    assert list(target.glob("rallypoint_torchft_compat-0.1.0.dist-info")), sorted(p.name for p in target.iterdir())
    assert not (target / "rallypoint").exists(), "--no-deps: rallypoint itself is not copied"
    return target


def _run(target: Path, code: str, tmp: Path) -> str:
    """Run ``code`` in a fresh interpreter with the installed package first on sys.path."""
    script = tmp / "run.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(target)!r})\n" + textwrap.dedent(code))
    res = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT, cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout


def test_import_torchft_is_rallypoint(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, """
        import json, torchft
        import rallypoint, rallypoint.process_groups as pgs
        from rallypoint.manager.manager import Manager, WorldSizeMode
        # TorchTitan's uses, after a bare `import torchft`
        assert torchft.process_group.ManagedProcessGroup is pgs.ManagedProcessGroup
        assert torchft.ProcessGroupNCCL is pgs.ProcessGroupNCCL
        assert torchft.ProcessGroupGloo is pgs.ProcessGroupGloo
        assert torchft.Manager is Manager
        assert torchft.manager.WorldSizeMode is WorldSizeMode
        assert torchft.process_group.ReconfigureOptions is pgs.ReconfigureOptions
        assert torchft.Optimizer is torchft.optim.OptimizerWrapper is rallypoint.OptimizerWrapper
        assert torchft.DistributedDataParallel is rallypoint.DistributedDataParallel
        assert torchft.DistributedSampler is rallypoint.DistributedSampler
        from torchft.local_sgd import DiLoCo, LocalSGD
        assert (DiLoCo, LocalSGD) == (rallypoint.DiLoCo, rallypoint.LocalSGD)
        from torchft.checkpointing import HTTPTransport, PGTransport
        assert (HTTPTransport, PGTransport) == (rallypoint.HTTPTransport, rallypoint.PGTransport)
        from torchft.coordination import LighthouseServer, LighthouseClient, ManagerServer, ManagerClient
        from torchft._torchft import Quorum, QuorumMember
        assert LighthouseServer is rallypoint.LighthouseServer
        print(json.dumps({"torchft": torchft.__file__, "rallypoint": rallypoint.__file__}))
    """, tmp_path)
    where = json.loads(out.strip().splitlines()[-1])
    assert Path(where["torchft"]).is_relative_to(installed), where
    assert not Path(where["torchft"]).is_relative_to(REPO), where


def test_torchft_training_loop_commits(installed: Path, tmp_path: Path) -> None:
    """A one-group torchft-style loop, written only against ``torchft``, commits 3 steps; then
    TorchTitan's loss sync (``dist.all_reduce`` over ``torchft.process_group.ManagedProcessGroup``,
    ``ReduceOp.AVG``) averages and commits."""
    out = _run(installed, """
        from datetime import timedelta
        import torch
        import torch.distributed as dist
        import torchft
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
        from torchft.coordination import LighthouseServer

        lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        manager = Manager(pg=pg, min_replica_size=1, load_state_dict=lambda sd: model.load_state_dict(sd),
                          state_dict=model.state_dict, replica_id="compat", lighthouse_addr=lh.address(),
                          rank=0, world_size=1, hostname="127.0.0.1", store_addr="127.0.0.1",
                          timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30))
        ddp = DistributedDataParallel(manager, model)
        optim = Optimizer(manager, opt)
        try:
            before = model.weight.detach().clone()
            for _ in range(3):
                optim.zero_grad()
                ddp(torch.ones(3, 4)).sum().backward()
                optim.step()
            print("steps", manager.current_step(), "changed", bool((model.weight != before).any()))
            # TorchTitan's loss-sync group: torchft.process_group.ManagedProcessGroup(manager),
            # registered beside the trainer's default group (torchrun's; here a 1-rank one)
            import os, tempfile
            import torch.distributed as dist
            store = os.path.join(tempfile.mkdtemp(), "store")
            dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
            replicate_pg = torchft.process_group.ManagedProcessGroup(manager)
            replicate_pg.register("dp_replicate")
            manager.start_quorum()
            t = torch.tensor([3.0, 5.0])
            dist.all_reduce(t, group=replicate_pg, op=dist.ReduceOp.AVG)
            print("avg", t.tolist(), "committed", manager.should_commit())
        finally:
            manager.shutdown(wait=False)
            lh.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
    """, tmp_path)
    assert "steps 3 changed True" in out, out
    assert "avg [3.0, 5.0] committed True" in out, out


# --- the parity check -------------------------------------------------------------------

@pytest.fixture(scope="module")
def compat_surface(installed: Path) -> dict[str, parity.Entry]:
    return parity.dump_in_subprocess(installed, role="compat")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, parity.Entry]]:
    refs = {"torchft 0.2.0": parity.dump_in_subprocess(None)}
    nightly = parity.nightly_dir()
    if nightly is not None:
        refs["torchft-nightly"] = parity.dump_in_subprocess(nightly)
    return refs


def test_reference_surfaces_are_walked(references: dict[str, dict[str, parity.Entry]]) -> None:
    """The walk sees what a trainer calls (so an empty walk cannot pass the check)."""
    ref = references["torchft 0.2.0"]
    for key in ("torchft:Manager", "torchft.manager:Manager.start_quorum", "torchft.manager:Manager.should_commit",
                "torchft.process_group:ManagedProcessGroup", "torchft.process_group:ProcessGroupGloo.allreduce",
                "torchft.optim:OptimizerWrapper", "torchft.local_sgd:DiLoCo", "torchft.checkpointing:HTTPTransport",
                "torchft.coordination:LighthouseServer"):
        assert key in ref, key
    assert ref["torchft.manager:Manager.start_quorum"]["params"] == ["self", "allow_heal", "shrink_only", "timeout"]
    assert ref["torchft.manager:Manager"]["params"][:3] == ["self", "pg", "load_state_dict"]


def test_parity_torchft_020(references: dict[str, dict[str, parity.Entry]],
                            compat_surface: dict[str, parity.Entry]) -> None:
    bad = parity.compare(references["torchft 0.2.0"], compat_surface, parity.load_allowed())
    assert not bad, "not in the compat package and not in compat/parity.toml:\n" + "\n".join(bad)


def test_parity_torchft_nightly(references: dict[str, dict[str, parity.Entry]],
                                compat_surface: dict[str, parity.Entry]) -> None:
    if "torchft-nightly" not in references:
        pytest.skip("torchft-nightly not found (<venv>/torchft-nightly or RALLYPOINT_TORCHFT_NIGHTLY); "
                    "make install unpacks it")
    bad = parity.compare(references["torchft-nightly"], compat_surface, parity.load_allowed())
    assert not bad, "not in the compat package and not in compat/parity.toml:\n" + "\n".join(bad)


def test_every_listed_difference_is_used(references: dict[str, dict[str, parity.Entry]],
                                         compat_surface: dict[str, parity.Entry]) -> None:
    """A stale entry in compat/parity.toml (one no longer differing) is removed, so the list
    stays what rallypoint actually lacks."""
    if "torchft-nightly" not in references:
        pytest.skip("needs both reference surfaces (torchft-nightly not found)")
    differing = [k for ref in references.values() for k in ref
                 if parity.differs(ref[k], compat_surface.get(k)) is not None]
    allowed = parity.load_allowed()
    unused = [pat for pat in allowed if not any(fnmatch.fnmatchcase(k, pat) for k in differing)]
    assert not unused, f"compat/parity.toml lists differences that no longer exist: {unused}"
    assert all(len(why) > 20 for why in allowed.values())


# --- the comparison, table-tested --------------------------------------------------------

F = "function"


@pytest.mark.parametrize(("ref", "got", "expected"), [
    ({"kind": F, "params": ["self", "a", "b"]}, {"kind": F, "params": ["self", "a", "b"]}, None),
    ({"kind": F, "params": ["self", "a"]}, {"kind": F, "params": ["self", "a", "extra"]}, None),
    ({"kind": F, "params": ["self", "a", "b"]}, None, "missing"),
    ({"kind": F, "params": ["self", "a", "b"]}, {"kind": "missing"}, "missing"),
    ({"kind": F, "params": ["self", "a", "b"]}, {"kind": F, "params": ["self", "a", "c"]}, "parameters missing: b"),
    ({"kind": F, "params": ["self", "a", "b"]}, {"kind": F, "params": ["self", "b", "a"]},
     "parameters at other positions"),
    ({"kind": F, "params": ["self", "a"]}, {"kind": F, "params": ["self", "a", "**kw"]}, None),
    ({"kind": F, "params": ["self", "a"]}, {"kind": F, "params": ["self", "*args"]}, "parameters missing: a"),
    ({"kind": "class", "params": ["self"]}, {"kind": "attribute"}, "is a attribute"),
    ({"kind": "property"}, {"kind": "property"}, None),
    ({"kind": F, "params": None}, {"kind": F, "params": ["x"]}, None),
])
def test_differs(ref: parity.Entry, got: parity.Entry | None, expected: str | None) -> None:
    why = parity.differs(ref, got)
    if expected is None:
        assert why is None
    else:
        assert why is not None and why.startswith(expected), why


def test_compare_fails_on_an_unlisted_name_only() -> None:
    ref = {"torchft:A": {"kind": "class", "params": ["self"]}, "torchft:A.go": {"kind": F, "params": ["self", "x"]},
           "torchft.process_group:ProcessGroupXCCL": {"kind": "class", "params": ["self"]}}
    got = {"torchft:A": {"kind": "class", "params": ["self"]}}
    assert parity.compare(ref, got, {"torchft*:ProcessGroupXCCL*": "no XPU"}) == ["torchft:A.go: missing"]
    assert parity.compare(ref, got, {"torchft*:ProcessGroupXCCL*": "no XPU", "torchft:A.go": "why"}) == []


def test_nightly_dir(tmp_path: Path) -> None:
    (tmp_path / "n" / "torchft").mkdir(parents=True)
    (tmp_path / "n" / "torchft" / "__init__.py").write_text("")
    assert parity.nightly_dir({"RALLYPOINT_TORCHFT_NIGHTLY": str(tmp_path / "n")}, "/none", []) == tmp_path / "n"
    (tmp_path / "venv" / "torchft-nightly" / "torchft").mkdir(parents=True)
    (tmp_path / "venv" / "torchft-nightly" / "torchft" / "__init__.py").write_text("")
    assert parity.nightly_dir({}, str(tmp_path / "venv"), []) == tmp_path / "venv" / "torchft-nightly"
    site = str(tmp_path / "venv" / "lib" / "python3.11" / "site-packages")  # a venv layered over that one
    assert parity.nightly_dir({}, str(tmp_path / "upper"), [site]) == tmp_path / "venv" / "torchft-nightly"
    assert parity.nightly_dir({}, str(tmp_path / "none"), []) is None
