"""The replica group's TCPStore, hosted in a child of ``rallypoint run`` (the supervisor
itself imports no torch): ``python -m rallypoint.supervisor._store_host HOST PORT [RUNDIR]``
(``RUNDIR``: the supervisor's scratch folder, removed at the end, even after a SIGKILL of
the supervisor).

One line each way:
- once the store listens it prints ``{"port": P}`` (``{"error": "..."}`` and exit 1 if it
  cannot, e.g. the port is taken);
- ``reset`` on stdin: close the store and open a fresh, empty one on the same port, then
  print ``{"port": P}`` again. The supervisor does it between incarnations, so keys that
  torch itself writes without a per-restart prefix (``init_process_group``'s rendezvous,
  an NCCL unique id) never leak into the next incarnation, while the address stays fixed;
- ``guard PGID...`` on stdin: the process groups of the running ranks (no answer);
  ``guard`` alone: none;
- end of stdin (the supervisor finished, or died, even by SIGKILL: the kernel closes its
  end): SIGKILL the guarded process groups, then exit. The ranks die with the supervisor
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
import sys
from datetime import timedelta
from typing import Any


def _say(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    from torch.distributed import TCPStore

    def open_store(p: int) -> Any:
        return TCPStore(host, p, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))

    try:
        store = open_store(port)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which explains it
        _say(error=f"cannot host the replica group's store on {host}:{port}: {e}")
        return 1
    port = int(store.port)
    _say(port=port)
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
            return 0
        if line.startswith("guard"):
            guarded = [int(p) for p in line.split()[1:]]
        elif line.strip() == "reset":
            del store
            gc.collect()  # the server closes its socket when the last reference goes
            try:
                store = open_store(port)
            except Exception as e:  # noqa: BLE001
                _say(error=f"cannot reopen the replica group's store on {host}:{port}: {e}")
                return 1
            _say(port=port)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
