"""The safe wire format: identity for random state dicts, and clear errors for every fault.

Equality is bit-exact (tensors compared as bytes, so NaN payloads and -0.0 count), and
containers must come back with the same types (tuple stays tuple, OrderedDict stays one).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import math
import random
import struct
import warnings
import zlib
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.transports import wire
from rallypoint.transports._tensors import DTYPES
from rallypoint.transports.wire import WireError

DTYPE_LIST = sorted(DTYPES)


def as_bytes(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    return bytes(flat.view(torch.uint8).tolist())


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact, type-exact equality of two state dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), path
        assert as_bytes(a) == as_bytes(b), path
        return
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def make_tensor(dtype_name: str, shape: list[int], seed: int, view: str) -> torch.Tensor:
    """Random bits of ``dtype`` (bool: 0/1), optionally as a non-contiguous or offset view."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seed)
    big = list(shape) + [2] if view == "step" else list(shape)
    n = math.prod(big) if big else 1
    if view == "offset":
        n += 3
    if dtype == torch.bool:
        base = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        item = torch.empty((), dtype=dtype).element_size()
        base = torch.randint(0, 256, (n * item,), generator=g, dtype=torch.uint8).view(dtype)
    if view == "offset":
        return base[3:].reshape(shape)  # a slice of a bigger storage
    t = base.reshape(big)
    if view == "step":
        return t[..., 0]  # every other element
    if view == "transpose" and t.dim() >= 2:
        return t.transpose(0, 1)
    return t


tensors = st.builds(
    make_tensor,
    st.sampled_from(DTYPE_LIST),
    st.lists(st.integers(0, 4), max_size=3),
    st.integers(0, 2**31),
    st.sampled_from(["plain", "offset", "step", "transpose"]),
)
scalars = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8), st.booleans(), st.none()
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))
state_dicts = st.recursive(
    st.one_of(tensors, scalars),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=3).map(OrderedDict),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts, block=st.sampled_from([1, 5, 64, wire.DEFAULT_BLOCK]))
def test_roundtrip_identity(sd: Any, block: int) -> None:
    assert_same(sd, wire.decode(wire.to_bytes(sd, block=block)))


@settings(max_examples=40, deadline=None)
@given(sd=st.dictionaries(st.text(max_size=4), tensors, min_size=1, max_size=5), in_place=st.booleans())
def test_roundtrip_into_target(sd: dict[str, Any], in_place: bool) -> None:
    """Received into a target of matching tensors: those tensor objects hold the values."""
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    out = wire.decode(wire.to_bytes(sd), into=target, in_place=in_place)
    assert_same(sd, out)
    for k in sd:
        assert out[k] is target[k]


def test_every_dtype_is_covered() -> None:
    for name in ["float32", "float64", "float16", "bfloat16", "bool", "int8", "int16", "int32", "int64", "uint8"]:
        assert name in DTYPES
    if hasattr(torch, "float8_e4m3fn"):
        assert "float8_e4m3fn" in DTYPES and "float8_e5m2" in DTYPES


def test_only_viewed_bytes_travel() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    enc = wire.encode({"s": big[10:20], "t": big[:4000].reshape(40, 100).t()[:3]})
    assert enc.data_bytes == 10 * 4 + 3 * 40 * 4
    out = wire.decode(wire.to_bytes({"s": big[10:20]}))
    assert torch.equal(out["s"], big[10:20])


def test_conjugate_and_parameter_and_size() -> None:
    c = torch.randn(4, dtype=torch.complex64)
    p = torch.nn.Parameter(torch.randn(3))
    sd = {"c": c.conj(), "p": p, "size": torch.Size([2, 3]), "nan": float("nan"), "inf": -math.inf}
    out = wire.decode(wire.to_bytes(sd))
    assert torch.equal(out["c"], c.conj().resolve_conj())
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert out["size"] == torch.Size([2, 3]) and type(out["size"]) is torch.Size
    assert math.isnan(out["nan"]) and out["inf"] == -math.inf


def test_module_and_optimizer_state_dict() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    sd = {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7}
    out = wire.decode(wire.to_bytes(sd))
    assert_same(sd, out)
    assert out["model"]._metadata == sd["model"]._metadata
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    m2.load_state_dict(out["model"])
    opt2 = torch.optim.AdamW(m2.parameters())
    opt2.load_state_dict(out["optim"])


