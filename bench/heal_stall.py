"""What serving a heal costs the sender's training thread: step time with and without a peer healing from it.

Goal (from the transport issue): the sender's training thread loses <= 50 ms per GB served.

One sender process per contender holds a state of ``--gb`` GB (GB = 2**30 bytes) as float32
``nn.Parameter``s of 3 MiB (a plain list) with ``torch.optim.SGD`` over them (lr 1e-4; every
parameter has a pre-allocated gradient of ones, set once, so every step changes every
parameter) and runs a training loop on its main thread shaped like the Manager's step:

1. heal step only: a "quorum thread" (a separate thread, as the Manager's quorum runs) calls
   ``transport.send_checkpoint([1], step, state, timeout)`` with
   ``state = {"params": {str(i): p.detach()}, "optim": opt.state_dict()}``;
2. fixed compute standing in for forward/backward: ``--compute-ms`` of 512x512 matmuls, as a
   count of matmuls calibrated once by the parent before any child starts (every step of
   every contender does the same work; CPU work, not a sleep); ``--compute wait``: a sleep
   of ``--compute-ms`` instead, as a step whose forward/backward runs on a GPU while the
   CPUs are free (a CPU-resident state served live: CPU-offloaded optimizer state, say);
3. the main thread joins the quorum thread (``Manager.allreduce`` waits for the quorum
   future), then ``transport.disallow_checkpoint()`` (what ``Manager.should_commit`` does
   before the optimizer may step; called every step, a no-op when nothing is served);
4. ``opt.step()``.

A receiver process per contender fetches the whole state with the contender's receive call
when the heal step starts (the sender prints a line, the parent relays it). Once the
sender's heal and after steps are over, the parent asks the receiver for a checksum per
parameter (the int64 sum of its bits viewed as int32; computed then, so that reading 1 GB
does not compete with the sender's compute for memory bandwidth). The sender computes the
same checksums between the step before and the heal step (untimed): the received state
must equal the state AS OF THE HEAL STEP, before that step's optimizer update. Receivers
keep their freed heap (``_sockets.keep_freed_heap``), so their page faults stay
out of the measured steps after the warm-up heal.

Contenders (in one run): ``rp_live`` = rallypoint ``HTTPTransport(timeout, 4,
bind="127.0.0.1:0", serve="live")`` (its defaults), ``rp_precopy`` = the same with
``precopy=True`` (a background copy ahead of the freeze), ``rp_copy`` = the same with
``serve="copy"``, ``rp_meet`` = ``rp_live`` with the freeze as it was before it could
wait for the receivers (it copies back to front until it meets their delivery, always),
``torchft`` = torchft 0.2.0's ``HTTPTransport(timeout, num_chunks=0)`` (its Manager's
default; it serves the caller's tensors, and ``disallow_checkpoint`` waits for the transfer
in flight), ``socket`` = the floor: the parameters' bytes over a plain socket, served live
from their memory by a thread, ``disallow_checkpoint`` waiting for the transfer (what any
transfer of this size costs this machine's training thread). Receivers:
``HTTPTransport(...).recv_checkpoint(src_rank=0, metadata=url, step=step, timeout=...)``
(fresh tensors), torchft's ``recv_checkpoint(0, metadata, step, timeout)``, and
``recv_into`` fresh tensors. A rallypoint without ``serve=`` gets ``copy_on_send`` (copy:
True, live: False), named in the output.

Per heal: ``--baseline-steps`` steps (their median is the baseline), the heal step, then
``--after-steps`` steps (work a transport defers, e.g. dropping or still serving copies,
shows there). Lost = (heal step - baseline) + the after-steps' excess over the baseline;
ms/GB = lost / GB served; medians over ``--heals`` heals, after one warm-up heal per
contender (reported as "1st heal": the receiver's first 1 GB of page faults, ~3 s here,
falls into it). Contenders take turns heal by heal, order reversed every other round, so
a shared machine's load hits them alike. When the processes would not fit in memory
together (3 bytes per byte of state per contender + a copy, against 80 % of
MemAvailable: above ``--gb`` 1 on a 24 GiB box), the contenders run one after another.

What this does not model: in a Manager whose healing peer joins the sender's allreduce in
the heal step, that collective already holds the sender until the peer has its state
(its quorum thread fetches before its allreduce may run); here nothing but the transport
orders the two, as for a sender whose collective does not include the peer.

Layout (``--layout``): ``split`` (default where there are >= 2 CPUs): the training thread
alone on the first CPU with 1 torch thread, everything else (the transport's threads, the
quorum thread, the receiver process, standing in for the remote peer) on the others, as on
a real box where the training thread has its core; ``shared``: no pinning, torch's default
threads (on a 2-core box the receiver and the serving threads then take CPU from the
compute). Either way the receiver shares the machine's memory bandwidth and caches with
the sender: a memcpy loop on the other core slows this compute's matmuls 1.9x here.

    python bench/heal_stall.py [--gb 1] [--compute-ms 300] [--heals 3] [--contenders rp_live,rp_copy,torchft,socket]
                               [--layout split|shared] [--matmul-size 512] [--out FILE]

Prints a table, the goals line and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _sockets import keep_freed_heap  # noqa: E402
from _util import Child, close_all, median, table  # noqa: E402

CONTENDERS = ("rp_live", "rp_meet", "rp_precopy", "rp_copy", "torchft", "socket")
TENSOR_NUMEL = 3 * 1024 * 1024 // 4  # 3 MiB of float32
LR = 1e-4
GOAL_MS_PER_GB = 50.0
MM = 512  # the compute's matmul size (--matmul-size)


def n_tensors(gb: float) -> int:
    return max(1, round(gb * (1 << 30) / (TENSOR_NUMEL * 4)))


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _cpus(layout: str) -> tuple[set[int], set[int]] | None:
    """(training CPU, everything else) for the split layout; None: no pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if layout != "split" or len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def _matmul_kernel(threads: int | None, mm: int = MM) -> Any:
    import torch

    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(mm, mm, generator=g), torch.randn(mm, mm, generator=g)
    c = torch.empty(mm, mm)

    def run(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b, out=c)

    return run


