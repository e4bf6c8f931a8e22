"""HTTPTransport with real servers on 127.0.0.1: round trips, step/token rules, faults.

Faults are injected on the serving side by overriding ``HTTPTransport._pieces`` (the one
place the body is produced), so the client code under test is the real one; the process
tests run the sender as a separate Python process and SIGKILL it mid-transfer.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rallypoint.transports import CheckpointTransport, wire
from rallypoint.transports.http import HTTPTransport, SourceRefused, TransferError, TransferTimeout

TEN = timedelta(seconds=10)

STATE_CODE = """
import torch
def make_state(seed, n=12, numel=40_000):
    g = torch.Generator().manual_seed(seed)
    m = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    m["mask"] = torch.randint(0, 2, (33,), generator=g).bool()
    m["half"] = torch.randn(64, 3, generator=g).to(torch.bfloat16).t()  # non-contiguous
    return {"model": m, "optim": {"state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}, "step": seed}
"""
_ns: dict[str, Any] = {}
exec(STATE_CODE, _ns)
make_state: Callable[..., dict[str, Any]] = _ns["make_state"]


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def zeros_like_state(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd, memory_format=torch.contiguous_format)
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(zeros_like_state(v) for v in sd)
    return sd


class Faulty(HTTPTransport):
    """Serves faults on the first ``faults`` data requests: flip / truncate / stall / slow."""

    def __init__(self, *a: Any, mode: str = "", faults: int = 0, **kw: Any) -> None:
        self.mode, self.faults = mode, faults
        self.requests = 0
        self.active = 0
        self.max_active = 0
        self.release = threading.Event()
        super().__init__(*a, **kw)

    def _pieces(self, served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Iterator[memoryview]:
        self.requests += 1
        faulty = self.requests <= self.faults
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            first = True
            for piece in super()._pieces(served, start, end, with_header, *kind):
                if self.mode == "slow":
                    time.sleep(0.05)
                if faulty and self.mode == "stall":
                    while not self.release.wait(0.02) and not served.aborted:
                        pass
                if faulty and self.mode == "truncate":
                    yield piece[: piece.nbytes // 2]
                    raise RuntimeError("injected: connection dropped mid-body")
                if faulty and self.mode == "flip" and first:
                    b = bytearray(piece)
                    b[len(b) // 2] ^= 0x01
                    piece = memoryview(b)
                first = False
                yield piece
        finally:
            self.active -= 1


@pytest.fixture
def transports() -> Iterator[Callable[..., HTTPTransport]]:
    made: list[HTTPTransport] = []

    def make(cls: type[HTTPTransport] = HTTPTransport, **kw: Any) -> HTTPTransport:
        kw.setdefault("bind", "127.0.0.1:0")
        kw.setdefault("timeout", TEN)
        t = cls(**kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.shutdown()


#: Sender: small checksum blocks; receiver: 4 connections and small ranges, so the sample
#: state (~2 MB) is fetched as ~60 ranges and retries and parallelism show.
SMALL_BLOCKS: dict[str, Any] = {"block": 16 << 10}
MANY_RANGES: dict[str, Any] = {"num_chunks": 4, "max_chunk_bytes": 32 << 10}


def n_ranges(sd: Any) -> int:
    """How many ranges a MANY_RANGES receiver fetches ``sd`` (sent with SMALL_BLOCKS) in."""
    enc = wire.encode(sd, **SMALL_BLOCKS)
    return len(wire.read_header(io.BytesIO(enc.header).readinto).split(4, 32 << 10))


def test_is_a_checkpoint_transport_and_round_trips(transports: Callable[..., HTTPTransport]) -> None:
    src, dst = transports(), transports()
    assert isinstance(src, CheckpointTransport)
    assert src.metadata() == f"http://127.0.0.1:{src.port}"
    sd = make_state(1)
    src.send_checkpoint([1], 7, sd, TEN)
    out = dst.recv_checkpoint(0, src.metadata(), 7, TEN)
    assert_same(sd, out)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 7, TEN))  # served until disallowed


def test_parallel_ranges_use_several_connections(transports: Callable[..., HTTPTransport]) -> None:
    src = transports(Faulty, mode="slow", **SMALL_BLOCKS)
    dst = transports(**MANY_RANGES)
    sd = make_state(2)
    src.send_checkpoint([1], 3, sd, TEN)
    out = dst.recv_checkpoint(0, src.metadata(), 3, TEN)
    assert_same(sd, out)
    assert isinstance(src, Faulty) and src.max_active >= 2 and src.requests == n_ranges(sd)


def test_in_place_into_template(transports: Callable[..., HTTPTransport]) -> None:
    src, dst = transports(), transports()
    sd = make_state(3)
    src.send_checkpoint([1], 1, sd, TEN)
    for in_place in (False, True):
        target = zeros_like_state(sd)
        w = target["model"]["layer0.weight"]
        out = dst.recv_checkpoint(0, src.metadata(), 1, TEN, into=target, in_place=in_place)
        assert out["model"]["layer0.weight"] is w and torch.equal(w, sd["model"]["layer0.weight"])
        assert_same(sd, out)


def test_older_step_409_newer_or_nothing_served_404_withdrawn_410(transports: Callable[..., HTTPTransport]) -> None:
    src, dst = transports(), transports(publish_wait=timedelta(0))
    with pytest.raises(SourceRefused, match="no checkpoint is being served") as ei:
        dst.recv_checkpoint(0, src.metadata(), 5, TEN)
    assert ei.value.status == 404
    src.send_checkpoint([1], 5, make_state(4), TEN)
    with pytest.raises(SourceRefused, match="serving the checkpoint of step 5, not step 4") as ei:
        dst.recv_checkpoint(0, src.metadata(), 4, TEN)  # an older step will not come back
    assert ei.value.status == 409
    r = httpx.get(f"{src.metadata()}/checkpoint/4/data", params={"start": 0, "end": 4}, timeout=5)
    assert r.status_code == 409 and "step 5" in r.text
    # A newer step than the one still served may simply not be published yet.
    with pytest.raises(SourceRefused, match="step 6 is not published yet") as ei:
        dst.recv_checkpoint(0, src.metadata(), 6, TEN)
    assert ei.value.status == 404
    src.disallow_checkpoint()  # nobody asked for step 5: withdrawn (a live state is not copied for nobody)
    patient = transports()  # even a receiver that waits for a publish gives up on a withdrawn step
    t0 = time.monotonic()
    with pytest.raises(SourceRefused, match="step 5 was withdrawn") as ei:
        patient.recv_checkpoint(0, src.metadata(), 5, TEN)
    assert ei.value.status == 410 and time.monotonic() - t0 < 5
    with pytest.raises(SourceRefused) as ei:
        dst.recv_checkpoint(0, src.metadata(), 7, TEN)
    assert ei.value.status == 404


def test_receiver_waits_for_the_source_to_publish(transports: Callable[..., HTTPTransport],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that asks before the sender publishes gets the state once it is
    published; one that waits past ``publish_wait`` gets a timeout naming the step."""
    import threading

    from rallypoint.transports._http_recv import Receive

    src, dst = transports(), transports(publish_wait=timedelta(seconds=5))
    sd = make_state(3)
    got: dict[str, Any] = {}
    asked = threading.Event()
    real_get = Receive._get_header

    def spy(*a: Any, **kw: Any) -> bytes:
        asked.set()
        return real_get(*a, **kw)

    monkeypatch.setattr(Receive, "_get_header", spy)
    t = threading.Thread(target=lambda: got.update(out=dst.recv_checkpoint(0, src.metadata(), 4, TEN)))
    t.start()
    assert asked.wait(10)
    src.send_checkpoint([1], 4, sd, TEN)
    t.join(15)
    assert not t.is_alive()
    assert_same(sd, got["out"])

    src.disallow_checkpoint()
    impatient = transports(publish_wait=timedelta(milliseconds=200))
    with pytest.raises(TransferTimeout, match="step 9"):
        impatient.recv_checkpoint(0, src.metadata(), 9, TEN)


def test_bearer_token(transports: Callable[..., HTTPTransport]) -> None:
    src = transports(token="s3cret")
    sd = make_state(5)
    src.send_checkpoint([1], 2, sd, TEN)
    for client in (transports(), transports(token="wrong")):
        with pytest.raises(SourceRefused, match="bearer token") as ei:
            client.recv_checkpoint(0, src.metadata(), 2, TEN)
        assert ei.value.status == 401
    r = httpx.get(f"{src.metadata()}/checkpoint/99/full", timeout=5)  # 401 before the step check
    assert r.status_code == 401
    assert_same(sd, transports(token="s3cret").recv_checkpoint(0, src.metadata(), 2, TEN))


def test_full_stream_route_is_the_wire_format(transports: Callable[..., HTTPTransport]) -> None:
    src = transports()
    sd = make_state(6)
    src.send_checkpoint([1], 4, sd, TEN)
    r = httpx.get(f"{src.metadata()}/checkpoint/4/full", timeout=5)
    assert r.status_code == 200
    assert_same(sd, wire.decode(r.content))


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_bad_range_is_retried(transports: Callable[..., HTTPTransport], mode: str) -> None:
    src = transports(Faulty, mode=mode, faults=2, **SMALL_BLOCKS)
    dst = transports(**MANY_RANGES)
    sd = make_state(7)
    src.send_checkpoint([1], 1, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))
    assert n_ranges(sd) > 20
    assert isinstance(src, Faulty) and src.requests == n_ranges(sd) + 2  # exactly the two bad ones again


@pytest.mark.parametrize("mode, match", [("flip", "checksum mismatch"), ("truncate", "truncated|closed|Error")])
def test_persistent_fault_fails_cleanly_and_another_source_works(
    transports: Callable[..., HTTPTransport], mode: str, match: str
) -> None:
    bad = transports(Faulty, mode=mode, faults=10**6, **SMALL_BLOCKS)
    good = transports()
    dst = transports(retries=1, **MANY_RANGES)
    sd = make_state(8)
    bad.send_checkpoint([1], 9, sd, TEN)
    good.send_checkpoint([1], 9, sd, TEN)
    target = zeros_like_state(sd)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=match) as ei:
        dst.recv_checkpoint(0, bad.metadata(), 9, TEN, into=target)
    assert time.monotonic() - t0 < 8
    assert bad.metadata() in str(ei.value)
    assert_same(zeros_like_state(sd), target)  # untouched
    out = dst.recv_checkpoint(1, good.metadata(), 9, TEN, into=target)
    assert_same(sd, out)
    assert_same(sd, target)


