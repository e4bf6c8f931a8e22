"""Cold start: a fresh process's ``import <framework>`` and ``Manager(...)`` until the
constructor returns (ready for the first quorum): rallypoint vs torchft 0.2.0, one run.

Every sample is a fresh child process (no module cached in memory; the files are in the
OS page cache after one untimed warm-up child per framework). Each child:

1. ``import torch`` (timed on its own and reported: the same for both frameworks);
2. ``import rallypoint; from rallypoint import Manager, ProcessGroupGloo`` or
   ``import torchft; from torchft import Manager, ProcessGroupGloo`` (the "import" column);
3. ``ProcessGroupGloo(...)`` and ``Manager(pg, load, save, min_replica_size=1, rank=0,
   world_size=1, lighthouse_addr=..., store_addr=..., store_port=...)`` until the
   constructor returns (the "construct" column: the manager server is up, the lighthouse
   reached, the group's store joined, the checkpoint server listening);
4. ``start_quorum()`` + ``wait_quorum()`` with ``min_replicas=1`` ("first quorum": the
   lighthouse round trip and the first process-group configure).

The parent hosts, fresh for every child, the lighthouse (ours: a
``rallypoint.lighthouse.server.LighthouseServer``; theirs: torchft's native
``torchft._torchft.LighthouseServer``, loaded without importing torch) on
``127.0.0.1:0`` with the address read back, and a ``TCPStore`` (port 0,
``is_master=True``, port read back) that the child's Manager connects to, as under
torchrun. Children alternate (ours, torchft / torchft, ours) so machine noise falls on
both; the median of ``--repeats`` is reported.

How rallypoint is imported: by default from a copy of the working tree's ``rallypoint/``
byte-compiled in a temporary directory (``compileall``), because an installed package
has its ``.pyc`` files, as torchft's in site-packages do (an environment with
``PYTHONDONTWRITEBYTECODE=1`` otherwise recompiles every module of an editable install at
every start, ~50 ms that no installed user pays). ``--from-tree`` imports the tree as it
is (with this environment's bytecode policy) instead; ``--rallypoint-src DIR`` copies the
package from another checkout (to measure a change against the same torchft run).

Where the time goes: one more child per framework runs with ``python -X importtime``;
the modules imported during steps 2-3 are summed by top-level package (self time) and
listed ("breakdown"). ``-X importtime`` adds its own overhead: read it as shares.

The goal (cold start issue): ours import+construct median <= torchft's + 100 ms
(``ours_minus_torchft_ms``), and rallypoint's Manager imports no FastAPI, uvicorn or
httpx ("heavy_modules" lists what a child found in ``sys.modules``).

    .venv/bin/python bench/cold_start.py                 # 5 repeats, ~1 minute
    .venv/bin/python bench/cold_start.py --quick         # 2 repeats, no breakdown
    .venv/bin/python bench/cold_start.py --repeats 9 --out cold_start.json
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ms, fmt_ratio, median, ratio, table  # noqa: E402

FRAMEWORKS = ("ours", "torchft")
REPO = Path(__file__).resolve().parent.parent
#: Modules whose presence after construction the children report (the issue: none of
#: the first three may be imported by a rallypoint Manager that has fetched nothing).
HEAVY = ("fastapi", "uvicorn", "httpx", "starlette", "pydantic", "anyio", "httpcore", "numpy",
         "rallypoint.lighthouse.http", "rallypoint.lighthouse.server")
FORBIDDEN = ("fastapi", "uvicorn", "httpx")
MARK = "cold_start-mark"
PHASES = ("import_torch", "import", "construct", "import_construct", "first_quorum", "to_first_quorum")
GOAL_MS = 100.0


# ---------------------------------------------------------------------- child side
def _mark(what: str) -> None:
    sys.stderr.write(f"{MARK} {what}\n")
    sys.stderr.flush()


def _child(plan: dict[str, Any]) -> None:
    _util.exit_with_parent()
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    _mark("torch")
    if plan["framework"] == "ours":
        import rallypoint
        from rallypoint import Manager, ProcessGroupGloo

        where = rallypoint.__file__
    else:
        import torchft
        from torchft import Manager, ProcessGroupGloo  # type: ignore[no-redef]

        where = torchft.__file__
    t2 = time.perf_counter()
    _mark("import")
    timeout = timedelta(seconds=plan["op_timeout_s"])
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg, lambda sd: None, lambda: {"w": 1}, min_replica_size=1, rank=0, world_size=1, replica_id="cold",
        lighthouse_addr=plan["lighthouse"], store_addr="127.0.0.1", store_port=plan["store_port"],
        hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    )
    t3 = time.perf_counter()
    _mark("construct")
    heavy = [m for m in HEAVY if m in sys.modules]
    t4 = None
    if plan["quorum"]:
        manager.start_quorum()
        manager.wait_quorum()
        t4 = time.perf_counter()
    _mark("quorum")
    ms = lambda a, b: None if a is None or b is None else (b - a) * 1e3  # noqa: E731
    result = {
        "import_torch": ms(t0, t1), "import": ms(t1, t2), "construct": ms(t2, t3), "import_construct": ms(t1, t3),
        "first_quorum": ms(t3, t4), "to_first_quorum": ms(t1, t4), "heavy_modules": heavy, "module_file": where,
        "modules": len(sys.modules),
    }
    sys.stdout.write(json.dumps({"result": result}) + "\n")
    sys.stdout.flush()
    try:
        manager.shutdown(wait=False)
    finally:
        os._exit(0)  # nothing after the measurement is measured; the parent reaps us


# ---------------------------------------------------------------------- parent side
class _Lighthouse:
    """One lighthouse for one child, on a port the OS picks, its address read back."""

    def __init__(self, framework: str) -> None:
        if framework == "ours":
            from rallypoint.lighthouse.server import LighthouseServer

            self.server: Any = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
        else:
            native = _util.load_torchft_native()
            self.server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)

    def addr(self) -> str:
        port = int(self.server.address().rsplit(":", 1)[1])
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def _store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _installed_copy(dest: str, src: Path) -> str:
    """``src/rallypoint/`` copied to ``dest`` and byte-compiled there; the PYTHONPATH entry."""
    if not (src / "rallypoint" / "__init__.py").is_file():
        raise SystemExit(f"no rallypoint package in {src}")
    shutil.copytree(src / "rallypoint", Path(dest) / "rallypoint",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if not compileall.compile_dir(str(Path(dest) / "rallypoint"), quiet=1, workers=1):
        raise SystemExit(f"compileall failed for the copy of rallypoint in {dest}")
    return dest


def _parse_importtime(text: str) -> dict[str, Any]:
    """Self time (ms) by top-level package of the modules imported between the
    ``torch`` and ``construct`` marks of a ``-X importtime`` log, and the import time
    of each phase (``import``: the framework's import; ``construct``: imports done
    lazily by the constructor)."""
    by_pkg: dict[str, float] = {}
    by_phase = {"import": 0.0, "construct": 0.0}
    by_mod: list[tuple[float, float, str]] = []
    phase = None
    for line in text.splitlines():
        if line.startswith(MARK):
            phase = line.split()[1]
            if phase == "construct":
                break
            continue
        if phase is None or not line.startswith("import time:"):
            continue
        try:
            _, self_us, cum_us, name = (p.strip() for p in line.replace("import time:", "|", 1).split("|"))
            s, c = int(self_us) / 1e3, int(cum_us) / 1e3
        except ValueError:
            continue  # the header line
        pkg = name.split(".")[0]
        by_pkg[pkg] = by_pkg.get(pkg, 0.0) + s
        by_phase["import" if phase == "torch" else "construct"] += s
        by_mod.append((s, c, name))
    total = sum(by_pkg.values())
    top_pkgs = sorted(by_pkg.items(), key=lambda kv: -kv[1])
    top_mods = sorted(by_mod, key=lambda t: -t[0])[:10]
    return {"imports_self_ms_total": total, "modules_imported": len(by_mod),
            "imports_ms_by_phase": {k: round(v, 2) for k, v in by_phase.items()},
            "by_package_ms": {k: round(v, 2) for k, v in top_pkgs},
            "top_modules_self_ms": [[n, round(s, 2), round(c, 2)] for s, c, n in top_mods]}


def _run_child(framework: str, plan: dict[str, Any], env: dict[str, str], timeout: float,
               importtime: bool = False) -> dict[str, Any]:
    lh = _Lighthouse(framework)
    store = _store()
    child: Child | None = None
    try:
        cplan = dict(plan, framework=framework, lighthouse=lh.addr(), store_port=int(store.port))
        argv = [sys.executable, *(["-X", "importtime"] if importtime else []), __file__, "--child", json.dumps(cplan)]
        child = Child(argv, name=f"cold-{framework}", env=env, cwd=tempfile.gettempdir())
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise _util.ChildError(f"{child.name} (pid {child.pid}) gave no result within {timeout:.0f}s; "
                                       f"log: {child.log_tail()}")
            obj = child.recv(left)
            if isinstance(obj, dict) and "result" in obj:
                res: dict[str, Any] = obj["result"]
                break
        try:
            child.proc.wait(timeout=10)  # it exits by itself right after its answer
        except Exception:
            pass
        if importtime:
            with open(child.log_path, encoding="utf-8", errors="replace") as f:
                res["importtime"] = it = _parse_importtime(f.read())
            # what the constructor spent on other work than importing (same process)
            it["construct_other_ms"] = round(res["construct"] - it["imports_ms_by_phase"]["construct"], 2)
        return res
    finally:
        if child is not None:
            close_all([child], grace=2.0)
        lh.close()
        del store


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ph in PHASES:
        vals = [s[ph] for s in samples if s.get(ph) is not None]
        if vals:
            out[ph] = {"median_ms": median(vals), "min_ms": min(vals), "max_ms": max(vals),
                       "samples_ms": [round(v, 2) for v in vals]}
    out["heavy_modules"] = sorted({m for s in samples for m in s["heavy_modules"]})
    out["modules_loaded"] = median([s["modules"] for s in samples])
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, help="fresh processes per framework (default 5, quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 repeats, no -X importtime breakdown")
    ap.add_argument("--no-quorum", action="store_true", help="stop at the constructor (no first-quorum column)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the -X importtime child per framework")
    ap.add_argument("--from-tree", action="store_true",
                    help="import rallypoint from the working tree as it is, not a byte-compiled copy")
    ap.add_argument("--rallypoint-src", type=Path, default=REPO,
                    help="the directory holding the rallypoint package to copy and compile (default: this "
                         "checkout; e.g. an older checkout, to measure a change)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset of ours,torchft")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one child may take")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        ap.error(f"unknown framework(s) {unknown}")
    repeats = args.repeats or (2 if args.quick else 5)
    breakdown = not (args.quick or args.no_breakdown)
    os.environ.setdefault("RUST_LOG", "warn")
    cleared = _util.clear_job_env(os.environ)
    if cleared:
        print(f"note: ignoring {', '.join(cleared)} from the environment", file=sys.stderr)
    import torch  # noqa: F401  (the parent's TCPStore; imported before anything is timed)

    tmp = tempfile.mkdtemp(prefix="bench-cold-start-")
    try:
        env = dict(os.environ)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE",
                  "RALLYPOINT_LIGHTHOUSE", "TORCHFT_MANAGER_PORT", "RALLYPOINT_MANAGER_PORT"):
            env.pop(k, None)
        if args.from_tree:
            rp_path, mode = str(REPO), "working tree"
        else:
            rp_path = _installed_copy(tmp, args.rallypoint_src.resolve())
            mode = "byte-compiled copy" + ("" if args.rallypoint_src.resolve() == REPO else f" of {args.rallypoint_src}")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (rp_path, str(REPO / "bench")) if p)
        plan = {"quorum": not args.no_quorum, "op_timeout_s": 30.0}
        load0 = os.getloadavg()[0]
        print(f"# cold start: {repeats} fresh processes per framework, rallypoint from a {mode}, "
              f"torchft {_util.torchft_version()}, {os.cpu_count()} CPUs, load {load0:.2f}", file=sys.stderr)

        samples: dict[str, list[dict[str, Any]]] = {f: [] for f in frameworks}
        for f in frameworks:  # warm-up: page cache, the lighthouses' first use; not counted
            _run_child(f, plan, env, args.timeout)
        for i in range(repeats):
            for f in (frameworks if i % 2 == 0 else frameworks[::-1]):
                samples[f].append(_run_child(f, plan, env, args.timeout))
                if f == "ours" and not args.from_tree and not samples[f][-1]["module_file"].startswith(rp_path):
                    raise SystemExit(f"the child imported rallypoint from {samples[f][-1]['module_file']}, "
                                     f"not the compiled copy in {rp_path}")
        breakdowns = {f: _run_child(f, plan, env, args.timeout, importtime=True)["importtime"]
                      for f in frameworks} if breakdown else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    res: dict[str, Any] = {f: _summary(samples[f]) for f in frameworks}
    for f, b in breakdowns.items():
        res[f]["breakdown"] = b
    torch_all = [s["import_torch"] for f in frameworks for s in samples[f]]

    def med(f: str, ph: str) -> float | None:
        return res.get(f, {}).get(ph, {}).get("median_ms")

    ratios = {ph: ratio(med("ours", ph), med("torchft", ph)) for ph in PHASES if ph != "import_torch"}
    diff = None
    if med("ours", "import_construct") is not None and med("torchft", "import_construct") is not None:
        diff = med("ours", "import_construct") - med("torchft", "import_construct")  # type: ignore[operator]
    forbidden = sorted(set(res.get("ours", {}).get("heavy_modules", [])) & set(FORBIDDEN))

    rows = [["import torch (both)", fmt_ms(median(torch_all)), "", "", ""]]
    names = {"import": "import framework", "construct": "construct Manager", "import_construct": "import + construct",
             "first_quorum": "first quorum (after ctor)", "to_first_quorum": "import → first quorum"}
    for ph, label in names.items():
        if med(frameworks[0], ph) is None:
            continue
        d = None if med("ours", ph) is None or med("torchft", ph) is None else med("ours", ph) - med("torchft", ph)  # type: ignore[operator]
        rows.append([label, fmt_ms(med("ours", ph)), fmt_ms(med("torchft", ph)), fmt_ratio(ratios.get(ph)),
                     "-" if d is None else f"{d:+.1f} ms"])
    print(table(["median of %d" % repeats, "ours", "torchft", "ours/torchft", "ours-torchft"], rows))
    print()
    for f in frameworks:
        print(f"{f}: modules loaded {res[f]['modules_loaded']:.0f}; heavy modules after construction: "
              f"{', '.join(res[f]['heavy_modules']) or 'none'}")
    goal_met = diff is not None and diff <= GOAL_MS and not forbidden
    if diff is not None:
        print(f"import + construct: ours - torchft = {diff:+.1f} ms (goal <= +{GOAL_MS:.0f} ms): "
              f"{'met' if goal_met else 'NOT met'}")
    if forbidden:
        print(f"ours imported {', '.join(forbidden)} during construction (goal: none)")
    for f, b in breakdowns.items():
        print()
        ph = b["imports_ms_by_phase"]
        print(f"{f}: -X importtime, import + construct: {b['modules_imported']} modules, "
              f"{b['imports_self_ms_total']:.1f} ms of import self time (inflated by -X importtime): "
              f"{ph['import']:.1f} ms in the import, {ph['construct']:.1f} ms in the constructor, which spent "
              f"{b['construct_other_ms']:.1f} ms on other work")
        pk = list(b["by_package_ms"].items())[:8]
        print(table(["package", "self ms"], [[k, f"{v:.1f}"] for k, v in pk]))
        print(table(["module", "self ms", "cumulative ms"], [[n, f"{s:.1f}", f"{c:.1f}"] for n, s, c in
                                                          b["top_modules_self_ms"][:6]]))
    line = json.dumps({
        "bench": "cold_start", "repeats": repeats, "rallypoint_from": mode, "torchft_version": _util.torchft_version(),
        "cpus": os.cpu_count(), "load_start": load0, "load_end": os.getloadavg()[0],
        "import_torch_median_ms": median(torch_all), "results": res, "ratios": ratios,
        "ours_minus_torchft_ms": diff, "goal_ms": GOAL_MS, "goal_met": goal_met,
    })
    _util.emit_line(line, args.out)


if __name__ == "__main__":
    main()
