"""The plain-socket ceiling of ``bench/transport.py`` (not part of the library): its sender
and receivers.

The plain-socket ceiling speaks a minimal protocol: the receiver opens a connection and
sends ``!III`` (part, parts, summed); the sender answers with the raw bytes of tensors
``[part * n // parts, (part + 1) * n // parts)`` of its state dict, in order, and
closes. One thread per connection, so ``socket4``'s four connections run in parallel.
``summed`` (``socket2_xxh3``, ``socket4_xxh3``): every tensor is followed by its XXH3 sum
(rallypoint's inline sum, 4 bytes), which the sender computes ``SUM_PART`` bytes at a
time, each just before it sends them, and the receiver read by read as they land, then
checks: the work rallypoint's wire does for these 3 MiB tensors (one piece each), with
nothing else of ours in it. The floor of a transfer that verifies every byte.
"""

from __future__ import annotations

import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from _transport_util import SUM_PART, SUMMED_SOCKETS, TLS_SOCKET, state_shapes, zeros_state

_REQ = struct.Struct("!III")  # (part, parts, summed)


def _part(n: int, part: int, parts: int) -> range:
    return range(part * n // parts, (part + 1) * n // parts)


def serve_socket(lsock: socket.socket, views: list[memoryview], timeout_s: float, wrap: Any = None) -> None:
    """Accept loop (run it in a daemon thread): each connection asks for a part and gets
    its tensors' bytes with ``sendall``, in its own thread (summed: each tensor followed
    by its XXH3 sum, see the module's docstring)."""
    from rallypoint.transports._crc import SUM_KINDS
    from rallypoint.transports._header import SUM

    def one(conn: socket.socket) -> None:
        try:
            conn.settimeout(timeout_s)
            if wrap is not None:
                conn = wrap(conn, server_side=True)
            with conn:
                req = b""
                while len(req) < _REQ.size:
                    more = conn.recv(_REQ.size - len(req))
                    if not more:
                        return
                    req += more
                part, parts, summed = _REQ.unpack(req)
                kind = SUM_KINDS["xxh3"]
                for i in _part(len(views), part, parts):
                    if not summed:
                        conn.sendall(views[i])
                        continue
                    v, state = views[i], kind.begin()
                    for at in range(0, v.nbytes, SUM_PART):  # each part summed just before it leaves
                        chunk = v[at : at + SUM_PART]
                        state = kind.update(state, chunk)
                        if at + SUM_PART < v.nbytes:
                            conn.sendall(chunk)
                        else:  # the tensor's last part and its sum
                            _send_both(conn, chunk, SUM.pack(kind.value(state)))
        except OSError:  # a refused handshake, a receiver gone: next connection
            pass

    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _send_both(conn: socket.socket, chunk: memoryview, crc: bytes) -> None:
    """``chunk`` then ``crc`` in one ``sendmsg`` (no 4-byte segment of its own), the rest
    with ``sendall`` where the kernel took less."""
    sent = conn.sendmsg([chunk, crc])
    if sent < chunk.nbytes:
        conn.sendall(chunk[sent:])
        conn.sendall(crc)
    elif sent < chunk.nbytes + len(crc):
        conn.sendall(crc[sent - chunk.nbytes :])


def _recv_part(port: int, dest: list[Any], part: int, parts: int, timeout_s: float, wrap: Any,
               summed: bool = False) -> None:
    from rallypoint.transports._tensors import byte_view

    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    with (wrap(raw) if wrap is not None else raw) as s:
        s.sendall(_REQ.pack(part, parts, int(summed)))
        for i in _part(len(dest), part, parts):
            view = byte_view(dest[i])
            if summed:
                _recv_summed(s, view, i)
                continue
            n, got = len(view), 0
            while got < n:
                k = s.recv_into(view[got:])
                if not k:
                    raise RuntimeError(f"socket closed after {got} of {n} bytes of tensor {i}")
                got += k


def _recv_summed(s: socket.socket, view: memoryview, i: int) -> None:
    """Tensor ``i``'s bytes into ``view``, summed read by read as they land (XXH3, at most
    ``SUM_PART`` per read, as rallypoint's receiver does), then its sum checked."""
    from rallypoint.transports._crc import SUM_KINDS
    from rallypoint.transports._header import SUM, read_exact

    kind = SUM_KINDS["xxh3"]
    state, got, n = kind.begin(), 0, view.nbytes
    while got < n:
        k = s.recv_into(view[got : min(n, got + SUM_PART)])
        if not k:
            raise RuntimeError(f"socket closed after {got} of {n} bytes of tensor {i}")
        state = kind.update(state, view[got : got + k])
        got += k
    theirs = memoryview(bytearray(SUM.size))
    read_exact(s.recv_into, theirs, f"the sum of tensor {i}")
    if SUM.unpack(theirs)[0] != kind.value(state):
        raise RuntimeError(f"tensor {i}: sum mismatch")


def keep_freed_heap() -> bool:
    """glibc: serve 3 MiB blocks from the heap and never trim it (``mallopt``), so memory
    freed after one fetch is reused, already faulted in, by the next one. Used by the
    ``socket`` ceiling (see :func:`socket_fetcher`) and by ``heal_stall``'s receivers
    (their page faults stay out of the sender's measured steps). False where not glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB: glibc's largest mmap threshold on 64-bit (blocks below it come from the heap)
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, -1))  # -1: never trim


def socket_fetcher(case: str, contender: str, port: int, timeout_s: float, wrap: Any = None) -> Callable[[], Any]:
    """The fetch of a plain-socket contender.

    ``socket``/``socket_tls``: per fetch a fresh destination allocated as rallypoint's
    fresh receiver allocates it (``torch.empty`` per tensor + ``advise_huge_pages``), one
    connection; the process keeps its freed heap (:func:`keep_freed_heap`), as ours in
    effect does: it allocates more after its tensors (connections, buffers), which pins
    the heap's top, and from its third fetch on it mostly reuses the freed blocks. A bare
    socket receiver allocates nothing after them: glibc merges the freed tensors into the
    heap's top and trims it, and every repeat faults the whole state in again (~262,000
    minor faults per GB, 1-4 s on this VM): the old ``socket`` median measured page
    faults, not the network. (A small block held after the tensors does not pin the top
    reliably: it lands in a free fragment lower down.) Both first fetches fault
    everything (``first_fetch_rallypoint_of_socket`` compares those). ``socket_inplace``: one destination, allocated and zeroed before the first
    fetch and reused (no page faults: the network ceiling). ``socket4``: the same in-place
    destination, a quarter of the tensors over each of 4 parallel connections.
    ``socket2_xxh3``, ``socket4_xxh3``: the in-place destination over 2 or 4 connections, every
    tensor summed and checked (XXH3, read and sent a MiB at a time).
    """
    import torch

    from rallypoint.transports._tensors import advise_huge_pages

    shapes = list(state_shapes(case).values())
    if contender in ("socket", TLS_SOCKET):
        keep_freed_heap()

        def fresh() -> Any:
            dest = [torch.empty(s) for s in shapes]
            for t in dest:
                advise_huge_pages(t)
            _recv_part(port, dest, 0, 1, timeout_s, wrap)
            return dest

        return fresh
    held = list(zeros_state(case).values())
    if contender == "socket_inplace":
        return lambda: _recv_part(port, held, 0, 1, timeout_s, wrap)
    if contender == "socket4" or contender in SUMMED_SOCKETS:
        k = SUMMED_SOCKETS.get(contender, 4)
        pool = ThreadPoolExecutor(k, thread_name_prefix=contender)
        summed = contender in SUMMED_SOCKETS

        def parallel() -> None:
            for f in [pool.submit(_recv_part, port, held, i, k, timeout_s, wrap, summed) for i in range(k)]:
                f.result(timeout_s)

        return parallel
    raise SystemExit(f"unknown socket contender {contender!r}")