# --------------------------------------------------------------------------- encode errors


class Opaque:
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; still a leaf to refuse
        return torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    "sd, key",
    [
        ({"a": {"b": {1, 2}}}, "['a']['b']"),
        ({"a": [1, Opaque()]}, "['a'][1]"),
        ({"a": {(1, 2): 3}}, "['a']"),
        ({"a": _quantized()}, "['a']"),
        ({"a": torch.randn(2).to_sparse()}, "['a']"),
        ({"a": torch.zeros(2, dtype=torch.uint4)} if hasattr(torch, "uint4") else {"a": Opaque()}, "['a']"),
    ],
)
def test_encode_rejects_disallowed_leaves(sd: Any, key: str) -> None:
    with pytest.raises(WireError) as ei:
        wire.encode(sd)
    assert ei.value.key == key and key in str(ei.value)


def test_encode_rejects_cycles() -> None:
    x: list[Any] = []
    x.append(x)
    with pytest.raises(WireError, match="deeper"):
        wire.encode({"x": x})


# --------------------------------------------------------------------------- decode faults


def sample() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(7, 5, generator=g), "b": torch.arange(6, dtype=torch.int16), "n": 3, "s": "x"}


def fresh_target() -> dict[str, Any]:
    return {"w": torch.full((7, 5), 9.0), "b": torch.full((6,), 9, dtype=torch.int16), "n": 0, "s": ""}


def assert_untouched(t: dict[str, Any]) -> None:
    assert_same(t, fresh_target())


def test_truncation_anywhere_is_an_error_and_target_untouched() -> None:
    data = wire.to_bytes(sample(), block=16)
    enc = wire.encode(sample(), block=16)
    hdr_end = len(enc.header)
    cuts = sorted(set(range(0, 24)) | set(range(hdr_end - 4, len(data))) | set(range(24, hdr_end, 37)))
    target = fresh_target()
    for cut in cuts:
        with pytest.raises(WireError, match="truncated") as ei:
            wire.decode(data[:cut], into=target)
        assert not ei.value.target_modified
        region = "header length" if cut < wire.PREFIX_BYTES else "header" if cut < hdr_end else "tensor"
        assert region in str(ei.value), (cut, str(ei.value))
    assert_untouched(target)


@pytest.mark.parametrize("sums", ["header", "inline"])
def test_flipped_byte_anywhere_is_an_error(sums: str) -> None:
    data = wire.to_bytes(sample(), block=16, sums=sums)
    target = fresh_target()
    hdr_end = len(wire.encode(sample(), block=16, sums=sums).header)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(WireError):
            wire.decode(bytes(bad), into=target)
    assert_untouched(target)
    if sums == "inline":  # a, 7 x 5 float32 in 16-byte pieces, each followed by its 4-byte sum
        pos = hdr_end + 7 * 5 * 4 + 4 * -(-7 * 5 * 4 // 16) + 3
    else:
        pos = hdr_end + 7 * 5 * 4 + 3
    bad = bytearray(data)
    bad[pos] ^= 1  # inside tensor 'b'
    with pytest.raises(WireError, match="checksum mismatch") as ei:
        wire.decode(bytes(bad))
    assert ei.value.key == "['b']"


def test_in_place_corruption_is_reported_as_such() -> None:
    data = bytearray(wire.to_bytes(sample(), block=16))
    data[-1] ^= 0xFF  # last byte of the last tensor
    target = fresh_target()
    with pytest.raises(WireError, match="partly overwritten") as ei:
        wire.decode(bytes(data), into=target, in_place=True)
    assert ei.value.target_modified
    target2 = fresh_target()
    with pytest.raises(WireError, match="checksum") as ei:
        wire.decode(bytes(data), into=target2, in_place=False)
    assert not ei.value.target_modified
    assert_untouched(target2)


def craft(header: dict[str, Any], data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<8sQI", wire.MAGIC, len(raw), zlib.crc32(raw)) + raw + data


def good_header() -> tuple[dict[str, Any], bytes]:
    enc = wire.encode({"a": torch.ones(2, 2), "v": 1})
    raw = enc.header[wire.PREFIX_BYTES :]
    data = b"".join(bytes(v) for v in enc.iter_data())
    return json.loads(raw), data


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h: h["tensors"][0].update(dtype="float33"), "unknown or unsupported dtype 'float33'"),
        (lambda h: h["tensors"][0].update(dtype="object"), "unknown or unsupported dtype 'object'"),
        (lambda h: h["tensors"][0].update(nbytes=12), "nbytes 12 disagrees"),
        (lambda h: h["tensors"][0].update(shape=[2, -2]), "non-negative"),
        (lambda h: h.update(data_bytes=17), "data_bytes 17"),
        (lambda h: h["tree"]["d"][1].__setitem__(1, {"v": [1, 2]}), "not an allowed leaf"),
        (lambda h: h["tree"]["d"][1].__setitem__(1, {"pickle": "cos\nsystem"}), "unknown node kind"),
        (lambda h: h["tree"]["d"][1].__setitem__(1, {"t": 0}), "repeated tensor index"),
        (lambda h: h.update(version=9), "version 9"),
        (lambda h: h["tensors"][0].update(crc32=[]), "checksums"),
        (lambda h: h.update(sums="outline"), "sums must be 'header' or 'inline'"),
        (lambda h: h.update(sums="inline"), "checksums in the header of an inline-checksum stream"),
    ],
)
def test_bad_headers_are_clear_errors(mutate: Any, match: str) -> None:
    h, data = good_header()
    mutate(h)
    target = {"a": torch.zeros(2, 2)}
    with pytest.raises(WireError, match=match):
        wire.decode(craft(h, data), into=target)
    assert torch.equal(target["a"], torch.zeros(2, 2))


