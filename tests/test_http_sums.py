"""The kinds of inline sum an HTTP heal carries (rallypoint/transports/_crc.py): a receiver
asks for XXH3, a source that knows it sends it and says so, one that does not (an older
release) sends CRC-32 and says nothing, and every mix verifies every byte. Real servers
on 127.0.0.1; the "older release" is our server with the kind negotiation taken out."""

from __future__ import annotations

import copy
import io
import os
import struct
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
import torch

from rallypoint.transports import _crc, wire
from rallypoint.transports._http_recv import SUM_HEADER
from rallypoint.transports._range_writer import COALESCE_BELOW, SUM_AS_READ
from rallypoint.transports._http_serve import Reply, Request
from rallypoint.transports.http import HTTPTransport, TransferError
from test_http_transport import (  # noqa: F401 - the fixture is used by name
    MANY_RANGES, SMALL_BLOCKS, Faulty, assert_same, make_state, transports, zeros_like_state)
from live_heal import HoldPart, step_during_heal

TEN = timedelta(seconds=10)
pytestmark = pytest.mark.skipif(_crc.XXH3 is None, reason="the xxhash package (a dependency) is not installed")


class OldSource(HTTPTransport):
    """A source from before sum kinds: ignores ``sum=`` and names no kind (CRC-32)."""

    def _route(self, request: Request) -> Reply:
        request.query.pop("sum", None)
        reply = super()._route(request)
        reply.headers.pop(SUM_HEADER, None)
        return reply


class SaysKind(HTTPTransport):
    """A source that sends CRC-32 sums but names another kind in its reply."""

    said = "sha-512"

    def _route(self, request: Request) -> Reply:
        request.query.pop("sum", None)
        reply = super()._route(request)
        if reply.status == 200 and SUM_HEADER in reply.headers:
            reply.headers[SUM_HEADER] = self.said
        return reply


# ------------------------------------------------------------------ the kinds themselves
@pytest.mark.parametrize("name", sorted(k for k, v in _crc.SUM_KINDS.items() if v.verifies))
@pytest.mark.parametrize("cuts", [(), (1,), (3, 4096), (65536, 65537, 100_000)])
def test_a_running_sum_equals_the_one_shot_sum_wherever_the_reads_are_cut(name: str, cuts: tuple[int, ...]) -> None:
    kind = _crc.SUM_KINDS[name]
    data = memoryview(os.urandom(150_000))
    state = kind.begin()
    at = 0
    for c in (*cuts, len(data)):
        state = kind.update(state, data[at:c])
        at = c
    assert kind.value(state) == kind.of(data)
    assert 0 <= kind.of(data) < 2**32  # four bytes on the wire
    flipped = bytearray(data)
    flipped[77_777] ^= 0x04
    assert kind.of(flipped) != kind.of(data)


def test_the_kinds_are_crc32_and_xxh3_and_an_unknown_name_is_none() -> None:
    assert _crc.CRC32.of(b"rallypoint") == zlib.crc32(b"rallypoint")  # zlib's values, whichever library
    assert _crc.kind_named(None) is _crc.CRC32 and _crc.kind_named("") is _crc.CRC32  # a source that names none
    assert _crc.kind_named("xxh3") is _crc.XXH3 and _crc.fastest() is _crc.XXH3
    assert _crc.kind_named("md5") is None and _crc.kind_named("x" * 10_000) is None
    none = _crc.kind_named("none")  # opt-in: a constant in each sum's place
    assert none is _crc.NONE and not none.verifies and none.of(b"a") == none.of(b"b") == 0
    assert all(k.verifies for k in (_crc.CRC32, _crc.XXH3))


def test_an_unknown_checksum_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="checksum='md5': this process knows crc32, xxh3, none"):
        HTTPTransport(TEN, bind="127.0.0.1:0", checksum="md5")


