"""A replica group (one rank) for the multi-process ``Manager`` tests, and the test-side
helper that starts, watches and kills them.

The worker trains a tiny ``nn.Linear`` on its own synthetic data, averaging gradients
with ``Manager.allreduce`` and committing with ``should_commit``. After every step it
writes its progress (step, participants, parameter hash, history) to a JSON file, and
it stops once its step reaches the target written to the stop file (or after its own
wall-clock limit). Options (a JSON object on the command line):

- ``fault``: ``{"at": POINT, "step": N}`` — SIGKILL itself at POINT of the first
  step it reaches at or after step N: ``before_quorum``, ``mid_allreduce`` (after the first gradient's
  allreduce was posted, while peers are in the collective), ``after_vote`` (should_commit
  said yes, the optimizer has not stepped), ``serving`` (while reading its state to send
  it to a healing peer) or ``receiving`` (a healed state arrived and was not
  applied yet), both from step N on (default 0). ``local_error`` kills nothing: the
  group reports an error after its collectives at step N, once, so it alone fails that step.
- ``fail_every``: N: the group reports an error at every step divisible by N (once each), so
  it alone fails that step and heals from a peer at the next quorum: a long-lived process
  healing again and again (receive buffers kept from heal to heal).
- ``mode``: ``"fixed"`` for ``WorldSizeMode.FIXED_WITH_SPARES``; ``min_replica_size``.
- ``transport``: ``"pg"`` heals over the cross-replica process group (``PGTransport``);
  ``"torchft_http"`` with torchft 0.2.0's own ``HTTPTransport`` (what a torchft user may
  pass as ``checkpoint_transport``).
- ``delay``: seconds between steps; ``async``: async quorum (default true).
- ``ranks``: ranks in the replica group (threads of the worker process; default 1).
- ``sdc``: the gradient-norm check on; ``sdc_every``: the parameter check every N steps.
- ``training_thread``: ``heal_on_training_thread=True``; the progress file then lists the
  threads the state callbacks ran on (``state_threads``) next to the training thread's.
- ``optimizer``: ``"torch"`` for ``torch.optim.SGD`` with momentum (its buffers are state
  a heal must copy, or the healed replica's parameters drift from the others'); the
  default is :class:`PlainSGD`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import zygote

HERE = Path(__file__).resolve()
LIMIT_S = 60.0  # a worker's own wall-clock limit


#: How many of the last steps' parameter hashes a worker keeps for ``Replicas.assert_identical``.
KEPT_HASHES = 32


def record_hash(hashes: dict[str, str], step: int, model: Any) -> str:
    """Hash ``model``'s parameters, keep it in ``hashes`` under ``step`` (only the last
    ``KEPT_HASHES`` steps stay) and return it. Every worker's progress file carries these
    for ``Replicas.assert_identical``'s lone-last-step check."""
    h = hashlib.sha256(repr([p.detach().flatten().tolist() for p in model.parameters()]).encode()).hexdigest()
    hashes[str(step)] = h
    while len(hashes) > KEPT_HASHES:
        del hashes[next(iter(hashes))]
    return h


def round_row(m: Any) -> list[Any]:
    """The round just ended, as ``[step, quorum id, quorum size, committed]``: the step
    reached, the quorum's id and how many replica groups it held, 1 if this replica
    committed it. Workers keep these under ``"rounds"`` so that
    ``Replicas.assert_identical`` can tell which replicas committed one and the same round
    (whose parameters must then be equal) from replicas that only reached the same step.
    Called after ``should_commit``, which closes the round."""
    rec = m.step_record()
    assert rec is not None, "round_row() before the first should_commit()"
    return [m.current_step(), rec.quorum_id, len(rec.participants), int(rec.outcome == "committed")]