def test_wrong_dtype_error_names_the_key() -> None:
    h, data = good_header()
    h["tensors"][0]["dtype"] = "float33"
    with pytest.raises(WireError) as ei:
        wire.decode(craft(h, data))
    assert ei.value.key == "['a']"


def test_oversize_header_and_bad_magic_and_trailing_bytes() -> None:
    data = wire.to_bytes(sample())
    with pytest.raises(WireError, match="over the limit of 100 bytes"):
        wire.decode(data, max_header_bytes=100)
    huge = struct.pack("<8sQI", wire.MAGIC, 2**40, 0)
    with pytest.raises(WireError, match="over the limit"):
        wire.decode(huge)
    with pytest.raises(WireError, match="not a rallypoint wire stream"):
        wire.decode(b"\x80\x04" + data[2:])  # a pickle opcode where the magic should be
    with pytest.raises(WireError, match="trailing bytes"):
        wire.decode(data + b"x")


def test_decode_never_unpickles() -> None:
    """A torch.save/pickle stream is refused by its first bytes, never loaded."""
    buf = io.BytesIO()
    torch.save({"a": torch.ones(1)}, buf)
    with pytest.raises(WireError, match="not a rallypoint wire stream"):
        wire.decode(buf.getvalue())


@pytest.mark.parametrize("sums", ["header", "inline"])
def test_parallel_ranges_out_of_order(sums: str) -> None:
    """What HTTP does: split at checksum blocks, write ranges from threads in any order."""
    sd = {f"t{i}": torch.randn(i * 37 + 1) for i in range(20)}
    enc = wire.encode(sd, block=256, sums=sums)
    header = wire.read_header(io.BytesIO(enc.header).readinto)
    sink = wire.Sink(header)
    ranges = header.split(7, max_bytes=1000)
    assert len(ranges) >= 7 and ranges[0][0] == 0 and ranges[-1][1] == header.data_bytes
    random.Random(0).shuffle(ranges)

    def fetch(r: tuple[int, int]) -> None:
        w = sink.writer(*r)
        data = b"".join(bytes(c) for c in enc.iter_data(*r, piece=100))
        assert len(data) == header.wire_bytes(*r) == enc.wire_bytes(*r)
        for i in range(0, len(data), 100):  # chunks that cut pieces and sums anywhere
            w.write(data[i : i + 100])
        w.close()

    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(fetch, ranges[1:]))
    assert not sink.complete
    with pytest.raises(WireError, match="incomplete"):
        sink.finish()
    fetch(ranges[0])
    assert_same(sd, sink.finish())
    with pytest.raises(ValueError, match="aligned"):
        sink.writer(1, 5)


# --------------------------------------------------------------------------- DTensor