def calibrate(compute_ms: float, layout: str, mm: int) -> int:
    """Matmuls per step for ``compute_ms``, measured here (before any child starts) with
    the training thread's pinning and thread count; the parent's affinity is restored."""
    pins = _cpus(layout)
    before = os.sched_getaffinity(0)
    if pins:
        os.sched_setaffinity(0, pins[0])
    try:
        run = _matmul_kernel(1 if pins else None, mm)
        k = max(1, round(20 * (MM / mm) ** 3))
        run(k)
        per = []
        for _ in range(10):
            t0 = time.perf_counter()
            run(k)
            per.append((time.perf_counter() - t0) / k)
        return max(1, round(compute_ms / 1000 / min(per)))  # min: the machine's speed, not a moment's load
    finally:
        os.sched_setaffinity(0, before)


# ---------------------------------------------------------------------- sender
class SocketServe:
    """The ``socket`` floor's sender: the parameters' bytes over plain sockets, served
    live from their own memory (no copy, no checksums) by a thread per connection;
    ``disallow_checkpoint`` waits for the transfer in flight (as torchft's does). A
    receiver sends the step (``!Q``) and gets every parameter's bytes in order."""

    def __init__(self, timeout_s: float) -> None:
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._timeout = timeout_s
        self._cv = threading.Condition()
        self._views: list[memoryview] | None = None
        self._step = -1
        self._active = 0
        threading.Thread(target=self._accept, name="socket-accept", daemon=True).start()

    def metadata(self) -> str:
        _, port = self._lsock.getsockname()
        return str(port)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state: Any, timeout: timedelta) -> None:
        from rallypoint.transports._tensors import byte_view

        ps = state["params"]
        with self._cv:
            self._views, self._step = [byte_view(ps[k]) for k in sorted(ps, key=int)], step
            self._cv.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cv:
            self._views = None
            if not self._cv.wait_for(lambda: self._active == 0, self._timeout):
                raise TimeoutError("a socket transfer still runs after the timeout")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._timeout)
            want = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))[0]
            with self._cv:
                if not self._cv.wait_for(lambda: self._views is not None and self._step == want, self._timeout):
                    return
                views, self._active = self._views, self._active + 1
            try:
                for v in views or []:
                    conn.sendall(v)
            except OSError:
                pass
            finally:
                with self._cv:
                    self._active -= 1
                    self._cv.notify_all()

    def shutdown(self) -> None:
        self._lsock.close()


