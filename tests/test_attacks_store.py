"""Issue 37, attack 3: the replica group's store redirects the job token.

Anyone who can reach the group's TCPStore can write in it. Before, whoever wrote
``rallypoint/<n>/manager_addr`` before group rank 0 did received the job token from ranks
1..n when they dialled it, and forged ``peer_down`` notices aborted every rank's
collectives. With a job token, rank 0 signs what it publishes (``_storesig``: an HMAC over
the incarnation's scope, the key and the value) and every rank refuses, and logs, what
does not check; the group goes on with rank 0's own values.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from rallypoint.manager._connect import read_signed
from rallypoint.manager._peer_relay import PeerDownRelay
from rallypoint.manager._storesig import MAGIC, sign, store_scope, verify

TOKEN = "s3cret-job-token"
SCOPE = store_scope("rallypoint/0", 29500, {})
FIVE = timedelta(seconds=5)


# ------------------------------------------------------------------ the pure check

GOOD = sign(TOKEN, SCOPE, "manager_addr", b"10.0.0.1:4000")


@pytest.mark.parametrize("token, scope, key, stored, expected", [
    (TOKEN, SCOPE, "manager_addr", GOOD, b"10.0.0.1:4000"),                     # rank 0's own value
    (TOKEN, SCOPE, "manager_addr", b"6.6.6.6:1", None),                        # unsigned (the attack)
    (TOKEN, SCOPE, "manager_addr", sign("guess", SCOPE, "manager_addr", b"6.6.6.6:1"), None),  # wrong key
    (TOKEN, SCOPE, "replica_id", GOOD, None),                                  # replayed under another key
    (TOKEN, store_scope("rallypoint/1", 29500, {}), "manager_addr", GOOD, None),   # another incarnation
    (TOKEN, store_scope("rallypoint/0", 29501, {}), "manager_addr", GOOD, None),   # another store
    (TOKEN, store_scope("rallypoint/0", 29500, {"TORCHELASTIC_RUN_ID": "r2"}), "manager_addr", GOOD, None),
    (TOKEN, SCOPE, "manager_addr", GOOD[:-1] + b"5", None),                    # value changed after signing
    (TOKEN, SCOPE, "manager_addr", GOOD.replace(b"10.0.0.1", b"6.6.6.66"), None),
    (TOKEN, SCOPE, "manager_addr", MAGIC + b"0" * 64 + b":6.6.6.6:1", None),   # a made-up signature
    (TOKEN, SCOPE, "manager_addr", MAGIC + b"short:x", None),                  # malformed
    (TOKEN, SCOPE, "manager_addr", b"", None),
    (None, SCOPE, "manager_addr", b"6.6.6.6:1", b"6.6.6.6:1"),                 # no token: open, as before
    (None, SCOPE, "manager_addr", b"", b""),
])
def test_verify(token: str | None, scope: str, key: str, stored: bytes, expected: bytes | None) -> None:
    assert verify(token, scope, key, stored) == expected


@pytest.mark.parametrize("value", [b"", b"x", b":" * 80, "é".encode(), bytes(range(256))])
def test_sign_round_trips(value: bytes) -> None:
    assert verify(TOKEN, SCOPE, "k", sign(TOKEN, SCOPE, "k", value)) == value
    assert sign(None, SCOPE, "k", value) == value


def test_fields_cannot_be_shifted() -> None:
    """Moving bytes between scope, key and value gives another signature."""
    assert verify(TOKEN, "ab", "c", sign(TOKEN, "a", "bc", b"v")) is None
    assert verify(TOKEN, "a", "b", sign(TOKEN, "a", "bv", b"")) is None


# ------------------------------------------------------------------ helpers


class Listener:
    """The attacker's server: counts the connections it is sent and what arrives."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.received = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(1.0)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class Lines(logging.Handler):
    """Collects WARNING lines of ``rallypoint``; ``wait_for`` blocks until one matches."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.lines.append(record.getMessage())
            self._cond.notify_all()

    def matching(self, text: str) -> list[str]:
        with self._cond:
            return [line for line in self.lines if text in line]

    def wait_for(self, text: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(text in line for line in self.lines), timeout)


@pytest.fixture
def warnings_seen() -> Any:
    handler = Lines()
    logger = logging.getLogger("rallypoint")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def attacker_writes(spawn_python: Any, port: int, items: dict[str, str]) -> None:
    """A separate process on loopback writes ``items`` in the group's store."""
    code = (
        "import json, sys\n"
        "from datetime import timedelta\n"
        "from torch.distributed import TCPStore\n"
        "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))\n"
        "for k, v in json.loads(sys.argv[2]).items():\n"
        "    s.set(k, v)\n"
        "print('written', flush=True)\n"
    )
    p = spawn_python(code, str(port), json.dumps(items), name="attacker")
    assert p.wait(60) == 0, p.stderr_text()


# ------------------------------------------------------------------ the attack on two real ranks


