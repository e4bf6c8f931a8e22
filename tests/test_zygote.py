"""The suite's fork server (tests/zygote.py) behaves like ``subprocess.Popen`` for a script:
argv, environment, working directory, stdio, exit status and signals are the child's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import zygote

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "cwd", os.getcwd(), flush=True)
print("torch preloaded", "torch" in sys.modules, "main", __name__, flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "stdin":
    print("read", sys.stdin.readline().strip(), flush=True)
elif sys.argv[1] == "block":
    import time
    print("blocking", flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "child.py"
    p.write_text(SCRIPT)
    return p


def test_a_forked_script_gets_its_argv_env_cwd_stdio_and_exit_status(tmp_path: Path, script: Path) -> None:
    if os.environ.get("RALLYPOINT_TEST_NO_ZYGOTE"):
        pytest.skip("RALLYPOINT_TEST_NO_ZYGOTE is set: workers start with subprocess.Popen")
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        p = zygote.popen([sys.executable, str(script), "plain", "3"], stdout=f, stderr=subprocess.STDOUT,
                         env={**os.environ, "ZYGOTE_TEST": "yes"}, cwd=str(tmp_path))
    assert isinstance(p, zygote.ZygoteProc) and p.pid not in (os.getpid(), 0)
    assert p.wait(60) == 3 and p.poll() == 3
    out = log.read_text()
    assert f"argv ['plain', '3'] env yes cwd {tmp_path}" in out
    assert "torch preloaded True main __main__" in out and "to stderr" in out


def test_a_forked_script_reads_its_stdin_pipe_and_dies_by_its_signal(tmp_path: Path, script: Path) -> None:
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        reader = zygote.popen([sys.executable, str(script), "stdin", "0"], stdin=subprocess.PIPE, stdout=f,
                              stderr=subprocess.STDOUT)
        blocker = zygote.popen([sys.executable, str(script), "block", "0"], stdout=f, stderr=subprocess.STDOUT)
    assert reader.stdin is not None
    reader.stdin.write(b"go\n")
    reader.stdin.close()
    assert reader.wait(60) == 0
    with pytest.raises(subprocess.TimeoutExpired):
        blocker.wait(0.2)
    assert blocker.poll() is None
    blocker.kill()
    assert blocker.wait(60) == -signal.SIGKILL
    assert "read go" in log.read_text()


def test_a_zygote_that_died_is_started_again(tmp_path: Path, script: Path) -> None:
    if os.environ.get("RALLYPOINT_TEST_NO_ZYGOTE"):
        pytest.skip("RALLYPOINT_TEST_NO_ZYGOTE is set: workers start with subprocess.Popen")
    z = zygote._ZYGOTE
    z.start()
    assert z._proc is not None
    z._proc.kill()  # the OOM killer, say
    z._proc.wait(30)
    with open(tmp_path / "out.log", "w") as f:
        p = zygote.popen([sys.executable, str(script), "plain", "0"], stdout=f, stderr=subprocess.STDOUT)
    assert p.wait(60) == 0
    assert z._proc.poll() is None