@pytest.fixture
def mesh1() -> Any:
    """A 1-rank gloo world and mesh in this process, torn down afterwards."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs gloo and no process group in this process")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def test_dtensor_roundtrip_on_receiver_mesh(mesh1: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = torch.randn(8, 3)
    sd = {"w": distribute_tensor(full, mesh1, [Shard(0)]), "r": distribute_tensor(full[:2], mesh1, [Replicate()])}
    data = wire.to_bytes(sd)
    hdr = json.loads(wire.encode(sd).header[wire.PREFIX_BYTES :])
    assert hdr["tensors"][0]["dtensor"]["placements"] == [["shard", 0]]
    with pytest.raises(WireError, match="is a DTensor; pass into= .* or mesh="):
        wire.decode(data)
    out = wire.decode(data, mesh=mesh1)
    assert isinstance(out["w"], DTensor) and out["w"].placements == (Shard(0),)
    assert torch.equal(out["w"].full_tensor(), full)
    target = {"w": distribute_tensor(torch.zeros(8, 3), mesh1, [Shard(0)]), "r": None}
    out2 = wire.decode(data, into=target, in_place=True, mesh=mesh1)
    assert out2["w"] is target["w"] and torch.equal(target["w"].to_local(), full)


def test_parallel_checksums_and_big_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threaded CRC path gives the serial result; a tensor big enough for the
    huge-page advice (>= 4 MiB) round-trips."""
    sd = {"big": torch.randn(5 << 18), "small": torch.arange(10)}
    serial = wire.encode(sd, block=1 << 16).header
    from rallypoint.transports import _encode

    monkeypatch.setattr(_encode, "PARALLEL_CRC_BYTES", 0)
    parallel = wire.encode(sd, block=1 << 16)
    assert parallel.header == serial
    assert_same(sd, wire.decode(b"".join(bytes(v) for v in parallel.iter_stream())))


class ShortReads:
    """A stream whose readinto returns at most a few (random) bytes per call, like a socket."""

    def __init__(self, data: bytes, seed: int, most: int) -> None:
        self.buf, self.pos = data, 0
        self.rng, self.most = random.Random(seed), most

    def readinto(self, mv: memoryview) -> int:
        n = min(mv.nbytes, len(self.buf) - self.pos, self.rng.randint(1, self.most))
        mv[:n] = self.buf[self.pos : self.pos + n]
        self.pos += n
        return n


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), most=st.sampled_from([333, 5000, 70_000, 1 << 20]), in_place=st.booleans(),
       sums=st.sampled_from(["header", "inline"]))
def test_short_reads_and_mixed_sizes(seed: int, most: int, in_place: bool, sums: str) -> None:
    """Runs of tiny tensors (read through the scratch buffer) around big ones (read in
    place), with a reader that returns arbitrary short counts."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "tiny": [torch.randn(3, generator=g) for _ in range(300)],
        "big": torch.randn(100_000, generator=g),
        "more": [torch.randint(0, 9, (50,), generator=g) for _ in range(50)],
        "big2": torch.randn(40_000, generator=g).to(torch.float16),
    }
    data = wire.to_bytes(sd, block=1 << 16, sums=sums)
    target = {
        k: [torch.zeros_like(t) for t in v] if isinstance(v, list) else torch.zeros_like(v) for k, v in sd.items()
    }
    out = wire.decode_from(ShortReads(data, seed, most), into=target, in_place=in_place)
    assert_same(sd, out)
    assert out["big"] is target["big"]


@pytest.mark.parametrize("sums", ["header", "inline"])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.999])
def test_a_big_piece_summed_as_it_is_read_still_catches_a_flipped_byte(sums: str, where: float) -> None:
    """Big pieces are checksummed read by read (each read while its bytes are in cache),
    including one begun by the scratch read of the tiny tensors before it: a flipped byte
    at the start, the middle or the end of such a piece fails its check, naming it."""
    g = torch.Generator().manual_seed(3)
    sd = {"tiny": [torch.randn(3, generator=g) for _ in range(300)], "big": torch.randn(100_000, generator=g)}
    enc = wire.encode(sd, block=1 << 16, sums=sums)
    data = bytearray(wire.to_bytes(sd, block=1 << 16, sums=sums))
    tiny_wire = enc.wire_bytes(0, 300 * 3 * 4)
    data[len(enc.header) + tiny_wire + int(where * (1 << 16))] ^= 0x40  # inside big's first piece
    for most in (333, 70_000, 1 << 20):
        with pytest.raises(WireError, match="checksum mismatch") as ei:
            wire.decode_from(ShortReads(bytes(data), 1, most))
        assert ei.value.key == "['big']"
