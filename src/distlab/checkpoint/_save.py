"""``save`` and ``async_save`` (torch/distributed/checkpoint/state_dict_saver.py).

Three steps, as in torch:

1. plan: each rank flattens its state dict and describes its pieces; the descriptions are gathered and every rank
   computes the same global plan (:mod:`._plan`); rank 0 adds the generation number of this save. A rank that
   cannot even describe its state dict says so in the same exchange, so every rank raises.
2. write: each rank writes its pieces into its data file and fsyncs it (:mod:`._storage`).
3. commit: the results are gathered; only if every rank wrote its file does rank 0 write ``.metadata`` (write,
   fsync, rename). Any failure raises :class:`~distlab.errors.CheckpointException` on every rank, naming each
   failed rank's reason (torch: ``CheckpointException({rank: exc})``).

``async_save`` runs step 1 and copies the arrays this rank writes to host memory before it returns (the caller
may change its arrays at once; a replicated array is copied only by the rank that writes it). Steps 2 and 3 run
on a thread that uses no MPI and drops the copies once they are written: ranks leave their results as small
files in the checkpoint directory, rank 0's thread writes the metadata once all are there, and the other ranks'
threads wait for it. The returned :class:`~distlab.futures.Future` completes with the metadata, or with the
exception.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..autograd._array import to_numpy
from ..errors import CheckpointException
from ..futures import Future, default_timeout
from ..timeline import get_timeline, now_us
from . import _storage
from ._agree import failed, reason, world
from ._flatten import flatten
from ._plan import global_plan, local_plan

__all__ = ["save", "async_save"]


class _Save:
    """One save in progress: the plan every rank agreed on, and this rank's part of it."""

    def __init__(self, state_dict, checkpoint_id, group, stage: bool):
        self.group = world(group)
        self.rank, self.world = self.group.rank, self.group.size
        self.directory = Path(checkpoint_id)
        self.started = now_us()
        mine = error = generation = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries, _ = flatten(state_dict)
            self.pieces = {p.chunk: p for p in local_plan(entries)}
            mine = [p.describe() for p in self.pieces.values()]
            generation = _storage.next_generation(self.directory) if self.rank == 0 else None
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            error = reason(exc)
        everyone = self.group.allgather_object((error, mine, generation), name=f"checkpoint plan {self.directory}")
        failures = {rank: e for rank, (e, _, _) in enumerate(everyone) if e}
        if failures:
            raise failed(f"save to {self.directory}", failures)
        self.generation = everyone[0][2]
        self.items, self.writes, self.holders = global_plan([described for _, described, _ in everyone])
        self.file = _storage.data_file(self.rank, self.generation)
        # only what this rank writes is kept (and, for async_save, copied)
        self.pieces = {chunk: self.pieces[chunk] for chunk in self.writes[self.rank]}
        self.failure = self._stage() if stage else None

    def _stage(self) -> str | None:
        """async_save: copy the pieces this rank writes to host memory, before the caller changes anything.

        Only this rank's share of the plan is copied (a replicated array is copied by the one rank that writes
        it). A failure is this rank's write failure, reported to every rank when the save commits.
        """
        try:
            for piece in self.pieces.values():
                if piece.kind != "object":
                    piece.payload = np.array(to_numpy(piece.payload), copy=True, order="C")
        except Exception as exc:  # noqa: BLE001 - reported to every rank through the commit
            self.release()
            return f"copying the arrays of {self.directory / self.file}: {reason(exc)}"
        return None

    def release(self) -> None:
        """Drop this rank's pieces (async_save: the staged copies, once written)."""
        for piece in self.pieces.values():
            piece.payload = None

    def write(self) -> dict:
        """Write this rank's pieces (``{"size", "checksum", "pieces"}``, or ``{"error": reason}``); no MPI."""
        mine = self.writes[self.rank]
        if self.failure:
            return {"error": self.failure}
        if not mine:
            return {"size": 0, "pieces": []}
        try:
            buffers = (self._buffer(self.pieces[chunk]) for chunk in mine)
            return _storage.write_pieces(self.directory / self.file, buffers)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            return {"error": f"writing {self.directory / self.file}: {reason(exc)}"}

    @staticmethod
    def _buffer(piece):
        if piece.kind == "object":
            return piece.payload
        return np.ascontiguousarray(to_numpy(piece.payload)).reshape(-1).view(np.uint8)

    def metadata(self, results: list[dict]) -> dict:
        """The metadata of this save from every rank's write result (rank 0 writes it)."""
        files = {}
        items = {fqn: dict(item, chunks=[]) for fqn, item in self.items.items()}
        for rank, (chunks, result) in enumerate(zip(self.writes, results)):
            if not chunks:
                continue
            name = _storage.data_file(rank, self.generation)
            files[name] = {"rank": rank, "size": result["size"], "checksum": result["checksum"]}
            offset = 0
            for (fqn, offsets, sizes), digest, length in zip(chunks, result["pieces"], result["lengths"]):
                chunk = {"file": name, "offset": offset, "length": length, "checksum": digest}
                if items[fqn]["kind"] != "object":
                    chunk.update(offsets=list(offsets), sizes=list(sizes))
                else:  # the ranks that held this value (several values when the ranks' values differed)
                    chunk["ranks"] = self.holders[fqn, offsets, sizes]
                items[fqn]["chunks"].append(chunk)
                offset += length
        return {"format": _storage.FORMAT, "version": _storage.VERSION, "generation": self.generation,
                "world_size": self.world, "time": time.time(), "files": files, "items": items}

    def lengths(self) -> list[int]:
        """The byte length of each piece this rank writes, in file order."""
        return [self.pieces[chunk].nbytes for chunk in self.writes[self.rank]]

    def commit(self, results: list[dict]) -> dict:
        """Rank 0: write the metadata if every rank wrote its file, then drop what no metadata names."""
        failures = {rank: r["error"] for rank, r in enumerate(results) if "error" in r}
        if failures:
            raise failed(f"save to {self.directory}", failures)
        metadata = self.metadata(results)
        _storage.write_metadata(self.directory, metadata)
        _storage.remove_unreferenced(self.directory, metadata)
        return metadata

    def trace(self, what: str) -> None:
        get_timeline().complete(what, self.started, now_us(), lane="checkpoint",
                                args={"checkpoint": str(self.directory), "generation": self.generation})


