"""The processes of ``bench/gpu.py`` (not part of the library).

- :func:`allreduce_rank`: one rank of the allreduce section; every implementation is
  configured side by side and measured round by round (interleaved), each op timed as
  ``allreduce`` + ``wait`` + ``torch.cuda.synchronize()`` (torchft's Baby NCCL ``wait``
  only orders the stream, so the synchronize makes every column a full round trip).
- :func:`heal_sender` / :func:`heal_receiver`: the two sides of the device heal, driven
  by the parent over a duplex pipe (one command, one answer); every answer is a dict,
  an ``"error"`` key when the command failed (the process keeps serving the others).

``device`` is ``"cuda"`` on a GPU machine; ``"cpu"`` runs the same code with Gloo in
place of NCCL and host tensors, so the harness itself is tested without a GPU.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
import traceback
from typing import Any, Callable

T = datetime.timedelta
TENSOR_BYTES = 4 << 20  # the heal's state: float32 tensors of 4 MiB


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _dev(device: str, index: int) -> Any:
    import torch

    return torch.device("cuda", index) if device == "cuda" else torch.device("cpu")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


# ----------------------------------------------------------------------- allreduce


class _Plain:
    """torch's own backend (NCCL or Gloo) used directly: the ceiling of the wrappers."""

    def __init__(self, backend: str, timeout_s: float) -> None:
        self.backend = backend
        self.timeout = T(seconds=timeout_s)
        self.b: Any = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None) -> None:
        import torch.distributed as dist

        hostport, _, prefix = store_addr.partition("/")
        host, _, port = hostport.rpartition(":")
        store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                                      timeout=self.timeout))
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.b = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.b = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)

    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        return self.b.allreduce(tensors, opts)

    def shutdown(self) -> None:
        b, self.b = self.b, None
        if b is not None and hasattr(b, "shutdown"):
            b.shutdown()


def make_group(impl: str, backend: str, timeout_s: float) -> Any:
    """A process group of ``impl`` (plain, ours, ours-baby, torchft, torchft-baby) for
    ``backend`` (nccl, gloo)."""
    t = T(seconds=timeout_s)
    if impl == "plain":
        return _Plain(backend, timeout_s)
    if impl.startswith("ours"):
        from rallypoint import process_groups as ours

        cls = {("ours", "nccl"): ours.ProcessGroupNCCL, ("ours-baby", "nccl"): ours.ProcessGroupBabyNCCL,
               ("ours", "gloo"): ours.ProcessGroupGloo, ("ours-baby", "gloo"): ours.ProcessGroupBabyGloo}[(impl, backend)]
        return cls(timeout=t)
    from torchft import process_group as theirs

    cls = {("torchft", "nccl"): theirs.ProcessGroupNCCL, ("torchft-baby", "nccl"): theirs.ProcessGroupBabyNCCL,
           ("torchft", "gloo"): theirs.ProcessGroupGloo, ("torchft-baby", "gloo"): theirs.ProcessGroupBabyGloo}[(impl, backend)]
    return cls(timeout=t)


