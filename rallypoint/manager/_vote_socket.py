"""The commit vote of group ranks > 0 over a plain socket instead of a gRPC call.

Why: in a replica group of several ranks every rank but 0 votes over the network at every
step, and a Python gRPC unary call costs 0.46-0.53 ms per round trip on an idle 2-core box
and 0.97-1.16 ms with two busy processes beside it, where a plain TCP round trip through a
server thread costs 13-15 us and 26-69 us (``bench/group_rounds.py`` measures the whole
step). The vote is the only call on the step path of such a group once the quorum is leased.

How: group rank 0's ``ManagerServer`` also listens on a TCP port of its own (same host,
port 0) when its gRPC port is not TLS, and names that port in the trailing metadata of
every ``ShouldCommit`` answer (:data:`PORT_KEY`: the port and the socket's random instance
id). A rallypoint client that gets it sends its later votes there; torchft's clients never see it (they ignore unknown trailing
metadata) and go on over gRPC. The server decides the vote exactly as the gRPC handler
does (the same checks, rank claim, vote round and hand-out).

The wire, one connection per client, votes one at a time:

* the server opens with :data:`MAGIC`, a fresh random nonce of :data:`NONCE_BYTES` and its
  instance id (:data:`INSTANCE_BYTES`, random per server). A client whose server named
  another id (the port it learnt now belongs to another server: its server restarted and
  another group's socket took the port) sends nothing there and votes over gRPC instead, so
  a stale port never carries a vote to the wrong replica group;
* the client answers with :func:`proof`: HMAC-SHA256 of the nonce under the job token
  (zeros without one). The token itself never travels, so it is only sent to nobody; a
  server with a token closes a connection whose proof is wrong, before reading anything
  else;
* then each vote is one length-prefixed JSON frame (:func:`encode_frame`, at most
  :data:`MAX_FRAME_BYTES`, the length checked before the body is read) and one answer
  frame: ``{"decision": bool, "trailing": [[key, value]]}`` or ``{"code": ..., "message":
  ...}`` (the gRPC status names, so the client raises what a gRPC failure would raise).

A vote carries its own timeout; the server bounds the wait by it, and a client that goes
away while its vote is undecided withdraws it, as a cancelled gRPC call does. Any failure
to connect or prove falls back to gRPC for that vote; a failure after the vote was sent
is that vote's error (a step that does not commit), and the next vote reconnects.
``RALLYPOINT_VOTE_SOCKET=0`` on group rank 0 turns the socket off (every vote over gRPC).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rallypoint._net.slots import evict_for_newcomer

log = logging.getLogger("rallypoint.manager.vote_socket")

#: Trailing metadata key of a ShouldCommit answer naming the vote socket's port.
PORT_KEY = "x-rallypoint-vote-port"
#: Environment switch on group rank 0: ``0`` serves no vote socket.
ENV = "RALLYPOINT_VOTE_SOCKET"
MAGIC = b"RPV2"
NONCE_BYTES = 32
INSTANCE_BYTES = 16
PROOF_BYTES = 32
_CONTEXT = b"rallypoint vote socket v1 "
_LEN = struct.Struct("!I")
#: Largest frame either side accepts (a vote carries a rank key, step stats of at most
#: 1 KiB and a hand-out of well under 1 KiB).
MAX_FRAME_BYTES = 8 << 10
#: Longest wait for a connection to the vote socket (it is on the host that answered the
#: gRPC call a moment ago: a port that does not answer within this is taken as blocked).
CONNECT_TIMEOUT_S = 1.0
#: Longest wait for a new client's proof.
HANDSHAKE_TIMEOUT_S = 5.0
#: A connection idle this long between votes is closed (the client reconnects).
IDLE_TIMEOUT_S = 600.0
#: Longest timeout a vote may ask the server to wait.
MAX_VOTE_TIMEOUT_S = 3600.0
#: Open vote connections a server keeps. A newcomer beyond them takes the place of the
#: oldest connection that has not proven the job token yet, and is closed only when every
#: one has (:func:`rallypoint._net.slots.evict_for_newcomer`): silent connections from
#: anyone who can reach the port cannot keep the group's ranks off the socket.
MAX_CONNECTIONS = 64
#: Metadata entries a vote may carry.
MAX_META = 8


class VoteSocketError(ConnectionError):
    """The vote socket could not be used before the vote was sent (connect, proof, a
    server gone): the caller votes over gRPC instead."""


def enabled(environ: Any = None) -> bool:
    """Whether group rank 0 serves the vote socket (``RALLYPOINT_VOTE_SOCKET`` not ``0``)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "1") != "0"