def _together(prog: list[dict[str, Any]], full: int) -> int:
    """The last step that all ``full`` replicas committed in one round whose quorum held
    them all (from their ``"rounds"``; from ``"history"`` rows with ``full`` participants
    where a worker writes no rounds); -1 if there is none."""
    common: set[tuple[int, Any]] | None = None
    for p in prog:
        if "rounds" in p:
            mine = {(s, q) for s, q, n, c in p["rounds"] if n == full and c}
        else:
            mine = {(row[0], None) for row in p["history"] if row[1] == full}
        common = mine if common is None else common & mine
    return max((s for s, _ in common or ()), default=-1)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def worker(lighthouse: str, name: str, seed: int, out: str, stop: str, opts: dict[str, Any]) -> int:
    """One replica group: ``opts["ranks"]`` ranks (threads of this process, each with its
    own manager, process group and model copy, all on the same data); rank r > 0 writes
    its progress to ``<name>-r<r>.json``."""
    import logging
    import threading

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    ranks = int(opts.get("ranks", 1))
    if ranks == 1:
        return run_rank(lighthouse, name, seed, out, stop, opts, 0, 1, None)
    import torch.distributed as dist

    # The group's store, hosted by the launcher (as torchrun's agent does) on a port the
    # OS picks; the ranks connect to it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    rcs = [4] * ranks

    def main(r: int) -> None:
        path = out if r == 0 else out.replace(".json", f"-r{r}.json")
        rcs[r] = run_rank(lighthouse, name, seed, path, stop, opts, r, ranks, port)

    threads = [threading.Thread(target=main, args=(r,), name=f"rank-{r}") for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S + 60)
    return max(rcs)