def allreduce_rank(rank: int, port: int, cfg: dict[str, Any], conn: Any) -> None:
    """One rank: configure every implementation, check one result, measure; rank 0 sends
    ``{impl: {size: {"latency_ms", "rounds"}, "correct": bool} | {"error": str}}``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    device, world, backend = cfg["device"], cfg["world"], cfg["backend"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    dev = _dev(device, rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=T(seconds=cfg["timeout_s"]))
    out: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for i, impl in enumerate(cfg["impls"]):
        try:
            g = make_group(impl, backend, cfg["timeout_s"])
            g.configure(f"127.0.0.1:{port}/{cfg['run_id']}/{i}", f"replica{rank}", rank, world, quorum_id=1)
            groups[impl] = g
        except Exception as e:  # noqa: BLE001 - the row says so; the others still run
            out[impl] = {"error": f"configure: {_err(e)}"}
    # The ranks agree on the groups that configured everywhere (a group missing on one
    # rank would leave the other waiting in its collectives).
    store.set(f"{cfg['run_id']}/alive/{rank}", json.dumps(sorted(groups)))
    alive = set(groups)
    for r in range(world):
        alive &= set(json.loads(store.get(f"{cfg['run_id']}/alive/{r}").decode()))
    for impl in list(groups):
        if impl not in alive:
            out.setdefault(impl, {"error": "configure failed on another rank"})
            groups.pop(impl)

    def opts(op: Any = None) -> Any:
        o = AllreduceOptions()
        if op is not None:
            o.reduceOp = op
        return o

    def one(impl: str, t: Any) -> None:
        groups[impl].allreduce([t], opts()).wait()
        _sync(device)

    samples: dict[str, dict[str, list[float]]] = {impl: {} for impl in groups}
    for impl in list(groups):  # warm-up and one checked result per group
        try:
            t = torch.full((1024,), float(rank + 1), device=dev)
            groups[impl].allreduce([t], opts(ReduceOp.SUM)).wait()
            _sync(device)
            want = world * (world + 1) / 2
            out[impl] = {"correct": bool(float(t.min()) == want == float(t.max()))}
        except Exception as e:  # noqa: BLE001
            out[impl] = {"error": f"first allreduce: {_err(e)}"}
            groups.pop(impl)
    for label, nbytes in cfg["sizes"].items():
        # zeros: repeated SUMs of ones would overflow to inf (harmless, but not tidy)
        tensors = {impl: torch.zeros(nbytes // 4, device=dev) for impl in groups}
        for impl in list(groups):
            try:
                for _ in range(2):
                    one(impl, tensors[impl])
            except Exception as e:  # noqa: BLE001
                out[impl] = {"error": f"{label}: {_err(e)}"}
                groups.pop(impl)
        for _ in range(cfg["rounds"]):
            for impl in list(groups):
                try:
                    t0 = time.perf_counter()
                    for _ in range(cfg["iters"][label]):
                        one(impl, tensors[impl])
                    samples[impl].setdefault(label, []).append((time.perf_counter() - t0) / cfg["iters"][label])
                except Exception as e:  # noqa: BLE001
                    out[impl] = {"error": f"{label}: {_err(e)}"}
                    groups.pop(impl)
    for impl, per in samples.items():
        if impl in groups:
            for label, vals in per.items():
                out[impl][label] = {"latency_ms": statistics.median(vals) * 1e3, "rounds": len(vals)}
    for g in groups.values():
        try:
            g.shutdown()
        except Exception:  # noqa: BLE001
            pass
    if rank == 0:
        conn.send(out)
    conn.close()


# ----------------------------------------------------------------------- heal


def state_shapes(nbytes: int) -> dict[str, int]:
    """Names and element counts of the heal's state: ``nbytes`` of float32 tensors of
    4 MiB (the last one smaller)."""
    out: dict[str, int] = {}
    left, i = nbytes, 0
    while left > 0:
        out[f"layer{i}.weight"] = max(min(left, TENSOR_BYTES) // 4, 1)
        left -= TENSOR_BYTES
        i += 1
    return out


def make_state(nbytes: int, dev: Any, seed: int = 0) -> dict[str, Any]:
    """The heal's state on ``dev``: random values (see :func:`state_shapes`)."""
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    return {k: torch.randn(n, generator=g, device=dev) for k, n in state_shapes(nbytes).items()}


def checksum(sd: dict[str, Any]) -> float:
    """The sum of every value (float64), to check that a heal delivered the data."""
    return float(sum(float(v.double().sum()) for v in sd.values()))


def _numpy_stand_in() -> None:
    """torchft's PG receiver unpickles ``buf.cpu().numpy().tobytes()``: where numpy is
    missing (this repository's CPU venv), a minimal stand-in (one copy, as numpy's)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        import torch

        from rallypoint.transports._tensors import byte_view

        class _Bytes:
            def __init__(self, x: Any) -> None:
                self._x = x.contiguous()

            def tobytes(self) -> bytes:
                return bytes(byte_view(self._x))

        torch.Tensor.numpy = lambda self, *a, **k: _Bytes(self)  # type: ignore[method-assign]


def _pg(contender: str, backend: str, timeout: T) -> Any:
    impl = "ours" if contender.startswith("ours") else "torchft"
    return make_group(impl, backend, timeout.total_seconds())


def _pg_transport(contender: str, pg: Any, timeout: T, dev: Any, template: Any = None) -> Any:
    if contender.startswith("ours"):
        from rallypoint.transports.pg import PGTransport

        return PGTransport(pg, timeout, device=dev)
    from torchft.checkpointing.pg_transport import PGTransport as TorchftPG

    return TorchftPG(pg, timeout, dev, state_dict=(lambda: template) if template is not None else None)


def _loopback(url: str) -> str:
    """``url`` with its host replaced by 127.0.0.1: torchft advertises this machine's host
    name, which a machine without DNS for itself may not resolve (both sides are here)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"127.0.0.1{port}"))


