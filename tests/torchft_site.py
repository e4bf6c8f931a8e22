"""Build a folder where ``import torchft`` finds torchft 0.2.0's own integration tests,
unchanged, next to either rallypoint's alias modules or torchft's real ones.

``build_site(dest, alias=True)``: ``dest/torchft/`` holds the re-exports of
``tests/torchft_alias/torchft/`` (rallypoint's classes under torchft's module paths)
plus the wheel's test files copied byte for byte; ``dest/test_fixtures/`` holds the
DiLoCo regression fixtures recorded from torchft 0.2.0 (``tests/fixtures/torchft_0.2.0``).
``alias=False`` copies the whole installed torchft package instead (used to record the
fixtures: ``tools/record_torchft_fixtures.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALIAS = HERE / "torchft_alias" / "torchft"
FIXTURES = HERE / "fixtures" / "torchft_0.2.0"

# The wheel's files the integration tests consist of (relative to the torchft package).
TEST_FILES = (
    "manager_integ_test.py",
    "local_sgd_integ_test.py",
    "diloco_regression_test.py",
    "_test/diloco_trainer.py",
)


def wheel_dir() -> Path:
    """The installed torchft package folder (found without importing it)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torchft 0.2.0 is not installed (make install installs it with the test extras)")
    return Path(next(iter(spec.submodule_search_locations)))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_site(dest: Path, alias: bool = True) -> Path:
    """Populate ``dest`` and return it (see the module docstring)."""
    src = wheel_dir()
    pkg = dest / "torchft"
    if alias:
        pkg.mkdir(parents=True)
        for f in sorted(ALIAS.glob("*.py")):
            shutil.copy2(f, pkg / f.name)
        for rel in TEST_FILES:
            (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, pkg / rel)
            assert sha256(pkg / rel) == sha256(src / rel)
    else:
        shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    fixtures = dest / "test_fixtures"
    fixtures.mkdir()
    if alias:
        for f in sorted(FIXTURES.glob("*.json")):
            shutil.copy2(f, fixtures / f.name)
    (dest / "pytest.ini").write_text("[pytest]\n")
    return dest
