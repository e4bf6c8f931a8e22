"""PGTransport on real processes (the shared pool of 3 spawned workers, a TCPStore on a
free port): a nested state dict from rank 0 to ranks 1 and 2 in one call (Gloo and
BabyGloo); in-place receive keeps the template's storage; a wrong step is a clear error
on both sides and leaves the group usable; a sender SIGKILLed mid-transfer makes the
receiver raise within the timeout with its state unchanged; 4,000 tiny tensors arrive
in one data message. Every wait has a deadline; killed workers are killed by pid and
respawned by the pool."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch

from rallypoint.transports.pg import DIRECT_BYTES, PACK_BYTES, plan_messages
from test_process_groups_util import (
    STATE,
    WorkerPool,
    master_store,
    new_prefix,
    report,
    shared_pool,
    w_configure,
    w_shutdown,
)

TIMEOUT_S = 10.0


# --------------------------------------------------------------------- worker side


def make_state(case: str) -> Any:
    g = torch.Generator().manual_seed(1234)
    if case == "tiny4000":
        return {f"p{i}": torch.randn(16, generator=g) for i in range(4000)}
    if case == "big":  # 48 MiB in 1 MiB tensors: long enough to kill the sender mid-way
        return {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(48)}
    return {
        "model": {
            "w": torch.randn(300, 300, generator=g),  # 360 KB: a direct message
            "emb": torch.randn(1024, 600, generator=g).to(torch.bfloat16),  # 1.2 MB: BabyGloo shm path
            "b": torch.randn(10, generator=g, dtype=torch.float64),
            "idx": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(33, generator=g) > 0.5,
            "i8": torch.randint(-100, 100, (7, 3), generator=g, dtype=torch.int8),
            "half": torch.randn(5, 5, generator=g).half(),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "view": torch.randn(40, 30, generator=g).t()[::2],  # non-contiguous
        },
        "optim": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(300, 300, generator=g)}},
            "param_groups": [{"lr": 0.1, "name": "adam", "amsgrad": False, "wd": None, "params": [0]}],
        },
        "tiny": [torch.randn(3, generator=g) for _ in range(50)],
        "pair": (1, 2.5, "x"),
        "step": 17,
    }


def same(a: Any, b: Any, path: str = "") -> str | None:
    """None if equal (values, dtypes, shapes, container types), else where they differ."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)} or values differ"
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            d = same(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def tensors_of(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_of(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors_of(v)]
    return []


def zeros_like_state(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x.contiguous())
    if isinstance(x, dict):
        return {k: zeros_like_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [zeros_like_state(v) for v in x]
    if isinstance(x, tuple):
        return tuple(zeros_like_state(v) for v in x)
    return x


def _transport(timeout_s: float) -> Any:
    from rallypoint.transports.pg import PGTransport

    return PGTransport(STATE["pg"], datetime.timedelta(seconds=timeout_s))


def w_send(dst: list[int], step: int, case: str, timeout_s: float = TIMEOUT_S, stall_after: int | None = None) -> dict[str, Any]:
    """Send ``make_state(case)``; with ``stall_after``, report "stalled" after that many
    data messages were posted and hang (the test SIGKILLs this process)."""
    t = _transport(timeout_s)
    sd = make_state(case)
    if stall_after is not None:
        pg = STATE["pg"]
        real_send = pg.send
        count = [0]

        def send(tensors: Any, dst_rank: int, tag: int = 0) -> Any:
            count[0] += 1
            if count[0] == 2 + stall_after:  # prefix, header, then data messages
                report("stalled")
                time.sleep(3600)
            return real_send(tensors, dst_rank, tag)

        pg.send = send  # instance attribute shadows the method for this call only
    t0 = time.monotonic()
    try:
        t.send_checkpoint(dst, step, sd, datetime.timedelta(seconds=timeout_s))
        err = None
    except Exception as e:  # noqa: BLE001 - the test checks it
        err = f"{type(e).__name__}: {e}"
    s = t.last_send
    return {"err": err, "elapsed": time.monotonic() - t0, "messages": s.messages, "data_messages": s.data_messages}


def w_recv(src: int, step: int, case: str, mode: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Receive and check against ``make_state(case)``. ``mode``: "fresh" (into=None),
    "inplace" (into=zeros template, in_place=True), "staged" (in_place=False)."""
    t = _transport(timeout_s)
    expect = make_state(case)
    template = zeros_like_state(expect) if mode != "fresh" else None
    before = [(x.data_ptr(), x.clone()) for x in tensors_of(template)] if template is not None else []
    t0 = time.monotonic()
    err, target_modified, out = None, None, None
    try:
        out = t.recv_checkpoint(src, "<pg>", step, datetime.timedelta(seconds=timeout_s), into=template, in_place=(mode == "inplace"))
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
        target_modified = getattr(e, "target_modified", None)
    elapsed = time.monotonic() - t0
    res: dict[str, Any] = {"err": err, "elapsed": elapsed, "target_modified": target_modified}
    s = t.last_recv
    res.update(messages=s.messages, data_messages=s.data_messages)
    if out is not None:
        res["diff"] = same(expect, out)
    if template is not None:
        tt = tensors_of(template)
        res["template_unchanged"] = all(torch.equal(x, b) for x, (_, b) in zip(tt, before))
        if out is not None:
            ot = tensors_of(out)
            res["same_objects"] = len(ot) == len(tt) and all(a is b for a, b in zip(ot, tt))
            res["same_ptrs"] = all(x.data_ptr() == p for x, (p, _) in zip(tt, before))
            res["template_equals_expected"] = same(expect, template) is None
    return res


# --------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def store() -> Any:
    return master_store()


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> WorkerPool:
    p = shared_pool(request.config)
    yield p
    alive = [i for i in range(3) if p.conns[i] is not None and p.procs[i].is_alive()]
    p.run(alive, w_shutdown, lambda r: (), 30)


def configure(pool: WorkerPool, store: Any, kind: str, quorum: int = 1) -> None:
    a = f"127.0.0.1:{store.port}/{new_prefix()}"
    got = pool.run([0, 1, 2], w_configure, lambda r: (kind, a, r, 3, quorum, TIMEOUT_S), 90)
    assert got == [(0, 3), (1, 3), (2, 3)]


def transfer(pool: WorkerPool, sender_step: int, recvs: dict[int, tuple[int, str]], case: str, timeout: float = 60) -> tuple[dict, dict]:
    """Rank 0 sends to the ranks of ``recvs`` ({rank: (step, mode)}) in one call."""
    for r, (step, mode) in recvs.items():
        pool.submit(r, w_recv, 0, step, case, mode)
    pool.submit(0, w_send, sorted(recvs), sender_step, case)
    deadline = time.monotonic() + timeout
    got = {r: pool.result(r, max(deadline - time.monotonic(), 0.0)) for r in recvs}
    return pool.result(0, max(deadline - time.monotonic(), 0.0)), got


def test_plan_coalesces_small_and_sends_big_directly() -> None:
    sizes = [64] * 4000 + [DIRECT_BYTES, 0, 10, 3 << 20, 0]
    plan = plan_messages(sizes)
    assert [(m.first, m.last, m.direct) for m in plan] == [(0, 4000, False), (4000, 4001, True), (4002, 4003, False), (4003, 4004, True)]
    assert plan[0].nbytes == 256000 and plan[2].start == 256000 + DIRECT_BYTES and plan[2].nbytes == 10
    many = plan_messages([1 << 15] * 1000)  # 32 MB of 32 KB tensors: packs of at most PACK_BYTES
    assert all(m.nbytes <= PACK_BYTES for m in many) and sum(m.nbytes for m in many) == 1000 << 15
    assert len(many) == (1000 << 15) // PACK_BYTES + ((1000 << 15) % PACK_BYTES > 0)
    assert plan_messages([0, 0]) == []


@pytest.mark.parametrize("kind", ["gloo", "babygloo"])
def test_round_trip_to_two_ranks_in_one_call(pool: WorkerPool, store: Any, kind: str) -> None:
    configure(pool, store, kind)
    send, got = transfer(pool, 7, {1: (7, "fresh"), 2: (7, "inplace")}, "nested")
    assert send["err"] is None, send
    for r in (1, 2):
        assert got[r]["err"] is None, got[r]
        assert got[r]["diff"] is None, got[r]
    # in place: the result holds the template's own tensor objects, now equal to the sent state
    assert got[2]["same_objects"] and got[2]["template_equals_expected"], got[2]
    if kind == "gloo":  # BabyGloo moves tensors >= 1 MiB to shared memory in place (new data_ptr)
        assert got[2]["same_ptrs"], got[2]
    # the 50 tiny tensors and the other small ones travel packed: a handful of data messages
    assert got[1]["data_messages"] <= 6, got[1]
    # again with the same group: nothing left unmatched by the first transfer
    send, got = transfer(pool, 8, {1: (8, "inplace"), 2: (8, "staged")}, "nested")
    assert send["err"] is None and got[1]["err"] is None and got[2]["err"] is None, (send, got)
    assert got[1]["same_objects"] and got[1]["diff"] is None and got[2]["diff"] is None
    assert got[2]["same_objects"] and got[2]["template_equals_expected"], got[2]
    if kind == "gloo":  # staged: the tensors that own their storage took the buffers' memory (_pool.py)
        assert got[1]["same_ptrs"] and not got[2]["same_ptrs"], got


def test_wrong_step_is_a_clear_error_and_the_group_stays_usable(pool: WorkerPool, store: Any) -> None:
    configure(pool, store, "gloo")
    send, got = transfer(pool, 5, {1: (6, "inplace"), 2: (5, "fresh")}, "nested")
    assert got[1]["err"] and "WireError" in got[1]["err"], got[1]
    assert "step 6" in got[1]["err"] and "step 5" in got[1]["err"], got[1]
    assert got[1]["template_unchanged"] and not got[1]["target_modified"], got[1]
    assert got[2]["err"] is None and got[2]["diff"] is None, got[2]  # the other destination was served
    assert send["err"] and "rank 1 asked for step 6" in send["err"] and "step 5" in send["err"], send
    send, got = transfer(pool, 6, {1: (6, "inplace")}, "nested")
    assert send["err"] is None and got[1]["err"] is None and got[1]["diff"] is None, (send, got)


def test_sender_killed_mid_transfer(pool: WorkerPool, store: Any) -> None:
    configure(pool, store, "gloo")
    timeout = 6.0
    pool.submit(1, w_recv, 0, 3, "big", "staged", timeout)
    pool.submit(0, w_send, [1], 3, "big", timeout, 10)  # stalls after 10 of 48 data messages
    assert pool.progress(0, 30) == "stalled"
    pid = pool.pid(0)
    pool.kill(0)  # SIGKILL by pid
    assert not _alive(pid)
    res = pool.result(1, timeout + 10)
    assert res["err"] and "PGTransportError" in res["err"], res
    assert "rank 0" in res["err"] and "step 3" in res["err"], res
    assert res["elapsed"] < timeout + 2, res
    assert res["template_unchanged"] and not res["target_modified"], res


def test_hung_sender_times_out(pool: WorkerPool, store: Any) -> None:
    """The sender stops mid-transfer but stays alive: the receiver's wait is bounded."""
    configure(pool, store, "gloo")
    timeout = 2.0
    pool.submit(1, w_recv, 0, 3, "big", "staged", timeout)
    pool.submit(0, w_send, [1], 3, "big", 30.0, 10)
    assert pool.progress(0, 30) == "stalled"
    try:
        res = pool.result(1, timeout + 10)
    finally:
        pool.kill(0)  # the stalled sender, by pid
    assert res["err"] and "PGTransportError" in res["err"] and "timeout 2s" in res["err"], res
    assert timeout * 0.9 < res["elapsed"] < timeout + 1.5, res
    assert res["template_unchanged"] and not res["target_modified"], res


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_4000_tiny_tensors_in_one_data_message(pool: WorkerPool, store: Any) -> None:
    configure(pool, store, "gloo")
    send, got = transfer(pool, 1, {1: (1, "inplace"), 2: (1, "fresh")}, "tiny4000")
    assert send["err"] is None, send
    for r in (1, 2):
        assert got[r]["err"] is None and got[r]["diff"] is None, got[r]
        assert got[r]["data_messages"] == 1, got[r]
        assert got[r]["messages"] == 4, got[r]  # request, prefix, header, one packed buffer
    assert send["messages"] == 2 * 4 and send["data_messages"] == 2, send
    assert got[1]["same_objects"] and got[1]["same_ptrs"], got[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_dict_round_trip_over_gloo(pool: WorkerPool, store: Any) -> None:
    """CUDA tensors in the state dict and in the template (staged through the host)."""
    configure(pool, store, "gloo")
    pool.submit(1, w_recv_cuda, 0, 2)
    pool.submit(0, w_send_cuda, [1], 2)
    assert pool.result(0, 60) is None
    assert pool.result(1, 60) is None


def w_send_cuda(dst: list[int], step: int) -> str | None:
    sd = {k: v.cuda() for k, v in make_state("big").items()}
    _transport(TIMEOUT_S).send_checkpoint(dst, step, sd, datetime.timedelta(seconds=TIMEOUT_S))
    return None


def w_recv_cuda(src: int, step: int) -> str | None:
    expect = make_state("big")
    template = {k: torch.zeros_like(v, device="cuda") for k, v in expect.items()}
    out = _transport(TIMEOUT_S).recv_checkpoint(src, "<pg>", step, datetime.timedelta(seconds=TIMEOUT_S), into=template)
    assert all(out[k] is template[k] and out[k].is_cuda for k in expect)
    return same(expect, {k: v.cpu() for k, v in out.items()})


def test_plan_sends_device_tensors_as_their_own_messages() -> None:
    """A tensor sent from device memory is never packed with others (it is never on the host)."""
    sizes = [64, 64, 64, 0]
    assert [m.direct for m in plan_messages(sizes)] == [False]
    plan = plan_messages(sizes, on_device=[False, True, False, True])
    assert [(m.first, m.last, m.direct) for m in plan] == [(0, 1, False), (1, 2, True), (2, 4, False)]


def test_a_header_sent_from_device_memory_is_refused_without_a_device() -> None:
    """``"device": true`` (no checksums: NCCL moved it device to device) is only taken by a
    receiver on a device; an HTTP or gloo receiver refuses it before allocating anything."""
    import json

    from rallypoint.transports import wire

    enc = wire.encode({"w": torch.ones(4)})
    doc = json.loads(enc.header[wire.PREFIX_BYTES:])
    doc["tensors"][0]["device"] = True
    doc["tensors"][0]["crc32"] = []
    header = wire.parse_header(json.dumps(doc).encode())
    assert header.tensors[0].device
    with pytest.raises(wire.WireError, match="sent from device memory"):
        wire.Sink(header)
    with pytest.raises(wire.WireError, match="sent from device memory"):
        wire.Sink(header, device=torch.device("cpu"))
    doc["tensors"][0]["crc32"] = [1]
    with pytest.raises(wire.WireError, match="checksums for a tensor sent from device memory"):
        wire.parse_header(json.dumps(doc).encode())
    doc["tensors"][0]["device"] = "yes"
    with pytest.raises(wire.WireError, match="device must be true or false"):
        wire.parse_header(json.dumps(doc).encode())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_are_encoded_and_received_without_a_host_copy() -> None:
    """One GPU: a CUDA state dict encoded for a device process group keeps its tensors on
    the device (no host view, no checksum), and a Sink on the device fills the caller's
    CUDA tensors in place."""
    from rallypoint.transports import wire

    dev = torch.device("cuda", torch.cuda.current_device())
    sd = {"w": torch.randn(1 << 20, device=dev), "b": torch.arange(5, device=dev), "host": torch.ones(3)}
    enc = wire.encode(sd, keep_device=dev)
    assert enc.on_device == [True, True, False]
    assert enc.tensor(0).data_ptr() == sd["w"].data_ptr()  # not copied
    header = wire.parse_header(enc.header[wire.PREFIX_BYTES:])
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    sink = wire.Sink(header, into=target, in_place=True, device=dev)
    for ti, spec in enumerate(header.tensors):
        dest = sink.destination(ti)
        if spec.device:
            assert dest.data_ptr() == target[spec.path[0]].data_ptr()
            dest.copy_(enc.tensor(ti))  # what NCCL's recv does, device to device
        else:
            dest.copy_(enc.tensor(ti))
        sink.verify_tensor(ti, [pi for pi, p in enumerate(header.pieces) if p[2] == ti])
    out = sink.finish()
    assert all(out[k] is target[k] for k in sd) and out["w"].is_cuda
    assert all(torch.equal(out[k].cpu(), sd[k].cpu()) for k in sd)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank")
def test_pg_transport_over_nccl_moves_device_memory_directly() -> None:
    """Two ranks on two GPUs (threads): the sender's CUDA tensors arrive in the receiver's
    CUDA tensors, in place (same storage), over NCCL, without a host copy."""
    import threading

    from rallypoint.process_groups import ProcessGroupNCCL
    from rallypoint.transports.pg import PGTransport

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/pgt_nccl"
    pgs = [ProcessGroupNCCL(timeout=datetime.timedelta(seconds=30)) for _ in range(2)]
    expect = make_state("big")
    errors: list[BaseException] = []
    out: dict[str, Any] = {}

    def rank(r: int) -> None:
        try:
            torch.cuda.set_device(r)
            pgs[r].configure(addr, f"r{r}", r, 2, quorum_id=1)
            t = PGTransport(pgs[r], datetime.timedelta(seconds=30), device=torch.device("cuda", r))
            if r == 0:
                t.send_checkpoint([1], 3, {k: v.cuda(0) for k, v in expect.items()}, datetime.timedelta(seconds=30))
            else:
                template = {k: torch.zeros_like(v, device="cuda:1") for k, v in expect.items()}
                ptrs = {k: v.data_ptr() for k, v in template.items()}
                got = t.recv_checkpoint(0, "<pg>", 3, datetime.timedelta(seconds=30), into=template)
                out.update(same_objects=all(got[k] is template[k] for k in expect),
                           same_ptrs=all(got[k].data_ptr() == ptrs[k] for k in expect),
                           diff=same(expect, {k: v.cpu() for k, v in got.items()}))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    for p in pgs:
        p.shutdown()
    assert not errors, errors
    assert out == {"same_objects": True, "same_ptrs": True, "diff": None}, out