def test_stalled_source_times_out_within_the_timeout(transports: Callable[..., HTTPTransport]) -> None:
    src = transports(Faulty, mode="stall", faults=10**6, serve="copy")
    dst = transports()
    sd = make_state(9)
    src.send_checkpoint([1], 1, sd, timedelta(seconds=2))  # bounds disallow's wait below
    target = zeros_like_state(sd)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=1.5), into=target)
    assert 1.0 < time.monotonic() - t0 < 4.0
    assert_same(zeros_like_state(sd), target)
    t0 = time.monotonic()
    src.disallow_checkpoint()  # waits its timeout (2 s) for the stalled streams, then aborts them
    assert 1.5 < time.monotonic() - t0 < 5.0
    assert isinstance(src, Faulty)
    src.release.set()


def test_shutdown_stops_threads_and_port(transports: Callable[..., HTTPTransport]) -> None:
    t = HTTPTransport(TEN, 2, bind="127.0.0.1:0")
    port = t.port
    t.send_checkpoint([1], 1, make_state(11), TEN)
    t.shutdown()
    assert not [th for th in threading.enumerate() if th.name.endswith(f":{port}")]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/checkpoint/1/header", timeout=2)


# --------------------------------------------------------------------------- separate process

CHILD = (
    STATE_CODE
    + """
import json, sys, time
from datetime import timedelta
from rallypoint.transports.http import HTTPTransport

class Slow(HTTPTransport):
    # sleeps before each piece once the parent wrote a line to stdin
    announced = False
    delay = 0.0
    def _pieces(self, served, start, end, with_header, *kind):
        for piece in super()._pieces(served, start, end, with_header, *kind):
            if Slow.delay and not Slow.announced:
                Slow.announced = True
                print("STREAMING", flush=True)
            time.sleep(Slow.delay)
            yield piece

t = Slow(timedelta(seconds=30), 4, bind="127.0.0.1:0", block=16 << 10, max_chunk_bytes=64 << 10)
t.send_checkpoint([1], int(sys.argv[1]), make_state(int(sys.argv[1])), timedelta(seconds=30))
print(json.dumps({"url": t.metadata()}), flush=True)
sys.stdin.readline()
Slow.delay = float(sys.argv[2])
print("SLOW", flush=True)
time.sleep(120)
"""
)


