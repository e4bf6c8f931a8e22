"""Record the DiLoCo regression fixtures from torchft 0.2.0 itself.

torchft's ``diloco_regression_test.py`` compares a run with JSON fixtures that its wheel
does not ship; the test writes them when ``WRITE_FIXTURE=true``. This runs the real
torchft (the installed wheel, copied into a temporary folder so the fixtures land there)
in that mode and copies the fixtures to ``tests/fixtures/torchft_0.2.0``, where
``tests/test_torchft_integ.py`` compares rallypoint's DiLoCo with them number for number.

    .venv/bin/python tools/record_torchft_fixtures.py
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from torchft_site import FIXTURES, build_site  # noqa: E402

log = logging.getLogger("record_torchft_fixtures")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        site = build_site(Path(tmp) / "site", alias=False)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = str(site)
        env["WRITE_FIXTURE"] = "true"
        argv = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", str(site), "-p", "no:cacheprovider",
                "-q", "-o", "timeout=120", "torchft/diloco_regression_test.py"]
        rc = subprocess.run(argv, cwd=site, env=env, timeout=900).returncode
        if rc != 0:
            log.error("torchft's regression tests failed (rc=%d); fixtures not copied", rc)
            return rc
        FIXTURES.mkdir(parents=True, exist_ok=True)
        written = sorted((site / "test_fixtures").glob("*.json"))
        for f in written:
            shutil.copy2(f, FIXTURES / f.name)
        log.info("recorded %d fixtures from torchft 0.2.0 into %s", len(written), FIXTURES.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