def _serve(conn: Any, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer commands until ``stop`` (or the parent goes away)."""
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd.get("op") == "stop":
            conn.send({"ok": True})
            return
        try:
            conn.send(handlers[cmd["op"]](cmd))
        except Exception as e:  # noqa: BLE001 - reported, the process keeps serving
            conn.send({"error": _err(e), "trace": traceback.format_exc()[-1500:]})


def heal_sender(conn: Any, cfg: dict[str, Any]) -> None:
    """Rank 0 of the heal: holds the state on ``cfg["sender_index"]`` and serves it."""
    import torch

    device = cfg["device"]
    if device == "cuda":
        torch.cuda.set_device(cfg["sender_index"])
    dev = _dev(device, cfg["sender_index"])
    timeout = T(seconds=cfg["timeout_s"])
    sd = make_state(cfg["heal_bytes"], dev)
    _sync(device)
    http: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for c in cfg["contenders"]:
        try:
            if c == "ours-http":
                from rallypoint.transports.http import HTTPTransport

                http[c] = HTTPTransport(timeout, bind="127.0.0.1:0", advertise_host="127.0.0.1")
            elif c == "torchft-http":
                from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

                http[c] = TorchftHTTP(timeout, num_chunks=0)
        except Exception as e:  # noqa: BLE001
            errors[c] = _err(e)
    pgs: dict[str, Any] = {}

    def serve(cmd: dict[str, Any]) -> dict[str, Any]:
        http[cmd["contender"]].send_checkpoint([1], cmd["step"], sd, timeout)
        return {"ok": True}

    def pg_setup(cmd: dict[str, Any]) -> dict[str, Any]:
        c = cmd["contender"]
        pg = _pg(c, cfg["pg_backend"], timeout)
        pg.configure(cmd["addr"], "heal_sender", 0, 2, quorum_id=1)
        pgs[c] = (pg, _pg_transport(c, pg, timeout, dev if cfg["pg_backend"] == "nccl" else torch.device("cpu")))
        return {"ok": True}

    def pg_send(cmd: dict[str, Any]) -> dict[str, Any]:
        pgs[cmd["contender"]][1].send_checkpoint([1], cmd["step"], sd, timeout)
        _sync(device)
        return {"ok": True}

    conn.send({"ready": True, "sum": checksum(sd), "errors": errors,
               "addrs": {c: _loopback(t.metadata()) for c, t in http.items()}})
    try:
        _serve(conn, {"serve": serve, "pg_setup": pg_setup, "pg_send": pg_send})
    finally:
        for t in http.values():
            try:
                t.shutdown()
            except Exception:  # noqa: BLE001
                pass
        for pg, _ in pgs.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass


def heal_receiver(conn: Any, cfg: dict[str, Any]) -> None:
    """Rank 1 of the heal: receives into its own state of the same shapes on
    ``cfg["receiver_index"]`` (a healing replica's real situation) and measures the
    memcpy ceiling."""
    import torch

    device = cfg["device"]
    if device == "cuda":
        torch.cuda.set_device(cfg["receiver_index"])
    dev = _dev(device, cfg["receiver_index"])
    timeout = T(seconds=cfg["timeout_s"])
    template = {k: torch.zeros(n, device=dev) for k, n in state_shapes(cfg["heal_bytes"]).items()}
    rx: dict[str, Any] = {}
    pgs: dict[str, Any] = {}

    def done() -> dict[str, Any]:
        _sync(device)
        s = checksum(template)
        for v in template.values():
            v.zero_()
        _sync(device)
        return {"ok": True, "sum": s}

    def into_template(got: Any) -> None:
        for k, v in got.items():
            if v is not template[k] and v.data_ptr() != template[k].data_ptr():
                template[k].copy_(v, non_blocking=True)

    def fetch(cmd: dict[str, Any]) -> dict[str, Any]:
        c = cmd["contender"]
        if c == "ours-http":
            if c not in rx:
                from rallypoint.transports.http import HTTPTransport

                rx[c] = HTTPTransport(timeout, bind="127.0.0.1:0")
            rx[c].recv_checkpoint(0, cmd["addr"], cmd["step"], timeout, into=template, in_place=True)
        else:
            if c not in rx:
                from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

                rx[c] = TorchftHTTP(timeout, num_chunks=0)
            into_template(rx[c].recv_checkpoint(0, cmd["addr"], cmd["step"], timeout))
        return done()

    def pg_setup(cmd: dict[str, Any]) -> dict[str, Any]:
        c = cmd["contender"]
        if c.startswith("torchft"):
            _numpy_stand_in()
        pg = _pg(c, cfg["pg_backend"], timeout)
        pg.configure(cmd["addr"], "heal_receiver", 1, 2, quorum_id=1)
        pg_dev = dev if cfg["pg_backend"] == "nccl" else torch.device("cpu")
        pgs[c] = (pg, _pg_transport(c, pg, timeout, pg_dev, template))
        return {"ok": True}

    def pg_recv(cmd: dict[str, Any]) -> dict[str, Any]:
        c = cmd["contender"]
        tr = pgs[c][1]
        if c.startswith("ours"):
            into_template(tr.recv_checkpoint(0, "<pg>", cmd["step"], timeout, into=template, in_place=True))
        else:
            into_template(tr.recv_checkpoint(0, "<n/a>", cmd["step"], timeout))
        return done()

    def memcpy(cmd: dict[str, Any]) -> dict[str, Any]:
        return memcpy_ceiling(device, cfg["heal_bytes"], cfg["receiver_index"], cfg.get("peer_index"), cmd["rounds"])

    conn.send({"ready": True})
    try:
        _serve(conn, {"fetch": fetch, "pg_setup": pg_setup, "pg_recv": pg_recv, "memcpy": memcpy})
    finally:
        for t in rx.values():
            try:
                t.shutdown()
            except Exception:  # noqa: BLE001
                pass
        for pg, _ in pgs.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass


def memcpy_ceiling(device: str, nbytes: int, index: int, peer: int | None, rounds: int) -> dict[str, Any]:
    """Median seconds of one device-to-host copy of ``nbytes`` into pinned memory and one
    host-to-device copy back (``d2h_s``, ``h2d_s``; their sum ``heal_s`` is the least a
    heal through host memory can take), and, with a ``peer`` device, of one copy from
    the peer to this device (``peer_s``). On ``cpu``: plain host memcpy."""
    import torch

    dev = _dev(device, index)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(device == "cuda"))
    back = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2h, h2d, p2p = [], [], []
    for _ in range(rounds + 1):  # the first is a warm-up
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(device)
        t1 = time.perf_counter()
        back.copy_(host, non_blocking=True)
        _sync(device)
        d2h.append(t1 - t0)
        h2d.append(time.perf_counter() - t1)
    ok = bool(torch.equal(back[:1024].cpu(), src[:1024].cpu()))
    out: dict[str, Any] = {"d2h_s": statistics.median(d2h[1:]), "h2d_s": statistics.median(h2d[1:]), "correct": ok}
    out["heal_s"] = out["d2h_s"] + out["h2d_s"]
    if device == "cuda" and peer is not None and peer != index:
        other = torch.ones(nbytes, dtype=torch.uint8, device=torch.device("cuda", peer))
        for _ in range(rounds + 1):
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(index)
            t0 = time.perf_counter()
            back.copy_(other)
            torch.cuda.synchronize(peer)
            torch.cuda.synchronize(index)
            p2p.append(time.perf_counter() - t0)
        out["peer_s"] = statistics.median(p2p[1:])
    return out