class Child:
    """The sender as a separate process; its stdout lines arrive through a queue."""

    def __init__(self, step: int, delay: float, log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.err = open(log, "wb")
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(step), str(delay)],
            stdout=subprocess.PIPE,
            stderr=self.err,
            stdin=subprocess.PIPE,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put(None)

    def line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child said nothing within {timeout} s: {self.log.read_text()[-2000:]}") from None
        assert line is not None, f"child exited: {self.log.read_text()[-2000:]}"
        return line

    def slow_down(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(b"slow\n")
        self.p.stdin.flush()
        assert self.line(20) == "SLOW"

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        self.err.close()
        if self.p.stdin is not None:
            self.p.stdin.close()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Callable[[int, float], Child]]:
    kids: list[Child] = []

    def start(step: int, delay: float) -> Child:
        c = Child(step, delay, tmp_path / f"child{len(kids)}.stderr")
        kids.append(c)
        return c

    yield start
    for c in kids:
        c.kill()


def test_sender_in_another_process_then_sigkilled_mid_transfer(
    child: Callable[[int, float], Child], transports: Callable[..., HTTPTransport]
) -> None:
    c = child(22, 0.5)
    url = json.loads(c.line(60))["url"]
    dst = transports(num_chunks=4)
    assert_same(make_state(22), dst.recv_checkpoint(0, url, 22, TEN))
    c.slow_down()
    sd = make_state(22)
    target = zeros_like_state(sd)
    errors: queue.Queue[BaseException | None] = queue.Queue()

    def recv() -> None:
        try:
            dst.recv_checkpoint(0, url, 22, timedelta(seconds=20), into=target)
            errors.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.put(exc)

    th = threading.Thread(target=recv)
    t0 = time.monotonic()
    th.start()
    assert c.line(20) == "STREAMING"
    c.kill()
    th.join(20)
    exc = errors.get(timeout=1)
    assert isinstance(exc, TransferError), exc
    assert time.monotonic() - t0 < 15
    assert url in str(exc)
    assert_same(zeros_like_state(sd), target)  # the receiver kept its old state
    other = transports()
    other.send_checkpoint([1], 22, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(1, other.metadata(), 22, TEN, into=target))