@pytest.mark.parametrize("mode", ["write", "pull", "mixed"])
def test_a_sink_verifies_xxh3_sums_however_the_bytes_arrive(mode: str) -> None:
    """Every way a range is written (push in chunks that cut pieces and sums anywhere, pull
    straight into the tensors, a piece begun by one and finished by the other) checks the
    XXH3 sums; a CRC-32 writer on the same bytes fails, naming the tensor."""
    assert _crc.XXH3 is not None
    sd = {f"t{i}": torch.randn(i * 4099 + 1) for i in range(12)}  # pieces both sides of COALESCE_BELOW
    enc = wire.encode(sd, block=256 << 10, sums="inline")
    header = wire.read_header(io.BytesIO(enc.header).readinto)
    data = b"".join(bytes(c) for c in enc.iter_data(0, header.data_bytes, sum_kind=_crc.XXH3))
    assert len(data) == header.wire_bytes(0, header.data_bytes)
    sink = wire.Sink(header)
    w = sink.writer(0, header.data_bytes, _crc.XXH3)
    src = io.BytesIO(data)
    if mode == "write":
        for i in range(0, len(data), 1000):
            w.write(data[i : i + 1000])
    else:
        if mode == "mixed":  # write into the first big piece, then pull from there on
            pi = next(i for i, p in enumerate(header.pieces) if p[1] >= COALESCE_BELOW + 1000)
            w.write(src.read(header.pieces[pi][0] + 4 * pi + 1000))
        w.pull(src.readinto)
    w.close()
    assert_same(sd, sink.finish())
    bad = wire.Sink(header).writer(0, header.data_bytes)  # CRC-32: the default
    with pytest.raises(wire.WireError, match=r"\['t0'\]: checksum mismatch"):
        bad.pull(io.BytesIO(data).readinto)
    with pytest.raises(ValueError, match="inline only"):
        wire.Sink(wire.read_header(io.BytesIO(wire.encode(sd).header).readinto)).writer(0, 8, _crc.XXH3)


# ------------------------------------------------------------------ on the wire
def test_a_range_asked_with_xxh3_carries_xxh3_sums_and_says_so(transports: Callable[..., HTTPTransport]) -> None:
    src = transports(**SMALL_BLOCKS)
    sd = make_state(3)
    src.send_checkpoint([1], 2, sd, TEN)
    header = wire.read_header(io.BytesIO(httpx.get(f"{src.metadata()}/checkpoint/2/header", timeout=5).content).readinto)
    start, ln = header.pieces[0][0], header.pieces[0][1]
    assert _crc.XXH3 is not None
    for asked, want in ((None, _crc.CRC32), ("crc32", _crc.CRC32), ("xxh3", _crc.XXH3), ("md5", _crc.CRC32)):
        params: dict[str, Any] = {"start": start, "end": start + ln, **({"sum": asked} if asked else {})}
        r = httpx.get(f"{src.metadata()}/checkpoint/2/data", params=params, timeout=5)
        assert r.status_code == 200 and r.headers[SUM_HEADER] == want.name
        body = r.content
        assert len(body) == ln + 4
        assert struct.unpack("<I", body[ln:])[0] == want.of(body[:ln]), asked


@pytest.mark.parametrize("src_cls, checksum, kind", [
    (HTTPTransport, None, "xxh3"),  # both new: XXH3
    (HTTPTransport, "crc32", "crc32"),  # a receiver that asks for CRC-32 gets it
    (OldSource, None, "crc32"),  # an older source: CRC-32, and the receiver verifies that
    (HTTPTransport, "none", "none"),  # no sums, asked for (opt-in)
    (OldSource, "none", "crc32"),  # an older source does not know none: CRC-32, verified
])
def test_every_mix_of_source_and_receiver_delivers_the_state(
        transports: Callable[..., HTTPTransport], src_cls: type[HTTPTransport], checksum: str | None,
        kind: str) -> None:
    seen: list[str | None] = []
    orig = wire.Sink.writer

    def writer(self: wire.Sink, start: int, end: int, sum_kind: _crc.SumKind = _crc.CRC32) -> Any:
        seen.append(sum_kind.name)
        return orig(self, start, end, sum_kind)

    src = transports(src_cls, **SMALL_BLOCKS)
    dst = transports(checksum=checksum, **MANY_RANGES)
    sd = make_state(5)
    src.send_checkpoint([1], 1, sd, TEN)
    mp = pytest.MonkeyPatch()
    mp.setattr(wire.Sink, "writer", writer)
    try:
        assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))
        into = zeros_like_state(sd)
        dst.recv_checkpoint(0, src.metadata(), 1, TEN, into=into)
        assert_same(sd, into)
    finally:
        mp.undo()
    assert len(seen) > 20 and set(seen) == {kind}


