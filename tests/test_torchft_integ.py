"""torchft 0.2.0's own integration tests, unchanged, run against rallypoint (issue 12).

``tests/torchft_site.py`` builds a folder where ``import torchft`` resolves to
rallypoint's torchft compatibility package (``compat/torchft``, pip-installed as a user
installs it) next to the wheel's test files copied byte for byte, and the DiLoCo regression fixtures
recorded from torchft 0.2.0 itself (``tools/record_torchft_fixtures.py``). Each test file
then runs in a pytest of its own (a subprocess: torchft's tests bind fixed manager ports
19530+, so one file's leftovers must not reach the next), and every test must pass,
except:

- ``EXCEPTIONS`` (torchft_site): tests whose result differs on purpose (docs/migrating.md,
  "torchft's own integration tests", gives each reason); each has a test here that checks
  what rallypoint does instead;
- tests that skip for want of a GPU or of torchcomms, as they do for torchft itself here.

torchft-nightly's (the 0.3 API) run the same way: ``tests/test_torchft_nightly_integ.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchft_site import (
    PER_FILE_TIMEOUT_S,
    EXCEPTIONS,
    RACY,
    SKIP_REASONS,
    TORCHFT_020,
    build_site,
    check_recovery_differs_only_by_the_stale_steps,
    failures,
    rerun_racy,
    run_file,
)

pytestmark = pytest.mark.interop

try:
    TORCHFT_020.dir()
    import parameterized  # noqa: F401  (torchft's tests use it)
except (RuntimeError, ImportError) as e:  # pragma: no cover - make install provides both
    pytest.skip(f"torchft 0.2.0 and parameterized are needed ({e}); run `make install`", allow_module_level=True)

#: Tests per file in torchft 0.2.0's wheel (so none silently disappears from the run).
COUNTS = {"manager_integ_test.py": 10, "local_sgd_integ_test.py": 28, "diloco_regression_test.py": 7}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_site(tmp_path_factory.mktemp("torchft_site"), wheel=TORCHFT_020)


# A file's run has its own deadlines (PER_FILE_TIMEOUT_S, PER_TEST_TIMEOUT_S inside), and a
# racy failure two reruns: the suite's 120 s must not cut it short and hide which test hung.
@pytest.mark.timeout(3 * PER_FILE_TIMEOUT_S + 60)
@pytest.mark.parametrize("rel", sorted(COUNTS))
def test_torchft_integration_tests_pass_against_rallypoint(site: Path, rel: str) -> None:
    results, tail = run_file(site, rel)
    assert len(results) == COUNTS[rel], (sorted(results), tail)
    bad = rerun_racy(site, rel, failures(results, EXCEPTIONS, SKIP_REASONS), RACY)
    assert not bad, f"{len(bad)} of torchft's tests did not pass against rallypoint: {bad}\n{tail}"
    passed = sum(1 for o, _ in results.values() if o == "passed")
    print(f"{rel}: {passed} passed, {len(results) - passed} not (exceptions/skips)")


def test_recovery_differs_only_by_the_stale_steps(tmp_path: Path) -> None:
    """See torchft_site.check_recovery_differs_only_by_the_stale_steps: the restarted
    replica's history is torchft 0.2.0's without its 2 stale steps, the survivor's equal."""
    check_recovery_differs_only_by_the_stale_steps(tmp_path / "site", TORCHFT_020)
