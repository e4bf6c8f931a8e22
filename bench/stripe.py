"""Striped healing benchmark: one healing receiver fetching a state from one peer vs from
two peers at once (rallypoint's ``HTTPTransport``), with and without a per-peer limit.

Why a limit: on one machine every "peer" shares the same two cores and the same memory
bus, so striping cannot beat one fast loopback peer here. On a cluster the bottleneck of
a heal is usually per peer (its NIC, its PCIe, its CPU serving while it trains), which
is what striping spreads. ``--limit-mbps`` caps each sender's serving rate (a sleep per
1 MiB piece, in the serving thread, so it is the peer that is slow, not the receiver);
0 skips the limited case. torchft 0.2.0 fetches from one peer only: its single-peer time
(``torchft0``: its ``HTTPTransport`` with ``num_chunks=0``, the Manager's default,
unlimited) is printed next to ours for reference.

Each peer is its own process serving the same state; the receiver is a third process.
Contenders take turns, round by round (one warm-up round, then ``--repeats``); the
receiver receives into a state it already holds (``into=``, ``in_place=True``: a healing
replica's situation, and free of first-touch page faults that would otherwise dominate).

    python bench/stripe.py [--mb 512] [--repeats 3] [--limit-mbps 400]

Prints a table and one JSON line; goal: striped from 2 peers >= 1.7x the single-peer
throughput when the bottleneck is per peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _util  # noqa: E402

TIMEOUT = timedelta(seconds=300)
NUMEL = 3 * 1024 * 1024 // 4  # 3 MiB float32 tensors


def make_state(mb: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(NUMEL, generator=g) for i in range(max(1, mb * (1 << 20) // (NUMEL * 4)))}


def run_sender(mb: int, limit_mbps: float) -> None:
    """Serve the state with rallypoint (limited and unlimited) and torchft; print URLs."""
    from rallypoint.transports.http import HTTPTransport
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

    class Limited(HTTPTransport):
        """Serves at most ``limit_mbps`` MB/s over all its connections (one peer's link)."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._budget_t = time.monotonic()

        def _pieces(self, served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Any:
            for piece in super()._pieces(served, start, end, with_header, *kind):
                yield piece
                with self._lock:  # a shared clock: the peer's rate, not each connection's
                    self._budget_t = max(self._budget_t, time.monotonic()) + piece.nbytes / (limit_mbps * 1e6)
                    wait = self._budget_t - time.monotonic()
                if wait > 0:
                    time.sleep(wait)

    sd = make_state(mb)
    plain = HTTPTransport(TIMEOUT, 4, bind="127.0.0.1:0", serve="copy")
    limited = Limited(TIMEOUT, 4, bind="127.0.0.1:0", serve="copy") if limit_mbps > 0 else None
    tf = TorchftHTTP(TIMEOUT, num_chunks=0)
    # Served once and kept for every fetch: "copy" (a live offer is dropped once its
    # receiver says done).
    for t in (plain, limited):
        if t is not None:
            t.send_checkpoint([1], 1, sd, TIMEOUT)
    tf.send_checkpoint([1], 1, sd, TIMEOUT)
    print(json.dumps({"plain": plain.metadata(), "limited": limited.metadata() if limited else None,
                      "torchft": tf.metadata()}), flush=True)
    sys.stdin.readline()


def run_receiver(mb: int) -> None:
    import torch

    from rallypoint.transports.http import HTTPTransport
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

    template = {k: torch.zeros_like(v) for k, v in make_state(mb).items()}
    rp = HTTPTransport(TIMEOUT, bind="127.0.0.1:0")
    tf = TorchftHTTP(TIMEOUT, num_chunks=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        if req["kind"] == "torchft":
            tf.recv_checkpoint(0, req["meta"], 1, TIMEOUT)
        else:
            rp.recv_checkpoint(0, req["meta"], 1, TIMEOUT, into=template, in_place=True)
        print(json.dumps({"t": time.perf_counter() - t0}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit-mbps", type=float, default=400.0)
    ap.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "sender":
        return run_sender(a.mb, a.limit_mbps)
    if a.role == "receiver":
        return run_receiver(a.mb)
    env = dict(os.environ)
    _util.clear_job_env(env)
    me = [sys.executable, os.path.abspath(__file__), "--mb", str(a.mb), "--limit-mbps", str(a.limit_mbps)]
    peers = [_util.Child(me + ["--role", "sender"], f"peer{i}", env=env) for i in range(2)]
    recv = _util.Child(me + ["--role", "receiver"], "receiver", env=env)
    try:
        urls = [p.recv(300) for p in peers]
        recv.recv(300)
        cases: dict[str, tuple[str, str]] = {
            "1 peer": ("rp", urls[0]["plain"]),
            "2 peers striped": ("rp", f"{urls[0]['plain']},{urls[1]['plain']}"),
            "torchft0, 1 peer": ("torchft", urls[0]["torchft"]),
        }
        if a.limit_mbps > 0:
            cases["1 peer, limited"] = ("rp", urls[0]["limited"])
            cases["2 peers striped, limited"] = ("rp", f"{urls[0]['limited']},{urls[1]['limited']}")
        times: dict[str, list[float]] = {c: [] for c in cases}
        for rnd in range(a.repeats + 1):
            for c, (kind, meta) in cases.items():
                recv.send({"kind": kind, "meta": meta})
                t = recv.recv(600)["t"]
                if rnd:
                    times[c].append(t)
    finally:
        for p in (*peers, recv):
            p.kill()
    nbytes = len(make_state(a.mb)) * NUMEL * 4
    rows, out = [], {}
    for c, ts in times.items():
        med = statistics.median(ts)
        out[c] = {"median_s": med, "gbps": nbytes / med / 1e9}
        rows.append([c, f"{med:.3f}", f"{nbytes / med / 1e9:.2f}"])
    print(_util.table(["case", "median s", "GB/s"], rows))
    ratios = {"striped_vs_single": times["1 peer"] and statistics.median(times["1 peer"])
              / statistics.median(times["2 peers striped"]),
              "single_vs_torchft0": statistics.median(times["torchft0, 1 peer"]) / statistics.median(times["1 peer"])}
    if a.limit_mbps > 0:
        ratios["striped_vs_single_limited"] = (statistics.median(times["1 peer, limited"])
                                               / statistics.median(times["2 peers striped, limited"]))
    print("ratios (higher is better for ours): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
          + "; goal: striped_vs_single_limited >= 1.7")
    print(json.dumps({"bench": "stripe", "mb": a.mb, "limit_mbps": a.limit_mbps, "repeats": a.repeats,
                      "cases": out, "ratios": ratios}))


if __name__ == "__main__":
    main()