def test_header_over_the_limit_is_refused(transports: Callable[..., HTTPTransport]) -> None:
    src, dst = transports(), transports(max_header_bytes=200)
    src.send_checkpoint([1], 1, make_state(12), TEN)
    with pytest.raises(TransferError, match="header larger than the limit of 200 bytes"):
        dst.recv_checkpoint(0, src.metadata(), 1, TEN)


def test_state_over_the_receivers_limit_is_refused_before_anything_is_written(
    transports: Callable[..., HTTPTransport],
) -> None:
    """The header's declared size is checked against max_state_bytes before the receiver
    allocates or writes anything: an in-place target stays as it was."""
    src, dst = transports(), transports(max_state_bytes=1000)
    sd = make_state(14)
    src.send_checkpoint([1], 1, sd, TEN)
    target = zeros_like_state(sd)
    with pytest.raises(TransferError, match="over this receiver's limit of 1000 bytes"):
        dst.recv_checkpoint(0, src.metadata(), 1, TEN, into=target, in_place=True)
    assert_same(target, zeros_like_state(sd))


def test_max_state_bytes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint.transports._http_util import default_max_state_bytes

    monkeypatch.setenv("RALLYPOINT_MAX_STATE_BYTES", "12345")
    assert default_max_state_bytes() == 12345
    monkeypatch.setenv("RALLYPOINT_MAX_STATE_BYTES", "lots")
    with pytest.raises(ValueError, match="not a number"):
        default_max_state_bytes()
    monkeypatch.delenv("RALLYPOINT_MAX_STATE_BYTES")
    assert default_max_state_bytes() > 1 << 20  # physical memory


def test_tiny_blocks_are_refused_on_the_network() -> None:
    """A checksum block below 4 KiB would make a small header cost much memory on the
    receiver: a sender cannot be built with one, and a receiver refuses such a header."""
    with pytest.raises(ValueError, match="below the 4096-byte minimum"):
        HTTPTransport(TEN, bind="127.0.0.1:0", block=16)
    raw = wire.encode(make_state(15), block=16).header
    with pytest.raises(wire.WireError, match="below the minimum of 4096"):
        wire.parse_header(bytes(raw)[wire.PREFIX_BYTES:], min_block=wire.MIN_NETWORK_BLOCK)


