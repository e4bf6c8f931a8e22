"""Helpers of ``bench/transport.py`` (not part of the library): the cases and their
states, child processes with timeouts, our sender's bare readers, and the
table/ratios/goals report.

The plain-socket ceiling (its sender and receivers) is in ``_sockets.py``.
"""

from __future__ import annotations

import io
import json
import statistics
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

TENSOR_NUMEL = 3 * 1024 * 1024 // 4  # 3 MiB of float32
CASES = {
    "100MB": ("big", 100 * 1024 * 1024 // (TENSOR_NUMEL * 4)),
    "1GB": ("big", 1024 * 1024 * 1024 // (TENSOR_NUMEL * 4)),
    "4GB": ("big", 4 * 1024 * 1024 * 1024 // (TENSOR_NUMEL * 4)),  # only with --cases 4GB
    "tiny4000": ("tiny", 4000),
}
#: From this state size on, one receiver process at a time (start, warm-up + repeats,
#: stop, next contender): ~6 receivers of 4 GB each plus the sender do not fit in 24 GiB.
SEQUENTIAL_FROM_BYTES = 2 << 30
CONTENDERS = ["rallypoint", "rp_inplace", "rp_into", "rp_into_crc", "rp_into_nosum", "torchft0", "torchft4",
              "socket", "socket_inplace", "socket4", "socket2_xxh3", "socket4_xxh3", "http_bare",
              "http_bare_tensors",
              "rp_pg", "rp_pg_inplace", "torchft_pg"]
PG_CONTENDERS = ("rp_pg", "rp_pg_inplace", "torchft_pg")
#: the plain-socket contenders (they all dial the sender's one socket port)
SOCKETS = ("socket", "socket_inplace", "socket4", "socket2_xxh3", "socket4_xxh3")
#: plain sockets, every byte summed (XXH3) by the sender and checked by the receiver: the
#: floor of a verified heal, over this many parallel connections
SUMMED_SOCKETS = {"socket2_xxh3": 2, "socket4_xxh3": 4}
#: bytes per summed read and send of ``SUMMED_SOCKETS``: as rallypoint's sender sums a part
#: just before it leaves and its receiver each read as it lands (``_range_writer.SUM_AS_READ``)
SUM_PART = 1 << 20
#: rallypoint's sender read by a bare receiver (no http.client, no parsing, no checks):
#: into one buffer, or piece by piece into the receiver's held tensors
BARE_HTTP = "http_bare"
BARE_HTTP_TENSORS = "http_bare_tensors"
BARE_HTTP_CONNECTIONS = 2  # as many as HTTPTransport's receiver opens on this 2-core machine
#: the in-place plain-socket ceilings, against which rp_inplace is measured
INPLACE_SOCKETS = ("socket_inplace", "socket4")
TLS_CONTENDER = "http_tls"  # with --tls: rallypoint's HTTPTransport over mutual TLS + token
TLS_INPLACE = "http_tls_inplace"  # the same, receiving in place (as rp_inplace)
TLS_SOCKET = "socket_tls"  # with --tls: "socket" over mutual TLS (the TLS ceiling)
#: --tls contenders, each run right after the clear-text contender it is compared with
TLS_CONTENDERS = {TLS_CONTENDER: "rallypoint", TLS_INPLACE: "rp_inplace", TLS_SOCKET: "socket"}
#: the issue's goals for the HTTP receive
GOAL_VS_TORCHFT = 1.3  # >= 1.3x torchft's (its Manager's default, num_chunks=0: "torchft0")
GOAL_OF_SOCKET = 0.8  # >= 80% of the plain-socket ceiling


def state_shapes(case: str) -> dict[str, tuple[int, ...]]:
    kind, n = CASES[case]
    if kind == "big":
        return {f"layer{i}.weight": (TENSOR_NUMEL,) for i in range(n)}
    return {f"p{i}": (16,) for i in range(n)}


def make_state(case: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g) for k, shape in state_shapes(case).items()}


def zeros_state(case: str) -> dict[str, Any]:
    """A receiver's own state of the case's shapes (allocated and touched once)."""
    import torch

    return {k: torch.zeros(shape) for k, shape in state_shapes(case).items()}


def state_bytes(case: str) -> int:
    kind, n = CASES[case]
    return n * (TENSOR_NUMEL * 4 if kind == "big" else 64)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def proc_cpu(pid: int) -> float:
    """user+system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- child processes


def child(script: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, os.path.abspath(script), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def read_json_line(p: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    box: list[str] = []
    th = threading.Thread(target=lambda: box.append(p.stdout.readline() if p.stdout else ""), daemon=True)
    th.start()
    th.join(timeout)
    if not box or not box[0].strip():
        raise RuntimeError(f"{what}: no answer within {timeout:.0f} s (rc={p.poll()})")
    return json.loads(box[0])


def kill(p: subprocess.Popen[str]) -> None:
    """SIGKILL by pid, then reap."""
    if p.poll() is None:
        try:
            os.kill(p.pid, 9)
        except ProcessLookupError:
            pass
    p.wait(10)


def _http_get(host: str, port: int, path: str, timeout_s: float) -> tuple[socket.socket, int, bytes]:
    """Send GET ``path`` over a new connection; the connection, the body's length and the
    body bytes read with the reply's head."""
    s = socket.create_connection((host, port), timeout=timeout_s)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            more = s.recv(4096)
            if not more or len(head) > 65536:
                raise RuntimeError(f"GET {path}: no reply head")
            head += more
        raw, rest = head.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        if " 200 " not in lines[0] + " ":
            raise RuntimeError(f"GET {path}: {lines[0]}")
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        return s, int(fields["content-length"]), rest
    except BaseException:
        s.close()
        raise


def _recv_exactly(s: socket.socket, dest: memoryview, rest: bytes, what: str) -> bytes:
    """Fill ``dest`` from ``rest`` (bytes already read), then from ``s``, at most 4 MiB per
    ``recv_into``; what is left of ``rest``."""
    got = min(len(rest), dest.nbytes)
    dest[:got] = rest[:got]
    n = dest.nbytes
    while got < n:
        k = s.recv_into(dest[got : min(n, got + (4 << 20))])
        if not k:
            raise RuntimeError(f"{what}: closed after {got} of {n} bytes")
        got += k
    return rest[min(len(rest), n):]


def bare_http_fetcher(case: str, contender: str, base: str, timeout_s: float) -> Callable[[], None]:
    """The ``http_bare`` contenders: rallypoint's sender (the bench's ``HTTPTransport``, the
    same ranges and bytes ``rp_into_nosum`` asks for: ``sum=none``) read by a receiver that
    does nothing but ``recv_into``, over ``BARE_HTTP_CONNECTIONS`` connections: no
    ``http.client``, no wire parsing, no checks, no landing. ``http_bare`` reads each range
    into one buffer (allocated and touched before the first fetch); ``http_bare_tensors``
    reads each piece into its place in tensors the receiver holds (as ``rp_inplace`` does)
    and each 4-byte sum into a scratch buffer. ``rp_into_nosum`` against them is what our
    receiver costs; they against the plain sockets, what our sender and HTTP (and the
    state's layout) cost."""
    from urllib.parse import urlsplit

    from rallypoint.transports import wire
    from rallypoint.transports._tensors import byte_view

    u = urlsplit(base)
    host, port, prefix = u.hostname or "127.0.0.1", u.port or 80, u.path.rstrip("/")
    s, n, rest = _http_get(host, port, f"{prefix}/checkpoint/1/header", timeout_s)
    with s:
        if n > wire.DEFAULT_MAX_HEADER_BYTES:
            raise RuntimeError(f"a header of {n} bytes is over the limit of {wire.DEFAULT_MAX_HEADER_BYTES}")
        raw = memoryview(bytearray(n))
        _recv_exactly(s, raw, rest, "header")
    header = wire.read_header(io.BytesIO(raw).readinto, n, wire.MIN_NETWORK_BLOCK, 1 << 40)
    ranges = header.split(BARE_HTTP_CONNECTIONS)
    offsets = [header.wire_bytes(0, a) for a, _ in ranges]
    whole = memoryview(bytearray(header.wire_bytes(0, header.data_bytes) if contender == BARE_HTTP else 0))
    # (tensor, its bytes): the view does not keep its tensor alive, the pair does
    placed = [(t, byte_view(t)) for t in zeros_state(case).values()] if contender == BARE_HTTP_TENSORS else []
    starts = [p[0] for p in header.pieces]
    pool = ThreadPoolExecutor(len(ranges), thread_name_prefix=contender)

    def one(r: tuple[int, int], off: int) -> None:
        a, b = r
        what = f"range [{a}, {b})"
        s, n, rest = _http_get(host, port, f"{prefix}/checkpoint/1/data?start={a}&end={b}&sum=none", timeout_s)
        with s:
            if n != header.wire_bytes(a, b):
                raise RuntimeError(f"{what}: {n} bytes, not {header.wire_bytes(a, b)}")
            if not placed:
                _recv_exactly(s, whole[off : off + n], rest, what)
                return
            sums = memoryview(bytearray(4))
            for _, ln, ti, st, _ in header.pieces[starts.index(a) : starts.index(b) if b in starts else None]:
                rest = _recv_exactly(s, placed[ti][1][st : st + ln], rest, what)
                rest = _recv_exactly(s, sums, rest, what)

    def fetch() -> None:
        for f in [pool.submit(one, r, off) for r, off in zip(ranges, offsets)]:
            f.result(timeout_s)

    return fetch


# --------------------------------------------------------------------------- report

# (ratio name, numerator contender, denominator contender, field): numerator/denominator
RATIOS = [
    ("rallypoint_vs_torchft0", "torchft0", "rallypoint", "median_s"),
    ("rallypoint_vs_torchft4", "torchft4", "rallypoint", "median_s"),
    ("rallypoint_of_socket", "socket", "rallypoint", "median_s"),  # fresh vs fresh
    ("inplace_vs_torchft0", "torchft0", "rp_inplace", "median_s"),
    ("inplace_of_socket_inplace", "socket_inplace", "rp_inplace", "median_s"),
    ("inplace_of_socket4", "socket4", "rp_inplace", "median_s"),
    ("into_vs_torchft0", "torchft0", "rp_into", "median_s"),
    ("into_of_socket_inplace", "socket_inplace", "rp_into", "median_s"),
    ("into_crc_vs_into", "rp_into_crc", "rp_into", "median_s"),  # > 1: XXH3 sums faster than CRC-32
    ("into_nosum_vs_torchft0", "torchft0", "rp_into_nosum", "median_s"),  # both trust the connection
    ("into_nosum_of_socket_inplace", "socket_inplace", "rp_into_nosum", "median_s"),
    ("into_nosum_of_socket4", "socket4", "rp_into_nosum", "median_s"),
    ("socket4_vs_socket_inplace", "socket_inplace", "socket4", "median_s"),
    ("socket4_xxh3_of_socket4", "socket4", "socket4_xxh3", "median_s"),  # the sums' cost at the floor
    # what our receiver costs: ours / a bare reader of the same sender's same bytes
    ("into_nosum_of_bare_http", BARE_HTTP, "rp_into_nosum", "median_s"),
    ("into_nosum_of_bare_http_tensors", BARE_HTTP_TENSORS, "rp_into_nosum", "median_s"),
    ("bare_http_tensors_of_bare_http", BARE_HTTP, BARE_HTTP_TENSORS, "median_s"),  # the state's layout
    # what our sender and HTTP cost: a bare reader of ours / bare sockets
    ("bare_http_of_socket_inplace", "socket_inplace", BARE_HTTP, "median_s"),
    ("bare_http_of_socket4", "socket4", BARE_HTTP, "median_s"),
    ("torchft0_of_socket_inplace", "socket_inplace", "torchft0", "median_s"),  # where the goal lies
    ("first_fetch_rallypoint_vs_torchft0", "torchft0", "rallypoint", "first_s"),
    ("first_fetch_inplace_vs_torchft0", "torchft0", "rp_inplace", "first_s"),
    ("first_fetch_rallypoint_of_socket", "socket", "rallypoint", "first_s"),
    ("pg_vs_torchft_pg", "torchft_pg", "rp_pg", "median_s"),
    ("pg_inplace_vs_torchft_pg", "torchft_pg", "rp_pg_inplace", "median_s"),
    ("first_fetch_pg_vs_torchft_pg", "torchft_pg", "rp_pg", "first_s"),
    # TLS: time over TLS / time in clear text (goal <= 1.15 for 1 GB)
    ("http_tls_vs_http", TLS_CONTENDER, "rallypoint", "median_s"),
    ("http_tls_inplace_vs_inplace", TLS_INPLACE, "rp_inplace", "median_s"),
    ("first_fetch_http_tls_vs_http", TLS_CONTENDER, "rallypoint", "first_s"),
    ("first_fetch_http_tls_inplace_vs_inplace", TLS_INPLACE, "rp_inplace", "first_s"),
    ("socket_tls_vs_socket", TLS_SOCKET, "socket", "median_s"),
    ("http_tls_of_socket_tls", TLS_SOCKET, TLS_CONTENDER, "median_s"),
]


def case_ratios(rs: dict[str, Any]) -> dict[str, Any]:
    """The ratios of one case, plus ``inplace_of_best_socket``: rp_inplace's throughput as a
    fraction of the best in-place socket ceiling run (socket_inplace or socket4, named in
    ``best_inplace_socket``): the goal's ratio."""
    out: dict[str, Any] = {name: rs[num][field] / rs[den][field] for name, num, den, field in RATIOS
                           if num in rs and den in rs}
    best = min((c for c in INPLACE_SOCKETS if c in rs), key=lambda c: rs[c]["median_s"], default=None)
    if best is not None and "rp_inplace" in rs:
        out["inplace_of_best_socket"] = rs[best]["median_s"] / rs["rp_inplace"]["median_s"]
        out["best_inplace_socket"] = best
    # the floor of a verified heal: the faster of the summed plain-socket contenders run
    floor = min((c for c in SUMMED_SOCKETS if c in rs), key=lambda c: rs[c]["median_s"], default=None)
    if floor is not None:
        out["verified_floor"] = floor
        if "torchft0" in rs:
            out["verified_floor_vs_torchft0"] = rs["torchft0"]["median_s"] / rs[floor]["median_s"]
        if "rp_into" in rs:
            out["into_of_verified_floor"] = rs[floor]["median_s"] / rs["rp_into"]["median_s"]
    for c, key in (("rp_into", "into_of_best_socket"), ("rp_into_nosum", "into_nosum_of_best_socket")):
        if best is not None and c in rs:
            out[key] = rs[best]["median_s"] / rs[c]["median_s"]
            out["best_inplace_socket"] = best
    return out


def checksum_seconds(nbytes: int, kind: str = "crc32") -> dict[str, float]:
    """CPU seconds one kind of the wire's inline sums (``rallypoint.transports._crc``)
    takes over ``nbytes`` on one core of this machine, as each side of a heal meets the
    bytes: ``send``, from memory (a 64 MiB buffer, evicted by a 64 MiB write before each
    pass: the sender sums the state as it reads it), and ``recv``, hot (1 MiB summed right
    after it was written: the receiver sums each read as it lands). Medians of 5."""
    from rallypoint.transports._crc import SUM_KINDS

    of = SUM_KINDS[kind].of
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)
    evict, fill = bytearray(64 << 20), bytes(64 << 20)
    of(buf)  # fault the pages in
    cold, hot = [], []
    for _ in range(5):
        evict[:] = fill  # 128 MiB read and written: larger than this machine's caches
        t0 = time.perf_counter()
        of(buf)
        cold.append(time.perf_counter() - t0)
        small = buf[: 1 << 20]
        t0 = time.perf_counter()
        for _ in range(16):
            of(small)
        hot.append((time.perf_counter() - t0) / 16)
    return {"send": statistics.median(cold) * nbytes / len(buf), "recv": statistics.median(hot) * nbytes / (1 << 20)}


def into_profile(rs: dict[str, Any], best: str | None, nbytes: int) -> dict[str, Any] | None:
    """Where ``rp_into``'s time over the best in-place socket goes: its extra wall time, its
    extra CPU (receiver + sender, per fetch), and what the inline sums of every byte cost
    on both sides (:func:`checksum_seconds`: the sender's from memory, the receiver's hot),
    for CRC-32 and for XXH3 (``rp_into`` asks for XXH3; ``rp_into_crc`` for CRC-32). On a
    machine whose two cores the sender and the receiver share, extra CPU shows up as wall
    time."""
    if best is None or "rp_into" not in rs or best not in rs:
        return None
    into, sock = rs["rp_into"], rs[best]
    from rallypoint.transports._crc import SUM_KINDS

    sums = {k: checksum_seconds(nbytes, k) for k in ("crc32", "xxh3") if k in SUM_KINDS}
    return {"socket": best, "extra_s": into["median_s"] - sock["median_s"],
            "extra_cpu_s": into["recv_cpu_s"] + into["send_cpu_s"] - sock["recv_cpu_s"] - sock["send_cpu_s"],
            "sums_cpu_s": sums}


def case_goals(rt: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals for one case: HTTP receive >= 1.3x torchft(0) and >= 80% of the socket ceiling."""
    checks = {"rallypoint_vs_torchft0": GOAL_VS_TORCHFT, "inplace_vs_torchft0": GOAL_VS_TORCHFT,
              "into_vs_torchft0": GOAL_VS_TORCHFT, "rallypoint_of_socket": GOAL_OF_SOCKET,
              "inplace_of_best_socket": GOAL_OF_SOCKET, "into_of_best_socket": GOAL_OF_SOCKET,
              "into_nosum_vs_torchft0": GOAL_VS_TORCHFT, "into_nosum_of_best_socket": GOAL_OF_SOCKET}
    return {k: rt[k] >= bound for k, bound in checks.items() if k in rt}


def _fmt(rt: dict[str, Any], key: str, fmt: str, label: str) -> str:
    return f"{label} {rt[key]:{fmt}}" if key in rt else ""


def report(repeats: int, results: dict[str, dict[str, Any]], json_only: bool, load: list[float],
           torchft_heap: str = "kept") -> None:
    """Print the table, the ratios and the goals, then one JSON line; ``torchft_heap`` says
    whether torchft's receivers kept their freed heap (``--torchft-heap``)."""
    summary: dict[str, Any] = {"bench": "transport", "repeats": repeats, "load_start_end": load,
                               "torchft_heap": torchft_heap, "cases": results, "ratios": {}, "goals": {}}
    for case, rs in results.items():
        summary["ratios"][case] = case_ratios(rs)
        summary["goals"][case] = case_goals(summary["ratios"][case])
        prof = into_profile(rs, summary["ratios"][case].get("best_inplace_socket"), state_bytes(case))
        if prof is not None:
            summary.setdefault("into_profile", {})[case] = prof
    if not json_only:
        print(f"load average {load[0]:.2f} -> {load[1]:.2f}; torchft's receivers: heap {torchft_heap}")
        cw = max([15] + [len(c) + 2 for rs in results.values() for c in rs])  # contender column
        print(f"{'case':<10}{'contender':<{cw}}{'first s':>9}{'median s':>10}{'GB/s':>8}{'recv CPU s':>12}"
              f"{'send CPU s':>12}{'peak RSS MB':>13}{'(peak-base)/state':>19}{'same, all repeats':>19}"
              f"{'faults 1st':>12}{'faults med':>12}")
        for case, rs in results.items():
            for c, r in rs.items():
                print(f"{case:<10}{c:<{cw}}{r['first_s']:>9.4f}{r['median_s']:>10.4f}{r['gbps']:>8.3f}"
                      f"{r['recv_cpu_s']:>12.3f}{r['send_cpu_s']:>12.3f}{r['peak_rss_mb']:>13.0f}"
                      f"{r['peak_over_base_x_state']:>19.2f}{r['peak_over_base_x_state_all_repeats']:>19.2f}"
                      f"{r['first_minor_faults']:>12}{r['minor_faults']:>12.0f}")
            rt = summary["ratios"][case]
            parts = [
                _fmt(rt, "rallypoint_vs_torchft0", ".2f", "rallypoint x torchft(0)"),
                _fmt(rt, "rallypoint_vs_torchft4", ".2f", "rallypoint x torchft(4)"),
                _fmt(rt, "rallypoint_of_socket", ".0%", "rallypoint of socket (fresh vs fresh)"),
                _fmt(rt, "inplace_vs_torchft0", ".2f", "rp_inplace x torchft(0)"),
                _fmt(rt, "inplace_of_socket_inplace", ".0%", "rp_inplace of socket_inplace"),
                _fmt(rt, "inplace_of_socket4", ".0%", "rp_inplace of socket4"),
                _fmt(rt, "into_vs_torchft0", ".2f", "rp_into x torchft(0)"),
                _fmt(rt, "into_of_socket_inplace", ".0%", "rp_into of socket_inplace"),
                _fmt(rt, "into_nosum_vs_torchft0", ".2f", "rp_into_nosum x torchft(0)"),
                _fmt(rt, "into_nosum_of_socket_inplace", ".0%", "rp_into_nosum of socket_inplace"),
                _fmt(rt, "socket4_vs_socket_inplace", ".2f", "socket4 x socket_inplace"),
                _fmt(rt, "first_fetch_rallypoint_vs_torchft0", ".2f", "first fetch: rallypoint x torchft(0)"),
                _fmt(rt, "first_fetch_inplace_vs_torchft0", ".2f", "first fetch: rp_inplace x torchft(0)"),
                _fmt(rt, "first_fetch_rallypoint_of_socket", ".0%", "first fetch: rallypoint of socket"),
                _fmt(rt, "pg_vs_torchft_pg", ".2f", "PG: rp_pg x torchft_pg"),
                _fmt(rt, "pg_inplace_vs_torchft_pg", ".2f", "rp_pg_inplace x torchft_pg"),
                _fmt(rt, "first_fetch_pg_vs_torchft_pg", ".2f", "first fetch rp_pg x torchft_pg"),
            ]
            print(f"{case:<10}ratios (median unless first): " + ", ".join(p for p in parts if p))
            goals = summary["goals"][case]
            if goals:
                shown = [(k, lab, f) for k, lab, f in (
                    ("rallypoint_vs_torchft0", "rallypoint (fresh) / torchft(0)", ".2f"),
                    ("inplace_vs_torchft0", "rp_inplace / torchft(0)", ".2f"),
                    ("rallypoint_of_socket", "rallypoint of socket (fresh)", ".1%"),
                    ("inplace_of_best_socket", f"rp_inplace of {rt.get('best_inplace_socket')} (best in-place "
                                               "socket ceiling)", ".1%"),
                    ("into_vs_torchft0", "rp_into / torchft(0)", ".2f"),
                    ("into_of_best_socket", f"rp_into of {rt.get('best_inplace_socket')}", ".1%"),
                    ("into_nosum_vs_torchft0", "rp_into_nosum / torchft(0)", ".2f"),
                    ("into_nosum_of_best_socket", f"rp_into_nosum of {rt.get('best_inplace_socket')}", ".1%"))
                    if k in goals]
                print(f"{case:<10}goals: HTTP receive >= {GOAL_VS_TORCHFT}x torchft(0) and >= {GOAL_OF_SOCKET:.0%} of "
                      "the socket ceiling: " + ", ".join(f"{lab} {rt[k]:{f}} {'met' if goals[k] else 'NOT met'}"
                                                         for k, lab, f in shown))
            if "torchft0_of_socket_inplace" in rt and "socket4_vs_socket_inplace" in rt:
                tf = rt["torchft0_of_socket_inplace"]
                print(f"{case:<10}where the goal lies: torchft(0) at {tf:.0%} of one plain socket's speed, so "
                      f"{GOAL_VS_TORCHFT}x torchft(0) is {GOAL_VS_TORCHFT * tf:.0%} of it; four plain sockets "
                      f"reach {rt['socket4_vs_socket_inplace']:.0%}")
            if "verified_floor_vs_torchft0" in rt:
                print(f"{case:<10}the floor of a verified heal: {rt['verified_floor']} (plain sockets, every byte summed "
                      f"and checked) {rt['verified_floor_vs_torchft0']:.2f}x torchft(0)"
                      + _fmt(rt, "socket4_xxh3_of_socket4", ".0%", ", socket4_xxh3 of socket4's speed")
                      + _fmt(rt, "into_of_verified_floor", ".0%", f", rp_into of {rt['verified_floor']}'s"))
            bare = [_fmt(rt, "bare_http_of_socket_inplace", ".0%", f"{BARE_HTTP} of one plain socket's speed"),
                    _fmt(rt, "bare_http_of_socket4", ".0%", f"{BARE_HTTP} of four plain sockets'"),
                    _fmt(rt, "bare_http_tensors_of_bare_http", ".0%", f"{BARE_HTTP_TENSORS} of {BARE_HTTP}'s"),
                    _fmt(rt, "into_nosum_of_bare_http", ".0%", f"rp_into_nosum of {BARE_HTTP}'s"),
                    _fmt(rt, "into_nosum_of_bare_http_tensors", ".0%", f"rp_into_nosum of {BARE_HTTP_TENSORS}'s")]
            if any(bare):
                print(f"{case:<10}our sender read by bare receivers: " + ", ".join(p for p in bare if p))
            prof = summary.get("into_profile", {}).get(case)
            if prof is not None:
                sums = "; ".join(f"{k} {v['send']:.3f} sending + {v['recv']:.3f} receiving"
                                 for k, v in prof["sums_cpu_s"].items())
                print(f"{case:<10}rp_into against {prof['socket']}: {prof['extra_s']:+.3f} s per fetch, "
                      f"{prof['extra_cpu_s']:+.3f} s of CPU (both sides); the sums of every byte alone, CPU s: {sums}")
                if "into_crc_vs_into" in rt:
                    print(f"{case:<10}rp_into_crc (CRC-32 sums) / rp_into (XXH3): {rt['into_crc_vs_into']:.2f}")
            tls_parts = [
                _fmt(rt, "http_tls_vs_http", ".2f", "http_tls / rallypoint"),
                _fmt(rt, "http_tls_inplace_vs_inplace", ".2f", "http_tls_inplace / rp_inplace"),
                _fmt(rt, "first_fetch_http_tls_vs_http", ".2f", "first fetch http_tls / rallypoint"),
                _fmt(rt, "first_fetch_http_tls_inplace_vs_inplace", ".2f", "first fetch http_tls_inplace / rp_inplace"),
                _fmt(rt, "socket_tls_vs_socket", ".2f", "socket_tls / socket"),
                _fmt(rt, "http_tls_of_socket_tls", ".0%", "http_tls of socket_tls"),
            ]
            if any(tls_parts):
                goal = " (goal <= 1.15 at 1 GB)" if case == "1GB" else ""
                sockets = {c: rs[c]["fast_path_sockets"] for c in (TLS_CONTENDER, TLS_INPLACE)
                           if "fast_path_sockets" in rs.get(c, {})}
                print(f"{case:<10}TLS (median time TLS / clear text){goal}: " + ", ".join(p for p in tls_parts if p)
                      + f"; fast path sockets {sockets}")
    print(json.dumps(summary))
