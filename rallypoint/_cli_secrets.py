"""The lighthouse's token on its command line, kept off it: ``--token-file PATH`` and
``RALLYPOINT_TOKEN`` are the ways to give it; ``--token`` still works but warns (a command
line is visible to every user of the host, in ``ps`` and ``/proc/PID/cmdline``), and a
``lighthouse-restart`` runs a command line without it (:func:`without_token`).

Apart from :mod:`rallypoint.cli` so that module stays the commands' frame.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rallypoint.cli")


def without_token(argv: list[str]) -> list[str]:
    """``argv`` without its ``--token VALUE`` / ``--token=VALUE`` (either spelling)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--token":
            skip = True
            continue
        if a.startswith("--token="):
            continue
        out.append(a)
    return out


def lighthouse_token(explicit: str | None, path: str | None) -> str | None:
    """The lighthouse's token: ``--token-file PATH`` (its content, one trailing newline
    dropped), else ``--token`` (with a warning: a command line is visible to every user of
    the host, in ``ps`` and ``/proc``), else ``RALLYPOINT_TOKEN``, else None. ValueError
    for both flags at once, an unreadable or empty file."""
    from rallypoint._net.auth import MAX_TOKEN_CHARS, check_token, job_token  # grpc: only when a command needs it

    if path is not None:
        if explicit is not None:
            raise ValueError("give --token-file or --token, not both")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_TOKEN_CHARS + 2)
        except OSError as e:
            raise ValueError(f"cannot read --token-file {path}: {e.strerror or e}") from None
        return check_token(text[:-1] if text.endswith("\n") else text, f"the token in --token-file {path}")
    if explicit is not None:
        log.warning("--token puts the token on the command line, where every user of this host can read it "
                    "(ps, /proc); use --token-file PATH or RALLYPOINT_TOKEN")
    return job_token(explicit)


__all__ = ["lighthouse_token", "without_token"]
