"""``RALLYPOINT_HEAL_HOST``: the network a replica serves its state on for heals (issue 17,
part 4). The rule is a pure function tested with a table; then a real Manager told to use
the loopback interface binds its checkpoint server there and advertises that address, and
a bad value stops the Manager with an error naming the variable."""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

import pytest

from rallypoint._net.heal_host import HEAL_HOST_ENV, HealAddress, HealHostError, heal_address, interface_addresses

IFACES = {"lo": "127.0.0.1", "ib0": "10.9.0.7", "docker0": None}


@pytest.mark.parametrize("value, expected", [
    (None, HealAddress("0.0.0.0", "node7")),             # unset: torchft's behaviour
    ("  ", HealAddress("0.0.0.0", "node7")),
    ("ib0", HealAddress("10.9.0.7", "10.9.0.7")),        # an interface: bound to and advertised
    ("10.1.2.3", HealAddress("10.1.2.3", "10.1.2.3")),   # an address
    ("fd00::5", HealAddress("fd00::5", "fd00::5")),
    ("[fd00::5]", HealAddress("fd00::5", "fd00::5")),
    ("node7-ib.cluster", HealAddress("0.0.0.0", "node7-ib.cluster")),  # a name: advertised, every interface
    ("eth9", HealAddress("0.0.0.0", "eth9")),            # no such interface here: a host name
])  # fmt: skip
def test_heal_address(value, expected) -> None:
    assert heal_address(value, "node7", IFACES) == expected


@pytest.mark.parametrize("value, message", [
    ("docker0", "the interface docker0 has no IPv4 address"),
    ("bad host!", "neither an interface of this host (docker0, ib0, lo), an IP address nor a host name"),
    ("a" * 254, "at most 253"),
])  # fmt: skip
def test_bad_heal_hosts_are_refused_naming_the_variable(value, message) -> None:
    with pytest.raises(HealHostError, match=HEAL_HOST_ENV) as e:
        heal_address(value, "node7", IFACES)
    assert message in str(e.value)


def test_bind_spec() -> None:
    assert HealAddress("10.0.0.1", "x").bind_spec() == "10.0.0.1:0"
    assert HealAddress("fd00::5", "x").bind_spec() == "[fd00::5]:0"


def test_this_hosts_interfaces_include_loopback() -> None:
    assert interface_addresses().get("lo") == "127.0.0.1"


def _manager(lighthouse):
    from rallypoint import Manager, ProcessGroupGloo

    t = timedelta(seconds=10)
    return Manager(ProcessGroupGloo(timeout=t), lambda sd: None, lambda: {"w": 1}, min_replica_size=1, rank=0,
                   world_size=1, replica_id="healhost", lighthouse_addr=lighthouse.address(), hostname="127.0.0.1",
                   timeout=t, quorum_timeout=t, connect_timeout=t)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "RALLYPOINT_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_a_manager_serves_its_state_on_the_chosen_interface(lighthouse, clean_env) -> None:
    """``RALLYPOINT_HEAL_HOST=lo``: the checkpoint server listens on 127.0.0.1 only (not on
    every interface) and peers are told that address."""
    clean_env.setenv(HEAL_HOST_ENV, "lo")
    m = _manager(lighthouse(min_replicas=1))
    try:
        transport = m._transport
        advertised = urlsplit(transport.metadata())
        assert (advertised.scheme, advertised.hostname) == ("http", "127.0.0.1")
        assert transport._sock.getsockname()[0] == "127.0.0.1"  # bound there, not to every interface
        with socket.create_connection((advertised.hostname, advertised.port), timeout=5):
            pass  # and it serves at the address it advertises
    finally:
        m.shutdown(wait=False)


def test_a_bad_heal_host_stops_the_manager_with_a_clear_error(lighthouse, clean_env) -> None:
    clean_env.setenv(HEAL_HOST_ENV, "bad host!")
    with pytest.raises(HealHostError, match=f"{HEAL_HOST_ENV}='bad host!' is neither an interface"):
        _manager(lighthouse(min_replicas=1))
