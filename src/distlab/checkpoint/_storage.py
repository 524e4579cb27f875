"""The files of a checkpoint directory: one data file per writing rank, the metadata last.

Mirrors torch's ``FileSystemWriter``/``FileSystemReader`` (torch/distributed/checkpoint/filesystem.py): each rank
writes its pieces into ``__{rank}_{generation}.distcp`` and fsyncs it; once every rank has, one rank writes
``.metadata`` through a temporary file, fsync and rename (and fsyncs the directory), so a checkpoint is whole or
absent: a reader opens ``.metadata`` first and finds only files that were complete before it was written.

Beyond torch: every piece has an xxHash (XXH3, 64 bits) in the metadata and every file its size and the hash of
its whole content; a reader checks the hash of every piece it reads before it uses a byte. A save writes its data
under a new *generation* number, so saving over an existing checkpoint leaves the old one loadable until the new
metadata replaces it; the files no metadata names any more are removed after that.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import time
from pathlib import Path

import xxhash

from ..errors import CheckpointException

__all__ = ["METADATA", "FORMAT", "VERSION", "data_file", "write_pieces", "write_metadata", "read_metadata",
           "next_generation", "remove_unreferenced", "MappedFile", "checksum"]

METADATA = ".metadata"
FORMAT = "distlab-checkpoint"
VERSION = 1
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: Bytes hashed and written at a time: small enough to stay in the CPU's cache from the hash to the write. (On
#: the development machine's virtual disk, larger write calls also took longer per byte: 70 MB in 4 MiB calls
#: several times longer than in 1 MiB calls, in turns within one run.)
WRITE_BLOCK = 1 << 20
#: Bytes after which the kernel is told to start writing them to the disk.
FLUSH_BLOCK = 8 << 20


def data_file(rank: int, generation: int) -> str:
    """The name of ``rank``'s data file in a save of ``generation`` (torch: ``__{rank}_{n}.distcp``)."""
    return f"__{rank}_{generation}.distcp"


def checksum(buffer) -> str:
    """The XXH3-64 hash of ``buffer`` (any object with the buffer protocol), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(buffer)


def write_pieces(path: Path, pieces, fsync: bool = True) -> dict:
    """Write ``pieces`` (buffers, in order) into ``path``, fsync it; ``{"size", "checksum", "pieces": [...]}``.

    Each piece goes out from its own buffer, without a copy, in blocks of :data:`WRITE_BLOCK` bytes: a block is
    hashed (into its piece's hash and the file's) and written with ``os.pwrite`` while it is still in the CPU's
    cache, so the bytes come from memory once. Every :data:`FLUSH_BLOCK` bytes the kernel is told to start
    writing that range to the disk (``sync_file_range``, where Linux has it: PostgreSQL's
    ``checkpoint_flush_after``, RocksDB's ``bytes_per_sync``), so that the disk works while the rest is written
    and the final fsync waits for less. Hashing and the system calls release the GIL: a step on another thread
    runs beside them.
    """
    whole = xxhash.xxh3_64()
    sums, size, flushed = [], 0, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            one = xxhash.xxh3_64()
            for start in range(0, len(view), WRITE_BLOCK):
                block = view[start:start + WRITE_BLOCK]
                one.update(block)
                whole.update(block)
                size += _pwrite_all(fd, block, size)
                if fsync and size - flushed >= FLUSH_BLOCK:
                    _start_writeback(fd, flushed, size - flushed)
                    flushed = size
            sums.append(one.hexdigest())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "checksum": whole.hexdigest(), "pieces": sums}


def _pwrite_all(fd: int, block: memoryview, offset: int) -> int:
    done = 0
    while done < len(block):
        done += os.pwrite(fd, block[done:], offset + done)
    return done


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, ImportError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages, without waiting


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range out now (a hint: the fsync at the end is what makes it durable)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse to open or fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_metadata(directory: Path, metadata: dict) -> None:
    """``.metadata`` through a temporary file, fsync, rename, then fsync of the directory: whole or absent."""
    tmp = directory / f"{METADATA}.{os.getpid()}.tmp"
    data = json.dumps(metadata, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / METADATA)
    _fsync_directory(directory)


def read_metadata(directory: Path) -> dict:
    """The checkpoint's metadata; a clear :class:`CheckpointException` when there is no whole checkpoint."""
    path = directory / METADATA
    if not directory.is_dir():
        raise CheckpointException(f"no checkpoint at {directory}: there is no such directory")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        found = sorted(p.name for p in directory.glob("__*.distcp"))
        why = (f"it holds data files ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) but no {METADATA}: "
               "a save that did not finish (the metadata is written last)" if found else f"it has no {METADATA}")
        raise CheckpointException(f"no whole checkpoint at {directory}: {why}") from None
    try:
        metadata = json.loads(raw)
    except ValueError as exc:
        raise CheckpointException(f"the checkpoint's metadata {path} is corrupt: {exc}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointException(f"{path} is not the metadata of a distlab checkpoint")
    if metadata.get("version") != VERSION:
        raise CheckpointException(f"{path} has format version {metadata.get('version')!r}; this distlab reads "
                                  f"version {VERSION}")
    return metadata


def next_generation(directory: Path) -> int:
    """One more than any generation the directory holds, in its metadata or in its data files' names."""
    seen = [0]
    with contextlib.suppress(OSError, ValueError, CheckpointException):
        seen.append(int(read_metadata(directory).get("generation", 0)))
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            match = _DATA_FILE.match(name)
            if match:
                seen.append(int(match.group(2)))
    return max(seen) + 1


def remove_unreferenced(directory: Path, metadata: dict) -> None:
    """Remove the data files (of older saves, or of saves that never finished) the metadata does not name."""
    keep = set(metadata["files"])
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if _DATA_FILE.match(name) and name not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(directory / name)


class MappedFile:
    """A data file mapped read-only, its size checked against the metadata before any byte is read.

    ``piece(offset, length, expected, key)`` gives a verified memoryview of one piece; a wrong hash or a short
    file raises :class:`CheckpointException` naming the file and the key.
    """

    def __init__(self, directory: Path, name: str, info: dict):
        self.path = directory / name
        self.name = name
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise CheckpointException(f"{self.path}: the data file is missing (the metadata names it)") from None
        if size != info["size"]:
            raise CheckpointException(f"{self.path}: the data file holds {size} bytes, the metadata says "
                                      f"{info['size']} (truncated or overwritten)")
        self._map = None
        if size:
            with open(self.path, "rb") as fh:
                # MAP_POPULATE: the pages mapped in one call, not one fault per page at first touch
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(fh.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._verified: set = set()

    def piece(self, offset: int, length: int, expected: str, key: str) -> memoryview:
        view = self._view[offset:offset + length]
        if (offset, length) not in self._verified:
            if checksum(view) != expected:
                raise CheckpointException(f"{self.path}: the bytes of {key!r} (offset {offset}, {length} bytes) do "
                                          "not match their checksum: the file is corrupt")
            self._verified.add((offset, length))
        return view

    def close(self) -> None:
        self._view.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: the map goes with the last one
                self._map.close()


def wait_for(predicate, deadline: float, interval: float = 0.01):
    """Poll ``predicate()`` until it returns something true or ``deadline`` (monotonic) passes; its last value."""
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