@pytest.mark.parametrize("checksum", ["xxh3", "crc32"])
def test_a_flipped_bit_fails_the_range_under_either_kind_and_the_retry_delivers(
        transports: Callable[..., HTTPTransport], checksum: str) -> None:
    src = transports(Faulty, mode="flip", faults=2, **SMALL_BLOCKS)
    dst = transports(checksum=checksum, **MANY_RANGES)
    sd = make_state(7)
    src.send_checkpoint([1], 1, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))
    assert isinstance(src, Faulty) and src.requests > 2  # the two flipped ranges were fetched again


@pytest.mark.parametrize("said, checksum, match", [
    ("sha-512", None, "sums are of kind 'sha-512', which this receiver does not know"),
    ("none", None, "the source sent no sums, and this receiver asked for xxh3"),  # never taken unasked
    ("none", "crc32", "the source sent no sums, and this receiver asked for crc32"),
])
def test_a_source_whose_sums_the_receiver_cannot_use_is_refused_and_the_target_is_untouched(
        transports: Callable[..., HTTPTransport], said: str, checksum: str | None, match: str) -> None:
    src = transports(SaysKind, **SMALL_BLOCKS)
    src.said = said  # type: ignore[attr-defined]
    dst = transports(timeout=timedelta(seconds=3), checksum=checksum, **MANY_RANGES)
    sd = make_state(9)
    src.send_checkpoint([1], 1, sd, TEN)
    into = zeros_like_state(sd)
    with pytest.raises(TransferError, match=match):
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=3), into=into)
    assert all(not t.any() for t in into["model"].values() if isinstance(t, torch.Tensor))


def test_a_source_that_names_the_wrong_kind_fails_the_checksum(transports: Callable[..., HTTPTransport]) -> None:
    """A source that sends CRC-32 sums but says XXH3 is caught by the sums themselves."""
    src = transports(SaysKind, **SMALL_BLOCKS)
    src.said = "xxh3"  # type: ignore[attr-defined]
    dst = transports(timeout=timedelta(seconds=3), **MANY_RANGES)
    src.send_checkpoint([1], 1, make_state(4), TEN)
    with pytest.raises(TransferError, match="checksum mismatch"):
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=3))


# ------------------------------------------------------------------ no sums (opt-in)
def test_no_sums_is_the_receivers_choice_and_delivers_the_state(transports: Callable[..., HTTPTransport]) -> None:
    src = transports(**SMALL_BLOCKS)
    dst = transports(checksum="none", **MANY_RANGES)
    sd = make_state(6)
    src.send_checkpoint([1], 1, sd, TEN)
    into = zeros_like_state(sd)
    dst.recv_checkpoint(0, src.metadata(), 1, TEN, into=into)
    assert_same(sd, into)
    raw = httpx.get(f"{src.metadata()}/checkpoint/1/header", timeout=5).content
    header = wire.read_header(io.BytesIO(raw).readinto)
    start, ln = header.pieces[0][0], header.pieces[0][1]
    r = httpx.get(f"{src.metadata()}/checkpoint/1/data", params={"start": start, "end": start + ln, "sum": "none"},
                  timeout=5)
    assert r.status_code == 200 and r.headers[SUM_HEADER] == "none"
    assert len(r.content) == ln + 4 and r.content[ln:] == b"\0\0\0\0"  # the marker in the sum's place


