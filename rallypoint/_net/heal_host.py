"""Which network a replica's checkpoint server uses: ``RALLYPOINT_HEAL_HOST``.

A heal moves a replica group's whole state (for a large model, tens of GB), and a peer
fetches it from the address the replica advertises. By default that is the machine's
hostname, which on many clusters resolves to a slow management network while the fast
one (InfiniBand IPoIB, RoCE) has another address; heals then crawl (torchft#329 reports
800 s). ``RALLYPOINT_HEAL_HOST`` chooses, per process:

- an interface name (``ib0``, ``eth1``): the server binds to that interface's IPv4
  address and advertises it, so heal traffic stays on that network;
- an IP address (``10.1.2.3``, ``fd00::5``): bound and advertised as given;
- any other name (``node7-ib.cluster``): advertised as given, bound to every interface
  (the name must resolve, on the peers, to an address of this host).

Unset or empty: bind every interface, advertise the hostname (torchft's behaviour). A
name of an interface that does not exist here is taken for a host name; an interface
without an IPv4 address, or a value that is not a valid host, is a ``HealHostError``
naming the variable. ``heal_address`` is a pure function over the interface table, so
it is tested with tables; ``interface_addresses`` reads the table from the OS.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

HEAL_HOST_ENV = "RALLYPOINT_HEAL_HOST"
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,252})$")
_SIOCGIFADDR = 0x8915


class HealHostError(ValueError):
    """``RALLYPOINT_HEAL_HOST`` cannot be used; the message says why."""


@dataclass(frozen=True)
class HealAddress:
    """Where the checkpoint server binds (``bind`` host, for ``host:0``) and what it advertises."""

    bind: str
    advertise: str

    def bind_spec(self) -> str:
        """``host:0`` (``[v6]:0``) for a server that picks its port."""
        return f"[{self.bind}]:0" if ":" in self.bind else f"{self.bind}:0"


def heal_address(value: str | None, default_advertise: str, interfaces: Mapping[str, str | None]) -> HealAddress:
    """The checkpoint server's address for ``RALLYPOINT_HEAL_HOST`` = ``value``
    (``interfaces``: name -> IPv4 address or None; see the module docstring)."""
    v = (value or "").strip()
    if not v:
        return HealAddress("0.0.0.0", default_advertise)
    if len(v) > 253:
        raise HealHostError(f"{HEAL_HOST_ENV} is {len(v)} characters long; a host name has at most 253")
    try:
        ip = ipaddress.ip_address(v.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None:
        return HealAddress(str(ip), str(ip))
    if v in interfaces:
        addr = interfaces[v]
        if addr is None:
            raise HealHostError(f"{HEAL_HOST_ENV}={v}: the interface {v} has no IPv4 address on this host; "
                                "give its address or another interface")
        return HealAddress(addr, addr)
    if not _HOST_RE.match(v):
        known = ", ".join(sorted(interfaces))
        raise HealHostError(f"{HEAL_HOST_ENV}={v!r} is neither an interface of this host ({known}), an IP address "
                            "nor a host name")
    return HealAddress("0.0.0.0", v)


def interface_addresses() -> dict[str, str | None]:
    """This host's network interfaces and their IPv4 addresses (None: none). Linux reads
    them with ``SIOCGIFADDR``; elsewhere only the names are known."""
    out: dict[str, str | None] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return dict.fromkeys(names)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out[name] = socket.inet_ntoa(raw[20:24])
            except OSError:
                out[name] = None
    return out


def heal_address_from_env(environ: Mapping[str, str], default_advertise: str) -> HealAddress:
    """``heal_address`` for this process (reads the interface table only when needed)."""
    value = environ.get(HEAL_HOST_ENV)
    return heal_address(value, default_advertise, interface_addresses() if (value or "").strip() else {})


__all__ = ["HEAL_HOST_ENV", "HealAddress", "HealHostError", "heal_address", "heal_address_from_env",
           "interface_addresses"]
