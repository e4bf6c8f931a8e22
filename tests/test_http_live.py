"""Live serving and striped receiving of HTTPTransport, with real servers on 127.0.0.1.

Live serving (rallypoint/transports/_live.py): the caller's tensors are served without a
copy and frozen before they change, so a receiver never gets a changed or torn state,
and the sender's step never waits for a slow receiver. Striping (_http_recv.py): one
receive fetches disjoint ranges from several identical sources at once and falls back
to the others when one fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
import torch

from rallypoint.transports.http import HTTPTransport, SourceRefused, TransferError, TransferTimeout
from test_http_transport import (  # noqa: F401 - the fixture is used by name
    MANY_RANGES,
    SMALL_BLOCKS,
    TEN,
    Faulty,
    assert_same,
    make_state,
    transports,
)
from live_heal import HoldPart, step_during_heal


def test_live_disallow_does_not_wait_for_a_stalled_receiver(transports: Callable[..., HTTPTransport]) -> None:
    """Live serving: a receiver that stops reading never holds up the sender's step;
    disallow freezes the state and returns at once."""
    src = transports(Faulty, mode="stall", faults=10**6, copy_below=0)
    dst = transports()
    sd = make_state(9)
    src.send_checkpoint([1], 1, sd, TEN)
    with pytest.raises(TransferTimeout):
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=1))
    assert isinstance(src, Faulty) and src.active > 0
    t0 = time.monotonic()
    src.disallow_checkpoint()
    assert time.monotonic() - t0 < 1.0
    src.release.set()


@pytest.mark.parametrize("serve", ["copy", "live", "live-optimizer", "live-precopy"])
def test_disallow_during_a_transfer_in_flight(transports: Callable[..., HTTPTransport], serve: str) -> None:
    """The sender's state changes right after disallow (its optimizer step) while four
    ranges are in flight: the receiver still gets the state as served. Copy: disallow
    waits for the streams. Live: it returns at once, the streams go on from the frozen
    copy. Live-optimizer: no disallow, an optimizer step mid-transfer freezes it.
    Live-precopy: live, with a background copy racing the four streams."""
    import copy as copy_mod

    warm = torch.nn.Parameter(torch.zeros(1))  # an optimizer's first step imports torch._dynamo: seconds
    warm.grad = torch.zeros(1)
    torch.optim.SGD([warm], lr=1.0).step()
    src = transports(Faulty, mode="slow", block=16 << 10, num_chunks=4, serve=serve.split("-")[0], copy_below=0,
                     precopy=serve == "live-precopy")
    dst = transports(num_chunks=4)
    sd = make_state(10)
    src.send_checkpoint([1], 1, sd, TEN)
    result: queue.Queue[Any] = queue.Queue()
    th = threading.Thread(target=lambda: result.put(dst.recv_checkpoint(0, src.metadata(), 1, TEN)))
    th.start()
    assert isinstance(src, Faulty)
    deadline = time.monotonic() + 5
    while src.active < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert src.active == 4
    want = copy_mod.deepcopy(sd)
    floats = [t for t in sd["model"].values() if t.is_floating_point() and t.is_contiguous()]
    if serve == "live-optimizer":
        params = [torch.nn.Parameter(t) for t in floats]  # share memory with the served tensors
        for p in params:
            p.grad = torch.ones_like(p)
        torch.optim.SGD(params, lr=1.0).step()
    else:
        src.disallow_checkpoint()
        with torch.no_grad():
            for t in floats:
                t.add_(1)
    assert src.active == (0 if serve == "copy" else 4)
    assert not torch.equal(floats[0], want["model"]["layer0.weight"])
    th.join(10)
    assert_same(want, result.get(timeout=1))


def test_served_state_never_arrives_changed_or_torn(transports: Callable[..., HTTPTransport]) -> None:
    """Training goes on while a peer fetches (DiLoCo's inner steps during the sync delay).
    ``serve="copy"``: the receiver gets the state as served whatever changes. Live (the
    default): an optimizer step freezes the served state first, so the receiver gets it
    as served; an in-place change outside an optimizer step is refused, naming the
    tensor, and never received."""
    import copy as copy_mod

    sd = make_state(5)
    want = copy_mod.deepcopy(sd)
    src, dst = transports(serve="copy"), transports()
    src.send_checkpoint([1], 2, sd, TEN)
    for t in sd["model"].values():
        if t.is_floating_point():
            t.add_(1)  # the sender's next inner step
    assert_same(want, dst.recv_checkpoint(0, src.metadata(), 2, TEN))

    live = transports(copy_below=0)
    assert live.serve_mode == "live" and live.copies_state
    sd = make_state(6)
    want = copy_mod.deepcopy(sd)
    params = [torch.nn.Parameter(t) for t in sd["model"].values() if t.is_floating_point() and t.is_contiguous()]
    sd["model"].update({k: p.detach() for k, p in zip(sd["model"], params)})
    opt = torch.optim.SGD(params, lr=0.5)
    for p in params:
        p.grad = torch.ones_like(p)
    live.send_checkpoint([1], 3, sd, TEN)
    opt.step()  # the pre-hook freezes what is served before the update
    assert not torch.equal(params[0].detach(), want["model"]["layer0.weight"])
    assert_same(want, dst.recv_checkpoint(0, live.metadata(), 3, TEN))

    sd = make_state(7)
    live.send_checkpoint([1], 4, sd, TEN)
    sd["model"]["layer0.weight"].add_(1)  # not an optimizer step, no disallow: a bug in the caller
    with pytest.raises(SourceRefused, match=r"\['model'\]\['layer0.weight'\] changed while it was served") as ei:
        dst.recv_checkpoint(0, live.metadata(), 4, TEN)
    assert ei.value.status == 410


def test_a_range_that_cannot_start_is_answered_410_naming_the_tensor(
        transports: Callable[..., HTTPTransport]) -> None:
    """A range whose first piece is a tensor changed outside an optimizer step gets an
    HTTP 410 that names it (the server reads the first piece before its 200), not a
    dropped stream that a receiver could only retry."""
    live = transports(copy_below=0)
    sd = make_state(8)
    live.send_checkpoint([1], 5, sd, TEN)
    sd["model"]["layer0.weight"].add_(1)  # a bug in the caller
    end = live._served.enc.data_bytes  # type: ignore[union-attr]
    r = httpx.get(f"{live.metadata()}/checkpoint/5/data", params={"start": 0, "end": end}, timeout=5)
    assert r.status_code == 410
    assert "['model']['layer0.weight'] changed while it was served" in r.text


# --------------------------------------------------------------------------- striping


class Counting(HTTPTransport):
    """Counts the data ranges it serves."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.ranges = 0
        super().__init__(*a, **kw)

    def _pieces(self, served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Any:
        if not with_header:
            self.ranges += 1
        return super()._pieces(served, start, end, with_header, *kind)


def serve_all(sources: list[HTTPTransport], sd: Any, step: int = 1) -> str:
    for s in sources:
        s.send_checkpoint([1], step, sd, TEN)
    return ",".join(s.metadata() for s in sources)


def test_striped_receive_uses_every_source_and_frees_them(transports: Callable[..., HTTPTransport]) -> None:
    """Three identical sources: the receive takes ranges from several of them (a source
    whose connection comes up last may find every range taken: work stealing), the state
    arrives whole, and each live source drops its offer as soon as the receiver says done."""
    sources = [transports(Counting, copy_below=0, **SMALL_BLOCKS) for _ in range(3)]
    sd = make_state(21)
    meta = serve_all(sources, sd)
    dst = transports(**MANY_RANGES)
    assert_same(sd, dst.recv_checkpoint(0, meta, 1, TEN))
    counts = [s.ranges for s in sources]  # type: ignore[attr-defined]
    assert sum(c > 0 for c in counts) >= 2 and sum(counts) > 0, counts
    for s in sources:
        s.disallow_checkpoint()  # told done: withdrawn, nothing copied
        assert s._served is None and s._withdrawn == 1


@pytest.mark.parametrize("which", ["first", "second"])
def test_striped_receive_survives_a_source_dying(transports: Callable[..., HTTPTransport], which: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A source that breaks every range it serves is dropped after its retries; the
    other one serves the rest; the receiver gets the whole state and the log names the
    dropped source."""
    good = transports(Faulty, mode="slow", copy_below=0, **SMALL_BLOCKS)  # slow: the bad one is surely asked
    bad = transports(Faulty, mode="truncate", faults=10**6, **SMALL_BLOCKS)
    order = [bad, good] if which == "first" else [good, bad]
    sd = make_state(22)
    meta = serve_all(order, sd)
    dst = transports(**MANY_RANGES)
    with caplog.at_level(logging.WARNING, logger="rallypoint.transports.http"):
        assert_same(sd, dst.recv_checkpoint(0, meta, 1, TEN))
    assert any("dropped from the striped heal" in r.getMessage() and bad.metadata() in r.getMessage()
               for r in caplog.records), caplog.text


def test_striped_receive_survives_a_source_that_is_shut_down(transports: Callable[..., HTTPTransport]) -> None:
    """The second source's server goes away mid-receive (its process died): the first
    one serves what is left."""
    slow = transports(Faulty, mode="slow", **SMALL_BLOCKS)
    gone = transports(Faulty, mode="slow", **SMALL_BLOCKS)
    sd = make_state(23)
    meta = serve_all([slow, gone], sd)
    dst = transports(**MANY_RANGES)
    out: queue.Queue[Any] = queue.Queue()
    th = threading.Thread(target=lambda: out.put(dst.recv_checkpoint(0, meta, 1, timedelta(seconds=30))))
    th.start()
    deadline = time.monotonic() + 10
    assert isinstance(gone, Faulty)
    while gone.requests < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    gone.shutdown(wait=False)
    th.join(40)
    assert_same(sd, out.get(timeout=1))


def test_a_source_with_another_state_is_left_out(transports: Callable[..., HTTPTransport],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Striping needs identical sources: one whose header differs (another layout) never
    serves a range; the receive comes from the first source alone."""
    first = transports(Counting, **SMALL_BLOCKS)
    other = transports(Counting, **SMALL_BLOCKS)
    sd = make_state(24)
    first.send_checkpoint([1], 1, sd, TEN)
    other.send_checkpoint([1], 1, make_state(24, n=3), TEN)
    dst = transports(**MANY_RANGES)
    with caplog.at_level(logging.WARNING, logger="rallypoint.transports.http"):
        assert_same(sd, dst.recv_checkpoint(0, f"{first.metadata()},{other.metadata()}", 1, TEN))
    assert other.ranges == 0 and first.ranges > 0  # type: ignore[attr-defined]
    assert "serves a different state" in caplog.text


def test_every_source_failing_is_one_clear_error(transports: Callable[..., HTTPTransport]) -> None:
    a = transports(Faulty, mode="truncate", faults=10**6, **SMALL_BLOCKS)
    b = transports(Faulty, mode="truncate", faults=10**6, **SMALL_BLOCKS)
    meta = serve_all([a, b], make_state(25))
    with pytest.raises(TransferError, match="every source failed") as ei:
        transports(**MANY_RANGES).recv_checkpoint(0, meta, 1, TEN)
    assert a.metadata() in str(ei.value) and b.metadata() in str(ei.value)
    with pytest.raises(TransferError, match="not an http"):
        transports().recv_checkpoint(0, f"{a.metadata()},file:///etc/passwd", 1, TEN)


def test_a_source_that_publishes_late_never_holds_up_the_receive(transports: Callable[..., HTTPTransport]) -> None:
    """The first source serves it all while the second has not published yet: the
    receive returns without waiting for it (its worker stops at once), and the late
    source is told done, so it will not keep a frozen copy for nobody."""
    first = transports(copy_below=0, **SMALL_BLOCKS)
    late = transports(copy_below=0, **SMALL_BLOCKS)
    sd = make_state(26)
    first.send_checkpoint([1], 1, sd, TEN)
    dst = transports(**MANY_RANGES)
    assert_same(sd, dst.recv_checkpoint(0, f"{first.metadata()},{late.metadata()}", 1, TEN))
    deadline = time.monotonic() + 2.0  # a worker asking for the header stops at its next poll (<= 20 ms)
    while (alive := [t.name for t in threading.enumerate() if t.name.startswith("rp-http-recv")]) \
            and time.monotonic() < deadline:
        time.sleep(0.01)  # thread exit has no event to wait on
    assert not alive, alive  # no worker left waiting for the late source's header
    first.disallow_checkpoint()
    assert first._served is None  # told done: withdrawn, nothing copied


def test_the_freeze_copies_the_tail_while_the_head_is_still_delivered() -> None:
    """The freeze works back to front. While it copies the last tensor, a receiver reads the
    first three from the caller's live memory. Those are then delivered and retired, not
    copied, so only the tail is copied. The receiver reads the last tensor from the copy
    after the caller has changed its state (its optimizer step), and the stream it got
    decodes to the state as served, never a torn mix."""
    from rallypoint.transports import wire

    sd, want, enc = _live_state(precopy=False)
    got = bytearray(enc.header)
    stream = enc.iter_data()
    copies: list[int] = []
    real_copy = enc._copy

    def copy_while_the_receiver_reads(ti: int) -> Any:
        copies.append(ti)
        while not enc.delivered_tensor(2):  # the serving threads go on meanwhile (into tensor 3)
            got.extend(next(stream))
        return real_copy(ti)

    enc._copy = copy_while_the_receiver_reads  # type: ignore[method-assign]
    assert enc.freeze(1.0) == 4 << 18  # one tensor's bytes: the last
    assert copies == [3]
    for t in sd.values():
        t.add_(1)  # the caller's optimizer step, right after the freeze
    for piece in stream:
        got.extend(piece)
    # The piece of tensor 3 handed out before the freeze returned is not counted: it could
    # have been sent after the caller's change (a socket's send, not this test's extend).
    assert not enc.delivered and not enc.delivered_tensor(3)
    enc.receiver_done()  # the receiver says it has everything (/done)
    assert enc.delivered
    assert_same(want, wire.decode(bytes(got)))
    with pytest.raises(Exception, match="delivered and the sender has stepped since"):
        next(enc.iter_data(0, 4 << 18))  # a retired tensor is never read again


def _live_state(n: int = 4, precopy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """``n`` tensors of 1 MiB (served live), a copy of them, and a fresh LiveEncoded
    over them (by default one that copies ahead of the freeze)."""
    import copy as copy_mod

    from rallypoint.transports import wire
    from rallypoint.transports._live import LiveEncoded

    sd = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(n)}
    return sd, copy_mod.deepcopy(sd), LiveEncoded(wire.encode(sd, block=1 << 18, copy_below=1, sums="inline"),
                                                  receivers=1, precopy=precopy)


def test_the_background_copy_leaves_the_freeze_nothing_to_copy() -> None:
    """Once a receiver asks, a background thread copies what it has not got yet (back to
    front) while forward and backward run. When the step's freeze comes, nothing is left
    to copy on the training thread; the caller changes its state at once; and the stream
    the receiver got decodes to the state as served."""
    from rallypoint.transports import wire

    sd, want, enc = _live_state()
    got = bytearray(enc.header)
    stream = enc.iter_data()
    got.extend(next(stream))  # the first request starts the copier
    enc._precopier.join(10)
    assert not enc._precopier.is_alive()
    assert enc.precopied == 4 << 20  # every tensor: none was delivered yet
    assert enc.freeze(1.0) == 0  # the training thread copies nothing
    for t in sd.values():
        t.add_(1)  # the optimizer step, right after the freeze
    for piece in stream:
        got.extend(piece)
    # The first piece, handed out from live memory before the freeze, is not counted (see
    # the test above); the receiver's /done delivers the state.
    assert not enc.delivered
    enc.receiver_done()
    assert enc.delivered
    assert_same(want, wire.decode(bytes(got)))


def test_a_freeze_during_the_background_copy_waits_for_the_tensor_in_hand() -> None:
    """The design's own race: the step's freeze arrives while the copier is copying a
    tensor. The freeze waits for that copy (the caller must not change the tensor under
    it), the copier stops there, the freeze copies the rest, and the receiver gets the
    state as served, not a torn mix."""
    from rallypoint.transports import wire

    sd, want, enc = _live_state()
    copying, go_on = threading.Event(), threading.Event()
    real_copy = enc._copy
    order: list[int] = []

    def slow_copy(ti: int) -> Any:
        order.append(ti)
        if threading.current_thread().name == "checkpoint-precopy":
            copying.set()
            assert go_on.wait(10)
        return real_copy(ti)

    enc._copy = slow_copy  # type: ignore[method-assign]
    got = bytearray(enc.header)
    stream = enc.iter_data()
    got.extend(next(stream))
    assert copying.wait(10)  # the copier holds tensor 3 (back to front)
    froze: queue.Queue[int] = queue.Queue()
    freezer = threading.Thread(target=lambda: froze.put(enc.freeze(10.0)))
    freezer.start()
    with pytest.raises(queue.Empty):
        froze.get(timeout=0.3)  # the freeze waits for the tensor in hand
    go_on.set()
    copied = froze.get(timeout=10)
    freezer.join(10)
    assert order[0] == 3 and enc.precopied == 1 << 20
    assert copied == 3 << 20  # the freeze copied the other three
    for t in sd.values():
        t.add_(1)
    for piece in stream:
        got.extend(piece)
    assert_same(want, wire.decode(bytes(got)))


def test_a_tensor_changed_under_the_background_copy_is_never_delivered() -> None:
    """An in-place change outside an optimizer step (a bug in the caller) while the
    copier copies that tensor: its copy may be torn, so the offer is spoiled and every
    later read is refused, naming the tensor."""
    from rallypoint.transports._live import StateChanged

    sd, _, enc = _live_state()
    real_copy = enc._copy

    def changed_during_copy(ti: int) -> Any:
        sd[f"t{ti}"].add_(1)
        return real_copy(ti)

    enc._copy = changed_during_copy  # type: ignore[method-assign]
    stream = enc.iter_data()
    next(stream)
    enc._precopier.join(10)
    assert enc.spoiled is not None and "tensor ['t3'] changed while it was served" in enc.spoiled
    with pytest.raises(StateChanged, match="changed while it was served"):
        for _ in stream:
            pass


def test_a_big_piece_is_summed_part_by_part_and_dropped_when_a_freeze_overtakes_it() -> None:
    """A piece larger than the send size is summed one part at a time, each just before it
    is sent, and its sum (over the whole piece) follows the last part. A freeze that begins
    while such a piece of live memory is on its way may let the caller change the memory
    between two parts, so the stream ends there (``Overtaken``) instead of sending a sum
    that would agree with a torn piece; the range fetched again comes from the frozen
    copy, as served."""
    from rallypoint.transports import _tensors as T
    from rallypoint.transports._crc import CRC32, XXH3
    from rallypoint.transports._encode import Overtaken
    from rallypoint.transports._header import SUM

    sd, want, enc = _live_state(precopy=False)  # 4 tensors of 1 MiB, pieces of 256 KiB
    for kind in [CRC32, XXH3]:
        assert kind is not None
        parts = list(enc.iter_data(0, 1 << 20, 64 << 10, kind))  # tensor 0: 4 x (4 parts + a sum)
        assert [p.nbytes for p in parts] == ([64 << 10] * 4 + [4]) * 4
        for i in range(4):
            piece = b"".join(bytes(p) for p in parts[5 * i : 5 * i + 4])
            assert SUM.unpack(parts[5 * i + 4])[0] == kind.of(piece)

    stream = enc.iter_data(1 << 20, 2 << 20, 64 << 10)  # tensor 1, not yet delivered
    first = next(stream)
    assert first.nbytes == 64 << 10
    assert enc.freeze(1.0) == 3 << 20  # tensors 1-3 copied; tensor 0 was delivered (twice)
    for t in sd.values():
        t.add_(1)  # the caller's optimizer step, right after the freeze
    with pytest.raises(Overtaken, match="t1"):
        for _ in stream:
            pass
    again = list(enc.iter_data(1 << 20, 4 << 20, 64 << 10))  # tensors 1-3, from the copies
    assert len(again) == 5 * 12
    data = b""
    for i in range(12):
        piece = b"".join(bytes(p) for p in again[5 * i : 5 * i + 4])
        assert SUM.unpack(again[5 * i + 4])[0] == CRC32.of(piece)
        data += piece
    assert data == b"".join(bytes(T.byte_view(want[k])) for k in ["t1", "t2", "t3"])


def test_a_live_piece_still_on_its_way_when_the_freeze_returns_does_not_count_as_delivered() -> None:
    """A piece of live memory, summed whole, is on its way when the freeze returns and the
    caller steps: its bytes no longer match its sum, so its receiver fetches the range again
    from the copy. That piece must not count towards delivery (counted, the state could be
    withdrawn as delivered before the retry, which then got HTTP 410); the copy's does."""
    from rallypoint.transports import _tensors as T
    from rallypoint.transports._crc import CRC32
    from rallypoint.transports._header import SUM

    sd, want, enc = _live_state(precopy=False)  # 4 tensors of 1 MiB, pieces of 256 KiB
    stream = enc.iter_data(1 << 20, 2 << 20, 256 << 10)  # tensor 1: each piece summed whole
    data = next(stream)  # summed, handed to the socket, not yet copied by the kernel
    assert data.nbytes == 256 << 10
    enc.freeze(1.0)
    for t in sd.values():
        t.add_(1)  # the caller's optimizer step, right after the freeze
    rest = list(stream)  # the first piece's sum, then three pieces from the copy
    assert SUM.unpack(rest[0])[0] != CRC32.of(bytes(data))  # the receiver's check fails: it asks again
    assert not enc.delivered_tensor(1) and not enc.delivered
    again = list(enc.iter_data(1 << 20, (1 << 20) + (256 << 10), 256 << 10))  # the range again, from the copy
    assert bytes(again[0]) == bytes(T.byte_view(want["t1"]))[: 256 << 10]
    assert SUM.unpack(again[1])[0] == CRC32.of(bytes(again[0]))
    assert enc.delivered_tensor(1)


def test_a_big_piece_changed_between_two_parts_outside_an_optimizer_step_never_gets_its_sum() -> None:
    """Summed part by part, a piece changed in place between two of its parts (a bug in the
    caller: no freeze, no optimizer step) would get a sum that agrees with the torn bytes.
    The version counter is checked before the sum leaves: the stream ends with the error
    naming the tensor, and the offer is spoiled (every later read is refused)."""
    from rallypoint.transports._live import StateChanged

    sd, _, enc = _live_state(precopy=False)
    stream = enc.iter_data(1 << 20, 2 << 20, 64 << 10)
    sent = [next(stream).nbytes]
    sd["t1"].add_(1)
    with pytest.raises(StateChanged, match=r"t1'\] changed while it was served"):
        for part in stream:
            sent.append(part.nbytes)
    assert sent == [64 << 10] * 4  # the first piece's parts, and no sum after them
    with pytest.raises(StateChanged, match="changed while it was served"):
        next(enc.iter_data(2 << 20, 3 << 20, 64 << 10))


def test_a_heal_overtaken_by_the_senders_step_mid_piece_still_gets_the_state_as_served(
        transports: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Over HTTP: a receiver is part-way through a big piece of live memory when the sender
    freezes (``disallow_checkpoint``) and changes its state. That stream is dropped at the
    end of the piece, the receiver fetches the range again, from the frozen copy, and gets
    the state as served."""
    import copy as copy_mod

    from rallypoint.transports import http as http_mod

    monkeypatch.setattr(http_mod, "SEND_PIECE", 64 << 10)
    src = transports(HoldPart, part=64 << 10, block=256 << 10, copy_below=0)
    dst = transports(num_chunks=2)
    sd = make_state(11, n=4, numel=1 << 18)  # four 1 MiB tensors: pieces of four parts
    want = copy_mod.deepcopy(sd)
    src.send_checkpoint([1], 1, sd, TEN)
    assert isinstance(src, HoldPart)
    with caplog.at_level(logging.INFO, logger="rallypoint"):
        assert_same(want, step_during_heal(src, dst, sd, src.held, src.go, TEN))
    assert "frozen while a piece of it was sent" in caplog.text
