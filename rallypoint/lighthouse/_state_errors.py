"""Errors of the lighthouse state file, and the one-line messages a user sees.

Every message names the file, says what is wrong and what to do, and never advises
anything that silently loses ``quorum_id``: a new or emptied state file restarts it at
0, which reuses store prefixes of the running replica groups, so they must restart too.
The message builders are pure functions (table-tested); ``startup_error`` and
``write_failure`` look at the filesystem once to tell a full disk from a permission
problem, because SQLite often reports both as a bare "disk I/O error".
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3

__all__ = [
    "StateCorruptError",
    "StateDiskFullError",
    "StateFileError",
    "StateLockedError",
    "StateNewerError",
    "StateReadOnlyError",
]

# Below this much free space (or with no free inode), an I/O error while writing the
# state file is reported as a full disk: SQLite needs a 32 KiB -shm file and a few pages.
LOW_SPACE_BYTES = 1 << 20
# What a new, empty state file costs, said wherever starting over is an option.
_RESTART_COST = "a new state file restarts quorum_id at 0, so every running replica group must be restarted too"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
_FULL_CODES = (sqlite3.SQLITE_FULL,)
_DENIED_CODES = (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM)
_IO_CODES = (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN)


class StateFileError(RuntimeError):
    """The lighthouse cannot use its state file; ``str()`` is the whole message for the user."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class StateLockedError(StateFileError):
    """Another live lighthouse holds the state file's lock."""


class StateCorruptError(StateFileError):
    """The state file is not a valid rallypoint state database."""


class StateNewerError(StateCorruptError):
    """The state file was written by a newer rallypoint (a higher schema version)."""


class StateReadOnlyError(StateFileError):
    """The state file, a file next to it or its directory is not writable."""


class StateDiskFullError(StateFileError):
    """No space is left to write the state file."""


# ---------------------------------------------------------------------- messages (pure)


def locked_message(path: str, holder: str) -> str:
    return (
        f"state file {path} is in use by another lighthouse ({holder}; lock {path}.lock). "
        "Two lighthouses on one job would split the quorum: stop the other one or pass a "
        "different --state."
    )


def corrupt_message(path: str, what: str) -> str:
    return (
        f"state file {path} is not a valid rallypoint lighthouse state database: {what}. "
        "Restore it from a backup if you have one; otherwise move it aside (with its -wal/-shm "
        f"files, to inspect later) and start again, or pass a different --state: {_RESTART_COST}."
    )


def newer_version(found: object, reads: int) -> int | None:
    """The schema version a newer rallypoint wrote, or None if ``found`` is not one."""
    if isinstance(found, list) and len(found) == 1 and type(found[0]) is int and found[0] > reads:
        return found[0]
    return None


def schema_error(path: str, found: object, reads: int, version: str) -> StateCorruptError:
    """For a schema_version table that does not hold exactly ``[reads]``."""
    newer = newer_version(found, reads)
    if newer is not None:
        return StateNewerError(
            f"state file {path} was written by a newer rallypoint (state schema version {newer}; "
            f"rallypoint {version} reads version {reads}). It was left untouched and still holds "
            "this job's quorum_id: upgrade rallypoint to the version that wrote it (or later), or "
            f"point --state elsewhere ({_RESTART_COST}).",
            path,
        )
    if isinstance(found, list) and len(found) == 1:
        found = repr(found[0])
    elif found == []:
        found = "none (an empty schema_version table)"
    return StateCorruptError(
        f"state file {path} has state schema version {found}, which rallypoint {version} does not "
        f"know (it reads version {reads}). It was left untouched: use the rallypoint that wrote it. "
        f"Only if that is impossible, move it aside (with its -wal/-shm files) and start again: {_RESTART_COST}.",
        path,
    )


def read_only_message(path: str, exists: bool, problem: str, error: str) -> str:
    if exists:
        fix = (
            "make the file and its directory writable for the lighthouse's user (chmod/chown), or "
            "copy it (with its -wal file, if any) to a writable directory and pass the copy as "
            f"--state; do not start from an empty --state instead: {_RESTART_COST}."
        )
    else:
        fix = (
            "make the directory writable for the lighthouse's user (chmod/chown), or pass a "
            "--state in a writable directory."
        )
    return f"state file {path} is not writable: {problem} ({error}). The lighthouse saves quorum_id there: {fix}"


def disk_full_message(path: str, exists: bool, free: str, error: str) -> str:
    if exists:
        fix = (
            "Free space on that filesystem and start the lighthouse again, or copy the file (with its "
            "-wal file, if any) to another filesystem and pass the copy as --state. Do not delete the "
            f"state file to make room: it holds this job's quorum_id, and {_RESTART_COST}."
        )
    else:
        fix = "Free space on that filesystem and start the lighthouse again, or pass a --state on another filesystem."
    return f"state file {path}: the disk is full ({error}; {free}). {fix}"


def other_message(path: str, error: str) -> str:
    return f"cannot use state file {path}: {error}. Fix the cause and start the lighthouse again."