def proof(token: str | None, nonce: bytes) -> bytes:
    """What a client sends for ``nonce``: HMAC-SHA256 under ``token`` (zeros without one)."""
    if not token:
        return bytes(PROOF_BYTES)
    return hmac.new(token.encode("utf-8"), _CONTEXT + nonce, hashlib.sha256).digest()


def proof_ok(token: str | None, nonce: bytes, got: bytes) -> bool:
    """Whether ``got`` proves the token (always, for a server without one); constant time."""
    return token is None or hmac.compare_digest(proof(token, nonce), got)


def encode_frame(obj: dict[str, Any]) -> bytes:
    """``obj`` as one frame: its JSON's length (4 bytes) and the JSON. ValueError over the limit."""
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a vote socket frame of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return _LEN.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    """The body length a frame's 4-byte prefix announces; ValueError when 0 or over the limit."""
    (n,) = _LEN.unpack(prefix)
    if not 0 < n <= MAX_FRAME_BYTES:
        raise ValueError(f"a vote socket frame announces {n} bytes (1..{MAX_FRAME_BYTES} allowed)")
    return n


@dataclass(frozen=True)
class VoteRequest:
    """One rank's vote as the socket carries it (checked by :func:`parse_request`)."""

    rank: int
    step: int
    vote: bool
    timeout_s: float
    meta: dict[str, str] = field(default_factory=dict)


def _int(obj: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"'{key}' must be a whole number in [{lo}, {hi}], got {v!r}"[:200])
    return v


def _object(body: bytes) -> dict[str, Any]:
    """A frame's body as a JSON object; ValueError when it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a JSON object: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def _pairs(obj: dict[str, Any], key: str) -> list[tuple[str, str]]:
    """``obj[key]``: at most MAX_META ``[key, value]`` string pairs (none when absent)."""
    raw = obj.get(key, [])
    if not isinstance(raw, list) or len(raw) > MAX_META:
        raise ValueError(f"'{key}' must be a list of at most {MAX_META} [key, value] pairs")
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError(f"'{key}' must be a list of [key, value] string pairs")
    return [(k, v) for k, v in raw]


def parse_request(body: bytes) -> VoteRequest:
    """A vote frame's body as a :class:`VoteRequest`; ValueError naming the bad field."""
    obj = _object(body)
    rank = _int(obj, "rank", 0, 2**31 - 1)
    step = _int(obj, "step", -(2**63), 2**63 - 1)
    vote = obj.get("vote")
    if not isinstance(vote, bool):
        raise ValueError(f"'vote' must be true or false, got {vote!r}"[:200])
    timeout = obj.get("timeout_s")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_VOTE_TIMEOUT_S:
        raise ValueError(f"'timeout_s' must be in (0, {MAX_VOTE_TIMEOUT_S:g}], got {timeout!r}"[:200])
    return VoteRequest(rank, step, vote, float(timeout), dict(_pairs(obj, "meta")))


@dataclass(frozen=True)
class VoteAnswer:
    """The server's answer: the decision and its trailing metadata, or a failure's gRPC
    status name and message."""

    decision: bool | None
    trailing: tuple[tuple[str, str], ...] = ()
    code: str | None = None
    message: str = ""


