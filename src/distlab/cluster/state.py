"""The state file of each cluster: what ``up`` is about to make and made, so ``down`` can undo it after a crash.

``up`` writes ``<STATE_DIR>/<name>.json`` *before* it creates anything, so there is never a namespace without a
record; ``down`` removes the file last. ``STATE_DIR`` is ``/run/distlab/clusters`` (``/run`` is a tmpfs: a
reboot, which also removes every namespace, empties it), or ``DISTLAB_CLUSTER_STATE`` when set (tests use it to
simulate a crash without touching the real directory). Each cluster also keeps its launcher script under
``<STATE_DIR>/<name>/``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["state_dir", "state_path", "read_state", "write_state", "remove_state", "list_states", "work_dir"]

DEFAULT_STATE_DIR = "/run/distlab/clusters"


def state_dir() -> Path:
    """Where the state files live (``DISTLAB_CLUSTER_STATE`` or ``/run/distlab/clusters``)."""
    return Path(os.environ.get("DISTLAB_CLUSTER_STATE") or DEFAULT_STATE_DIR)


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def work_dir(name: str) -> Path:
    """The cluster's own directory (its launcher script)."""
    return state_dir() / name


def read_state(name: str) -> dict | None:
    """The recorded state of cluster ``name``, or None if there is none (or it is unreadable)."""
    try:
        return json.loads(state_path(name).read_text())
    except (OSError, ValueError):
        return None


def write_state(name: str, **fields) -> dict:
    """Record (or update) the cluster's state; atomic (written aside, then renamed)."""
    path = state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = read_state(name) or {"name": name, "created": time.time()}
    state.update(fields, updated=time.time(), owner_pid=os.getpid())
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return state


def remove_state(name: str) -> None:
    """Forget the cluster: its state file and its work directory."""
    for entry in sorted(work_dir(name).glob("*")) if work_dir(name).is_dir() else []:
        entry.unlink(missing_ok=True)
    if work_dir(name).is_dir():
        work_dir(name).rmdir()
    state_path(name).unlink(missing_ok=True)


def list_states() -> list[str]:
    """Names of the clusters that have a state file."""
    if not state_dir().is_dir():
        return []
    return sorted(p.stem for p in state_dir().glob("*.json"))
