"""Record the DiLoCo regression fixtures from torchft itself (0.2.0 or torchft-nightly).

torchft's ``diloco_regression_test.py`` compares a run with JSON fixtures that its wheel
does not ship; the test writes them when ``WRITE_FIXTURE=true``. This runs the real
torchft (the wheel, copied into a temporary folder so the fixtures land there) in that
mode and copies the fixtures to the wheel's folder under ``tests/fixtures/``
(``torchft_0.2.0``, ``torchft_nightly_2026.10.26``), where ``tests/test_torchft_integ.py``
and ``tests/test_torchft_nightly_integ.py`` compare rallypoint's DiLoCo with them number
for number.

    .venv/bin/python tools/record_torchft_fixtures.py                    # torchft 0.2.0
    .venv-newest/bin/python tools/record_torchft_fixtures.py --wheel nightly
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from torchft_site import WHEELS, build_site  # noqa: E402

log = logging.getLogger("record_torchft_fixtures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--wheel", choices=sorted(WHEELS), default="0.2.0",
                        help="which torchft records them (nightly: run with a torch >= 2.14 venv's python)")
    wheel = WHEELS[parser.parse_args(argv).wheel]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = wheel.installed_version()
    if found != wheel.version:
        log.error("torchft %s %s is wanted, %s is installed", wheel.name, wheel.version, found)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        site = build_site(Path(tmp) / "site", alias=False, wheel=wheel)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = str(site)
        env["WRITE_FIXTURE"] = "true"
        cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", str(site), "-p", "no:cacheprovider",
                "-q", "-o", "timeout=120", "torchft/diloco_regression_test.py"]
        rc = subprocess.run(cmd, cwd=site, env=env, timeout=900).returncode
        if rc != 0:
            log.error("torchft's regression tests failed (rc=%d); fixtures not copied", rc)
            return rc
        wheel.fixtures.mkdir(parents=True, exist_ok=True)
        written = sorted((site / "test_fixtures").glob("*.json"))
        for f in written:
            shutil.copy2(f, wheel.fixtures / f.name)
        log.info("recorded %d fixtures from torchft %s %s into %s", len(written), wheel.name, wheel.version,
                 wheel.fixtures.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
