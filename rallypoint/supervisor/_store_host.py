"""The replica group's TCPStore, hosted in a child of ``rallypoint run`` (the supervisor
itself imports no torch): ``python -m rallypoint.supervisor._store_host HOST PORT [RUNDIR]``
(``RUNDIR``: the supervisor's scratch folder, removed at the end, even after a SIGKILL of
the supervisor).

One line each way:
- the store listens on ``HOST``'s address only (a name is resolved), not on every
  interface: on a host with several networks, only the one the ranks use reaches it;
- once the store listens it prints ``{"port": P}`` (``{"error": "..."}`` and exit 1 if it
  cannot, e.g. the port is taken);
- ``reset`` on stdin: close the store and open a fresh, empty one, then print
  ``{"port": P}`` again. The supervisor does it between incarnations, so keys that torch
  itself writes without a per-restart prefix (``init_process_group``'s rendezvous, an NCCL
  unique id) never leak into the next incarnation. It reopens on the same port, so the
  address normally stays fixed; a port released is a port another process may take in
  between, so when that happened it opens on a port the OS picks and reports that one
  (the supervisor gives it to the next incarnation's ranks);
- ``next`` on stdin: the same, without the wait. Closing a TCPStore server takes 0.2 s to
  a second on a busy host (its thread is joined), which a restart should not wait for; so a
  spare, empty store is kept open on a second port, ``next`` switches to it at once and
  prints its port, and the old one is closed and reopened (empty, on its own port again
  when it is still free) in the background as the next spare. The group's store thus
  alternates between two ports. The supervisor uses ``next`` unless the user fixed the
  port (``--master-port``), and ``reset`` then;
- ``guard PGID...`` on stdin: the process groups of the running ranks (no answer);
  ``guard`` alone: none;
- end of stdin (the supervisor finished, or died, even by SIGKILL: the kernel closes its
  end): SIGKILL the guarded process groups, remove ``RUNDIR``, then exit at once
  (``os._exit``: the interpreter's own teardown of a process with torch imported takes
  0.3-0.5 s of CPU, seconds when every process of a finished job tears down at once on a
  small host, and ``rallypoint run`` waits for this exit). The ranks die with the supervisor
  by ``PR_SET_PDEATHSIG``; this takes down what they started (data loader workers,
  helpers) with them. So this process has no ``PR_SET_PDEATHSIG`` of its own: end of
  input is its parent check.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, Callable

from rallypoint.supervisor import _rank


def _say(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def reopen(open_store: Callable[[int], Any], port: int) -> tuple[Any, int]:
    """A fresh store on ``port``, or, when another process took that port while it was
    free, on one the OS picks; the store and its port."""
    try:
        return open_store(port), port
    except Exception as taken:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
        store = open_store(0)
        sys.stderr.write(f"the store's port {port} was taken while it was reopened ({taken}); "
                         f"moved to port {store.port}\n")
        return store, int(store.port)


SPARE_WAIT_S = 60.0  # the longest a ``next`` waits for the spare still being made


class _Spare:
    """The next store, made in a thread: from nothing at the start, then by closing the
    store the group just left and reopening it (empty) on its port."""

    def __init__(self, open_store: Callable[[int], Any]) -> None:
        self._open = open_store
        self.store: Any = None
        self._thread: threading.Thread | None = None

    def make(self, old: list[Any], port: int) -> None:
        """Close ``old[0]`` (the list holds the last reference) and open a spare on ``port``."""
        def run() -> None:
            old.clear()
            gc.collect()  # the server closes its socket when the last reference goes
            try:
                self.store, _ = reopen(self._open, port)
            except Exception as e:  # noqa: BLE001 - `next` falls back to a reset
                sys.stderr.write(f"cannot open a spare store: {e}\n")
                self.store = None

        self._thread = threading.Thread(target=run, name="spare store", daemon=True)
        self._thread.start()

    def take(self) -> Any:
        """The spare (None if it could not be made), waiting for it if need be."""
        if self._thread is not None:
            self._thread.join(SPARE_WAIT_S)
            if self._thread.is_alive():
                return None
        store, self.store = self.store, None
        return store


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    from torch.distributed import TCPStore

    def open_store(p: int) -> Any:
        # Listen on ``host``'s address only (TCPStore alone would listen on every interface).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listen = socket.create_server((host, p), family=family, backlog=512)
        bound = listen.getsockname()[1]
        return TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300),
                        master_listen_fd=listen.detach())

    try:
        store = open_store(port)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which explains it
        _say(error=f"cannot host the replica group's store on {host}:{port}: {e}")
        return 1
    port = int(store.port)
    _say(port=port)
    spare = _Spare(open_store)
    spare_made = False
    guarded: list[int] = []
    while True:
        line = sys.stdin.readline()
        if not line:
            for pgid in guarded:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except OSError:
                    pass
            if len(argv) > 2:
                shutil.rmtree(argv[2], ignore_errors=True)
            _rank.exit_now(0)
        cmd = line.strip()
        if cmd.startswith("guard"):
            guarded = [int(p) for p in cmd.split()[1:]]
        elif cmd == "spare" and not spare_made:
            spare.make([], 0)  # the first spare, on a port the OS picks
            spare_made = True
        elif cmd == "next" and spare_made and (new := spare.take()) is not None:
            old, port = [store], int(new.port)
            store = new
            _say(port=port)
            spare.make(old, int(old[0].port))
            del old
        elif cmd in ("reset", "next"):
            del store
            gc.collect()  # the server closes its socket when the last reference goes
            try:
                store, port = reopen(open_store, port)
            except Exception as e:  # noqa: BLE001
                _say(error=f"cannot reopen the replica group's store on {host}: {e}")
                return 1
            _say(port=port)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
