"""Runs TorchTitan's fault-tolerant training as its users launch it, for tests/test_torchtitan.py.

One scenario: a lighthouse (rallypoint's ``rallypoint lighthouse`` or torchft 0.2.0's
``LighthouseServer``) and two replica groups, each ``torchrun --standalone --nproc_per_node 1
tests/titan/launch.py --module tests.titan.cpu_config --config llama3_torchft_debugmodel_cpu
--fault_tolerance.enable --fault_tolerance.replica_id N ...`` with ``TORCHFT_LIGHTHOUSE`` set.
Group 1 is SIGKILLed (its whole process group: torchrun and the trainer, by pid) once it has
reported step ``kill_at``, restarted ``restart_delay`` seconds later with the same command, and
both must finish. The launcher prints one ``TITAN {json}`` line per step (the trainer's step,
the manager's committed-step count, the wall time) and the parameter hashes at the end.

Every wait has a deadline; every process is killed by pid at the end, whatever happened.
The decisions (reading the step lines, the heal time, the table) are pure functions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "tests" / "titan" / "launch.py"
MARK = "TITAN "


# ------------------------------------------------------------------ pure decisions


def parse_event(line: str) -> dict[str, Any] | None:
    """The launcher's ``TITAN {json}`` line as a dict; anything else (logs) is None."""
    if not line.startswith(MARK):
        return None
    try:
        obj = json.loads(line[len(MARK):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def first_commit(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first step line of a run in which the manager's ``should_commit`` said yes."""
    for ev in events:
        if any(ev.get("ok") or ()):
            return ev
    return None


def heal_seconds(kill_t: float, restarted: list[dict[str, Any]]) -> float | None:
    """Kill -> the restarted group's first committed step, in seconds (None: it never
    committed one)."""
    ev = first_commit(restarted)
    return None if ev is None else round(ev["t"] - kill_t, 2)


def params_of(events: list[dict[str, Any]]) -> dict[str, str] | None:
    """The parameter hashes of the run's final ``done`` line (None: it did not finish)."""
    for ev in reversed(events):
        if ev.get("done"):
            return ev.get("params")
    return None


def heal_lr_mismatch(survivor: list[dict[str, Any]], restarted: list[dict[str, Any]]) -> str | None:
    """Whether the restarted group's first committed step updated with another lr than the
    survivor's same step (a description of both, or None: same lr, or no such step)."""
    healed = first_commit(restarted)
    if healed is None or healed.get("lr") is None:
        return None
    for ev in survivor:
        if ev.get("step") == healed["step"] and ev.get("lr") is not None:
            if ev["lr"] != healed["lr"]:
                return (f"at step {healed['step']} the restarted group's update used lr {healed['lr']:.6g}, "
                        f"the survivor's lr {ev['lr']:.6g}")
            return None
    return None


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Parameter names whose hashes differ or that only one side has, sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


#: How the serving group dies when a peer's heal reads its FSDP2 state from the quorum thread
#: while its forward pass runs (torchtitan#4754): FSDP2's state_dict hooks swap the sharded
#: DTensor parameters back in mid-forward, or the state read is an unsharded parameter
#: forward has freed (its storage already released). Seen on torchft 0.2.0 and on rallypoint's
#: default quorum-thread heal.
RACES = ("got mixed torch.Tensor and DTensor", "but its data is not allocated yet", "for storage of size 0")


def crash_of(log_text: str) -> str | None:
    """The error line a trainer died with, when it is the heal-serving race (None otherwise)."""
    for line in log_text.splitlines():
        if "Error" in line and any(r in line for r in RACES):
            return line.replace("[rank0]:", "").strip()
    return None


def table(rows: list[dict[str, Any]]) -> str:
    """The heal-time table (markdown): one row per scenario, a column per backend."""
    modes = sorted({r["mode"] for r in rows})
    kinds = ["torchft", "rallypoint"]
    cell: dict[tuple[str, str], str] = {}
    for r in rows:
        if r.get("skipped"):
            text = "skipped: " + r["skipped"]
        elif r.get("heal_s") is None:
            text = "no heal"
        else:
            text = f"{r['heal_s']:.2f} s (healed to step {r['healed_step']})"
        if r.get("note"):
            text += "; " + r["note"]
        cell[(r["mode"], r["kind"])] = text
    out = ["| run | torchft 0.2.0 | rallypoint |", "|---|---|---|"]
    for m in modes:
        out.append(f"| {m} | " + " | ".join(cell.get((m, k), "-") for k in kinds) + " |")
    return "\n".join(out)


# ------------------------------------------------------------------ processes


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc), parents before their children."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out: list[int] = []
    frontier = [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        out += kids
        frontier = kids
    return out


class Run:
    """One child in a session of its own, stdout+stderr to ``log``, step lines collected."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> None:
        self.log = log
        self._f: TextIO = open(log, "w")
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd, start_new_session=True, bufsize=1)
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._f.write(line)
            ev = parse_event(line)
            with self._cv:
                self.lines.append(line)
                if ev is not None:
                    self.events.append(ev)
                self._cv.notify_all()
        self._f.flush()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, pred: Any, timeout: float, what: str) -> Any:
        """The first collected item ``pred`` accepts (events and log lines), failing on the
        deadline or when the process ends without one."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for item in [*self.events, *self.lines]:
                    if pred(item):
                        return item
                if self.proc.poll() is not None and not self._t.is_alive():
                    raise AssertionError(f"{what}: the process ended (rc {self.proc.returncode}) first; "
                                         f"log {self.log}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{what}: not within {timeout:.0f} s; log {self.log}:\n{self.tail()}")
                self._cv.wait(min(left, 0.5))

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._t.join(timeout=10)
        return rc

    def kill(self) -> None:
        """SIGKILL the child and every process under it (torchrun starts its trainer in a
        session of its own), each by its pid, the trainers first."""
        for pid in [*reversed(descendants(self.proc.pid)), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def close(self) -> None:
        self.kill()
        self._t.join(timeout=10)
        self._f.close()


@dataclass
class Scenario:
    """What a run needs: which backend, which mode, where, with which interpreter."""

    kind: str  # "rallypoint" | "torchft"
    mode: str  # "synchronous" | "diloco"
    work: Path
    python: str = sys.executable
    compat_site: Path | None = None  # rallypoint: the pip-installed compat package
    steps: int = 30
    kill_at: int = 12
    restart_delay: float = 3.0
    # 2: the survivor cannot commit alone, so it waits for the restarted group (a run of a
    # few steps suffices); 1: it trains on alone and serves the heal mid-training.
    min_replicas: int = 2
    start_timeout: float = 240.0
    run_timeout: float = 420.0
    extra: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    kind: str
    mode: str
    rcs: list[int | None]
    kill_t: float
    kill_step: int
    heal_s: float | None
    healed_step: int | None
    params: list[dict[str, str] | None]
    logs: list[Path]
    lr_mismatch: str | None = None  # heal_lr_mismatch of the survivor and the restarted group
    error: str | None = None  # the run never reached the kill (why)

    def row(self) -> dict[str, Any]:
        return {"kind": self.kind, "mode": self.mode, "heal_s": self.heal_s, "healed_step": self.healed_step}


def _env(sc: Scenario, lighthouse: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "RALLYPOINT_", "PYTHONPATH"))}
    path = [str(REPO)]
    if sc.kind == "rallypoint":
        assert sc.compat_site is not None, "the rallypoint runs import torchft from the installed compat package"
        path.insert(0, str(sc.compat_site))
    env.update(PYTHONPATH=os.pathsep.join(path), HF_HOME=str(sc.work / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if lighthouse:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
    return env


def _lighthouse_argv(sc: Scenario) -> list[str]:
    timeouts = {"join_timeout_ms": 2000, "heartbeat_timeout_ms": 2000}
    if sc.kind == "rallypoint":
        return [sc.python, "-m", "rallypoint", "lighthouse", "--min-replicas", str(sc.min_replicas), "--bind", "127.0.0.1:0",
                "--http-bind", "off", "--state", ":memory:",
                *(f"--{k.replace('_', '-')}={v}" for k, v in timeouts.items())]
    code = ("import json, threading\nfrom torchft.coordination import LighthouseServer\n"
            f"s = LighthouseServer(bind='127.0.0.1:0', min_replicas={sc.min_replicas}, **{timeouts!r})\n"
            "print(json.dumps({'lighthouse': s.address()}), flush=True)\nthreading.Event().wait()\n")
    return [sc.python, "-c", code]


def _group_argv(sc: Scenario, replica: int) -> list[str]:
    mode = (["--fault_tolerance.semi_sync_method", "None"] if sc.mode == "synchronous" else
            ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "5",
             "--fault_tolerance.num_fragments", "1"])
    return [sc.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "1",
            str(LAUNCH), "--module", "tests.titan.cpu_config", "--config", "llama3_torchft_debugmodel_cpu",
            "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica),
            "--fault_tolerance.group_size", "2", "--fault_tolerance.process_group", "gloo",
            "--fault_tolerance.min_replica_size", str(sc.min_replicas), *mode,
            "--training.steps", str(sc.steps), "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--checkpoint.enable", "--checkpoint.interval", "1000", "--profiler.no-enable_profiling",
            "--validator.no-enable", "--metrics.log_freq", "1", "--debug.seed", "1",
            "--dump_folder", str(sc.work / f"dump{replica}"), *sc.extra]


def make_assets(python: str, work: Path) -> None:
    """The tokenizer and the dataset, made by the launcher (it has ``tokenizers``)."""
    subprocess.run([python, str(LAUNCH), "assets", str(work)], check=True, timeout=120,
                   capture_output=True, text=True)


def run_scenario(sc: Scenario) -> Outcome:
    """Lighthouse, two groups, kill group 1 at ``kill_at``, restart it after
    ``restart_delay`` s, wait for both to finish; every process killed at the end."""
    sc.work.mkdir(parents=True, exist_ok=True)
    make_assets(sc.python, sc.work)
    runs: list[Run] = []
    try:
        lh = Run(_lighthouse_argv(sc), sc.work / "lighthouse.log", _env(sc, None), sc.work)
        runs.append(lh)
        key = "{\"lighthouse\""
        info = lh.wait_for(lambda x: isinstance(x, str) and key in x, 60, "lighthouse ready")
        # stderr shares the pipe, and torchft's Rust logger writes a line in several writes: the
        # JSON object (one write) may land after a log line's timestamp or before its text
        address = json.JSONDecoder().raw_decode(info, info.index(key))[0]["lighthouse"]
        env = _env(sc, address)
        g0 = Run(_group_argv(sc, 0), sc.work / "group0.log", env, sc.work)
        g1 = Run(_group_argv(sc, 1), sc.work / "group1.log", env, sc.work)
        runs += [g0, g1]
        try:
            victim = g1.wait_for(lambda e: isinstance(e, dict) and e.get("step", 0) >= sc.kill_at,
                                 sc.start_timeout, f"group 1 reaching step {sc.kill_at}")
        except AssertionError as e:
            return Outcome(kind=sc.kind, mode=sc.mode, rcs=[g0.proc.poll(), g1.proc.poll()], kill_t=0.0,
                           kill_step=-1, heal_s=None, healed_step=None, params=[None, None],
                           logs=[g0.log, g1.log, lh.log], error=str(e))
        kill_t = time.time()
        g1.kill()
        deadline = time.monotonic() + sc.restart_delay
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(left)
        g1b = Run(_group_argv(sc, 1), sc.work / "group1-restarted.log", env, sc.work)
        runs.append(g1b)
        rcs: list[int | None] = []
        end = time.monotonic() + sc.run_timeout
        for r in (g0, g1b):
            try:
                rcs.append(r.wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                rcs.append(None)
        healed = first_commit(g1b.events)
        return Outcome(kind=sc.kind, mode=sc.mode, rcs=rcs, kill_t=kill_t, kill_step=int(victim["step"]),
                       heal_s=heal_seconds(kill_t, g1b.events),
                       healed_step=None if healed is None else int(healed["step"]),
                       params=[params_of(g0.events), params_of(g1b.events)],
                       logs=[g0.log, g1.log, g1b.log, lh.log],
                       lr_mismatch=heal_lr_mismatch(g0.events, g1b.events))
    finally:
        for r in reversed(runs):
            r.close()