def describe_free(free_bytes: int | None, free_inodes: int | None) -> str:
    """``"12.0 KiB free"`` / ``"no free inodes"`` / ``"free space unknown"``."""
    if free_inodes == 0:
        return "no free inodes"
    if free_bytes is None:
        return "free space unknown"
    size = float(free_bytes)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{free_bytes} bytes free" if unit == "bytes" else f"{size:.1f} {unit} free"


def classify(err_no: int | None, sqlite_code: int | None, free_bytes: int | None,
             free_inodes: int | None, problem: str | None) -> str:
    """``"full"``, ``"read-only"`` or ``"other"`` for an error while writing the state file.

    ``sqlite_code`` may be an extended code; ``problem`` says what is not writable, if
    anything. A bare I/O error (EIO, SQLITE_IOERR*, SQLITE_CANTOPEN) counts as a full disk
    when space is low (SQLite reports a -shm file that cannot grow as "disk I/O error"), else
    as read-only when a problem is known; anything else is not guessed at.
    """
    primary = None if sqlite_code is None else sqlite_code & 0xFF
    if err_no in _FULL_ERRNOS or primary in _FULL_CODES:
        return "full"
    if err_no in _DENIED_ERRNOS or primary in _DENIED_CODES:
        return "read-only"
    if err_no == errno.EIO or primary in _IO_CODES:
        if free_inodes == 0 or (free_bytes is not None and free_bytes < LOW_SPACE_BYTES):
            return "full"
        if problem:
            return "read-only"
    return "other"


def should_log_retry(attempt: int) -> bool:
    """Log the first retries of a failing write, then about once a minute (5 s back-off)."""
    return attempt <= 6 or attempt % 12 == 0


# ---------------------------------------------------------------------- looking at the disk


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids)


def _existing_dir(path: str) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    return directory


def find_unwritable(path: str) -> str | None:
    """What keeps the lighthouse from writing ``path`` and the files next to it, in words."""
    directory = os.path.dirname(os.path.abspath(path))
    existing = _existing_dir(path)
    try:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"the filesystem holding {existing} is mounted read-only"
    except OSError:
        pass
    problems = [
        "the file is read-only" if not suffix else f"{path}{suffix} is read-only"
        for suffix in ("", "-wal", "-shm", ".lock")
        if os.path.exists(path + suffix) and not _writable(path + suffix)
    ]
    if existing != directory and not _writable(existing):
        problems.append(f"its directory {directory} cannot be created in {existing}, which is not writable")
    elif existing == directory and not _writable(directory):
        problems.append(f"its directory {directory} is not writable")
    return "; ".join(problems) or None


def free_space(path: str) -> tuple[int | None, int | None]:
    """(bytes, inodes) free to this user on the filesystem holding ``path``; None if unknown."""
    try:
        st = os.statvfs(_existing_dir(path))
    except OSError:
        return None, None
    return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else None)


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    if isinstance(exc, sqlite3.Error):
        return f"SQLite: {exc}"
    return str(exc)


def _facts(path: str, exc: BaseException) -> tuple[str, str | None, int | None, int | None]:
    err_no = exc.errno if isinstance(exc, OSError) else None
    code = getattr(exc, "sqlite_errorcode", None) if isinstance(exc, sqlite3.Error) else None
    free_bytes, free_inodes = free_space(path)
    problem = find_unwritable(path)
    return classify(err_no, code, free_bytes, free_inodes, problem), problem, free_bytes, free_inodes


def holds_data(path: str) -> bool:
    """Whether ``path`` is a non-empty file (one that may hold a quorum_id worth keeping)."""
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def startup_error(path: str, exc: BaseException, existed: bool) -> StateFileError:
    """The error to raise for ``exc`` (an OSError or sqlite3 error) while opening ``path``;
    ``existed``: whether the file held data before this start (see ``holds_data``)."""
    kind, problem, free_bytes, free_inodes = _facts(path, exc)
    error = _error_text(exc)
    if kind == "full":
        free = f"{describe_free(free_bytes, free_inodes)} in {_existing_dir(path)}"
        return StateDiskFullError(disk_full_message(path, existed, free, error), path)
    if kind == "read-only":
        return StateReadOnlyError(read_only_message(path, existed, problem or "permission denied", error), path)
    return StateFileError(other_message(path, error), path)


def write_failure(path: str, exc: BaseException) -> str:
    """Why a write of the running lighthouse failed and what to do, for the log."""
    kind, problem, free_bytes, free_inodes = _facts(path, exc)
    if kind == "full":
        free = f"{describe_free(free_bytes, free_inodes)} in {_existing_dir(path)}"
        return f"the disk is full ({_error_text(exc)}; {free}): free space on that filesystem"
    if kind == "read-only":
        return f"it is not writable ({problem or 'permission denied'}; {_error_text(exc)}): fix its permissions"
    return _error_text(exc)


def read_holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file (best effort)."""
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        info = json.loads(raw) if raw else {}
        if not isinstance(info, dict):
            raise ValueError(raw)
    except (OSError, ValueError):
        return "holder pid unknown"
    pid, host, started = info.get("pid", "unknown"), info.get("host", "unknown host"), info.get("started", "?")
    return f"pid {pid} on {host}, started {started}"
