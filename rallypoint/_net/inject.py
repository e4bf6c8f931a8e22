"""The fault-injection request (``rallypoint inject``) as it travels: from the operator to
the lighthouse's authenticated API, from the lighthouse to the replica group's
ManagerServer as trailing metadata of its quorum answer, and on to every rank.

Shared by the lighthouse (which checks what an operator asks) and the manager (which
checks what arrives before carrying it out: ``rallypoint.manager._inject``), so both
apply the same limits. Standard library only: the lighthouse imports no torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

#: Trailing metadata key carrying injections (lighthouse -> ManagerServer -> ranks).
INJECT_KEY = "rallypoint-inject-bin"
#: Kinds the manager carries out; the lighthouse carries out ``lighthouse-restart``.
MANAGER_KINDS = ("kill", "hang", "slow", "nan-grad", "bitflip-grad", "bitflip-param", "drop-collective")
KINDS = (*MANAGER_KINDS, "lighthouse-restart")
#: Fault injection is off unless this is "1" (or the lighthouse's ``--allow-inject``): a
#: lighthouse and a Manager carry out injections only when their operator turned them on.
ALLOW_INJECT_ENV = "RALLYPOINT_ALLOW_INJECT"
#: Largest injection list accepted (bytes of JSON), checked before it is parsed.
MAX_INJECT_BYTES = 4096
MAX_INJECTIONS = 8
MAX_ID_CHARS = 64
MAX_FOR_S = 86400.0
MAX_FACTOR = 1000.0

def inject_allowed(explicit: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether fault injection is on: ``explicit`` if given, else ``RALLYPOINT_ALLOW_INJECT=1``.
    Off by default: an injection kills, hangs or corrupts a replica, so carrying one out is
    something an operator turns on for a drill, never a default of a production job."""
    if explicit is not None:
        return explicit
    env = os.environ if environ is None else environ
    return env.get(ALLOW_INJECT_ENV, "").strip() == "1"


@dataclass(frozen=True)
class Injection:
    """One fault to carry out (see the module docstring)."""

    id: str
    kind: str
    at_step: int | None = None
    for_s: float | None = None
    factor: float = 3.0
    bit: int = 30

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_injection(value: Any) -> Injection:
    """An injection from plain JSON values, checked; ``ValueError`` names the bad field."""
    if not isinstance(value, dict):
        raise ValueError(f"an injection must be a JSON object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in ("id", "kind", "at_step", "for_s", "factor", "bit"))
    if unknown:
        raise ValueError(f"unknown injection field(s) {unknown[:4]}")
    kind = value.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown injection kind {str(kind)[:40]!r}; the kinds are {', '.join(KINDS)}")
    ident = value.get("id", "")
    if not isinstance(ident, str) or len(ident) > MAX_ID_CHARS:
        raise ValueError(f"injection id must be a string of at most {MAX_ID_CHARS} characters")
    at_step = value.get("at_step")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or not 0 <= at_step < 2**63):
        raise ValueError("at_step must be an integer >= 0")
    for_s = _number(value, "for_s", 0.0, MAX_FOR_S)
    factor = _number(value, "factor", 1.0, MAX_FACTOR)
    bit = value.get("bit", 30)
    if isinstance(bit, bool) or not isinstance(bit, int) or not 0 <= bit < 64:
        raise ValueError("bit must be an integer in 0..63")
    return Injection(ident, kind, at_step, for_s, 3.0 if factor is None else factor, bit)


def _number(value: dict[str, Any], key: str, low: float, high: float) -> float | None:
    x = value.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not low <= x <= high:
        raise ValueError(f"{key} must be a number in {low:g}..{high:g}")
    return float(x)


def parse_injections(raw: bytes | str | None) -> list[Injection]:
    """The injections in ``raw`` (a JSON list), checked; ``ValueError`` when malformed."""
    if not raw:
        return []
    if len(raw) > MAX_INJECT_BYTES:
        raise ValueError(f"injections are {len(raw)} bytes; the limit is {MAX_INJECT_BYTES}")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # deep nesting: RecursionError
        raise ValueError(f"injections are not JSON: {type(e).__name__}") from None
    if not isinstance(value, list) or len(value) > MAX_INJECTIONS:
        raise ValueError(f"injections must be a JSON list of at most {MAX_INJECTIONS}")
    return [check_injection(v) for v in value]


def encode_injections(injections: list[Injection]) -> bytes:
    return json.dumps([i.to_json() for i in injections], separators=(",", ":")).encode()


__all__ = ["ALLOW_INJECT_ENV", "INJECT_KEY", "KINDS", "MANAGER_KINDS", "MAX_INJECT_BYTES", "MAX_INJECTIONS", "Injection",
           "check_injection", "encode_injections", "inject_allowed", "parse_injections"]
