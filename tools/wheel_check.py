"""Check that the built wheel works on its own, outside this checkout (`make wheel-check`).

1. Builds the sdist and, from it, the wheel (``python -m build``), so a file the sdist
   forgets fails here too.
2. Checks the wheel holds every file of ``rallypoint/`` that git tracks (package data: the
   dashboard's static files, the protobuf stubs' ``.pyi``, ``py.typed``, ``LEASES.md``), the
   license and the console script, and that the sdist holds the ``.proto`` sources.
3. Creates a fresh venv in a temporary folder and installs torch (``--torch``, the version
   the Makefile installs) and the wheel with its runtime dependencies, nothing from here.
4. From the temporary folder, with no ``PYTHONPATH``: ``import rallypoint`` must resolve to
   that venv's site-packages; ``rallypoint --help`` runs; a lighthouse starts on ports the
   OS picks and serves its dashboard; two replica groups, one ``rallypoint run`` each, train
   a small model with ``rallypoint.Manager``, ``DistributedDataParallel`` and ``Optimizer``
   on different data for ``--steps`` steps: both must commit every step and end with
   identical parameters.

Every wait has a deadline; every process started here is stopped by its process group id
(each starts in a session of its own) and the folder is removed (``--keep`` keeps it).
Exit status 0 when every check passed. Prints what it does and how long each part took.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TRAIN = '''\
"""Two replica groups train one small model; each group reads its own data."""
import hashlib
import json
import os
import struct
import sys
from datetime import timedelta

import torch
from torch import nn

import rallypoint

steps, out = int(sys.argv[1]), sys.argv[2]
group = int(os.environ["REPLICA_GROUP_ID"])
rank = int(os.environ["RANK"])
timeout = timedelta(seconds=30)
torch.manual_seed(0)  # one init everywhere
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
inner = torch.optim.SGD(model.parameters(), lr=0.05)
manager = rallypoint.Manager(
    pg=rallypoint.ProcessGroupGloo(timeout=timeout),
    load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
    state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    min_replica_size=2, hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    checkpoint_transport=rallypoint.HTTPTransport(timeout=timeout, bind="127.0.0.1:0", advertise_host="127.0.0.1"),
)
ddp = rallypoint.DistributedDataParallel(manager, model)
optimizer = rallypoint.Optimizer(manager, inner)
data = torch.Generator().manual_seed(100 + group)  # different data per group: only averaging keeps them equal
commits = 0
try:
    while manager.current_step() < steps:
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 2, generator=data)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        commits += bool(optimizer.step())
finally:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).double().tolist()
    digest = hashlib.sha256(struct.pack(f"{len(flat)}d", *flat)).hexdigest()
    with open(os.path.join(out, f"result-{group}-{rank}.json"), "w") as f:
        json.dump({"group": group, "rank": rank, "step": manager.current_step(), "commits": commits,
                   "participants": manager.num_participants(), "sha256": digest,
                   "rallypoint": rallypoint.__file__}, f)
    ddp.shutdown()
    manager.shutdown(wait=False)
'''


class Check:
    """The temporary folder, the processes started in it, and the timings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="rallypoint-wheel-"))
        self.venv = Path(args.venv).resolve() if args.venv else self.tmp / "venv"
        self.py = self.venv / "bin" / "python"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.t0 = time.monotonic()
        self.timings: list[tuple[str, float]] = []
        # the installed package only: nothing of this checkout on the path, no venv leaking in
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
                        PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR")
        for k in ("RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "RANK", "LOCAL_RANK",
                  "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RALLYPOINT_TOKEN", "RALLYPOINT_JOB"):
            self.env.pop(k, None)

    def say(self, msg: str) -> None:
        print(f"wheel-check [{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def part(self, name: str, started: float) -> None:
        self.timings.append((name, time.monotonic() - started))

    def run(self, cmd: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Run ``cmd`` to completion within ``timeout`` seconds; its output, or SystemExit on failure."""
        try:
            p = subprocess.run(cmd, cwd=cwd or self.tmp, env=env or self.env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True)
        except subprocess.TimeoutExpired as e:
            raise SystemExit(f"wheel-check: {' '.join(cmd[:4])} ... did not finish in {timeout:.0f} s:\n{e.output}")
        if p.returncode != 0:
            raise SystemExit(f"wheel-check: {' '.join(cmd[:4])} ... exited {p.returncode}:\n{p.stdout[-4000:]}")
        return p.stdout

    def start(self, cmd: list[str], log: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in its own session (so it and its children stop together)."""
        out = open(log, "wb") if log else subprocess.PIPE  # noqa: SIM115 (the child holds it)
        p = subprocess.Popen(cmd, cwd=self.tmp, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT if log else subprocess.DEVNULL, start_new_session=True)
        if log:
            out.close()  # type: ignore[union-attr]
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        """SIGTERM each started process group, SIGKILL what is left after a few seconds."""
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            live = [p for p in self.procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)  # p.pid is its own process group (start_new_session)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            for p in live:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    # --- the parts ---------------------------------------------------------------------

    def build(self) -> tuple[Path, Path]:
        t = time.monotonic()
        dist = self.tmp / "dist"
        self.say(f"building the sdist and the wheel of {REPO}")
        self.run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], timeout=600, cwd=REPO,
                 env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        wheels, sdists = sorted(dist.glob("rallypoint-*.whl")), sorted(dist.glob("rallypoint-*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            raise SystemExit(f"wheel-check: expected one wheel and one sdist in {dist}: {os.listdir(dist)}")
        self.say(f"built {wheels[0].name} ({wheels[0].stat().st_size // 1024} KiB) and {sdists[0].name}")
        self.part("build sdist + wheel", t)
        return wheels[0], sdists[0]

    def check_contents(self, wheel: Path, sdist: Path) -> None:
        with tarfile.open(sdist) as tar:
            in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        lacking = [f for f in ("LICENSE", "pyproject.toml", "proto/torchft.proto", "proto/rallypoint.proto",
                               "rallypoint/lighthouse/static/dashboard.html") if f not in in_sdist]
        if lacking:
            raise SystemExit(f"wheel-check: the sdist lacks {lacking} (MANIFEST.in)")
        names = set(zipfile.ZipFile(wheel).namelist())
        try:
            tracked = subprocess.run(["git", "ls-files", "rallypoint"], cwd=REPO, capture_output=True, text=True,
                                     timeout=60, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError):  # not a git checkout: every file of the package
            tracked = [str(p.relative_to(REPO)) for p in (REPO / "rallypoint").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts]
        missing = sorted(f for f in tracked if f not in names)
        if missing:
            raise SystemExit(f"wheel-check: the wheel lacks package files: {missing} (pyproject package-data)")
        meta = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zipfile.ZipFile(wheel).read(meta[0]).decode()
        entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        if not entry or "rallypoint = rallypoint.cli:main" not in zipfile.ZipFile(wheel).read(entry[0]).decode():
            raise SystemExit("wheel-check: the wheel declares no `rallypoint` console script")
        licenses = [n for n in names if "/licenses/" in n or n.endswith(".dist-info/LICENSE")]
        if not licenses:
            raise SystemExit("wheel-check: the wheel carries no license file (pyproject license-files)")
        self.say(f"the wheel holds all {len(tracked)} package files, the console script, "
                 f"the license; requires: "
                 + ", ".join(line.split(": ", 1)[1] for line in metadata.splitlines()
                             if line.startswith("Requires-Dist:") and "extra ==" not in line))

    def install(self, wheel: Path) -> None:
        t = time.monotonic()
        self.say(f"creating a fresh venv in {self.venv}")
        base = getattr(sys, "_base_executable", sys.executable)
        self.run([base, "-m", "venv", str(self.venv)], timeout=300)
        self.say(f"installing torch=={self.args.torch} and {wheel.name} with its dependencies")
        self.run([str(self.py), "-m", "pip", "install", "--quiet", f"torch=={self.args.torch}", str(wheel)],
                 timeout=1200)
        self.part("fresh venv + pip install (torch, wheel, deps)", t)

    def check_import(self) -> None:
        out = self.run([str(self.py), "-c", "import rallypoint, sys; print(rallypoint.__file__); "
                        "print(rallypoint.__version__); print(len(dir(rallypoint)))"], timeout=120)
        where, version = out.split()[:2]
        site = (self.venv / "lib").resolve()
        if not Path(where).resolve().is_relative_to(site):
            raise SystemExit(f"wheel-check: `import rallypoint` found {where}, not the venv's site-packages {site}")
        if Path(where).resolve().is_relative_to(REPO):
            raise SystemExit(f"wheel-check: `import rallypoint` found the checkout: {where}")
        self.say(f"import rallypoint -> {where} (version {version})")
        helped = self.run([str(self.venv / "bin" / "rallypoint"), "--help"], timeout=120)
        for sub in ("lighthouse", "run", "status", "kill"):
            if sub not in helped:
                raise SystemExit(f"wheel-check: `rallypoint --help` does not mention {sub!r}:\n{helped}")
        self.say("rallypoint --help: ok")

    def lighthouse(self) -> str:
        t = time.monotonic()
        p = self.start([str(self.venv / "bin" / "rallypoint"), "lighthouse", "--min-replicas", "2",
                        "--join-timeout-ms", "1000", "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0",
                        "--state", ":memory:"])
        assert p.stdout is not None
        deadline, line = time.monotonic() + 120, b""
        while not line and time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(f"wheel-check: the lighthouse exited {p.returncode} before reporting its ports")
            if select.select([p.stdout], [], [], 0.5)[0]:
                line = p.stdout.readline()
        if not line:
            raise SystemExit("wheel-check: the lighthouse did not report its ports within 120 s")
        info = json.loads(line)
        with urllib.request.urlopen(f"{info['http']}/", timeout=30) as r:  # the packaged static page
            page = r.read().decode()
        if "<html" not in page.lower():
            raise SystemExit(f"wheel-check: the dashboard at {info['http']} served no page: {page[:200]!r}")
        self.say(f"lighthouse up: gRPC {info['local']}, dashboard {info['http']}/ serves its page")
        self.part("lighthouse start", t)
        return str(info["local"])

    def train(self, lighthouse: str) -> None:
        t = time.monotonic()
        script, out = self.tmp / "train.py", self.tmp / "out"
        script.write_text(TRAIN)
        out.mkdir()
        groups = [self.start([str(self.venv / "bin" / "rallypoint"), "run", "--nproc-per-node", str(self.args.ranks),
                              "--replica-group-id", str(g), "--lighthouse", lighthouse, "--no-standby",
                              "--max-restarts", "0", str(script), str(self.args.steps), str(out)],
                             log=self.tmp / f"group{g}.log") for g in (0, 1)]
        self.say(f"started 2 replica groups ({self.args.ranks} rank(s) each) for {self.args.steps} steps")
        deadline = time.monotonic() + self.args.timeout
        for g, p in enumerate(groups):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"wheel-check: group {g} did not finish in {self.args.timeout:.0f} s:\n"
                                 + (self.tmp / f"group{g}.log").read_text()[-4000:])
            text = (self.tmp / f"group{g}.log").read_text()
            if rc != 0 or '"event": "restart"' in text:
                raise SystemExit(f"wheel-check: group {g} exited {rc} or restarted a rank:\n{text[-4000:]}")
        results = [json.loads((out / f"result-{g}-{r}.json").read_text())
                   for g in (0, 1) for r in range(self.args.ranks)]
        for res in results:
            if res["step"] != self.args.steps or res["commits"] != self.args.steps or res["participants"] != 2:
                raise SystemExit(f"wheel-check: a rank did not commit every step with both groups: {res}")
            if not Path(res["rallypoint"]).resolve().is_relative_to(self.venv.resolve()):
                raise SystemExit(f"wheel-check: a rank imported rallypoint from {res['rallypoint']}")
        if len({res["sha256"] for res in results}) != 1:
            raise SystemExit(f"wheel-check: the replicas' parameters differ: {results}")
        self.say(f"both groups committed {self.args.steps} steps with 2 participants and end with identical "
                 f"parameters ({results[0]['sha256'][:12]})")
        self.part("two groups train", t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default="2.13.0", help="the torch version to install into the fresh venv (2.13.0)")
    ap.add_argument("--steps", type=int, default=5, help="steps the two replica groups train (5)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per replica group (1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the training may take (300)")
    ap.add_argument("--venv", default=None, help="skip the build and the install: use this venv, which holds the "
                    "wheel already (a --keep run's), to rerun the checks quickly")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (venv, logs) for a look")
    args = ap.parse_args()
    check = Check(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the cleanup below runs
    ok, passed = False, 0
    try:
        if not args.venv:
            wheel, sdist = check.build()
            check.check_contents(wheel, sdist)
            check.install(wheel)
            passed += 3
        check.check_import()
        passed += 1
        lighthouse = check.lighthouse()
        passed += 1
        check.train(lighthouse)
        passed += 1
        ok = True
    finally:
        check.stop_all()
        total = time.monotonic() - check.t0
        for name, secs in check.timings:
            print(f"wheel-check: {name}: {secs:.1f} s")
        print(f"wheel-check: {'passed' if ok else 'FAILED'} in {total:.1f} s", flush=True)
        if args.keep:
            print(f"wheel-check: kept {check.tmp}")
        else:  # a failure's logs were printed above; the venv is too big to leave behind
            shutil.rmtree(check.tmp, ignore_errors=True)
        # the plain closing line a CI log reader counts (build, contents, install, import, lighthouse, training)
        print(f"wheel-check: {passed} passed, {0 if ok else 1} failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