def test_in_place_receive_of_a_corrupt_source_says_the_target_was_written(
    transports: Callable[..., HTTPTransport],
) -> None:
    bad = transports(Faulty, mode="flip", faults=10**6, **SMALL_BLOCKS)
    dst = transports(num_chunks=1, retries=0)
    sd = make_state(13)
    bad.send_checkpoint([1], 1, sd, TEN)
    target = zeros_like_state(sd)
    with pytest.raises(TransferError, match="partly overwritten"):
        dst.recv_checkpoint(0, bad.metadata(), 1, TEN, into=target, in_place=True)


def test_each_worker_keeps_one_connection_for_all_its_ranges(
    transports: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """~60 ranges over 4 workers: a connection per worker (plus the header's), kept alive
    from range to range; the range that failed its checksum costs one new connection."""
    import http.client

    connects: list[int] = []
    real_connect = http.client.HTTPConnection.connect

    def counting(self: http.client.HTTPConnection) -> None:
        connects.append(1)
        real_connect(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", counting)
    src = transports(Faulty, mode="flip", faults=1, **SMALL_BLOCKS)
    dst = transports(**MANY_RANGES)
    sd = make_state(14)
    src.send_checkpoint([1], 1, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))
    assert isinstance(src, Faulty) and src.requests == n_ranges(sd) + 1 > 20
    assert len(connects) <= 4 + 1 + 1, connects


def test_receive_goes_to_the_source_not_to_a_proxy(transports: Callable[..., HTTPTransport],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Proxy settings are not followed: the state (and the bearer token) go straight to the
    address the source advertises."""
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # discard port: nothing there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    src, dst = transports(token="s3cret"), transports(token="s3cret")
    sd = make_state(15)
    src.send_checkpoint([1], 1, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))


def test_a_process_that_heals_imports_no_http_library() -> None:
    """A heal is usually a fresh process's first receive: it imports nothing beyond the
    standard library for HTTP (httpx and httpcore cost 0.1-0.2 s there)."""
    code = STATE_CODE + """
import sys
from datetime import timedelta
from rallypoint.transports.http import HTTPTransport
T = timedelta(seconds=20)
src = HTTPTransport(timeout=T, bind="127.0.0.1:0")
dst = HTTPTransport(timeout=T, bind="127.0.0.1:0")
sd = make_state(16)
src.send_checkpoint([1], 1, sd, T)
out = dst.recv_checkpoint(0, src.metadata(), 1, T)
assert torch.equal(out["model"]["layer0.weight"], sd["model"]["layer0.weight"])
print(sorted(m for m in sys.modules if m.split(".")[0] in ("httpx", "httpcore", "h11", "anyio")))
src.shutdown(); dst.shutdown()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_shutdown_without_waiting_ends_cleanly(caplog: pytest.LogCaptureFixture) -> None:
    """``shutdown(wait=False)`` (what a manager does on its way out) must not pull the
    socket from under the running server: no crash is logged, the port is released."""
    t = HTTPTransport(timeout=TEN, bind="127.0.0.1:0")
    t.shutdown(wait=False)
    t._server._acceptor.join(10)
    assert not t._server.alive()
    assert not [r for r in caplog.records if "crashed" in r.getMessage()], caplog.text
    assert t._sock.fileno() == -1




@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 2), (3, 3), (4, 4), (16, 4), (0, 1)])
def test_default_connections_are_four_but_no_more_than_the_cpus(cpus: int, expected: int) -> None:
    from rallypoint.transports._http_util import default_connections

    assert default_connections(cpus) == expected


def test_the_default_receiver_uses_the_default_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, ``num_chunks`` follows this process's CPUs; given (torchft's positional
    ``HTTPTransport(timeout, num_chunks)`` too), it is what the caller said."""
    from rallypoint.transports import _http_util

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    t = HTTPTransport(TEN, bind="127.0.0.1:0")
    u = HTTPTransport(TEN, 4, bind="127.0.0.1:0")
    z = HTTPTransport(TEN, 0, bind="127.0.0.1:0")
    try:
        assert _http_util.usable_cpus() == 2
        assert (t._num_chunks, u._num_chunks, z._num_chunks) == (2, 4, 1)
    finally:
        for x in (t, u, z):
            x.shutdown()
