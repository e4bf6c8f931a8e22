"""Build a folder where ``import torchft`` finds a torchft wheel's own integration tests,
unchanged, next to either rallypoint's torchft compatibility package or torchft's real
modules, and run one of those test files there.

Two wheels (``WHEELS``): torchft 0.2.0 (installed in the venv by the test extras) and
torchft-nightly 2026.10.26 (the 0.3 API; unpacked beside the venv by ``make install`` /
``make test-newest`` with ``pip install --no-deps --target VENV/torchft-nightly``, since it
installs the same ``torchft`` package; or where ``RALLYPOINT_TORCHFT_NIGHTLY`` points: the
folder that contains ``torchft/``).

``build_site(dest, wheel, alias=True)``: ``dest`` is rallypoint's torchft compatibility
package (``compat/torchft``, distribution ``rallypoint-torchft-compat``) installed the way a
user installs it in place of torchft (:func:`install_compat`: ``pip install --no-deps
--target``), with the wheel's test files copied byte for byte into its ``torchft/``;
``dest/test_fixtures/`` holds the DiLoCo regression fixtures recorded from that wheel
itself. ``alias=False`` copies the whole torchft package instead (used to record the
fixtures: ``tools/record_torchft_fixtures.py``).

``run_file(site, rel)`` runs one test file in a pytest of its own (a subprocess: torchft's
tests bind fixed manager ports 19530+, so one file's leftovers must not reach the next) and
returns each test's outcome; ``failures(...)`` applies a wheel's exceptions, allowed skips
and racy reruns to them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPAT = HERE.parent / "compat" / "torchft"
PIP_TIMEOUT_S = 300

#: The environment variable naming the folder that contains torchft-nightly's ``torchft/``.
NIGHTLY_ENV = "RALLYPOINT_TORCHFT_NIGHTLY"


def _installed_torchft() -> Path | None:
    """torchft 0.2.0's package folder in this venv (found without importing it)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def nightly_root() -> Path:
    """The folder that contains torchft-nightly's ``torchft/``: ``$RALLYPOINT_TORCHFT_NIGHTLY``,
    else ``torchft-nightly/`` beside the running venv (where the Makefile unpacks it)."""
    env = os.environ.get(NIGHTLY_ENV)
    return Path(env) if env else Path(sys.prefix) / "torchft-nightly"


def _nightly_torchft() -> Path | None:
    pkg = nightly_root() / "torchft"
    return pkg if (pkg / "__init__.py").is_file() else None


@dataclass(frozen=True)
class Wheel:
    """One torchft wheel whose integration tests run against rallypoint."""

    name: str
    version: str
    #: The wheel's files the integration tests consist of (relative to the torchft package).
    test_files: tuple[str, ...]
    fixtures: Path
    find: Callable[[], Path | None]
    missing: str

    def dir(self) -> Path:
        """The wheel's torchft package folder; RuntimeError (saying how to get it) if absent."""
        found = self.find()
        if found is None:
            raise RuntimeError(self.missing)
        return found

    def installed_version(self) -> str | None:
        """The version its dist-info records (None if none is found)."""
        found = self.find()
        if found is None:
            return None
        if self.name == "nightly":
            infos = sorted(found.parent.glob("torchft_nightly-*.dist-info"))
            return infos[-1].name[len("torchft_nightly-"):-len(".dist-info")] if infos else None
        try:
            return importlib.metadata.version("torchft")
        except importlib.metadata.PackageNotFoundError:
            return None


TORCHFT_020 = Wheel(
    name="0.2.0",
    version="0.2.0",
    test_files=("manager_integ_test.py", "local_sgd_integ_test.py", "diloco_regression_test.py",
                "_test/diloco_trainer.py"),
    fixtures=HERE / "fixtures" / "torchft_0.2.0",
    find=_installed_torchft,
    missing="torchft 0.2.0 is not installed (make install installs it with the test extras)",
)

TORCHFT_NIGHTLY = Wheel(
    name="nightly",
    version="2026.10.26",
    test_files=("manager_integ_test.py", "local_sgd_integ_test.py", "diloco_regression_test.py",
                "reconfigure_test.py", "_test/diloco_trainer.py"),
    fixtures=HERE / "fixtures" / "torchft_nightly_2026.10.26",
    find=_nightly_torchft,
    missing=(f"torchft-nightly is not unpacked at {nightly_root()} (`make install` / `make test-newest` put it "
             f"beside the venv; or set {NIGHTLY_ENV} to the folder that contains torchft/)"),
)

WHEELS = {w.name: w for w in (TORCHFT_020, TORCHFT_NIGHTLY)}