def socket_recv(port: int, step: int, n: int, timeout_s: float) -> dict[str, Any]:
    """The ``socket`` floor's receiver: fresh tensors as our fresh receiver allocates them."""
    import torch

    from rallypoint.transports._tensors import advise_huge_pages, byte_view

    dest = [torch.empty(TENSOR_NUMEL) for _ in range(n)]
    for t in dest:
        advise_huge_pages(t)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(struct.pack("!Q", step))
        for t in dest:
            view, got = byte_view(t), 0
            while got < len(view):
                k = s.recv_into(view[got:])
                if not k:
                    raise RuntimeError(f"socket closed after {got} of {len(view)} bytes")
                got += k
    # no optimizer state travels here; the checksums of the parameters are what is checked
    return {"params": {str(i): t for i, t in enumerate(dest)}, "optim": {"param_groups": [{"lr": LR}]}}


def make_transport(contender: str, timeout: timedelta) -> tuple[Any, str]:
    if contender == "socket":
        return SocketServe(timeout.total_seconds()), "plain sockets, served live, disallow waits (the floor)"
    if contender == "torchft":
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        return TorchftHTTP(timeout, num_chunks=0), "torchft num_chunks=0"
    from rallypoint.transports.http import HTTPTransport

    mode = {"rp_live": "live", "rp_meet": "live", "rp_precopy": "live", "rp_copy": "copy"}[contender]
    params = inspect.signature(HTTPTransport).parameters
    if contender == "rp_meet":
        # The freeze as it was before it could wait for the receivers: it always copies
        # back to front until it meets their delivery (never weighs waiting instead).
        from rallypoint.transports import _live

        if hasattr(_live, "MEASURE_S"):
            _live.MEASURE_S = float("inf")
        return HTTPTransport(timeout, 4, bind="127.0.0.1:0", serve=mode), "serve='live', the freeze never waits"
    if contender == "rp_precopy" and "precopy" in params:
        return HTTPTransport(timeout, 4, bind="127.0.0.1:0", serve=mode, precopy=True), \
            "serve='live', precopy=True"
    if "serve" in params:
        return HTTPTransport(timeout, 4, bind="127.0.0.1:0", serve=mode), f"serve={mode!r}"
    # Before HTTPTransport had serve=: its copy_on_send (copy: True, live: False).
    return HTTPTransport(timeout, 4, bind="127.0.0.1:0", copy_on_send=(mode == "copy")), \
        f"copy_on_send={mode == 'copy'} (no serve= yet)"


def checksums(tensors: list[Any]) -> list[int]:
    import torch

    return [int(t.detach().view(torch.int32).sum(dtype=torch.int64)) for t in tensors]