def save(state_dict: dict, checkpoint_id, *, group=None) -> dict:
    """Save ``state_dict`` into the directory ``checkpoint_id``; collective over ``group`` (default: the world).

    Each rank writes its pieces (a replicated array once, by the rank with the fewest bytes planned), then rank 0
    writes the metadata, last, through write, fsync and rename: the checkpoint is whole or absent, and saving over
    an existing one keeps the old one loadable until the new metadata replaces it.

    Parameters
    ----------
    state_dict : dict
        Nested dicts (and lists) of arrays, :class:`~distlab.ShardedArray` blocks, stateful objects (with
        ``state_dict``/``load_state_dict``: modules, optimizers, samplers) and picklable values.
    checkpoint_id : str or os.PathLike
        The checkpoint's directory (made if missing; every rank must see the same directory).
    group : distlab.comm.ProcessGroup, optional
        The ranks that save together.

    Returns
    -------
    dict
        The checkpoint's metadata (what ``.metadata`` holds).

    Raises
    ------
    CheckpointException
        On every rank, when any rank failed (its ``failures`` maps each failed rank to its reason).
    """
    wait_pending()
    job = _Save(state_dict, checkpoint_id, group, stage=False)
    result = job.write()
    if "error" not in result:
        result["lengths"] = job.lengths()
    results = job.group.allgather_object(result, name=f"checkpoint write {job.directory}")
    outcome = None
    metadata = None
    if job.rank == 0:
        try:
            metadata = job.commit(results)
        except CheckpointException as exc:
            outcome = (str(exc), exc.failures)
        except Exception as exc:  # noqa: BLE001 - the metadata could not be written
            outcome = (f"save to {job.directory}: rank 0 could not write the metadata", {0: reason(exc)})
    outcome, metadata = job.group.broadcast_object((outcome, metadata), src=0, name=f"checkpoint commit {job.directory}")
    job.trace("checkpoint save")
    if outcome is not None:
        raise CheckpointException(*outcome)
    return metadata


