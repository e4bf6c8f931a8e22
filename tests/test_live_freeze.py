"""The freeze's choice between copying the undelivered tail and waiting for the receivers
(rallypoint.transports._live: ``wait_for_delivery`` and its use in ``LiveEncoded.freeze``)."""

from __future__ import annotations

import copy as copy_mod
import threading
import time
from typing import Any

import pytest
import torch

from rallypoint.transports import _live, wire
from rallypoint.transports._crc import CRC32
from rallypoint.transports._live import LiveEncoded, wait_for_delivery
from test_http_transport import assert_same

MiB = 1 << 20
GB = 1e9


@pytest.mark.parametrize(
    ("left_send", "rate_before", "left_copy", "copy_rate", "rate_copying", "want"),
    [
        # 0.1 GB left at 2 GB/s (0.05 s) against 0.5 GB to copy at 1 GB/s while the
        # transfer still makes 0.5 GB/s (meets in 0.33 s): wait, at most 2 x 0.05 s.
        (0.1 * GB, 2 * GB, 0.5 * GB, 1 * GB, 0.5 * GB, 0.1),
        # The copy is fast and costs the transfer nothing: meeting in the middle (0.05 s)
        # beats waiting (0.25 s): copy.
        (0.5 * GB, 2 * GB, 0.5 * GB, 8 * GB, 2 * GB, 0.0),
        # Equal estimates: copy (it needs nothing from a receiver).
        (1 * GB, 1 * GB, 2 * GB, 1 * GB, 1 * GB, 0.0),
        # Waiting is sooner, but twice the expected wait exceeds the copy's time: the
        # copy's time bounds the wait.
        (0.3 * GB, 1 * GB, 0.5 * GB, 1 * GB, 0.0, 0.5),
        # Nothing to copy, nothing left to send, or no rate yet: copy (nothing to weigh).
        (0.1 * GB, 1 * GB, 0.0, 1 * GB, 0.0, 0.0),
        (0.0, 1 * GB, 0.1 * GB, 1 * GB, 0.0, 0.0),
        (0.1 * GB, 0.0, 0.1 * GB, 1 * GB, 0.0, 0.0),
        (0.1 * GB, 1 * GB, 0.1 * GB, 0.0, 0.0, 0.0),
    ],
)
def test_wait_only_when_the_receivers_finish_sooner_than_copying_would(
        left_send: float, rate_before: float, left_copy: float, copy_rate: float, rate_copying: float,
        want: float) -> None:
    assert wait_for_delivery(left_send, rate_before, left_copy, copy_rate, rate_copying) == pytest.approx(want)


def _state(n: int = 4) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], LiveEncoded]:
    """``n`` tensors of 1 MiB served live (one piece each), a copy, and the encoding."""
    sd = {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(n)}
    enc = LiveEncoded(wire.encode(sd, block=MiB, copy_below=1, sums="inline"), receivers=1)
    return sd, copy_mod.deepcopy(sd), enc


def _weigh(pause: float, calls: list[tuple[float, ...]], weighed: threading.Event | None = None) -> Any:
    """A stand-in for ``wait_for_delivery`` that records its arguments, answers
    ``pause`` and sets ``weighed``: a receiver that reads on only then cannot finish
    before the freeze has weighed (it then waits on the lock the freeze's wait frees)."""
    def decide(*args: float) -> float:
        calls.append(args)
        if weighed is not None:
            weighed.set()
        return pause
    return decide


def test_a_freeze_waits_for_a_receiver_about_to_finish_instead_of_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver has two of four tensors when the step's freeze comes. The freeze
    copies the last one (back to front), weighs what is left, and waits: the receiver
    reads the other two meanwhile, from live memory, and the freeze returns having copied
    one tensor, not two. The stream the receiver got is the state as served."""
    monkeypatch.setattr(_live, "MEASURE_S", 0.0)  # weigh after the first copy, however quick
    calls: list[tuple[float, ...]] = []
    weighed = threading.Event()
    monkeypatch.setattr(_live, "wait_for_delivery", _weigh(30.0, calls, weighed))
    sd, want, enc = _state()
    got = bytearray(enc.header)
    stream = enc.iter_data()
    while not enc.delivered_tensor(1):  # tensors 0 and 1 (tensor 2's first bytes are out)
        got.extend(next(stream))

    def receiver() -> None:
        assert weighed.wait(10)  # the freeze copied the last tensor and chose to wait
        for piece in stream:  # the rest: tensor 2 from live memory, tensor 3 from its copy
            got.extend(piece)

    th = threading.Thread(target=receiver)
    th.start()
    copied = enc.freeze(30.0)
    th.join(10)
    assert not th.is_alive()
    assert copied == MiB  # the last tensor only: tensor 2 arrived while the freeze waited
    assert enc.delivered
    (args,) = calls
    left_send, rate_before, left_copy, copy_rate, _ = args
    assert left_send == 2 * MiB and left_copy == MiB and rate_before > 0 and copy_rate > 0
    for t in sd.values():
        t.add_(1)  # the optimizer step, after the freeze
    assert_same(want, wire.decode(bytes(got)))


def test_a_delivery_completing_while_the_freeze_waits_is_completed_by_the_freeze(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport frees a live state once its last receiver has every byte
    (``on_complete``). When that delivery completes while the step's freeze waits for
    the receivers, the freeze must find nothing left to do and return, and the state be
    freed by then; it used to be freed under the running freeze, on the receiver's
    serving thread, and the step's ``disallow_checkpoint`` raised IndexError (seen in
    ``bench/heal_stall.py --compute wait``)."""
    monkeypatch.setattr(_live, "MEASURE_S", 0.0)
    weighed = threading.Event()
    monkeypatch.setattr(_live, "wait_for_delivery", _weigh(30.0, [], weighed))
    sd = {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(4)}
    want = copy_mod.deepcopy(sd)
    released = threading.Event()
    enc: LiveEncoded

    def free_on_delivery() -> None:  # what HTTPTransport's on_complete does, once no stream reads
        enc.release()
        released.set()

    enc = LiveEncoded(wire.encode(sd, block=MiB, copy_below=1, sums="inline"), receivers=1,
                      on_complete=free_on_delivery)
    got = bytearray(enc.header)
    stream = enc.iter_data()
    while not enc.delivered_tensor(1):
        got.extend(next(stream))

    def receiver() -> None:
        assert weighed.wait(10)
        for piece in stream:
            got.extend(piece)

    th = threading.Thread(target=receiver)
    th.start()
    t0 = time.monotonic()
    copied = enc.freeze(30.0)  # copies tensor 3, waits; the receiver takes 2 and 3; the freeze frees it
    th.join(10)
    assert not th.is_alive()
    assert copied == MiB  # tensor 3 only: tensor 2 was delivered while the freeze waited
    assert released.is_set() and enc.views == []
    assert time.monotonic() - t0 < 10.0  # woken by the delivery, not the 30 s bound
    for t in sd.values():
        t.add_(1)
    assert_same(want, wire.decode(bytes(got)))