@pytest.mark.parametrize("checksum", [None, "none"])
def test_a_live_piece_changed_after_the_freeze_is_never_taken_whole_with_or_without_sums(
        transports: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch, checksum: str | None) -> None:
    """A piece of live memory (one part: summed whole, where there are sums) is on its way
    when the sender freezes and changes its state. With sums, the receiver's check fails
    and it fetches the piece again from the copy; without sums, the piece goes part by part
    and its end check drops the stream instead of sending the marker. Either way the
    receiver gets the state as served."""
    from rallypoint.transports import http as http_mod

    monkeypatch.setattr(http_mod, "SEND_PIECE", 64 << 10)
    src = transports(HoldPart, part=64 << 10, before=True, block=64 << 10, copy_below=0)
    dst = transports(num_chunks=1, checksum=checksum)
    sd = make_state(14, n=2, numel=1 << 16)  # two 256 KiB tensors: pieces of one part each
    want = copy.deepcopy(sd)
    src.send_checkpoint([1], 1, sd, TEN)
    assert isinstance(src, HoldPart)
    assert_same(want, step_during_heal(src, dst, sd, src.held, src.go, TEN))


@pytest.mark.parametrize("kind", ["none", "crc32"])
def test_reads_per_piece_whole_without_sums_and_by_sum_as_read_with_them(kind: str) -> None:
    """Without sums a big piece's rest is asked for in one read (nothing to sum while it is
    cached); with sums, at most SUM_AS_READ bytes per read. A stream cut inside a piece
    fails either way, and a retry resumes at that piece's start."""
    sk = _crc.kind_named(kind)
    assert sk is not None
    numel = (3 * SUM_AS_READ) // 4  # 3 MiB float32: one piece of a 4 MiB block
    sd = {"a": torch.randn(numel), "b": torch.randn(numel)}
    enc = wire.encode(sd, block=4 << 20, sums="inline")
    header = wire.read_header(io.BytesIO(enc.header).readinto)
    data = b"".join(bytes(c) for c in enc.iter_data(0, header.data_bytes, sum_kind=sk))
    asked: list[int] = []

    def reader(stream: bytes) -> Callable[[memoryview], int]:
        pos = [0]

        def readinto(mv: memoryview) -> int:
            asked.append(mv.nbytes)
            k = min(mv.nbytes, len(stream) - pos[0])
            mv[:k] = stream[pos[0]: pos[0] + k]
            pos[0] += k
            return k

        return readinto

    sink = wire.Sink(header)
    w = sink.writer(0, header.data_bytes, sk)
    w.pull(reader(data))
    w.close()
    assert_same(sd, sink.finish())
    big = [n for n in asked if n > 4]  # the 4-byte sums are read exactly
    if kind == "none":
        assert big == [numel * 4, numel * 4]
    else:
        assert max(big) == SUM_AS_READ and len(big) == 6
    cut = wire.Sink(header)
    w = cut.writer(0, header.data_bytes, sk)
    with pytest.raises(wire.WireError, match="truncated"):
        w.pull(reader(data[: numel * 4 + 4 + 1000]))  # "a" whole, then part of "b"
    assert w.verified_to == header.pieces[1][0]


def test_the_environment_chooses_the_sums_when_the_constructor_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_HEAL_CHECKSUM", "none")
    t = HTTPTransport(TEN, bind="127.0.0.1:0")
    try:
        assert t.sum_kind is _crc.NONE
    finally:
        t.shutdown()
    t = HTTPTransport(TEN, bind="127.0.0.1:0", checksum="crc32")  # the argument wins
    try:
        assert t.sum_kind is _crc.CRC32
    finally:
        t.shutdown()
    monkeypatch.setenv("RALLYPOINT_HEAL_CHECKSUM", "md5")
    with pytest.raises(ValueError, match="RALLYPOINT_HEAL_CHECKSUM='md5': this process knows"):
        HTTPTransport(TEN, bind="127.0.0.1:0")
