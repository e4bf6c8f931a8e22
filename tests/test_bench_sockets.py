"""The plain-socket ceiling of ``bench/transport.py`` (``bench/_sockets.py``), summed variant:
``socket4_xxh3`` is the floor a verified heal is measured against, so it must move every byte
into place, check every tensor's sum, and refuse a tensor whose bytes changed on the way."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

_sockets = pytest.importorskip("_sockets", reason="bench/_sockets.py is importable from the checkout")
pytest.importorskip("xxhash", reason="socket4_xxh3 sums with XXH3")

from rallypoint.transports._crc import SUM_KINDS  # noqa: E402
from rallypoint.transports._header import SUM, WireError  # noqa: E402
from rallypoint.transports._tensors import byte_view  # noqa: E402

TIMEOUT_S = 30.0


def _serve(views: list[memoryview]) -> tuple[socket.socket, int]:
    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_sockets.serve_socket, args=(lsock, views, TIMEOUT_S), daemon=True).start()
    return lsock, lsock.getsockname()[1]


@pytest.mark.parametrize("summed", [False, True])
@pytest.mark.parametrize("parts", [2, 4])
def test_parallel_connections_deliver_every_tensor(summed: bool, parts: int) -> None:
    g = torch.Generator().manual_seed(0)
    # sizes around the 1 MiB sum part: below it, exactly it, across it, not a multiple of 4 bytes
    src = [torch.randn(n, generator=g) for n in (1000, 1 << 18, (1 << 18) + 3, 700_001, 5)]
    dest = [torch.zeros_like(t) for t in src]
    lsock, port = _serve([byte_view(t) for t in src])
    try:
        for part in range(parts):
            _sockets._recv_part(port, dest, part, parts, TIMEOUT_S, None, summed)
    finally:
        lsock.close()
    for a, b in zip(src, dest):
        assert torch.equal(a, b)


def test_summed_receiver_refuses_a_changed_byte() -> None:
    data = bytearray(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes: two reads at most
    good = SUM.pack(SUM_KINDS["xxh3"].of(memoryview(data)))
    data[12345] ^= 0x01  # flipped on the way: the sum no longer matches
    a, b = socket.socketpair()
    a.settimeout(TIMEOUT_S)
    b.settimeout(TIMEOUT_S)
    sender = threading.Thread(target=lambda: (a.sendall(data), a.sendall(good)), daemon=True)
    sender.start()
    view = memoryview(bytearray(len(data)))
    try:
        with pytest.raises(RuntimeError, match="tensor 7: sum mismatch"):
            _sockets._recv_summed(b, view, 7)
    finally:
        sender.join(TIMEOUT_S)
        a.close()
        b.close()
    assert bytes(view) == bytes(data)  # every byte landed; only the check failed


def test_summed_receiver_names_a_stream_cut_inside_the_sum() -> None:
    a, b = socket.socketpair()
    b.settimeout(TIMEOUT_S)
    a.sendall(b"y" * 64 + b"ab")  # the tensor whole, half of its sum
    a.close()
    with pytest.raises(WireError, match="got 2 of 4 bytes of the sum of tensor 5"):
        _sockets._recv_summed(b, memoryview(bytearray(64)), 5)
    b.close()


def test_summed_receiver_names_a_short_stream() -> None:
    a, b = socket.socketpair()
    b.settimeout(TIMEOUT_S)
    a.sendall(b"x" * 100)
    a.close()
    got: Any = memoryview(bytearray(1000))
    with pytest.raises(RuntimeError, match="closed after 100 of 1000 bytes of tensor 3"):
        _sockets._recv_summed(b, got, 3)
    b.close()