# -- async_save -----------------------------------------------------------------------------------------------
_pending: list[Future] = []  # this process's async save in flight, if any


def async_save(state_dict: dict, checkpoint_id, *, group=None) -> Future:
    """Save as :func:`save` does, writing in the background; returns a Future of the metadata.

    The plan is agreed and the arrays this rank writes are copied to host memory before this returns, so
    training may go on and change its arrays at once. The writing, and the metadata written last once every
    rank has written its file, happen on a thread that uses no MPI. A second ``async_save`` (or ``save``) waits
    for the first to finish.
    The future completes with the metadata, or with a :class:`~distlab.errors.CheckpointException` (the same on
    every rank).
    """
    wait_pending()
    job = _Save(state_dict, checkpoint_id, group, stage=True)
    future = Future(description=f"async_save to {job.directory}")
    thread = threading.Thread(target=_background, args=(job, future, default_timeout()),
                              name="distlab-async-save", daemon=True)
    _pending.append(future)
    future.add_done_callback(lambda f: _pending.remove(f) if f in _pending else None)
    thread.start()
    return future


def wait_pending(timeout: float | None = None) -> None:
    """Wait for this process's async save in flight, if any (its error is raised by its own future, not here)."""
    for future in list(_pending):
        with contextlib.suppress(Exception):
            future.wait(timeout if timeout is not None else default_timeout() + 30)


def _result_file(job: _Save, rank: int) -> Path:
    return job.directory / f".result.{job.generation}.{rank}"


def _failure_file(job: _Save) -> Path:
    return job.directory / f".failed.{job.generation}"


#: The writing thread's nice value (Linux sets one per thread), the lowest priority: training comes first. Where
#: the ranks keep every core busy, the save takes longer (the thread gets about 1.5% of a core beside a step at
#: nice 0, against 10% at nice 10) and the steps beside it are slowed less.
WRITER_NICE = 19


def _background(job: _Save, future: Future, timeout: float) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    try:
        result = job.write()
        job.release()  # the staged copies are written: their memory goes back before the commit's wait
        if "error" not in result:
            result["lengths"] = job.lengths()
        _write_json(_result_file(job, job.rank), result)
        deadline = time.monotonic() + timeout
        metadata = _finish_rank0(job, deadline) if job.rank == 0 else _await_commit(job, deadline + 5)
        job.trace("checkpoint async_save")
        future.set_result(metadata)
    except BaseException as exc:  # noqa: BLE001 - the future carries it to the caller
        future.set_exception(exc if isinstance(exc, CheckpointException)
                             else CheckpointException(f"async_save to {job.directory}: {reason(exc)}",
                                                      {job.rank: reason(exc)}))


def _finish_rank0(job: _Save, deadline: float) -> dict:
    paths = [_result_file(job, rank) for rank in range(job.world)]
    _storage.wait_for(lambda: all(p.exists() for p in paths), deadline)
    results = [_read_json(p) for p in paths]
    missing = [rank for rank, r in enumerate(results) if r is None]
    try:
        if missing:
            raise failed(f"async_save to {job.directory}",
                          {rank: "did not finish writing its file within the timeout" for rank in missing})
        return job.commit(results)
    except CheckpointException as exc:
        _write_json(_failure_file(job), {"message": str(exc), "failures": {str(k): v for k, v in exc.failures.items()}})
        raise
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()


def _await_commit(job: _Save, deadline: float) -> dict:
    def outcome():
        failed = _read_json(_failure_file(job))
        if failed is not None:
            return ("failed", failed)
        with contextlib.suppress(CheckpointException, OSError):
            metadata = _storage.read_metadata(job.directory)
            if metadata.get("generation", 0) >= job.generation:
                return ("done", metadata)
        return None

    found = _storage.wait_for(outcome, deadline)
    if found is None:
        raise failed(f"async_save to {job.directory}", {0: "rank 0 wrote no metadata within the timeout"})
    kind, value = found
    if kind == "failed":
        raise CheckpointException(value["message"], {int(k): v for k, v in value["failures"].items()})
    return value


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