def _where(e: BaseException) -> str:
    """Where an error was raised (its innermost frame), so a failing transport call is
    reported with its place, not only its message."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def run_sender(cfg: dict[str, Any]) -> None:
    _util.exit_with_parent()
    pins = _cpus(cfg["layout"])
    import torch
    from torch import nn

    timeout = timedelta(seconds=cfg["timeout"])
    base = torch.randn(TENSOR_NUMEL, generator=torch.Generator().manual_seed(0))
    params = [nn.Parameter(base + i * 1e-3) for i in range(n_tensors(cfg["gb"]))]  # distinct, and cheap to make
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=LR)
    if pins:
        os.sched_setaffinity(0, pins[1])  # threads started from here on (the transport's) inherit this
    transport, spelled = make_transport(cfg["contender"], timeout)
    if pins:
        os.sched_setaffinity(0, pins[0])  # the training thread alone on its CPU
    if cfg.get("compute") == "wait":
        compute = lambda _n: time.sleep(cfg["compute_ms"] / 1000)  # noqa: E731 - the GPU computes
    else:
        compute = _matmul_kernel(1 if pins else None, cfg["mm"])
    step_no = 0

    def step(heal: bool) -> dict[str, Any]:
        nonlocal step_no
        step_no += 1
        box: dict[str, Any] = {}
        r0, m0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        t0 = time.perf_counter()
        quorum = None
        if heal:

            def quorum_thread() -> None:
                if pins:
                    os.sched_setaffinity(0, pins[1])
                q0 = time.perf_counter()
                try:
                    state = {"params": {str(i): p.detach() for i, p in enumerate(params)}, "optim": opt.state_dict()}
                    transport.send_checkpoint([1], step_no, state, timeout)
                except BaseException as e:  # noqa: BLE001 - reported
                    box["err"] = f"send_checkpoint: {type(e).__name__}: {e}{_where(e)}"
                box["send_s"] = time.perf_counter() - q0

            quorum = threading.Thread(target=quorum_thread, name="quorum", daemon=True)
            quorum.start()
        compute(cfg["matmuls"])
        t1 = time.perf_counter()
        if quorum is not None:
            quorum.join(cfg["timeout"])
            if quorum.is_alive():
                raise SystemExit("the quorum thread's send_checkpoint did not return within the timeout")
        t2 = time.perf_counter()
        try:
            transport.disallow_checkpoint()
        except Exception as e:  # noqa: BLE001 - reported (a torchft lock timeout, say)
            box["err"] = f"disallow_checkpoint: {type(e).__name__}: {e}{_where(e)}"
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        r1, m1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
        others = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime - (m1 - m0)  # CPU of the other threads
        return {"t": t4 - t0, "compute": t1 - t0, "join": t2 - t1, "disallow": t3 - t2, "opt": t4 - t3,
                "others_cpu": others, **box}

    for _ in range(cfg["warmup_steps"]):
        step(False)
    _out({"ready": True, "addr": transport.metadata(), "transport": spelled, "tensors": len(params),
          "bytes": sum(p.numel() * 4 for p in params)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") != "heal":
            break
        before = [step(False) for _ in range(cmd["before"])]
        sums = checksums(params)  # the state the heal step must serve (untimed: between steps)
        _out({"heal": step_no + 1, "sums": sums})
        healed = step(True)
        after = [step(False) for _ in range(cmd["after"])]
        _out({"before": before, "heal_step": healed, "after": after})
    try:
        transport.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


# ---------------------------------------------------------------------- receiver
def run_receiver(cfg: dict[str, Any]) -> None:
    _util.exit_with_parent()
    pins = _cpus(cfg["layout"])
    if pins:
        os.sched_setaffinity(0, pins[1])
    import torch  # noqa: F401

    keep_freed_heap()  # every receiver: its page faults (a CPU's worth of work here) stay out of the window
    timeout = timedelta(seconds=cfg["timeout"])
    if cfg["contender"] == "torchft":
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        tf: Any = TorchftHTTP(timeout, num_chunks=0)
        fetch = lambda addr, step: tf.recv_checkpoint(0, addr, step, timeout)  # noqa: E731
    elif cfg["contender"] == "socket":
        tf = None
        fetch = lambda addr, step: socket_recv(int(addr), step, n_tensors(cfg["gb"]), cfg["timeout"])  # noqa: E731
    else:
        from rallypoint.transports.http import HTTPTransport

        tf = HTTPTransport(timeout, bind="127.0.0.1:0")
        fetch = lambda addr, step: tf.recv_checkpoint(src_rank=0, metadata=addr, step=step, timeout=timeout)  # noqa: E731
    _out({"ready": True})
    sd: Any = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if "sums" in cmd:  # asked once the sender's heal and after steps are over: out of the window
            if sd is None:
                _out({"sums": None})
                continue
            ps = sd["params"]
            sums = checksums([ps[k] for k in sorted(ps, key=int)])
            optim_ok = sd["optim"]["param_groups"][0]["lr"] == LR
            sd = ps = None
            gc.collect()
            _out({"sums": sums, "optim_ok": optim_ok})
            continue
        if "fetch" not in cmd:
            break
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        try:
            sd = fetch(cmd["addr"], cmd["fetch"])
        except Exception as e:  # noqa: BLE001 - reported
            sd = None
            _out({"t": time.perf_counter() - t0, "err": f"{type(e).__name__}: {e}"[:500]})
            continue
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        _out({"t": dt, "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
              "minflt": r1.ru_minflt - r0.ru_minflt})
    if tf is not None:
        tf.shutdown()


# ---------------------------------------------------------------------- parent
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _start(contender: str, cfg: dict[str, Any], env: dict[str, str]) -> tuple[Child, Child]:
    c = dict(cfg, contender=contender)
    s = Child([sys.executable, __file__, "--role", "sender", "--cfg", json.dumps(c)], f"heal-{contender}-send", env)
    r = Child([sys.executable, __file__, "--role", "receiver", "--cfg", json.dumps(c)], f"heal-{contender}-recv", env)
    return s, r


def _heal(c: str, s: Child, r: Child, addr: str, a: argparse.Namespace) -> dict[str, Any]:
    s.send({"cmd": "heal", "before": a.baseline_steps, "after": a.after_steps})
    mark = s.recv(a.timeout + 60)
    r.send({"fetch": mark["heal"], "addr": addr})
    steps = s.recv(a.timeout * 2 + 60)
    got = r.recv(a.timeout + 60)
    r.send({"sums": True})  # the receiver checksums what it got now, with the sender idle
    got.update({k: v for k, v in r.recv(a.timeout + 60).items() if v is not None})
    base = median([x["t"] for x in steps["before"]])
    h = steps["heal_step"]
    delta = h["t"] - base
    after = sum(x["t"] - base for x in steps["after"])
    bad = None if "sums" not in got else sum(x != y for x, y in zip(mark["sums"], got["sums"]))
    ok = bad == 0 and len(got["sums"]) == len(mark["sums"]) and got.get("optim_ok") is True
    return {"base_ms": base * 1e3, "heal_ms": h["t"] * 1e3, "delta_ms": delta * 1e3, "after_ms": after * 1e3,
            "lost_ms": (delta + after) * 1e3, "compute_ms": h["compute"] * 1e3,
            "base_compute_ms": median([x["compute"] for x in steps["before"]]) * 1e3, "send_ms": h.get("send_s", float("nan")) * 1e3,
            "join_ms": h["join"] * 1e3, "disallow_ms": h["disallow"] * 1e3, "opt_ms": h["opt"] * 1e3,
            "base_opt_ms": median([x["opt"] for x in steps["before"]]) * 1e3,
            "send_cpu_s": h["others_cpu"] + sum(x["others_cpu"] for x in steps["after"]),
            "recv_cpu_s": got.get("cpu", float("nan")), "recv_faults": got.get("minflt", -1),
            "fetch_s": got["t"], "correct": ok, "bad_tensors": bad,
            "err": h.get("err") or got.get("err")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB (2**30 bytes)")
    ap.add_argument("--compute-ms", type=float, default=300.0)
    ap.add_argument("--matmul-size", type=int, default=MM,
                    help="n of the compute's n x n matmuls (larger: fewer, longer ops: fewer GIL hand-offs)")
    ap.add_argument("--heals", type=int, default=3, help="measured heals per contender (after one warm-up heal)")
    ap.add_argument("--baseline-steps", type=int, default=4)
    ap.add_argument("--after-steps", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "rp_meet"))
    ap.add_argument("--layout", choices=["split", "shared"], default="split")
    ap.add_argument("--compute", choices=["cpu", "wait"], default="cpu",
                    help="cpu: matmuls on the training thread; wait: it sleeps --compute-ms, as a step whose "
                         "forward/backward runs on a GPU (the CPUs are free meanwhile; no pinning)")
    ap.add_argument("--timeout", type=float, default=120.0, help="the transports' timeout, s")
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        return (run_sender if a.role == "sender" else run_receiver)(json.loads(a.cfg))
    contenders = [c for c in a.contenders.split(",") if c]
    if any(c not in CONTENDERS for c in contenders):
        ap.error(f"contenders are {CONTENDERS}")
    env = dict(os.environ)
    _util.clear_job_env(env)  # clear text, whatever this shell's job settings say
    if a.compute == "wait":
        a.layout = "shared"  # a GPU step leaves every CPU to the transport's threads
    matmuls = calibrate(a.compute_ms, a.layout, a.matmul_size) if a.compute == "cpu" else 0
    cfg = {"gb": a.gb, "matmuls": matmuls, "mm": a.matmul_size, "layout": a.layout if _cpus(a.layout) else "shared",
           "timeout": a.timeout, "warmup_steps": a.warmup_steps, "compute": a.compute, "compute_ms": a.compute_ms}
    load0 = os.getloadavg()[0]
    what = (f"{matmuls} matmuls {a.matmul_size}x{a.matmul_size}" if a.compute == "cpu"
            else "a wait (GPU-like: the CPUs are free)")
    print(f"heal_stall: {a.gb:g} GB, {n_tensors(a.gb)} tensors, compute {a.compute_ms:g} ms = {what}, layout {cfg['layout']}, {a.heals} heals + 1 warm-up per contender, "
          f"load {load0:.2f}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    info: dict[str, dict[str, Any]] = {}
    # Memory: per contender the sender's parameters and gradients (2x the state) and the
    # receiver's state (it keeps its freed heap), plus rp_copy's copy; together if that fits.
    together = a.gb * (1 << 30) * (3 * len(contenders) + 1) < 0.8 * _mem_available()
    groups = [contenders] if together else [[c] for c in contenders]
    for group in groups:
        procs: dict[str, tuple[Child, Child]] = {}
        try:
            for c in group:
                procs[c] = _start(c, cfg, env)
            t0 = time.monotonic()
            for c in group:
                info[c] = procs[c][0].recv(600)
                procs[c][1].recv(600)
            print(f"  {', '.join(group)}: senders and receivers ready in {time.monotonic() - t0:.1f} s", flush=True)
            for rnd in range(a.heals + 1):  # round 0: the warm-up heal
                for c in (group if rnd % 2 == 0 else group[::-1]):
                    res = _heal(c, *procs[c], info[c]["addr"], a)
                    res["warmup"] = rnd == 0
                    runs[c].append(res)
                    if res["err"]:
                        print(f"  {c} heal {rnd}: {res['err']}", flush=True)
        finally:
            close_all(x for pair in procs.values() for x in pair)
    cfg["load"] = [load0, os.getloadavg()[0]]
    _report(a, cfg, contenders, runs, info)


def _report(a: argparse.Namespace, cfg: dict[str, Any], contenders: list[str], runs: dict[str, list[dict[str, Any]]],
            info: dict[str, dict[str, Any]]) -> None:
    results: dict[str, Any] = {}
    rows = []
    keys = ("base_ms", "heal_ms", "delta_ms", "after_ms", "lost_ms", "compute_ms", "base_compute_ms", "send_ms",
            "join_ms", "disallow_ms", "opt_ms", "base_opt_ms", "send_cpu_s", "recv_cpu_s", "recv_faults", "fetch_s")
    for c in contenders:
        meas = [x for x in runs[c] if not x["warmup"]]
        gb = info[c]["bytes"] / (1 << 30)
        m = {k: median([x[k] for x in meas]) for k in keys}
        first = runs[c][0]
        results[c] = {**m, "ms_per_gb": m["lost_ms"] / gb, "gb_served": gb, "transport": info[c]["transport"],
                      "first_heal_lost_ms": first["lost_ms"], "correct": sum(x["correct"] for x in runs[c]),
                      "heals": len(runs[c]), "per_heal": runs[c]}
        rows.append([c, f"{m['base_ms']:.0f}", f"{m['heal_ms']:.0f}", f"{m['lost_ms']:+.0f}", f"{m['lost_ms'] / gb:+.0f}",
                     f"{first['lost_ms']:+.0f}", f"{m['compute_ms'] - m['base_compute_ms']:+.0f}",
                     f"{m['join_ms']:.0f}", f"{m['disallow_ms']:.0f}", f"{m['opt_ms'] - m['base_opt_ms']:+.0f}",
                     f"{m['after_ms']:+.0f}", f"{m['send_ms']:.0f}", f"{m['send_cpu_s']:.2f}", f"{m['recv_cpu_s']:.2f}",
                     f"{m['fetch_s']:.2f}", f"{results[c]['correct']}/{len(runs[c])}"])
    print(f"load average {cfg['load'][0]:.2f} -> {cfg['load'][1]:.2f}")
    print(table(["contender", "base ms", "heal ms", "lost ms", "ms/GB", "1st heal", "Δcompute", "join", "disallow",
                 "Δopt", "Δafter", "send ms", "serve CPU s", "recv CPU s", "fetch s", "correct"], rows))
    print("  lost = heal step - baseline + the after-steps' excess = Δcompute + join + disallow + Δopt + Δafter "
          "(medians, so the parts need not add up); send ms: send_checkpoint on the quorum thread; serve CPU: the "
          "sender's threads but the training thread in the heal and after steps (with --layout shared also torch's "
          "compute threads); 1st heal: the warm-up heal's lost ms")
    for c in contenders:
        print(f"  {c}: {info[c]['transport']}; per heal (warm-up first) lost ms "
              + ", ".join(f"{x['lost_ms']:+.0f}" for x in runs[c]) + "; compute/join/disallow/opt ms "
              + ", ".join(f"{x['compute_ms']:.0f}/{x['join_ms']:.0f}/{x['disallow_ms']:.0f}/{x['opt_ms']:.0f}"
                          for x in runs[c]) + f" (baseline {results[c]['base_compute_ms']:.0f}/0/0/"
              f"{results[c]['base_opt_ms']:.0f}); receiver faults " + ", ".join(str(x["recv_faults"]) for x in runs[c]))
    ratios: dict[str, Any] = {f"{c}_ms_per_gb": results[c]["ms_per_gb"] for c in contenders}
    if "rp_live" in results and "torchft" in results:
        ratios["live_vs_torchft"] = _util.ratio(results["torchft"]["lost_ms"], results["rp_live"]["lost_ms"])
    if "rp_copy" in results and "torchft" in results:
        ratios["copy_vs_torchft"] = _util.ratio(results["torchft"]["lost_ms"], results["rp_copy"]["lost_ms"])
    live = results.get("rp_live", {}).get("ms_per_gb")
    print(f"goal: the sender's training thread loses <= {GOAL_MS_PER_GB:g} ms per GB served (rp_live, lost = Δheal "
          f"+ Δafter, median of {a.heals}): " + ("-" if live is None else
                                               f"{live:+.0f} ms/GB {'met' if live <= GOAL_MS_PER_GB else 'NOT met'}"))
    print("ratios: " + ", ".join(f"{k} {_util.fmt_ratio(v)}" for k, v in ratios.items()))
    goals = {"rp_live_ms_per_gb_le_50": _util.goal_met(live, live is not None and live <= GOAL_MS_PER_GB),
             "rp_live_correct": _util.goal_met(live, results.get("rp_live", {}).get("correct")
                                                == results.get("rp_live", {}).get("heals"))}
    plan = {"gb": a.gb, "compute_ms": a.compute_ms, "compute": a.compute, "matmuls": cfg["matmuls"], "matmul_size": a.matmul_size, "layout": cfg["layout"],
            "heals": a.heals, "baseline_steps": a.baseline_steps, "after_steps": a.after_steps,
            "torchft": _util.torchft_version(), "load_start_end": cfg["load"]}
    _util.report_goals("heal_stall", plan, results, goals, ratios, a.out)


if __name__ == "__main__":
    main()
