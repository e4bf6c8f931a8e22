"""``make gpu-check`` (tools/gpu_check.py, bench/gpu.py): the parts that run without a
GPU. Which tests are gpu-marked and which need 2 GPUs, the plan for 0/1/2 GPUs, the
JUnit counts, the table and the JSON line, the no-GPU exit (2, nothing run), the
missing-module exit (3), and the whole pipeline on CPU (``--cpu-dry-run``: the gpu
tests skip, the benchmark runs on Gloo and host tensors)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "gpu_check.py"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gc = _load("rallypoint_tools_gpu_check", TOOL)
bench = _load("rallypoint_bench_gpu_t", REPO / "bench" / "gpu.py")


def run_tool(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


# ----------------------------------------------------------------------- finding the tests

MODULE_MARKED = '''
import pytest, torch
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
def helper(): pass
def test_one(): pass
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank")
def test_two(): pass
'''

DECORATED = '''
import pytest, torch
def test_cpu(): pass
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu(): pass
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two")
def test_gpu_pair(): pass
'''


@pytest.mark.parametrize("source, want", [
    (MODULE_MARKED, [("test_one", False), ("test_two", True)]),
    (DECORATED, [("test_gpu", False), ("test_gpu_pair", True)]),
    ("def test_x(): pass\n", []),
])
def test_gpu_tests_in_a_module(source: str, want: list[tuple[str, bool]]) -> None:
    assert [(t.name, t.needs_2_gpus) for t in gc.gpu_tests_in(source, "tests/x.py")] == want


def test_every_gpu_marked_file_of_the_repository_is_found() -> None:
    found = gc.find_gpu_tests(REPO / "tests")
    files = {t.file for t in found}
    marked = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
              if "mark.gpu" in p.read_text() and p.name != "test_gpu_check.py"}
    assert marked <= files and "tests/test_process_groups_gpu.py" in files
    pairs = {t.name for t in found if t.needs_2_gpus}
    assert "test_nccl_unmatched_op_times_out_and_aborts_the_communicator" in pairs
    assert "test_nccl_one_rank_configure_allreduce_abort_reconfigure" not in pairs


# ----------------------------------------------------------------------- the plan


def test_plan_for_zero_one_and_two_gpus() -> None:
    tests = [gc.GpuTest("tests/a.py", "t1", False), gc.GpuTest("tests/a.py", "t2", True),
             gc.GpuTest("tests/b.py", "t3", False)]
    none = gc.plan(0, tests, torchft=True)
    assert not none["runs"] and not none["bench"]["runs"]
    assert none["tests"]["tests/a.py"]["run"] == 0
    one = gc.plan(1, tests, torchft=True)
    assert one["tests"]["tests/a.py"] == {"tests": 2, "run": 1, "skip_need_2_gpus": 1}
    assert one["bench"]["world"] == 1 and one["bench"]["pg_backend"] == "gloo"
    assert one["bench"]["sender_index"] == one["bench"]["receiver_index"] == 0
    assert "one rank per device" in one["bench"]["why_world"]
    two = gc.plan(2, tests, torchft=True)
    assert two["tests"]["tests/a.py"] == {"tests": 2, "run": 2, "skip_need_2_gpus": 0}
    assert two["bench"]["world"] == 2 and two["bench"]["pg_backend"] == "nccl"
    assert (two["bench"]["sender_index"], two["bench"]["receiver_index"]) == (0, 1)
    eight = gc.plan(8, tests, torchft=True)
    assert eight["bench"]["world"] == 2  # one pair of GPUs is enough for the check


def test_bench_plan_without_torchft_has_only_our_contenders() -> None:
    p = bench.plan(1, torchft=False)
    assert p["impls"] == ["plain", "ours", "ours-baby"]
    assert p["heal"] == ["ours-http", "ours-pg"] and p["heal_bytes"] == 1 << 30
    assert bench.plan(1, torchft=True, device="cpu")["backend"] == "gloo"
    assert bench.plan(1, torchft=True)["backend"] == "nccl"


# ----------------------------------------------------------------------- the bench's rows


def _results(**over: Any) -> dict[str, Any]:
    lat = {label: {"latency_ms": v, "rounds": 5} for label, v in zip(bench.SIZES, (0.1, 0.2, 2.0))}
    ar = {impl: {"correct": True, **lat} for impl in ("plain", "ours", "ours-baby", "torchft", "torchft-baby")}
    heal = {"memcpy": {"heal_s": 0.1, "d2h_s": 0.05, "h2d_s": 0.05, "peer_s": 0.01},
            "ours-http": {"median_s": 0.5}, "torchft-http": {"median_s": 2.0},
            "ours-pg": {"median_s": 0.4}, "torchft-pg": {"median_s": 0.8}}
    res = {"allreduce": ar, "heal": heal}
    for k, v in over.items():
        res[k] = v
    return res


def test_rows_hold_the_ratios_and_name_the_ceilings() -> None:
    p = bench.plan(1, torchft=True)
    rs = {r["metric"]: r for r in bench.rows(p, _results())}
    http = rs["heal 1 GB HTTP, CUDA to CUDA s"]
    assert http["ours_vs_torchft"] == pytest.approx(0.25) and http["ours_vs_ceiling"] == pytest.approx(5.0)
    assert http["ceiling_name"] == "memcpy D2H+H2D" and http["error"] is None
    assert rs["allreduce NCCL 64MB ws1 ms"]["ours_vs_ceiling"] == pytest.approx(1.0)
    assert "allreduce Baby NCCL 4KB ws1 ms" in rs
    two = {r["metric"]: r for r in bench.rows(bench.plan(2, torchft=True), _results())}
    pg = two["heal 1 GB PG over nccl s"]
    assert pg["ceiling_name"] == "peer copy" and pg["ceiling"] == pytest.approx(0.01)
    assert "allreduce NCCL 4KB ws2 ms" in two


def test_rows_without_torchft_say_not_installed() -> None:
    p = bench.plan(1, torchft=False)
    rs = bench.rows(p, _results())
    assert all(r["torchft"] is None and r["ours_vs_torchft"] is None and r["error"] is None for r in rs)
    assert all(r["torchft_note"] == "not installed" for r in rs)
    assert "not installed" in bench.render(rs)


def test_rows_carry_errors_and_wrong_results() -> None:
    p = bench.plan(1, torchft=True)
    res = _results()
    res["allreduce"]["ours"] = {**res["allreduce"]["ours"], "correct": False}
    res["allreduce"]["torchft-baby"] = {"error": "configure: boom"}
    res["heal"]["ours-pg"] = {"error": "wrong data: checksum 0.0, sent 1.0"}
    rs = {r["metric"]: r for r in bench.rows(p, res)}
    assert "wrong allreduce result" in rs["allreduce NCCL 1MB ws1 ms"]["error"]
    assert "torchft: configure: boom" in rs["allreduce Baby NCCL 1MB ws1 ms"]["error"]
    assert rs["allreduce Baby NCCL 1MB ws1 ms"]["ours"] == pytest.approx(0.2)
    assert "wrong data" in rs["heal 1 GB PG over gloo s"]["error"]
    whole = bench.rows(p, _results(heal={"error": "TimeoutError: heal-sender answered nothing within 120s"}))
    assert all("heal-sender" in r["error"] for r in whole if r["metric"].startswith("heal"))


# ----------------------------------------------------------------------- JUnit, status, table

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py" line="3" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" file="tests/test_a.py" line="5" time="0.1"><failure message="x">tb</failure></testcase>
<testcase classname="tests.test_a" name="test_pair" file="tests/test_a.py" line="9" time="0"><skipped type="pytest.skip" message="NCCL needs a device per rank">s</skipped></testcase>
<testcase classname="tests.test_b.TestK" name="test_err" time="0"><error message="fixture">tb</error></testcase>
<testcase classname="tests.test_b.TestK" name="test_skip" time="0"><skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_per_file() -> None:
    got = gc.parse_junit(JUNIT)
    a, b = got["tests/test_a.py"], got["tests/test_b.py"]
    assert (a.passed, a.failed, a.errors, a.skipped) == (1, 1, 0, 1)
    assert a.skip_reasons == {"NCCL needs a device per rank": 1} and a.failures == ["test_bad"]
    assert (b.passed, b.failed, b.errors, b.skipped) == (0, 0, 1, 1) and b.failures == ["test_err"]


@pytest.mark.parametrize("tests, rows, terr, berr, want", [
    ({"f": gc.FileResult(passed=3, skipped=1)}, [{"error": None}], None, None, "ok"),
    ({"f": gc.FileResult(passed=3, failed=1)}, [], None, None, "failed"),
    ({"f": gc.FileResult(errors=1)}, [], None, None, "failed"),
    ({}, [{"error": "rallypoint: boom"}], None, None, "failed"),
    ({}, [], "pytest ran past 270s", None, "failed"),
    ({}, [], None, "bench/gpu.py wrote no result", "failed"),
])
def test_status(tests: Any, rows: Any, terr: Any, berr: Any, want: str) -> None:
    assert gc.status_of(tests, rows, terr, berr) == want


def test_the_table_has_a_row_per_file_and_per_metric() -> None:
    results = gc.parse_junit(JUNIT)
    rows = bench.rows(bench.plan(1, torchft=False), _results())
    rows[0]["error"] = "rallypoint: boom"
    text = gc.render("1 x NVIDIA H200; torch 2.11", results, None, rows, None, "failed")
    lines = text.splitlines()
    assert lines[0] == "rallypoint gpu-check: 1 x NVIDIA H200; torch 2.11"
    assert any(line.startswith("tests/test_a.py") and "1 passed, 1 failed, 1 skipped" in line for line in lines)
    assert any(line.startswith("tests: total") and "1 passed, 2 failed, 2 skipped" in line for line in lines)
    assert any(line.startswith("allreduce NCCL 4KB ws1 ms") and " error " in line for line in lines)
    assert any(line.startswith("heal 1 GB HTTP") and "not installed" in line for line in lines)
    assert "skipped (1): needs CUDA" in text and "FAILED tests/test_a.py::test_bad" in text
    assert "bench error, allreduce NCCL 4KB ws1 ms: rallypoint: boom" in text
    assert lines[-1] == "status: failed"


def test_download_command_fetches_binary_wheels_for_the_gpu_image() -> None:
    cmd = gc.download_command(Path("/x/.whl"), "3.12")
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "torchft==0.2.0" in cmd
    assert all(w in cmd for w in gc.WHEELS)


# ----------------------------------------------------------------------- the tool itself


def test_no_gpu_exits_2_and_says_nothing_ran(tmp_path: Path) -> None:
    cp = run_tool("--python", sys.executable, "--out", str(tmp_path))
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "no CUDA GPU here, nothing was run" in cp.stdout and sys.executable in cp.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["gpu_check"] == "no_gpu" and doc["probes"][0]["cuda"] is False
    assert "nothing was run" in (tmp_path / "gpu_check.txt").read_text()


def test_plan_flag_prints_the_plan_and_runs_nothing() -> None:
    cp = run_tool("--plan", "--gpus", "2")
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["bench"]["world"] == 2 and doc["tests"]["tests/test_process_groups_gpu.py"]["skip_need_2_gpus"] == 0


def test_a_module_that_does_not_import_exits_3_naming_it(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pytest_timeout.py").write_text("raise ImportError('pytest-timeout is not installed here')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(shadow)}
    cp = run_tool("--python", sys.executable, "--cpu-dry-run", "--out", str(tmp_path / "out"), env=env, timeout=120)
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert "pytest_timeout" in cp.stdout and "make gpu-wheels" in cp.stdout
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["gpu_check"] == "env_missing"


@pytest.mark.slow
def test_cpu_dry_run_goes_through_every_step(tmp_path: Path) -> None:
    """Tests (all skip here: no CUDA), the benchmark on Gloo and host tensors, the table,
    the JSON line, the files in --out."""
    cp = run_tool("--python", sys.executable, "--cpu-dry-run", "--out", str(tmp_path),
                  "--bench-args", "--quick --heal-mb 4", timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["gpu_check"] == "ok" and doc["tests_error"] is None and doc["bench_error"] is None
    assert doc["tests"]["tests/test_process_groups_gpu.py"]["skipped"] >= 5
    assert doc["tests"]["tests/test_process_groups_gpu.py"]["passed"] == 0
    metrics = [r["metric"] for r in doc["bench"]]
    assert "allreduce GLOO 1MB ws1 ms" in metrics and "heal 4 MB HTTP, host to host s" in metrics
    assert all(r["ours"] is not None and r["error"] is None for r in doc["bench"])
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "CPU dry run" in text and "tests/test_process_groups_gpu.py" in text and "status: ok" in text
    assert {"bench.json", "junit.xml", "pytest.log", "bench.log"} <= {p.name for p in tmp_path.iterdir()}


def test_a_step_past_its_timeout_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    """A hung step (here: a child that started a grandchild and sleeps) is killed as a
    group, so nothing it left behind keeps running (and holding a GPU)."""
    log = tmp_path / "log"
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
            "print(p.pid, flush=True); time.sleep(60)")
    with open(log, "w") as f:
        assert gc._run([sys.executable, "-c", code], dict(__import__("os").environ), f, timeout=3) is None
    pid = int(log.read_text().split()[0])

    def gone() -> bool:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        return "\nState:\tZ" in state

    import time

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(), f"the grandchild {pid} still runs"