#: Backwards-compatible names (torchft 0.2.0's).
FIXTURES = TORCHFT_020.fixtures
TEST_FILES = TORCHFT_020.test_files


def wheel_dir(wheel: Wheel = TORCHFT_020) -> Path:
    """The wheel's torchft package folder (found without importing it)."""
    return wheel.dir()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install_compat(target: Path) -> Path:
    """``pip install --no-deps --target target`` rallypoint's torchft compatibility package
    (with build isolation, else with the venv's own setuptools), from a clean copy of its
    sources (setuptools leaves ``build/`` beside them, whose stale files a later build would
    package); returns ``target``. RuntimeError with pip's output when both ways fail."""
    src = target.parent / f"{target.name}-src"
    shutil.copytree(COMPAT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    errors = []
    try:
        for extra in ([], ["--no-build-isolation"]):
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *extra,
                   str(src)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=target.parent)
            if res.returncode == 0:
                return target
            errors.append(f"{cmd}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    raise RuntimeError("installing compat/torchft failed:\n" + "\n".join(errors))


def build_site(dest: Path, alias: bool = True, wheel: Wheel = TORCHFT_020) -> Path:
    """Populate ``dest`` and return it (see the module docstring)."""
    src = wheel.dir()
    pkg = dest / "torchft"
    if alias:
        install_compat(dest)
        for rel in wheel.test_files:
            assert not (pkg / rel).exists(), f"the compat package must not ship torchft's test file {rel}"
            (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, pkg / rel)
            assert sha256(pkg / rel) == sha256(src / rel)
    else:
        shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    fixtures = dest / "test_fixtures"
    fixtures.mkdir()
    if alias:
        for f in sorted(wheel.fixtures.glob("*.json")):
            shutil.copy2(f, fixtures / f.name)
    (dest / "pytest.ini").write_text("[pytest]\n")
    return dest


RECOVERY = "torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_failure_recovery_0"

#: test id -> why it fails against rallypoint on purpose (mirrored in docs/migrating.md), for
#: both wheels (their diloco_regression_test.py differ by one unused import).
EXCEPTIONS = {
    RECOVERY: (
        "the restarted replica joins the running round when its first inner step begins (and drops that "
        "step's gradient, taken on its stale parameters); torchft's first trains sync_every/n_fragments - "
        "fragment_sync_delay inner steps from its stale initial parameters, which the heal then overwrites, "
        "so torchft's recorded history has 2 more entries. The survivor's history is torchft's number for "
        "number (test_recovery_differs_only_by_the_stale_steps)"
    ),
}

#: Skips allowed (torchft skips them here too): no GPU, no torchcomms.
SKIP_REASONS = ("gpu", "cuda", "torchcomms")

#: torchft tests with a race in their own code, and why (a key may end in ``*``: every test
#: whose id starts with the rest). Such a test that fails is run again on its own (at most
#: twice) and must pass then; any other failure fails at once.
RACY = {
    "torchft.manager_integ_test.ManagerIntegTest.test_ddp_skip_init_sync": (
        "its two replica threads share torch's global RNG: each seeds it and builds its model under "
        "INIT_LOCK, but the training loop's torch.rand (outside the lock) of the replica that is done "
        "first can draw inside the other's seeded init; with init_sync=False nothing syncs the two "
        "models, so they end apart (seen once in a full-file run on a loaded machine; 8 of 8 runs alone pass)"
    ),
    "torchft.local_sgd_integ_test.LocalSGDIntegTest.test_streaming_diloco_upscale_*": (
        "replica 0 waits at a barrier until the two others reach manager step 2, then asks its first quorum; "
        "the others go on to step 4 (two more syncs, 8 tiny inner steps) and leave. When replica 0's thread "
        "is slow to reach its first inner step (2 loaded cores), they are gone before its request arrives "
        "and it times out alone (min_replicas=2): seen in full-file runs on a loaded machine (_01, _10, _11 "
        "on torch 2.14.1, _05 on 2.13.0, both wheels' copies of the test); 36 of 36 runs of the upscale tests "
        "alone pass, and 4 of 4 full-file runs on torch 2.13.0 and 2.14.1 when the machine is less loaded"
    ),
}

PER_TEST_TIMEOUT_S = 90
PER_FILE_TIMEOUT_S = 600
EXIT_GRACE_S = 15

Results = dict[str, tuple[str, str]]


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHFT_LIGHTHOUSE", "WRITE_FIXTURE")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_file(site: Path, rel: str, *args: str, **env: str) -> tuple[Results, str]:
    """Run one of torchft's test files in ``site``; returns ({test id: (outcome, message)},
    the output tail). Leases are on, as for every user (rallypoint's default); the bug
    they once exposed in test_streaming_diloco_commit_failure is in LEASES.md."""
    xml = site / f"{Path(rel).stem}.{os.getpid()}.xml"
    xml.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", str(site), "-p", "no:cacheprovider",
            "-q", "-o", f"timeout={PER_TEST_TIMEOUT_S}", f"--junitxml={xml}", f"torchft/{rel}", *args]
    out = site / f"{Path(rel).stem}.{os.getpid()}.log"
    with open(out, "w") as log_file:
        p = subprocess.Popen(argv, cwd=site, env=_env(site, **env), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            # A run whose failed test left replica threads behind may not exit after
            # writing its report: once the report exists, it gets a short grace.
            deadline = time.monotonic() + PER_FILE_TIMEOUT_S
            while p.poll() is None and not xml.exists() and time.monotonic() < deadline:
                try:
                    p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            try:
                p.wait(timeout=EXIT_GRACE_S if xml.exists() else 1)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    tail = out.read_text(errors="replace")[-8000:]
    assert xml.exists(), f"pytest wrote no report (rc={p.returncode}):\n{tail}"
    results: Results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname')}.{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:500]
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        results[tid] = outcome, message
    return results, tail


def failures(results: Results, exceptions: Mapping[str, str], skip_reasons: tuple[str, ...]) -> Results:
    """The tests that neither passed, nor are listed in ``exceptions``, nor skipped for one
    of ``skip_reasons`` (lower-case substrings of the skip message)."""
    bad: Results = {}
    for tid, (outcome, message) in results.items():
        if tid in exceptions:
            continue
        if outcome == "skipped" and any(r in message.lower() for r in skip_reasons):
            continue
        if outcome != "passed":
            bad[tid] = (outcome, message)
    return bad


def racy_reason(tid: str, racy: Mapping[str, str]) -> str | None:
    """Why ``tid`` is racy (its entry in ``racy``, exact or a ``prefix*`` one), or None."""
    if tid in racy:
        return racy[tid]
    return next((why for key, why in racy.items() if key.endswith("*") and tid.startswith(key[:-1])), None)


def rerun_racy(site: Path, rel: str, bad: Results, racy: Mapping[str, str]) -> Results:
    """Run each racy failure again on its own (at most twice); those that pass then are
    dropped from ``bad`` (returned), with a line saying so."""
    bad = dict(bad)
    for tid in list(bad):
        reason = racy_reason(tid, racy)
        if reason is None:
            continue
        for _ in range(2):
            again, _tail = run_file(site, rel, "-k", tid.rsplit(".", 1)[1])
            if again.get(tid, ("missing", ""))[0] == "passed":
                print(f"{tid} failed ({bad.pop(tid)[1][:200]}) and passed when run again: {reason}")
                break
    return bad


def _history(run: list, replica: int) -> dict[int, dict[str, list]]:
    return {int(k): v for k, v in run[replica][0]["history"].items()}


def check_recovery_differs_only_by_the_stale_steps(dest: Path, wheel: Wheel) -> None:
    """torchft's DiLoCo failure-recovery regression test, recorded from rallypoint with the
    test's own WRITE_FIXTURE mode, against the same test recorded from the torchft wheel:
    the survivor's parameters are torchft's at every inner step; the restarted replica's
    are torchft's without the inner steps torchft trains from its stale initialisation
    before the heal overwrites them: of sync_every 6 / 2 fragments - delay 0 = 3 such
    steps, torchft records the first 2 (the third's result is overwritten by the sync in
    the same iteration); rallypoint heals at its first step and drops that step."""
    site = build_site(dest, wheel=wheel)
    for f in (site / "test_fixtures").glob("*.json"):
        f.unlink()  # record rallypoint's run, not read torchft's
    # Leases off: with a lease, the survivor's round that starts as its peer fails is answered
    # from the lease and fails too (LEASES.md, "What leases cost"), one sync torchft's run has
    # not; this test compares the heal itself, number for number.
    results, tail = run_file(site, "diloco_regression_test.py", "-k", "test_diloco_mocked_failure_recovery",
                             WRITE_FIXTURE="true", RALLYPOINT_LEASES="0")
    assert results == {RECOVERY: ("passed", "")}, tail
    ours = json.loads((site / "test_fixtures" / f"{RECOVERY}.json").read_text())
    theirs = json.loads((wheel.fixtures / f"{RECOVERY}.json").read_text())
    assert _history(ours, 0) == _history(theirs, 0)  # the survivor: number for number
    mine, torchft = _history(ours, 1), _history(theirs, 1)
    stale = 2
    assert mine[0] == torchft[0]
    assert len(mine) == len(torchft) - stale
    for k in range(1, len(mine)):
        assert mine[k] == torchft[k + stale], (k, mine[k], torchft[k + stale])