def parse_answer(body: bytes) -> VoteAnswer:
    """An answer frame's body; ValueError when it is not one."""
    obj = _object(body)
    if "code" in obj:
        code, msg = obj.get("code"), obj.get("message", "")
        if not isinstance(code, str) or not isinstance(msg, str):
            raise ValueError("a failure needs a string code and message")
        return VoteAnswer(None, (), code[:64], msg[:2000])
    decision = obj.get("decision")
    if not isinstance(decision, bool):
        raise ValueError(f"an answer needs a boolean decision, got {decision!r}"[:200])
    return VoteAnswer(decision, tuple(_pairs(obj, "trailing")))


# ------------------------------------------------------------------------------ server
#: ``decide(request, peer)`` -> (decision, trailing pairs); raises an exception with
#: ``code`` (a gRPC status name) and ``message`` attributes for a refusal.
Decide = Callable[[VoteRequest, str], Awaitable[tuple[bool, list[tuple[str, str]]]]]


class VoteSocketServer:
    """The vote socket of one ManagerServer, on its asyncio loop (a thin shell: the
    decision is the server's ``decide``)."""

    def __init__(self, token: str | None, decide: Decide, label: str) -> None:
        self._token = token
        #: random per server: named with the port, checked by clients before they send anything
        self.instance = secrets.token_bytes(INSTANCE_BYTES)
        self._decide = decide
        self._label = label
        self._server: asyncio.AbstractServer | None = None
        #: open connections, oldest first: when accepted and whether proven
        self._conns: dict[asyncio.StreamWriter, tuple[float, bool]] = {}
        self.port = 0
        self.refused = 0  #: connections closed for a wrong proof or a bad frame (tests read it)
        self.votes = 0  #: well-formed votes received (refused ones included)

    async def start(self, host: str) -> int:
        """Listen on ``host``, a free port; the port."""
        self._server = await asyncio.start_server(self._serve, host=host or None, port=0,
                                                  limit=MAX_FRAME_BYTES + _LEN.size)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop listening and close every open connection (their votes are withdrawn)."""
        for writer in list(self._conns):
            writer.close()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
                pass

    def _make_room(self, peer: str) -> bool:
        """Whether a newcomer (from ``peer``) gets a place: at once below the cap, else by
        closing the oldest connection not yet proven; False when every one is proven."""
        if len(self._conns) < MAX_CONNECTIONS:
            return True
        writers = list(self._conns)
        i = evict_for_newcomer(list(self._conns.values()))
        if i is None:
            return False
        victim = writers[i]
        del self._conns[victim]
        log.warning("[%s] vote socket: %d connections open; closing the oldest without a proof for a newcomer "
                    "from %s", self._label, MAX_CONNECTIONS, peer)
        victim.close()
        return True

    def _refuse(self, peer: str, why: str, writer: asyncio.StreamWriter) -> None:
        self.refused += 1
        log.warning("[%s] vote socket: closed the connection from %s: %s", self._label, peer, why)
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % tuple(writer.get_extra_info("peername") or ("?", "?"))[:2]
        if not self._make_room(peer):
            self._refuse(peer, f"{MAX_CONNECTIONS} proven vote connections are open already", writer)
            return
        accepted = time.monotonic()
        self._conns[writer] = (accepted, False)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(NONCE_BYTES)
            writer.write(MAGIC + nonce + self.instance)
            try:
                got = await asyncio.wait_for(reader.readexactly(PROOF_BYTES), HANDSHAKE_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            if not proof_ok(self._token, nonce, got):
                self._refuse(peer, "wrong job token proof", writer)
                return
            if writer not in self._conns:  # displaced by a newcomer meanwhile
                return
            self._conns[writer] = (accepted, True)
            while await self._one_vote(reader, writer, peer):
                pass
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def _one_vote(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> bool:
        """Serve one vote; whether the connection stays open. Lean on the loop (a vote a
        step goes through here): the bounds are ``asyncio.timeout`` scopes, not tasks, and
        only the vote and the watch for the client going away run as tasks."""
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                prefix = await reader.readexactly(_LEN.size)
            n = frame_length(prefix)
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                body = await reader.readexactly(n)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        except ValueError as e:
            self._refuse(peer, str(e), writer)
            return False
        try:
            req = parse_request(body)
        except ValueError as e:
            writer.write(encode_frame({"code": "INVALID_ARGUMENT", "message": f"bad vote: {e}"}))
            self._refuse(peer, f"bad vote: {e}", writer)
            return False
        self.votes += 1
        vote = asyncio.ensure_future(self._decide(req, peer))
        gone = asyncio.ensure_future(reader.read(1))  # the client went away: withdraw its vote
        try:
            done, _ = await asyncio.wait((vote, gone), timeout=req.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this connection's task was cancelled (the server stops): no watch left behind
            gone.cancel()
            raise
        finally:
            if not vote.done():
                vote.cancel()  # withdraws the undecided vote (CommitVotes.vote)
        if vote not in done and gone in done:
            return False
        stay = gone not in done
        gone.cancel()
        if vote not in done:
            answer: dict[str, Any] = {"code": "DEADLINE_EXCEEDED", "message": f"no decision within {req.timeout_s:g}s"}
        else:
            try:
                decision, trailing = vote.result()
                answer = {"decision": decision, "trailing": [list(p) for p in trailing]}
            except Exception as e:  # noqa: BLE001 - a refusal (the server's _Failure) or a bug: told to the client
                answer = {"code": str(getattr(e, "code", "UNKNOWN")).rsplit(".", 1)[-1][:64],
                          "message": str(getattr(e, "message", e))[:2000]}
        writer.write(encode_frame(answer))
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            return False
        if stay:
            await asyncio.sleep(0)  # the watch's cancellation lands before the next read starts
        return stay


# ------------------------------------------------------------------------------ client
class VoteSocketClient:
    """One rank's connections to its group rank 0's vote socket. Thread-safe: a vote takes
    an idle connection or opens one (so votes from several threads, e.g. a stale one still
    waiting, do not queue behind each other) and gives it back after a clean answer."""

    def __init__(self, host: str, port: int, token: str | None, instance: bytes) -> None:
        self.host, self.port, self.instance = host, port, instance
        self._token = token
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, timeout: float) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(timeout, CONNECT_TIMEOUT_S))
        except OSError as e:
            raise VoteSocketError(f"cannot connect to the vote socket {self.host}:{self.port}: {e}") from None
        try:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = _read_exact(sock, len(MAGIC) + NONCE_BYTES + INSTANCE_BYTES)
            if head[: len(MAGIC)] != MAGIC:
                raise VoteSocketError("not a rallypoint vote socket of this release")
            if head[len(MAGIC) + NONCE_BYTES:] != self.instance:
                raise VoteSocketError("another server's vote socket holds the port now")
            sock.sendall(proof(self._token, head[len(MAGIC):len(MAGIC) + NONCE_BYTES]))
        except (OSError, VoteSocketError) as e:
            sock.close()
            raise VoteSocketError(f"vote socket {self.host}:{self.port}: {e}") from None
        return sock

    def vote(self, rank: int, step: int, vote: bool, meta: list[tuple[str, str]], timeout: float) -> VoteAnswer:
        """Send one vote and wait for the answer (at most ``timeout`` s, plus a second for
        the answer to travel). :class:`VoteSocketError` when it could not be sent (vote
        over gRPC instead); ``TimeoutError`` / ``ConnectionError`` once it was sent.

        A kept connection the server has closed meanwhile (its idle timeout, say) shows
        only once a vote was written to it: the server ends such a connection before
        reading it, so when it ends without a byte of answer, the vote goes once more on a
        new connection (a vote is idempotent: the same rank's same vote for the same step,
        and an answer already decided is given again)."""
        frame = encode_frame({"rank": rank, "step": step, "vote": vote, "timeout_s": max(0.001, timeout),
                              "meta": [list(p) for p in meta]})
        again = False  # the second pass: on a new connection, after a kept one turned out closed
        while True:
            with self._lock:
                if self._closed:
                    raise VoteSocketError("the vote socket client is closed")
                sock = self._idle.pop() if self._idle and not again else None
            kept = sock is not None
            if sock is None:
                sock = self._connect(min(timeout, HANDSHAKE_TIMEOUT_S))
            try:
                sock.settimeout(min(timeout, HANDSHAKE_TIMEOUT_S))
                sock.sendall(frame)
                end = time.monotonic() + timeout + 1.0
                sock.settimeout(timeout + 1.0)
                prefix = sock.recv(_LEN.size)  # b"": closed before a byte of answer
            except socket.timeout:
                sock.close()  # the server withdraws the vote when it sees the close
                raise TimeoutError(f"vote for step {step} over the vote socket {self.host}:{self.port} timed out "
                                   f"after {timeout:.1f}s") from None
            except OSError as e:
                sock.close()
                if kept:
                    again = True
                    continue
                raise ConnectionError(f"vote for step {step} over the vote socket {self.host}:{self.port} "
                                      f"failed: {e}") from None
            if not prefix and kept:
                sock.close()
                again = True
                continue
            try:
                if not prefix:
                    raise ConnectionError("the connection closed before the answer")
                sock.settimeout(max(0.1, end - time.monotonic()))
                n = frame_length(prefix + _read_exact(sock, _LEN.size - len(prefix)))
                answer = parse_answer(_read_exact(sock, n))
            except socket.timeout:
                sock.close()
                raise TimeoutError(f"vote for step {step} over the vote socket {self.host}:{self.port}: the answer "
                                   "did not arrive in time") from None
            except (OSError, ValueError) as e:
                sock.close()
                raise ConnectionError(f"vote for step {step} over the vote socket {self.host}:{self.port} "
                                      f"failed: {e}") from None
            with self._lock:
                keep = not self._closed and len(self._idle) < 4
                if keep:
                    self._idle.append(sock)
            if not keep:
                sock.close()
            return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the connection closed")
        buf += chunk
    return bytes(buf)


def answer_error(answer: VoteAnswer, what: str) -> Exception:
    """A failure answer as the exception a gRPC failure with that status would be
    (:func:`rallypoint._net.rpc.translate_rpc_error`'s mapping)."""
    msg = f"{what}: {answer.message}"
    if answer.code == "DEADLINE_EXCEEDED":
        return TimeoutError(msg)
    if answer.code == "INVALID_ARGUMENT":
        return ValueError(f"{what} was rejected: {answer.message}")
    if answer.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return PermissionError(f"{what} was refused: {answer.message}")
    return ConnectionError(f"{what} failed ({answer.code}): {answer.message}")


def advertise(port: int, instance: bytes) -> str:
    """The :data:`PORT_KEY` value a server sends: ``"<port>/<instance id in hex>"``."""
    return f"{port}/{instance.hex()}"


def advertised(trailing: Any) -> tuple[int, bytes] | None:
    """The vote socket (port, instance id) a ShouldCommit answer's trailing metadata names,
    if well-formed."""
    raw = next((v for k, v in (trailing or ()) if k == PORT_KEY), None)
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str) or len(raw) != raw.find("/") + 1 + 2 * INSTANCE_BYTES:
        return None
    port_s, _, inst = raw.partition("/")
    if not port_s.isdigit() or len(port_s) > 5 or not 0 < int(port_s) < 65536:
        return None
    try:
        instance = bytes.fromhex(inst)
    except ValueError:
        return None
    return (int(port_s), instance) if len(instance) == INSTANCE_BYTES else None


__all__ = ["ENV", "MAX_FRAME_BYTES", "PORT_KEY", "VoteAnswer", "VoteRequest", "VoteSocketClient", "VoteSocketError",
           "VoteSocketServer", "advertise", "advertised", "answer_error", "enabled", "encode_frame", "frame_length",
           "parse_answer", "parse_request", "proof", "proof_ok"]