def test_a_freeze_waits_for_a_stalled_receiver_no_longer_than_it_was_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that stops reading after two tensors: the freeze waits the bounded
    time, then copies what is left, and the caller's step goes on; the receiver that
    comes back later gets the state as served, from the copies."""
    monkeypatch.setattr(_live, "MEASURE_S", 0.0)
    monkeypatch.setattr(_live, "wait_for_delivery", _weigh(0.2, []))
    sd, want, enc = _state()
    got = bytearray(enc.header)
    stream = enc.iter_data()
    while not enc.delivered_tensor(1):
        got.extend(next(stream))
    t0 = time.monotonic()
    copied = enc.freeze(30.0)
    took = time.monotonic() - t0
    assert copied == 2 * MiB  # tensors 3 and 2: nobody delivered them
    assert 0.2 <= took < 5.0
    for t in sd.values():
        t.add_(1)
    for piece in stream:
        got.extend(piece)
    assert_same(want, wire.decode(bytes(got)))


def test_a_freeze_with_nothing_delivered_yet_copies_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """No receiver has read anything: there is no delivery rate to weigh, and the real
    rule copies everything at once (the receiver may never come)."""
    monkeypatch.setattr(_live, "MEASURE_S", 0.0)
    sd, want, enc = _state()
    t0 = time.monotonic()
    assert enc.freeze(30.0) == 4 * MiB
    assert time.monotonic() - t0 < 5.0
    for t in sd.values():
        t.add_(1)
    assert_same(want, wire.decode(b"".join(bytes(v) for v in enc.iter_stream())))


def _drain(enc: LiveEncoded, start: int, end: int) -> None:
    for _ in enc.iter_data(start, end, sum_kind=CRC32):
        pass


def test_a_piece_sent_twice_does_not_stand_in_for_a_piece_never_sent() -> None:
    """Delivery is counted piece by piece: a receiver that fetches a range again (its first
    attempt failed after some pieces left) has those pieces sent twice, and that must not
    make up for a piece of the same tensor that was never sent (counted per tensor, it
    did: the tensor was retired at the freeze and the fetch of its last piece got 410)."""
    sd = {"w": torch.arange(MiB // 4, dtype=torch.float32)}  # one tensor of four 256 KiB pieces
    enc = LiveEncoded(wire.encode(sd, block=MiB // 4, copy_below=0, sums="inline"), receivers=1)
    starts = [p[0] for p in enc.pieces]
    assert len(starts) == 4
    _drain(enc, starts[0], starts[2])  # pieces 0 and 1
    _drain(enc, starts[0], starts[3])  # pieces 0, 1 again, and 2: six sends, piece 3 never
    assert not enc.delivered_tensor(0) and not enc.delivered
    _drain(enc, starts[3], enc.data_bytes)
    assert enc.delivered_tensor(0) and enc.delivered


def test_small_pieces_count_as_sent_only_once_their_batch_has_left() -> None:
    """Small tensors travel copied into one batch; a stream dropped before the batch left
    sent none of them, so none counts towards delivery."""
    sd = {f"b{i}": torch.full((1024,), float(i)) for i in range(4)}  # 4 KiB each: one batch
    enc = LiveEncoded(wire.encode(sd, block=MiB, copy_below=0, sums="inline"), receivers=1)
    stream = enc.iter_data(0, enc.data_bytes, sum_kind=CRC32)
    batch = next(stream)  # handed out, but its send fails: the connection closes the stream
    assert batch.nbytes == enc.wire_bytes(0, enc.data_bytes)
    stream.close()
    assert not any(enc.delivered_tensor(i) for i in range(4)) and not enc.delivered
    _drain(enc, 0, enc.data_bytes)
    assert enc.delivered