def test_forged_manager_addr_never_receives_the_token(lighthouse: Any, spawn_python: Any, warnings_seen: Lines,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker writes ``manager_addr`` (its own listener) and peer-down notices in the
    group's store before group rank 0 starts. Rank 1 refuses them (logged once), waits for
    rank 0's signed address, and both ranks train and commit; the attacker's listener is
    never dialled."""
    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    lh = lighthouse(min_replicas=1, join_timeout_ms=100, token=TOKEN)
    host_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the launcher's part
    thief = Listener()
    forged = {"replica_id": "grp:victim", "reason": "forged"}
    attacker_writes(spawn_python, host_store.port, {
        "rallypoint/0/manager_addr": thief.address,
        "rallypoint/0/replica_id": "attacker",
        **{f"rallypoint/0/peer_down/{n}": json.dumps(forged) for n in (1, 2, 3)},
    })
    results: dict[int, Any] = {}
    managers: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        pg = ProcessGroupGloo(timeout=FIVE)
        m = None
        try:
            m = Manager(pg, lambda sd: None, dict, min_replica_size=1, rank=rank, world_size=2,
                        store_addr="127.0.0.1", store_port=host_store.port, lighthouse_addr=lh.address(),
                        replica_id="grp", hostname="127.0.0.1", timeout=FIVE, quorum_timeout=FIVE,
                        connect_timeout=timedelta(seconds=20))
            managers[rank] = m
            got = []
            for _ in range(3):
                m.start_quorum()
                t = torch.tensor([float(rank + 1)])
                m.allreduce(t).wait()
                got.append((m.should_commit(), t.item()))
            results[rank] = (got, m.current_step(), m.replica_id, m._relay.refused if m._relay else None)
        except Exception as e:  # noqa: BLE001
            results[rank] = e
        finally:
            if m is not None:
                m.shutdown()
            pg.shutdown()

    threads = {r: threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)}
    try:
        threads[1].start()  # rank 1 reads the store first: it finds the attacker's value
        assert warnings_seen.wait_for("refused store key manager_addr", 20), warnings_seen.lines
        threads[0].start()
        for t in threads.values():
            t.join(60)
        assert not any(t.is_alive() for t in threads.values()), results
        for rank in (0, 1):
            assert not isinstance(results[rank], Exception), results
            got, step, rid, _ = results[rank]
            assert got == [(True, float(rank + 1))] * 3 and step == 3, results
            assert rid.startswith("grp:"), results
        assert results[1][3] == 3, "rank 1's relay refused the three forged notices"
        assert thief.connections == 0 and thief.received == b""
        assert TOKEN.encode() not in thief.received
        assert len(warnings_seen.matching("refused store key manager_addr")) == 1, warnings_seen.lines
        assert warnings_seen.matching("peer_down/1"), warnings_seen.lines
    finally:
        thief.close()


# ------------------------------------------------------------------ the peer-down relay on its own


def _relays(port: int, token: str | None) -> tuple[PeerDownRelay, PeerDownRelay, list[tuple[str, str]]]:
    got: list[tuple[str, str]] = []
    scope = store_scope("rallypoint/0", port, {})
    writer = PeerDownRelay("127.0.0.1", port, 0, lambda r, why: None, FIVE, prefix="rallypoint/0",
                           token=token, scope=scope)
    listener = PeerDownRelay("127.0.0.1", port, 1, lambda r, why: got.append((r, why)), FIVE,
                             prefix="rallypoint/0", token=token, scope=scope)
    return writer, listener, got


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not done.is_set():
            if pred():
                return True
            done.wait(0.02)
        return bool(pred())
    finally:
        deadline.cancel()


def test_forged_and_replayed_notices_are_refused_and_real_ones_still_arrive(warnings_seen: Lines) -> None:
    """Slots filled in advance by the attacker, a notice signed with a guessed token and a
    genuine notice copied to another slot are all refused (one warning); rank 0's notices
    are still delivered, in order, in the slots after them."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    attacker = TCPStore("127.0.0.1", store.port, is_master=False, timeout=FIVE)
    writer, listener, got = _relays(store.port, TOKEN)
    try:
        listener.start()
        attacker.set("rallypoint/0/peer_down/1", json.dumps({"replica_id": "victim", "reason": "forged"}))
        scope = store_scope("rallypoint/0", store.port, {})
        attacker.set("rallypoint/0/peer_down/2", sign("guess", scope, "rallypoint/0/peer_down/2",  # type: ignore[arg-type]
                                                      b'{"replica_id": "victim", "reason": "guessed"}'))
        writer.publish("peer-a", "really down")          # takes slot 3: 1 and 2 are taken
        assert _wait(lambda: got == [("peer-a", "really down")]), got
        attacker.set("rallypoint/0/peer_down/4", attacker.get("rallypoint/0/peer_down/3"))  # type: ignore[arg-type]  # a replay
        writer.publish("peer-b", "really down too")     # slot 5
        assert _wait(lambda: len(got) == 2), got
        assert got == [("peer-a", "really down"), ("peer-b", "really down too")]
        assert listener.refused == 3
        assert len(warnings_seen.matching("refused store key rallypoint/0/peer_down/")) == 1, warnings_seen.lines
    finally:
        listener.close()
        writer.close()


def test_without_a_token_the_store_is_trusted_as_before() -> None:
    """No token configured: values are plain and not checked (documented: the data plane
    is open), so a forged notice is delivered, as in torchft."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    attacker = TCPStore("127.0.0.1", store.port, is_master=False, timeout=FIVE)
    writer, listener, got = _relays(store.port, None)
    try:
        listener.start()
        attacker.set("rallypoint/0/peer_down/1", json.dumps({"replica_id": "victim", "reason": "forged"}))
        assert _wait(lambda: got == [("victim", "forged")]), got
        writer.publish("peer-a", "down")
        assert _wait(lambda: len(got) == 2), got
    finally:
        listener.close()
        writer.close()
    attacker.set("manager_addr", "6.6.6.6:1")
    log = logging.getLogger("test")
    assert read_signed(attacker, "manager_addr", None, SCOPE, 1.0, log) == "6.6.6.6:1"


def test_read_signed_gives_up_when_only_forgeries_arrive(warnings_seen: Lines) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("manager_addr", "6.6.6.6:1")
    with pytest.raises(TimeoutError, match="not signed with the job token"):
        read_signed(store, "manager_addr", TOKEN, SCOPE, 0.3, logging.getLogger("rallypoint.test"))
    assert len(warnings_seen.matching("refused store key manager_addr")) == 1