def run_rank(lighthouse: str, name: str, seed: int, out: str, stop: str, opts: dict[str, Any],
             rank: int, world_size: int, store_port: int | None) -> int:
    from datetime import timedelta

    import torch
    from torch import nn

    from rallypoint.manager import Manager, WorldSizeMode
    from rallypoint.process_groups import ProcessGroupGloo

    fault = opts.get("fault") or {}
    m: Any = None  # the manager, once built

    def at(point: str) -> bool:
        """The fault is set for ``point`` and this replica has reached its step."""
        return fault.get("at") == point and m is not None and m.current_step() >= int(fault.get("step", 0))
    # Initial weights from a generator of our own: ranks run as threads of one process,
    # and the global RNG would interleave their draws.
    init = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, int(opts.get("width", 2)))  # width 80000: a 1.3 MB weight, served live
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.5)
    opt: Any = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opts.get("optimizer") == "torch"
                else PlainSGD(model.parameters(), lr=0.1))

    import threading

    state_threads: set[str] = set()

    def save() -> dict[str, Any]:
        state_threads.add(threading.current_thread().name)
        if at("serving"):
            _die()
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        state_threads.add(threading.current_thread().name)
        if at("receiving"):
            _die()
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    timeout = timedelta(seconds=float(opts.get("timeout", 10)))
    pg = ProcessGroupGloo(timeout=timeout)
    transport = None
    if opts.get("transport") == "pg":
        from rallypoint.transports.pg import PGTransport

        transport = PGTransport(pg, timeout=timeout)
    elif opts.get("transport") == "torchft_http":
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTPTransport

        transport = TorchftHTTPTransport(timeout=timeout, num_chunks=0)
    m = Manager(
        pg=pg, load_state_dict=load, state_dict=save, min_replica_size=int(opts.get("min_replica_size", 1)),
        rank=rank, world_size=world_size, store_addr="127.0.0.1", store_port=store_port,
        lighthouse_addr=lighthouse, replica_id=name,
        hostname="127.0.0.1", timeout=timeout, quorum_timeout=timedelta(seconds=float(opts.get("quorum_timeout", 2 * timeout.total_seconds()))),
        connect_timeout=timedelta(seconds=10), use_async_quorum=bool(opts.get("async", True)),
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES if opts.get("mode") == "fixed" else WorldSizeMode.DYNAMIC,
        checkpoint_transport=transport, heal_on_training_thread=bool(opts.get("training_thread", False)),
        sdc_check=bool(opts.get("sdc", False)), sdc_check_every=int(opts.get("sdc_every", 0)),
    )
    m.register_sdc_params(list(model.parameters()))
    if fault.get("at") == "mid_transfer":  # the source dies after sending part of a heal's data
        served = m._transport
        pieces = served._pieces

        def dying(sv: Any, start: int, end: int, with_header: bool, *kind: Any) -> Any:
            it = pieces(sv, start, end, with_header, *kind)
            if with_header or not at("mid_transfer"):
                yield from it
                return
            first = next(it)
            yield first[: max(1, len(first) // 2)]
            _die()

        served._pieces = dying
    gen = torch.Generator().manual_seed(1000 + seed)
    history: list[list[int]] = []
    rounds: list[list[Any]] = []  # round_row() of every round
    failed_at: set[int] = set()  # steps failed on purpose (fail_every)
    failed: list[int] = []  # current_step() of the rounds that did not commit
    hashes: dict[str, str] = {}  # the parameters' hash at each of the last steps (Replicas.assert_identical)
    t0 = time.monotonic()
    rc = 0
    delay = float(opts.get("delay", 0.05))
    every = int(opts.get("fail_every", 0))


    try:
        while True:
            if os.path.exists(stop):
                target = int(Path(stop).read_text() or "1000000")
                if m.current_step() >= target:
                    break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            if at("before_quorum"):
                _die()
            m.start_quorum()
            x = torch.randn(8, 4, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            works = []
            for p in model.parameters():
                works.append(m.allreduce(p.grad))
                if at("mid_allreduce"):
                    _die()
            for w in works:
                w.wait()
            if every and m.current_step() % every == 0 and m.current_step() not in failed_at:
                failed_at.add(m.current_step())  # once per step: it heals to the next one
                m.report_error(RuntimeError(f"test: fail step {m.current_step()} (fail_every={every})"))
            if at("local_error") and not fault.get("done"):
                fault["done"] = True  # once: this group alone fails the step; its peers commit it
                m.report_error(RuntimeError("test: a local error after the step's collectives"))
            participants = m.num_participants()
            spare = not m.is_participating()
            if m.should_commit():
                if at("after_vote"):
                    _die()
                opt.step()
            else:
                failed.append(m.current_step())
            history.append([m.current_step(), participants, int(spare)])
            rounds.append(round_row(m))
            h = record_hash(hashes, m.current_step(), model)
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({
                "step": m.current_step(), "batches": m.batches_committed(), "hash": h,
                "history": history, "rounds": rounds, "hashes": hashes, "replica_id": m.replica_id,
                "heal_reused": getattr(getattr(m._transport, "receive_pool", None), "reused_bytes", 0), "failed": failed,
                "state_threads": sorted(state_threads), "train_thread": threading.current_thread().name,
            }))
            os.replace(tmp, out)
            time.sleep(delay)  # paces the replicas so they overlap; not a wait for an event
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    return rc


class PlainSGD:
    """SGD without momentum, written out: the optimizer interface the Manager's callers
    use (``zero_grad``, ``step``, ``state_dict``, ``load_state_dict``) and nothing else.

    Why not ``torch.optim.SGD`` everywhere: its ``step`` and ``state_dict`` import
    ``torch._dynamo`` (about 2 s of CPU per process here), and these workers are started
    some hundred times a suite on two cores. What these tests check (who commits, who
    heals from whom, identical state) does not depend on the optimizer; the tests whose
    point includes optimizer state pass ``optimizer="torch"``, and the DDP, FSDP,
    DiLoCo, supervisor and example tests train with ``torch.optim`` throughout."""

    def __init__(self, params: Any, lr: float) -> None:
        self.params, self.lr = list(params), lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.lr = float(sd["lr"])


class Replicas:
    """Starts worker processes, reads their progress, kills them all at teardown."""

    #: the worker script started by :meth:`start` (subclasses point it at their own)
    script: Path = HERE

    def __init__(self, tmp: Path, lighthouse: str, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.lighthouse = lighthouse
        self.env = env  # extra environment of every worker (RALLYPOINT_JOB, RALLYPOINT_TOKEN)
        self.procs: dict[str, zygote.Proc] = {}
        self.stop = tmp / "stop"

    def start(self, name: str, seed: int, **opts: Any) -> zygote.Proc:
        out = self.tmp / f"{name}.json"
        out.unlink(missing_ok=True)
        log = open(self.tmp / f"{name}.{len(self.procs)}.log", "w")
        p = zygote.popen(
            [sys.executable, str(self.script), self.lighthouse, name, str(seed), str(out), str(self.stop), json.dumps(opts)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env} if self.env else None,
        )
        log.close()
        self.procs[f"{name}#{p.pid}"] = p
        return p

    def progress(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.tmp / f"{name}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> float:
        """Poll ``cond`` (progress files have no event to await); seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if cond():
                return time.monotonic() - t0
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; logs:\n{self.logs()}")

    def wait_dead(self, p: zygote.Proc, timeout: float) -> int:
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {p.pid} still running after {timeout}s; logs:\n{self.logs()}") from None

    def step(self, name: str) -> int:
        p = self.progress(name)
        return p["step"] if p else -1

    def finish(self, target: int, timeout: float = 30.0) -> None:
        self.stop.write_text(str(target))
        deadline = time.monotonic() + timeout
        for key, p in self.procs.items():
            if p.poll() is None:
                try:
                    rc = p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{key} did not stop; logs:\n{self.logs()}") from None
                assert rc == 0, f"{key} exited {rc}; logs:\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(f"==== {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)

    def assert_identical(self, names: list[str], target: int, within: int = 2) -> None:
        """Every replica stopped at ``target`` with the same parameters.

        Replicas may end with different parameters only by the harness's own ending, never
        after committing one round together: each stops as soon as it reaches ``target``,
        so a replica that failed a round near the end (or whose last heal failed as its
        source stopped) is behind when its peers stop and, with ``min_replicas=1``, commits
        the last steps in quorums without them. Then every replica is compared at the last
        step all of them committed in one round whose quorum held them all; that step must
        be at most ``within`` steps before ``target``, their parameters equal there, and
        replicas that committed ``target`` in one round must be equal at ``target``."""
        prog = [self.progress(n) for n in names]
        assert all(p is not None for p in prog), self.logs()
        assert [p["step"] for p in prog] == [target] * len(names), (prog, self.logs())
        finals = [p["hash"] for p in prog]
        if len(set(finals)) == 1:
            assert len({p["batches"] for p in prog}) == 1, prog
            return
        full = len(names)
        tails = [(n, p["history"][-3:], p.get("rounds", [])[-3:], p.get("failed", [])[-3:])
                 for n, p in zip(names, prog)]
        why = f"the replicas' parameters differ at step {target}: {dict(zip(names, finals))}; last rounds {tails}"
        last: dict[tuple[Any, ...], list[int]] = {}  # the round each committed target in -> who did
        for i, p in enumerate(prog):
            if "rounds" in p:
                rows = [tuple(r[1:3]) for r in p["rounds"] if r[0] == target and r[3]]
            else:  # a worker without rounds: a last history row of the full quorum
                rows = [(None, full)] if p["history"] and p["history"][-1][:2] == [target, full] else []
            if rows:
                last.setdefault(rows[-1], []).append(i)
        for (qid, _), who in last.items():
            assert len({finals[i] for i in who}) == 1, \
                (f"{why}; {[names[i] for i in who]} committed step {target} in quorum {qid} together", self.logs())
        together = _together(prog, full)
        assert together >= target - within, (f"{why}; the last step all committed together is {together}", self.logs())
        at = [p.get("hashes", {}).get(str(together)) for p in prog]
        assert None not in at and len(set(at)) == 1, \
            (f"{why}; and at step {together}, the last they committed together: {dict(zip(names, at))}", self.logs())


if __name__ == "__main__":
    lh_addr, name_, seed_s, out_s, stop_s, opts_s = sys.argv[1:7]
    sys.exit(worker(lh_addr, name_, int(seed_s), out_s, stop_s, json.loads(opts_s)))
