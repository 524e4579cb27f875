"""MPI's shared-memory files that a job whose ranks were killed leaves in ``/dev/shm``, and their removal.

MPICH's ranks on one node share memory through files named ``mpich_shm_*`` in ``/dev/shm`` (about 2 MB for
the node, more for communicators with shared-memory collectives), and MPICH removes them in ``MPI_Finalize``.
A rank that never finalizes leaves them behind: it was killed, its job timed out, a peer failed and the job was
stopped, or Ctrl-C. They are files in memory (tmpfs), so each one holds its RAM until someone deletes it or
the machine reboots. Measured here: one stopped 2-rank job, one 2 MB file; over a day of test and benchmark
runs, 1,800 files and 3.5 GB.

When a job ends, the launcher (:mod:`distlab.launch`) removes the files it can prove are such leftovers:

- named ``mpich_shm_*``, owned by this user (MPICH creates them readable by their owner only);
- changed since the job started;
- open and mapped by no process this user runs (``/proc/<pid>/fd``, then ``/proc/<pid>/maps``): a live job,
  such as one starting beside this one, still holds its files. A process holds its file from the moment it
  creates or opens it (an open descriptor) until it exits (a mapping, made before the descriptor is closed),
  and the files are listed before the processes are read, so a file some process holds is never taken.

It runs on the launcher's machine, which on the virtual cluster (:mod:`distlab.cluster`) is every host's too.
Other machines of a real cluster keep what their killed ranks left: MPICH's own affair there.
"""
from __future__ import annotations

import os

__all__ = ["SHM_DIR", "PREFIX", "held_shm_paths", "remove_leftovers"]

SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"


def held_shm_paths() -> set[str]:
    """The ``/dev/shm`` files any process of this user has open or mapped now (others' cannot be read)."""
    found: set[str] = set()
    marker = f" {SHM_DIR}/".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:  # descriptors first, then mappings: a file mapped and then closed meanwhile is seen either way
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith(SHM_DIR + "/"):
                    found.add(target.removesuffix(" (deleted)"))
            with open(f"/proc/{entry.name}/maps", "rb") as maps:
                for line in maps:
                    at = line.find(marker)
                    if at >= 0:
                        path = line[at + 1:].rstrip(b"\n").decode(errors="replace")
                        found.add(path.removesuffix(" (deleted)"))
        except OSError:  # gone, or another user's
            continue
    return found


def _candidates(since: float) -> list[str]:
    uid = os.getuid()
    paths = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid == uid and info.st_ctime >= since:
            paths.append(entry.path)
    return paths


def remove_leftovers(since: float) -> list[str]:
    """Remove MPI's shared-memory files changed since ``since`` (epoch seconds) that no process holds.

    Returns the paths removed. Best effort and quiet: a file that cannot be removed stays.
    """
    if not os.path.isdir("/proc"):
        return []
    candidates = _candidates(since)  # before the processes are read (see the module's docstring)
    if not candidates:
        return []
    in_use = held_shm_paths()
    removed = []
    for path in candidates:
        if path in in_use:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed
