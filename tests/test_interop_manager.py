"""Training interop with the real torchft 0.2.0 wheel, both directions, on loopback.

* torchft's own ``torchft.Manager`` + ``torchft.ProcessGroupGloo`` (two replica groups)
  trains against OUR lighthouse;
* OUR ``rallypoint.manager.Manager`` + ``rallypoint.process_groups.ProcessGroupGloo``
  trains against torchft's (Rust) ``LighthouseServer``;
* torchft-nightly's (the 0.3 API) ``Manager`` + its reconfigurable ``ProcessGroupGloo``
  trains against OUR lighthouse, reconfiguring from the handles it carries; and our
  Manager against torchft-nightly's lighthouse. torchft-nightly is found unpacked at
  ``<venv>/torchft-nightly`` (``make install``) and put first on the zygote's path; its
  Python runs on torch 2.13 through its own ``ReconfigureOptions`` stand-in.

Each replica group (one rank) is a process running this file's ``worker``, forked from a
"zygote" subprocess (``python this_file zygote KIND``) that has imported torch and the
manager under test once, so three replicas cost one torch import. The worker trains a tiny
``nn.Linear`` with SGD on its own synthetic data, gradients averaged with
``manager.allreduce``, the step committed with ``should_commit``. After every step it
writes its progress (step, batches committed, participants, parameter hash) to a JSON
file, and stops once its step reaches the target written to a stop file (or after its
own wall-clock limit). In each direction two replicas train in lockstep from step 0, then
a late third one with other initial weights must heal from them (torchft heals over its
HTTP transport, we over ours), join the training, and end bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

pytestmark = pytest.mark.interop

HERE = Path(__file__).resolve()
LIMIT_S = 60.0  # a worker's own wall-clock limit


# ---------------------------------------------------------------------- worker side
def worker(kind: str, lighthouse: str, replica: str, seed: int, out: str, stop: str, delay: float) -> int:
    import logging
    from datetime import timedelta

    import torch
    from torch import nn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
        os.environ.pop(k, None)
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    timeouts = dict(timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
                    connect_timeout=timedelta(seconds=10))
    store = None
    if kind in ("torchft", "torchft-nightly"):
        from torch.distributed import TCPStore
        from torchft import Manager as TorchftManager
        from torchft import ProcessGroupGloo as TorchftGloo

        # torchft's Manager expects the group's TCPStore to exist already (torchrun's job).
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        pg = TorchftGloo(timeout=timedelta(seconds=5))
        m = TorchftManager(pg=pg, load_state_dict=load, state_dict=save, min_replica_size=1, rank=0, world_size=1,
                           store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                           replica_id=replica, hostname="127.0.0.1", **timeouts)
    else:
        from rallypoint.manager.manager import Manager
        from rallypoint.process_groups import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        m = Manager(pg=pg, load_state_dict=load, state_dict=save, min_replica_size=1, rank=0, world_size=1,
                    store_addr="127.0.0.1", lighthouse_addr=lighthouse, replica_id=replica,
                    hostname="127.0.0.1", **timeouts)
    gen = torch.Generator().manual_seed(1000 + seed)
    history: list[list[int]] = []
    t0 = time.monotonic()
    rc = 0
    try:
        while True:
            if os.path.exists(stop):
                target = int(Path(stop).read_text() or "1000000")
                if m.current_step() >= target:
                    break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            m.start_quorum()
            x = torch.randn(8, 4, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                m.allreduce(p.grad).wait()
            participants = m.num_participants()
            if m.should_commit():
                opt.step()
            history.append([m.current_step(), participants])
            h = hashlib.sha256(repr([p.detach().flatten().tolist() for p in model.parameters()]).encode()).hexdigest()
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({"step": m.current_step(), "batches": m.batches_committed(), "hash": h,
                                             "history": history}))
            os.replace(tmp, out)
            time.sleep(delay)  # paces the loop so the late joiner catches a running peer
    finally:
        m.shutdown(wait=False)
        if kind == "ours":
            pg.shutdown()
        del store
    return rc


def zygote(kind: str) -> int:
    """Imports torch and the manager under test once, then forks one worker per request
    line on stdin (a JSON list of ``worker`` arguments after ``kind``), answering each
    with the child's pid. Importing torch costs seconds of CPU per process on this small
    machine; forking a ready interpreter costs milliseconds. Exits at EOF on stdin."""
    import importlib

    # Imported here, before any thread exists, so that the forked children start warm.
    ours = ["rallypoint.manager.manager", "rallypoint.manager.server", "rallypoint.process_groups",
            "rallypoint.transports.http"]
    for mod in ["torch", "torch.distributed", *(["torchft"] if kind != "ours" else ours)]:
        importlib.import_module(mod)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        args = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            rc = 1
            fd = os.open(args[0] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            try:
                rc = worker(kind, *args[1:])
            except BaseException:  # noqa: BLE001 - reported through the log and the rc file
                import traceback

                traceback.print_exc()
            finally:
                Path(args[0] + ".rc").write_text(str(rc))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        print(pid, flush=True)
    return 0


# ---------------------------------------------------------------------- test side
class Replicas:
    """Replica groups forked by one zygote subprocess; files ``<name>.json`` (progress),
    ``<name>.log`` and ``<name>.rc`` (exit status) under ``tmp``."""

    def __init__(self, tmp: Path, kind: str, lighthouse: str) -> None:
        self.tmp = tmp
        self.lighthouse = lighthouse
        self.stop = tmp / "stop"
        self.pids: dict[str, int] = {}
        env = dict(os.environ)
        if kind == "torchft-nightly":
            env["PYTHONPATH"] = os.pathsep.join([str(nightly_dir()), env.get("PYTHONPATH", "")])
        with open(tmp / "zygote.log", "w") as log:
            self.zygote = subprocess.Popen([sys.executable, str(HERE), "zygote", kind], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self._answer(60) == "ready", self.logs()

    def _answer(self, timeout: float) -> str:
        ready, _, _ = select.select([self.zygote.stdout], [], [], timeout)
        assert ready, f"zygote did not answer in {timeout}s; logs:\n{self.logs()}"
        return self.zygote.stdout.readline().strip()  # type: ignore[union-attr]

    def start(self, name: str, seed: int, delay: float = 0.1, lighthouse: str | None = None) -> None:
        base = str(self.tmp / name)
        args = [base, lighthouse or self.lighthouse, name, seed, base + ".json", str(self.stop), delay]
        self.zygote.stdin.write(json.dumps(args) + "\n")  # type: ignore[union-attr]
        self.zygote.stdin.flush()  # type: ignore[union-attr]
        self.pids[name] = int(self._answer(10))

    def progress(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.tmp / f"{name}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def step(self, name: str) -> int:
        p = self.progress(name)
        return p["step"] if p else -1

    def rc(self, name: str) -> int | None:
        try:
            return int((self.tmp / f"{name}.rc").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if any(self.rc(n) is not None for n in self.pids):
                raise AssertionError(f"a worker exited while waiting for {what}; logs:\n{self.logs()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; logs:\n{self.logs()}")

    def finish(self, target: int, timeout: float) -> None:
        self.stop.write_text(str(target))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.rc(n) is None for n in self.pids):
            time.sleep(0.05)
        rcs = {n: self.rc(n) for n in self.pids}
        assert all(rc == 0 for rc in rcs.values()), f"exit codes {rcs}; logs:\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(f"==== {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.zygote.kill()
        self.zygote.wait(5)
        self.zygote.stdin.close()  # type: ignore[union-attr]
        self.zygote.stdout.close()  # type: ignore[union-attr]


@pytest.fixture
def servers():
    """Lighthouses started by a test; shut down at teardown."""
    made: list[Any] = []
    yield made
    for lh in reversed(made):
        lh.shutdown()


@pytest.fixture
def replicas_factory(tmp_path: Path):
    made: list[Replicas] = []

    def make(kind: str, lighthouse: str) -> Replicas:
        r = Replicas(tmp_path, kind, lighthouse)
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill_all()


def nightly_dir() -> Path:
    """The folder holding torchft-nightly's ``torchft`` package (``make install`` unpacks it
    at ``<venv>/torchft-nightly``; ``$RALLYPOINT_TORCHFT_NIGHTLY`` overrides)."""
    return Path(os.environ.get("RALLYPOINT_TORCHFT_NIGHTLY") or Path(sys.prefix) / "torchft-nightly")


def start_lighthouse(servers: list[Any], impl: str, **kw: Any) -> str:
    """Starts a lighthouse of the *other* implementation than the workers'; returns the
    address the workers are given."""
    if impl == "ours":
        from rallypoint.lighthouse.server import LighthouseServer

        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        servers.append(lh)
        return lh.address()
    if impl == "torchft-nightly":
        import importlib.util

        so = next((nightly_dir() / "torchft").glob("_torchft*.so"))
        spec = importlib.util.spec_from_file_location("_torchft", so)  # PyInit__torchft; not put in sys.modules
        assert spec is not None and spec.loader is not None
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)  # a pyo3 module: no torch, no clash with 0.2.0's
        TorchftLighthouseServer = native.LighthouseServer
    else:
        from torchft._torchft import LighthouseServer as TorchftLighthouseServer

    lh = TorchftLighthouseServer(bind="127.0.0.1:0", quorum_tick_ms=20, **kw)
    servers.append(lh)
    # torchft advertises "http://<gethostname()>:<port>"; keep its scheme, pin loopback.
    addr = lh.address()
    assert addr.startswith("http://"), addr
    return "http://127.0.0.1:" + addr.rsplit(":", 1)[1]


NAMES = ["replica_0", "replica_1", "replica_2"]


def assert_identical(r: Replicas, names: list[str], target: int) -> None:
    prog = [r.progress(n) for n in names]
    assert all(p is not None for p in prog), r.logs()
    assert [p["step"] for p in prog] == [target] * len(names), (prog, r.logs())
    assert len({p["hash"] for p in prog}) == 1, ([p["hash"] for p in prog], r.logs())
    assert len({p["batches"] for p in prog}) == 1, prog


# workers' implementation -> the lighthouse they train against
DIRECTIONS = [("torchft", "ours"), ("ours", "torchft"), ("torchft-nightly", "ours"), ("ours", "torchft-nightly")]
IDS = ["torchft_manager-our_lighthouse", "our_manager-torchft_lighthouse",
       "torchft_nightly_manager-our_lighthouse", "our_manager-torchft_nightly_lighthouse"]


@pytest.mark.parametrize(("kind", "lh_impl"), DIRECTIONS, ids=IDS)
def test_train_in_lockstep_then_late_replica_heals(servers, replicas_factory, kind: str, lh_impl: str) -> None:
    """Two replicas (different initial weights) start together and train in lockstep;
    a third one with other weights starts late, heals from them and joins the training.
    At the end all three hold identical parameters at the same step."""
    if "torchft-nightly" in (kind, lh_impl) and not (nightly_dir() / "torchft").is_dir():
        pytest.skip(f"torchft-nightly is not unpacked at {nightly_dir()} (make install unpacks it)")
    addr = start_lighthouse(servers, lh_impl, min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=5000)
    r = replicas_factory(kind, addr)
    r.start("replica_0", seed=1)
    r.start("replica_1", seed=2)  # init_sync: takes replica_0's weights at step 0
    r.wait_for("both replicas at step 4", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 4, 40)
    # our Manager must also take a bare host:port (torchft's lighthouse advertises http://)
    late = addr.removeprefix("http://") if lh_impl.startswith("torchft") else addr
    r.start("replica_2", seed=3, lighthouse=late)  # other initial weights, step 0
    r.wait_for("replica_2 healed and committing", lambda: r.step("replica_2") >= r.step("replica_0") > 4, 30)
    target = max(r.step(n) for n in NAMES) + 3
    r.finish(target, timeout=30)

    assert_identical(r, NAMES, target)
    hist0 = r.progress("replica_0")["history"]
    assert [s for s, _ in hist0] == list(range(1, target + 1)), hist0  # every step committed
    counts = [p for _, p in hist0]
    assert counts[:4] == [2] * 4 and counts[-1] == 3 and counts == sorted(counts), hist0
    assert r.progress("replica_1")["history"] == hist0
    hist2 = r.progress("replica_2")["history"]
    assert hist2[0][0] > 4, hist2  # its first committed step came after the heal, not from 0
    assert hist2[-1][1] == 3, hist2  # and then trained together with the others
    assert r.progress("replica_0")["batches"] == sum(counts)


if __name__ == "__main__":
    assert sys.argv[1] == "zygote", sys.argv
    sys.exit(zygote(sys.argv[2]))
