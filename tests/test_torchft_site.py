"""The pure parts of ``tests/torchft_site.py``, which runs torchft's own integration tests
against rallypoint: which outcomes count as failures, which failures are rerun as racy,
and where torchft-nightly is looked for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torchft_site as S

EXC = {"t.A.excepted": "why"}
R = ("gpu", "cuda")


@pytest.mark.parametrize("outcome, message, tid, bad", [
    ("passed", "", "t.A.x", False),
    ("failed", "boom", "t.A.x", True),
    ("failed", "boom", "t.A.excepted", False),
    ("skipped", "Not enough GPUs for CUDA test", "t.A.x", False),
    ("skipped", "requires native process group reconfiguration", "t.A.x", True),  # not an allowed skip
    ("skipped", "", "t.A.x", True),
])
def test_failures(outcome: str, message: str, tid: str, bad: bool) -> None:
    assert (tid in S.failures({tid: (outcome, message)}, EXC, R)) is bad


@pytest.mark.parametrize("tid, reason", [
    ("m.C.test_x", "exact"),
    ("m.C.test_up_01", "family"),
    ("m.C.test_up_", "family"),
    ("m.C.test_u", None),
    ("m.C.test_y", None),
])
def test_racy_reason(tid: str, reason: str | None) -> None:
    assert S.racy_reason(tid, {"m.C.test_x": "exact", "m.C.test_up_*": "family"}) == reason


def test_every_racy_and_excepted_entry_names_a_torchft_test_with_a_reason() -> None:
    for table in (S.RACY, S.EXCEPTIONS):
        for tid, why in table.items():
            assert tid.startswith("torchft.") and len(why) > 40, tid


def test_nightly_is_found_beside_the_venv_or_where_the_variable_says(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.delenv(S.NIGHTLY_ENV, raising=False)
    assert S.nightly_root() == Path(sys.prefix) / "torchft-nightly"
    monkeypatch.setenv(S.NIGHTLY_ENV, str(tmp_path))
    assert S.TORCHFT_NIGHTLY.find() is None and S.TORCHFT_NIGHTLY.installed_version() is None
    with pytest.raises(RuntimeError, match="torchft-nightly is not unpacked"):
        S.TORCHFT_NIGHTLY.dir()
    (tmp_path / "torchft").mkdir()
    (tmp_path / "torchft" / "__init__.py").write_text("")
    (tmp_path / "torchft_nightly-2026.10.26.dist-info").mkdir()
    assert S.TORCHFT_NIGHTLY.dir() == tmp_path / "torchft"
    assert S.TORCHFT_NIGHTLY.installed_version() == "2026.10.26"
