"""Where a durable checkpoint lives, and how its pieces become one DCP checkpoint.

Layout of ``DIR/step_00000060/`` (one folder per step)::

    __<attempt>_<writer>_0.distcp     each writer's share, written by its own dcp.save
    .share-<attempt>-<writer>.metadata  that save's DCP metadata: also the share's done-marker
    .metadata                          the merged DCP metadata (written by the committer)
    .rallypoint-complete               the commit marker (JSON), written last

Why this is ONE DCP checkpoint: DCP's metadata maps every saved key to a file name, an
offset and a length, and nothing ties a file to the rank that wrote it. Each writer runs
its own ``dcp.save`` (``no_dist``) whose storage writer names its files with the writer's
own prefix and keeps its metadata under its own name instead of ``.metadata``; the
committer merges those metadata files into the single ``.metadata`` that
``torch.distributed.checkpoint.load`` reads, with no rallypoint code. ``<attempt>``
differs for every quorum and step, so files of a write that died (an earlier run of the
job) are never mistaken for this one's.

Paths with a scheme (``s3://``, ``gs://``, ``memory://``) go through fsspec and DCP's
``FsspecWriter``/``FsspecReader``; plain paths through DCP's ``FileSystemWriter``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from typing import Any

import fsspec
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from rallypoint._net.inject import inject_allowed
from rallypoint.checkpoint.plan import parse_step_dir, step_dir_name

#: What a failed save or load raises: DCP wraps errors in a ``CheckpointException``, which
#: is a ``BaseException`` (so ``except Exception`` would let it kill the writer thread).
ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)

MARKER = ".rallypoint-complete"
METADATA = ".metadata"


def has_scheme(path: str) -> bool:
    """``s3://bucket/x`` yes; ``/data/ckpt`` and ``C:\\x`` no."""
    return "://" in path


def share_metadata_name(attempt: str, index: int) -> str:
    return f".share-{attempt}-{index}.metadata"


def share_prefix(attempt: str, index: int) -> str:
    return f"__{attempt}_{index}_"


class Store:
    """The few file operations the checkpointer needs, on a local path or an fsspec URL."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if has_scheme(root) else os.path.abspath(root)
        self.fs: Any
        self.fs, _ = fsspec.core.url_to_fs(self.root)
        self.local = not has_scheme(root)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if not self.local else os.path.join(self.root, *parts)

    def child(self, folder: str, name: str) -> str:
        return os.path.join(folder, name) if self.local else f"{folder}/{name}"

    def step_dir(self, step: int) -> str:
        return self.join(step_dir_name(step))

    def steps(self) -> list[int]:
        """Every step that has a folder, newest first (complete or not)."""
        try:
            names = os.listdir(self.root) if self.local else [p.rstrip("/").rsplit("/", 1)[-1]
                                                               for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted((s for s in map(parse_step_dir, names) if s is not None), reverse=True)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return bytes(f.read())

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``path`` so that readers see all of it or nothing: a temporary name,
        flushed to disk, then renamed (on object stores the upload itself is atomic)."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself durable
        finally:
            os.close(fd)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    def writer(self, path: str, step: int, attempt: str, index: int,
               paths: dict[str, tuple[Any, ...]]) -> FileSystemWriter:
        """A DCP storage writer for one share (see :class:`_ShareMixin`)."""
        cls = _LocalShareWriter if self.local else _fsspec_share_writer()
        w = cls(path)
        w._share_init(step, attempt, index, paths)
        return w

    def reader(self, path: str) -> FileSystemReader:
        if self.local:
            return FileSystemReader(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)


class _ShareMixin:
    """Overrides of a DCP storage writer for one share: files named with the share's own
    prefix; the metadata kept as the share's done-marker rather than ``.metadata``, with
    DCP's flattening paths for the keys, so the merged checkpoint unflattens as one."""

    fs: Any
    path: Any

    def _share_init(self, step: int, attempt: str, index: int, paths: dict[str, tuple[Any, ...]]) -> None:
        self._step, self._attempt, self._index, self._paths = step, attempt, index, paths

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(share_prefix(self._attempt, self._index)))
                for p in plans]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.planner_data = {k: self._paths.get(k, (k,)) for k in metadata.state_dict_metadata}
        _die_if_asked("share", self._step)  # tests: a writer killed after its data, before its done-marker
        name = share_metadata_name(self._attempt, self._index)
        tmp = self.fs.concat_path(self.path, name + ".tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            pickle.dump(metadata, f)
        final = self.fs.concat_path(self.path, name)
        self.fs.rename(tmp, final)


class _LocalShareWriter(_ShareMixin, FileSystemWriter):
    pass


def _fsspec_share_writer() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class _FsspecShareWriter(_ShareMixin, FsspecWriter):
        pass

    return _FsspecShareWriter


def _die_if_asked(point: str, step: int) -> None:
    """Test hook: ``RALLYPOINT_CHECKPOINT_TEST_DIE=<point>:<step>`` SIGKILLs this process
    at ``point`` while writing step ``<step>`` (``share``: its data written, its
    done-marker not). Only where fault injection is opted into
    (``RALLYPOINT_ALLOW_INJECT=1``): a stray variable never kills a production job."""
    if os.environ.get("RALLYPOINT_CHECKPOINT_TEST_DIE", "") == f"{point}:{step}" and inject_allowed():
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def merge_metadata(parts: list[Metadata]) -> Metadata:
    """One DCP ``Metadata`` from the shares' (a key written by several writers, as a
    DTensor's shards are, gets the union of their chunks)."""
    out = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for md in parts:
        for key, meta in md.state_dict_metadata.items():
            have = out.state_dict_metadata.get(key)
            if isinstance(have, TensorStorageMetadata) and isinstance(meta, TensorStorageMetadata):
                seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}  # a replicated shard: once
                have.chunks.extend(c for c in meta.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen)
            else:
                out.state_dict_metadata[key] = meta
        out.planner_data.update(md.planner_data or {})
        out.storage_data.update(md.storage_data or {})
        out.version = md.version
    return out


def read_metadata(store: Store, path: str) -> Metadata:
    md = pickle.loads(store.read(path))
    if not isinstance(md, Metadata):
        raise ValueError(f"{path} holds no DCP metadata")
    return md


def write_marker(store: Store, folder: str, info: dict[str, Any]) -> None:
    store.write_atomic(store.child(folder, MARKER), json.dumps(info, sort_keys=True).encode())


def check_complete(store: Store, folder: str) -> tuple[dict[str, Any] | None, str]:
    """``(marker, "")`` when the folder holds a complete checkpoint: the commit marker,
    a readable ``.metadata``, and every data file it names at least as long as the
    metadata says; else ``(None, why not)``."""
    def j(name: str) -> str:
        return store.child(folder, name)

    try:
        marker = json.loads(store.read(j(MARKER)))
    except FileNotFoundError:
        return None, "no commit marker (an interrupted or unfinished write)"
    except (OSError, ValueError) as e:
        return None, f"unreadable commit marker: {e}"
    try:
        md = read_metadata(store, j(METADATA))
    except ERRORS as e:  # noqa: BLE001
        return None, f"unreadable {METADATA}: {type(e).__name__}: {e}"
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = str(info.relative_path)
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        try:
            size = store.size(j(rel))
        except FileNotFoundError:
            return None, f"data file {rel} is missing"
        if size < end:
            return None, f"data file {rel} is truncated ({size} of {end} bytes)"
    return marker, ""


__all__ = ["ERRORS", "MARKER", "METADATA", "Store", "check_complete", "has_scheme", "merge_metadata", "read_metadata",
           "share_metadata_name", "share_prefix", "write_marker"]
