"""``make gpu-check``: on a machine with a CUDA GPU, run every ``@pytest.mark.gpu`` test
and ``bench/gpu.py``, then print one summary table and one JSON line.

It needs no network: it picks the first Python whose torch sees CUDA (``--python``,
else this one, ``.venv/bin/python``, ``python3`` on the PATH: a GPU machine's own
CUDA torch, not this repository's CPU venv) and, where ``.whl/`` holds wheels (carried
there from a machine with network: ``make gpu-wheels``), installs them with ``pip
--no-index --target`` into a temporary folder put first on ``PYTHONPATH`` (torchft
0.2.0 and the versions of grpcio/protobuf/isal rallypoint needs; nothing else).
The working tree itself is put on ``PYTHONPATH``: rallypoint needs no install.

Steps: (1) the probe: Python, torch, CUDA, GPU count and names, NCCL, torchft, and
whether rallypoint's modules import; (2) ``pytest -m gpu`` over every test file that
holds a ``gpu`` mark (tests that need 2 GPUs skip, saying so, where there is one);
(3) ``bench/gpu.py``. Both run under a timeout (``--tests-timeout``,
``--bench-timeout``), so the whole takes under 10 minutes on one GPU.

Exit status: 0 every test passed or skipped and every bench row measured; 1 a test
failed or a bench row has an error; 2 no CUDA GPU (nothing run: the table would prove
nothing); 3 a CUDA torch was found but rallypoint's modules do not import there (the
message names them and the wheels to carry). With ``$OUT`` set (or ``--out DIR``)
the table (``gpu_check.txt``), the JSON line (``gpu_check.json``), the pytest log and
JUnit file and the bench's JSON and log are written there too.

    make gpu-check                       # or: python3 tools/gpu_check.py
    python3 tools/gpu_check.py --plan --gpus 2     # what would run, nothing run
    make gpu-wheels                      # here, with network: the wheels into .whl/
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: What ``make gpu-wheels`` downloads (the versions this repository tests with): the
#: peer torchft 0.2.0 and what it imports (opentelemetry), and rallypoint's own needs
#: whose versions a GPU image may lack (grpcio and protobuf: the generated stubs check
#: them; isal: the transports' CRC). Everything else is on such an image already.
WHEELS = (
    "torchft==0.2.0",
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-proto==1.45.2",
    "googleapis-common-protos==1.76.0",
    "grpcio==1.85.3",
    "protobuf==7.36.2",
    "isal==1.9.1",
    "xxhash==4.1.0",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")

#: Modules the gpu tests and the benchmark import; one that fails stops the check (exit 3).
REQUIRED = ("pytest", "pytest_timeout", "grpc", "google.protobuf", "rallypoint.process_groups",
            "rallypoint.transports.http", "rallypoint.transports.pg", "rallypoint.manager",
            "rallypoint.integrations.fsdp", "rallypoint.lighthouse.server")

PROBE = r"""
import importlib, json, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0], "missing": {}}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = bool(torch.cuda.is_available())
    out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
    out["names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if out["cuda"] else None
    except Exception:
        out["nccl"] = None
except Exception as e:
    out["torch"], out["cuda"], out["gpus"] = None, False, 0
    out["torch_error"] = f"{type(e).__name__}: {e}"[:300]
if (out["cuda"] and sys.argv[1:] == ["full"]) or sys.argv[1:] == ["full", "dry"]:
    for mod in REQUIRED:
        try:
            importlib.import_module(mod)
        except Exception as e:
            out["missing"][mod] = f"{type(e).__name__}: {e}"[:300]
    try:
        import torchft.process_group
        from importlib.metadata import version
        out["torchft"] = version("torchft")
    except Exception as e:
        out["torchft"] = None
        out["torchft_error"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
""".replace("REQUIRED", repr(REQUIRED))

EXIT = {"ok": 0, "failed": 1, "no_gpu": 2, "env_missing": 3}


# ----------------------------------------------------------------------- pure parts


@dataclass
class GpuTest:
    """One ``gpu``-marked test function, found by reading the source (no import)."""

    file: str
    name: str
    needs_2_gpus: bool


def gpu_tests_in(source: str, file: str) -> list[GpuTest]:
    """The ``gpu``-marked tests of one test module's ``source`` (pure): a module-level
    ``pytestmark`` naming ``mark.gpu`` marks all of them; otherwise a ``@pytest.mark.gpu``
    decorator. A test needs 2 GPUs when a decorator of it compares ``device_count()``
    with 2 (``skipif(torch.cuda.device_count() < 2, ...)``)."""
    tree = ast.parse(source)
    module_gpu = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_gpu = "mark.gpu" in (ast.get_source_segment(source, node.value) or "")
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test"):
            continue
        decos = [ast.get_source_segment(source, d) or "" for d in node.decorator_list]
        if module_gpu or any("mark.gpu" in d for d in decos):
            two = any("device_count()" in d and "2" in d for d in decos)
            out.append(GpuTest(file, node.name, two))
    return out


def find_gpu_tests(tests_dir: Path) -> list[GpuTest]:
    """Every ``gpu``-marked test under ``tests_dir`` (``test_*.py`` files, sorted)."""
    out: list[GpuTest] = []
    for path in sorted(tests_dir.glob("test_*.py")):
        text = path.read_text()
        if "mark.gpu" in text:
            out.extend(gpu_tests_in(text, f"{tests_dir.name}/{path.name}"))
    return out


def plan(gpus: int, tests: list[GpuTest], torchft: bool) -> dict[str, Any]:
    """What runs with ``gpus`` GPUs (pure): per test file how many tests run and how many
    skip for want of a second GPU; the benchmark's sections (``bench/gpu.py``'s plan)."""
    files: dict[str, dict[str, int]] = {}
    for t in tests:
        f = files.setdefault(t.file, {"tests": 0, "run": 0, "skip_need_2_gpus": 0})
        f["tests"] += 1
        if gpus < 1:
            continue
        if t.needs_2_gpus and gpus < 2:
            f["skip_need_2_gpus"] += 1
        else:
            f["run"] += 1
    bench = _bench_module().plan(gpus, torchft)
    return {"gpus": gpus, "runs": gpus >= 1, "tests": files, "bench": bench}


def _bench_module() -> Any:
    """``bench/gpu.py`` as a module (it imports no torch at module level)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rallypoint_bench_gpu", REPO / "bench" / "gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class FileResult:
    """pytest's outcome counts for one test file, and the reasons of its skips."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def parse_junit(xml_text: str, default_file: str = "?") -> dict[str, FileResult]:
    """Per test file, the outcomes in a pytest JUnit report (``junit_family=xunit1``:
    each testcase names its ``file``; else the file is read off ``classname``)."""
    out: dict[str, FileResult] = {}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        f = case.get("file") or ""
        if not f:
            cls = case.get("classname") or case.get("name") or ""
            parts = cls.split(".")
            mods = [p for p in parts if p.startswith("test_")]
            f = "/".join(parts[: parts.index(mods[0]) + 1]) + ".py" if mods else default_file
        r = out.setdefault(f, FileResult())
        name = case.get("name", "?")
        if case.find("failure") is not None:
            r.failed += 1
            r.failures.append(name)
        elif case.find("error") is not None:
            r.errors += 1
            r.failures.append(name)
        elif (sk := case.find("skipped")) is not None:
            r.skipped += 1
            why = (sk.get("message") or "").strip() or "skipped"
            r.skip_reasons[why] = r.skip_reasons.get(why, 0) + 1
        else:
            r.passed += 1
    return out


def status_of(tests: dict[str, FileResult] | None, bench_rows: list[dict[str, Any]] | None,
              tests_error: str | None = None, bench_error: str | None = None) -> str:
    """``ok`` or ``failed`` (pure): failed when a test failed or errored, a step could not
    run, or a bench row carries an error."""
    if tests_error or bench_error:
        return "failed"
    if any(r.failed or r.errors for r in (tests or {}).values()):
        return "failed"
    if any(r.get("error") for r in bench_rows or []):
        return "failed"
    return "ok"


def _f(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if v < 1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _ratio(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(machine: str, tests: dict[str, FileResult], tests_error: str | None, bench_rows: list[dict[str, Any]],
           bench_error: str | None, status: str) -> str:
    """The one summary table (pure), with the machine above it and, below, the skip
    reasons, the failed tests and errors in full."""
    head = ["check", "result", "rallypoint", "torchft 0.2.0", "ceiling", "ours/torchft", "ours/ceiling"]
    body: list[list[str]] = []
    total = FileResult()
    for f, r in sorted(tests.items()):
        body.append([f, f"{r.passed} passed, {r.failed + r.errors} failed, {r.skipped} skipped", "", "", "", "", ""])
        total.passed, total.failed, total.skipped = total.passed + r.passed, total.failed + r.failed + r.errors, \
            total.skipped + r.skipped
    body.append(["tests: total", tests_error or f"{total.passed} passed, {total.failed} failed, {total.skipped} skipped",
                 "", "", "", "", ""])
    for b in bench_rows:
        theirs = b.get("torchft_note") or _f(b.get("torchft"))
        result = "error" if b.get("error") else "ok"
        body.append([b["metric"], result, _f(b.get("ours")), theirs, _f(b.get("ceiling")),
                     _ratio(b.get("ours_vs_torchft")), _ratio(b.get("ours_vs_ceiling"))])
    if bench_error:
        body.append(["bench", "error", "", "", "", "", ""])
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [f"rallypoint gpu-check: {machine}", "", line(head), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in body]
    out.append("")
    out.append("Lower is better (ms or s); ratios < 1: rallypoint faster; ceiling: plain torch NCCL for "
               "allreduce, cudaMemcpy (or a peer copy) for the heal.")
    reasons: dict[str, int] = {}
    for r in tests.values():
        for why, n in r.skip_reasons.items():
            reasons[why] = reasons.get(why, 0) + n
    for why, n in sorted(reasons.items()):
        out.append(f"skipped ({n}): {why}")
    for f, r in sorted(tests.items()):
        for name in r.failures:
            out.append(f"FAILED {f}::{name}")
    if tests_error:
        out.append(f"tests: {tests_error}")
    for b in bench_rows:
        if b.get("error"):
            out.append(f"bench error, {b['metric']}: {b['error']}")
    if bench_error:
        out.append(f"bench: {bench_error}")
    out.append(f"status: {status}")
    return "\n".join(out)


def describe(probe: dict[str, Any]) -> str:
    """One line about the machine from a probe (pure)."""
    names = probe.get("names") or []
    gpus = f"{len(names)} x {names[0]}" if names and len(set(names)) == 1 else ", ".join(names) or "no GPU"
    tf = probe.get("torchft") or "not installed"
    return (f"{gpus}; torch {probe.get('torch')}, NCCL {probe.get('nccl')}, torchft {tf}, "
            f"Python {probe.get('python_version')} ({probe.get('python')})")


def no_gpu_message(probes: list[dict[str, Any]]) -> str:
    """Why nothing ran (pure): each Python looked at and what its torch said."""
    seen = "; ".join(f"{p.get('python')}: " + (f"torch {p['torch']}, no CUDA device" if p.get("torch")
                                               else p.get("torch_error", "no torch")) for p in probes)
    return (f"gpu-check: no CUDA GPU here, nothing was run (looked at: {seen or 'no Python'}). "
            "It proves the GPU paths only on a machine with a GPU and a CUDA build of torch; "
            "`--python PATH` names another interpreter.")


# ----------------------------------------------------------------------- running


def probe(python: str, env: dict[str, str], full: bool, dry_run: bool = False, timeout: float = 180) -> dict[str, Any]:
    """Run :data:`PROBE` under ``python``; ``{"python": ..., "torch_error": ...}`` if it fails.
    ``full``: also check the imports (where CUDA is there, or always with ``dry_run``)."""
    try:
        cp = subprocess.run([python, "-c", PROBE, *(["full", "dry"] if full and dry_run else ["full"] if full else [])],
                            cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
        return dict(json.loads(cp.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as e:
        return {"python": python, "cuda": False, "gpus": 0, "torch": None, "torch_error": f"probe failed: {e}"[:300]}


def candidates(explicit: str | None) -> list[str]:
    """The interpreters to look at, in order, without duplicates."""
    if explicit:
        return [explicit]
    out: list[str] = []
    for c in (sys.executable, str(REPO / ".venv/bin/python"), shutil.which("python3")):
        if c and Path(c).exists() and c not in out:
            out.append(c)
    return out


def base_env(site: str | None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in (site, str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def install_wheels(python: str, wheels_dir: Path, site: Path) -> str | None:
    """Install every wheel of ``wheels_dir`` into ``site`` (no network); an error or None."""
    wheels = sorted(str(p) for p in wheels_dir.glob("*.whl"))
    if not wheels:
        return None
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *wheels]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "installing the carried wheels took over 300 s"
    return None if cp.returncode == 0 else f"pip install of {wheels_dir}/*.whl failed: {cp.stderr[-800:]}"


def download_command(dest: Path, py_version: str) -> list[str]:
    """The ``pip download`` of :data:`WHEELS` for a GPU image's Python (pure)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", py_version,
            "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *WHEELS]


def download_wheels(dest: Path, py_version: str) -> int:
    """``make gpu-wheels``: :data:`WHEELS` for a GPU image's Python, into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = download_command(dest, py_version)
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def _run(cmd: list[str], env: dict[str, str], log: Any, timeout: float) -> int | None:
    """Run ``cmd`` in its own process group with output to ``log``; its exit code, or None
    when it ran past ``timeout`` (then the whole group it started is killed, so no rank
    or child process it left behind keeps the GPU)."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)
        return None


def run_tests(python: str, env: dict[str, str], files: list[str], out_dir: Path,
              timeout: float) -> tuple[dict[str, FileResult], str | None]:
    junit, log = out_dir / "junit.xml", out_dir / "pytest.log"
    cmd = [python, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={junit}", "-q", "-rfEs", "--timeout=120", *files]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = _run(cmd, env, f, timeout)
    if rc is None:
        res = parse_junit(junit.read_text()) if junit.exists() else {}
        return res, f"pytest ran past {timeout:.0f}s and was stopped (see {log})"
    if not junit.exists():
        return {}, f"pytest wrote no report (exit {rc}; see {log})"
    res = parse_junit(junit.read_text())
    if rc not in (0, 1, 5):  # 1: some failed (counted); 5: nothing collected
        return res, f"pytest exited {rc} (see {log})"
    return res, None


def run_bench(python: str, env: dict[str, str], out_dir: Path, timeout: float,
              extra: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    js, log = out_dir / "bench.json", out_dir / "bench.log"
    cmd = [python, str(REPO / "bench/gpu.py"), "--out", str(js), "--timeout", str(max(30.0, timeout / 2 - 15)), *extra]
    with open(log, "w") as f:
        rc = _run(cmd, env, f, timeout)
    if rc is None:
        return [], None, f"bench/gpu.py ran past {timeout:.0f}s and was stopped (see {log})"
    if not js.exists():
        return [], None, f"bench/gpu.py wrote no result (see {log})"
    doc = json.loads(js.read_text())
    return list(doc.get("rows", [])), doc, None


def finish(text: str, doc: dict[str, Any], out: Path | None) -> int:
    print(text)
    line = json.dumps(doc)
    print(line)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.txt").write_text(text + "\n")
        (out / "gpu_check.json").write_text(line + "\n")
    return EXIT[doc["gpu_check"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--python", help="the interpreter with CUDA torch (default: the first found)")
    ap.add_argument("--wheels", default=str(REPO / ".whl"), help="carried wheels to install first (if any)")
    ap.add_argument("--out", default=os.environ.get("OUT") or None, help="write the results here (default $OUT)")
    ap.add_argument("--plan", action="store_true", help="print what would run (with --gpus N), run nothing")
    ap.add_argument("--gpus", type=int, help="with --plan: plan for this many GPUs")
    ap.add_argument("--tests-timeout", type=float, default=240, help="seconds for all the gpu tests")
    ap.add_argument("--bench-timeout", type=float, default=240, help="seconds for bench/gpu.py (half per section)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--bench-args", default="", help="extra arguments for bench/gpu.py (e.g. '--quick')")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the whole pipeline without a GPU (the gpu tests skip, the bench runs on Gloo and host "
                         "tensors): a test of this tool, proving nothing about GPUs")
    ap.add_argument("--download-wheels", metavar="DIR", help="download the wheels to carry into DIR, and stop")
    ap.add_argument("--py-version", default="3.12", help="with --download-wheels: the GPU image's Python")
    args = ap.parse_args(argv)
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels), args.py_version)
    tests = find_gpu_tests(REPO / "tests")
    out = Path(args.out) if args.out else None
    if args.plan and args.gpus is not None:
        print(json.dumps(plan(args.gpus, tests, torchft=True), indent=1))
        return 0
    t0 = time.monotonic()
    probes = [probe(py, base_env(None), full=False) for py in candidates(args.python)]
    chosen = next((p for p in probes if p.get("cuda")), None)
    if chosen is None and args.cpu_dry_run:
        chosen = next((p for p in probes if p.get("torch")), None)
    if chosen is None:
        if args.plan:
            print(json.dumps({"probes": probes, "plan": plan(0, tests, False)}, indent=1))
            return 0
        msg = no_gpu_message(probes)
        return finish(msg, {"gpu_check": "no_gpu", "probes": probes, "plan": plan(0, tests, False)}, out)
    python = chosen["python"]
    site = Path(tempfile.mkdtemp(prefix="rallypoint-gpu-site-"))
    wheel_error = install_wheels(python, Path(args.wheels), site)
    env = base_env(str(site))
    machine = probe(python, env, full=True, dry_run=args.cpu_dry_run)
    gpus = 1 if args.cpu_dry_run and not machine.get("gpus") else int(machine.get("gpus", 0))  # bench: --device cpu
    p = plan(gpus, tests, bool(machine.get("torchft")))
    if args.plan:
        print(json.dumps({"machine": machine, "plan": p}, indent=1))
        return 0
    if machine.get("missing"):
        msg = (f"gpu-check: {python} has CUDA torch but these do not import: "
               + "; ".join(f"{m} ({e})" for m, e in machine["missing"].items())
               + (f"; {wheel_error}" if wheel_error else "")
               + ". Carry the wheels: on a machine with network run `make gpu-wheels` (into .whl/), "
               "then run `make gpu-check` with .whl beside the checkout.")
        return finish(msg, {"gpu_check": "env_missing", "machine": machine, "plan": p}, out)
    work = out or Path(tempfile.mkdtemp(prefix="rallypoint-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    files = sorted({t.file for t in tests})
    results, tests_error = ({}, None) if args.skip_tests else run_tests(python, env, files, work, args.tests_timeout)
    rows: list[dict[str, Any]] = []
    bench_error = None
    if not args.skip_bench:
        extra = args.bench_args.split() + (["--device", "cpu"] if args.cpu_dry_run else [])
        rows, _, bench_error = run_bench(python, env, work, args.bench_timeout, extra)
    status = status_of(results, rows, tests_error, bench_error)
    text = render(describe(machine) + (" (CPU dry run: proves nothing about GPUs)" if args.cpu_dry_run else ""), results, tests_error, rows, bench_error, status)
    doc = {"gpu_check": status, "machine": machine, "plan": p, "seconds": round(time.monotonic() - t0, 1),
           "tests": {f: vars(r) for f, r in sorted(results.items())}, "tests_error": tests_error,
           "bench": rows, "bench_error": bench_error, "wheels_error": wheel_error}
    shutil.rmtree(site, ignore_errors=True)
    return finish(text, doc, out)


if __name__ == "__main__":
    sys.exit(main())
