"""torchft-nightly's own integration tests (the 0.3 API, 2026.10.26), unchanged, run
against rallypoint: ``manager_integ_test.py`` (with its native-process-group cases),
``local_sgd_integ_test.py``, ``diloco_regression_test.py`` and ``reconfigure_test.py``.

As for torchft 0.2.0's (``tests/test_torchft_integ.py``): ``tests/torchft_site.py`` builds a
folder where ``import torchft`` resolves to rallypoint's
torchft compatibility package (``compat/torchft``, pip-installed as a user installs it) next to
the nightly wheel's test files copied byte for byte, and its DiLoCo regression fixtures
recorded from torchft-nightly itself (``tools/record_torchft_fixtures.py --wheel nightly``);
each file runs in a pytest of its own and every test must pass, except those in
``EXCEPTIONS`` (with reasons) and those that skip for want of a GPU or torchcomms.

torchft-nightly installs the same ``torchft`` package as torchft 0.2.0, so it is unpacked
beside the venv (``VENV/torchft-nightly``); its tests need torch's native process-group
reconfigure (torch >= 2.14). They run in ``make torchft-nightly-check`` (.venv-newest, torch
2.14.1), which sets ``RALLYPOINT_TORCHFT_NIGHTLY_CHECK=1``: there a missing wheel or an old
torch fails; elsewhere (``make test``) this file skips and says where it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from torchft_site import (
    PER_FILE_TIMEOUT_S,
    EXCEPTIONS as EXCEPTIONS_020,
    RACY,
    SKIP_REASONS,
    TORCHFT_NIGHTLY,
    build_site,
    check_recovery_differs_only_by_the_stale_steps,
    failures,
    rerun_racy,
    run_file,
)

pytestmark = pytest.mark.interop

CHECK_ENV = "RALLYPOINT_TORCHFT_NIGHTLY_CHECK"

if os.environ.get(CHECK_ENV) != "1":
    pytest.skip(f"torchft-nightly's own integration tests run in `make torchft-nightly-check` (torch 2.14.1); "
                f"set {CHECK_ENV}=1 to run them here", allow_module_level=True)

#: Tests per file in torchft-nightly 2026.10.26's wheel (so none silently disappears).
COUNTS = {"manager_integ_test.py": 12, "local_sgd_integ_test.py": 28, "diloco_regression_test.py": 7,
          "reconfigure_test.py": 8}

#: test id -> why it fails against rallypoint on purpose: torchft 0.2.0's (the same
#: diloco_regression_test) plus the nightly's own.
RT = "torchft.reconfigure_test.ReconfigureTest"
EXCEPTIONS: dict[str, str] = {
    **EXCEPTIONS_020,
    f"{RT}.test_order_and_timeout": (
        "it patches torchft.process_group.create_store_client, a module global its own reconfigure_with_store "
        "reads; rallypoint's reconfigure_with_store (rallypoint.process_groups.store_exchange, re-exported by the "
        "alias) opens its store through its own module, which the patch does not reach, so it connects to the "
        "mock's address host:123 and times out. The same store calls, keys, order and timeout are checked of "
        "rallypoint's function by tests/test_store_exchange.py::test_the_store_calls_and_the_options_in_rank_order"
    ),
    f"{RT}.test_rendezvous": (
        "it calls torchft's private _rendezvous(opts, handle_id), answered in the alias by rallypoint's "
        "rendezvous_of(uuid, handles, own_id), whose Rendezvous is frozen and gives global_ranks as a tuple: "
        "(3, 5) != [3, 5]; with that one field as a list every other assertion passes (store address, rank, "
        "world size, handles stable across set_rank_info, None global ranks). rallypoint's parser is "
        "table-tested in tests/test_pg_reconfigure.py"
    ),
    f"{RT}.test_manager_reconfigure_pg": (
        "it calls torchft's private Manager._reconfigure_pg on a Manager made with __new__; rallypoint's Manager "
        "reconfigures through rallypoint.manager._reconfig.Configurer (tests/test_pg_reconfigure_manager.py), "
        "and manager_integ_test.py's native cases run it end to end here"
    ),
}

#: Skips allowed: as for 0.2.0 (no GPU, no torchcomms), and reconfigure_test's nccl2 case
#: ("requires NCCL and three GPUs").
NIGHTLY_SKIP_REASONS = (*SKIP_REASONS, "three gpus")


def test_the_check_runs_the_pinned_wheel_on_a_torch_that_reconfigures() -> None:
    """The nightly's native cases skip on a torch without ``ProcessGroup.reconfigure``: the
    check must not pass by skipping them, nor run another wheel than the pinned one."""
    assert TORCHFT_NIGHTLY.installed_version() == TORCHFT_NIGHTLY.version, TORCHFT_NIGHTLY.missing
    assert hasattr(dist.ProcessGroup, "reconfigure"), (
        "torch has no native process-group reconfigure (torch >= 2.14): make torchft-nightly-check uses .venv-newest")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory.mktemp("torchft_nightly_site"), wheel=TORCHFT_NIGHTLY)


# A file's run has its own deadlines (PER_FILE_TIMEOUT_S, PER_TEST_TIMEOUT_S inside), and a
# racy failure two reruns: the suite's 120 s must not cut it short and hide which test hung.
@pytest.mark.timeout(3 * PER_FILE_TIMEOUT_S + 60)
@pytest.mark.parametrize("rel", sorted(COUNTS))
def test_torchft_nightly_integration_tests_pass_against_rallypoint(site: Path, rel: str) -> None:
    results, tail = run_file(site, rel)
    assert len(results) == COUNTS[rel], (sorted(results), tail)
    bad = rerun_racy(site, rel, failures(results, EXCEPTIONS, NIGHTLY_SKIP_REASONS), RACY)
    assert not bad, f"{len(bad)} of torchft-nightly's tests did not pass against rallypoint: {bad}\n{tail}"
    passed = sum(1 for o, _ in results.values() if o == "passed")
    print(f"{rel}: {passed} passed, {len(results) - passed} not (exceptions/skips)")


def test_recovery_differs_only_by_the_stale_steps(tmp_path: Path) -> None:
    """As for torchft 0.2.0: the restarted replica's DiLoCo history is torchft-nightly's
    without its 2 stale steps, the survivor's equal number for number."""
    check_recovery_differs_only_by_the_stale_steps(tmp_path / "site", TORCHFT_NIGHTLY)
