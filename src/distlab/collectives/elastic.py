"""Horovod's elastic API over the launcher's restarts: ``run``, ``State``, ``ObjectState``, ``ModelState``,
``ElasticSampler`` (mirrors horovod/common/elastic.py and horovod/torch/elastic/).

Horovod's ``@hvd.elastic.run`` loops: sync the state, run the training function; when a collective fails
(``HorovodInternalError``) roll the state back to the last ``commit()``, re-form the job without the failed host
(a Gloo re-rendezvous: its MPI mode cannot), run the reset callbacks, and go on, in the same processes. distlab
over MPI takes the other road torchrun takes: the launcher stops every rank and starts the job again
(``python -m distlab run --max-restarts N``, on a virtual cluster without the hosts that died), and the new
processes find the last commit on disk::

    state = elastic.ModelState(ddp_model, optimizer, sampler=sampler, epoch=0, batch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, batch in enumerate(state.sampler.batches(32), start=state.batch):
                step(batch)
                state.sampler.record_batch(state.batch, 32)
                if state.batch % 10 == 0:
                    state.commit()          # a checkpoint: everything needed to go on from here
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

``commit()`` saves the state as a checkpoint (:mod:`distlab.checkpoint`: whole or absent, resharded on load)
in ``checkpoint_dir`` (default: ``$DISTLAB_RUN_DIR/elastic``, a directory the launcher keeps for the whole job,
across its restarts). ``run`` restores the last commit when it starts (then runs the reset callbacks: the world
may have changed), and a failure ends the process for the launcher to restart.

One place decides what a failure means: :func:`recovery_for`. With no :class:`Recovery` registered (the
default), every failure is left to the launcher's restart; a recovery registered with :func:`register_recovery`
(an in-process shrink over a fault-tolerant MPI, say) claims the failures it can repair, rebuilds the world in
place, and the loop then restores the last commit, runs the reset callbacks and goes on in the same process.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from .. import _restart
from ..checkpoint import async_save, load, read_metadata, save
from ..checkpoint.stateful import TrainState
from ..data import ElasticSampler
from ..errors import CheckpointException

__all__ = ["run", "State", "ObjectState", "ModelState", "ElasticSampler", "HostsUpdatedInterrupt", "Recovery",
           "register_recovery", "unregister_recovery", "recovery_for"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that hosts were added or removed; ``skip_sync`` when only removed. distlab changes hosts
    between restarts, so nothing raises it here; a :class:`Recovery` that grows the world in place may."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class Recovery:
    """A way to go on after a failure without restarting the processes (the base class recovers nothing).

    ``recovers(exc)`` says whether it can repair the failure ``exc``; ``recover(exc, state)`` rebuilds the world
    in place (the failed ranks left out). :func:`run` then restores the last commit and runs the reset callbacks.
    """

    def recovers(self, exc: BaseException) -> bool:
        return False

    def recover(self, exc: BaseException, state: "State") -> None:
        raise NotImplementedError


_recoveries: list[Recovery] = []


def register_recovery(recovery: Recovery) -> None:
    """Let ``recovery`` claim the failures it can repair in process (the last registered is asked first)."""
    _recoveries.insert(0, recovery)


def unregister_recovery(recovery: Recovery) -> None:
    if recovery in _recoveries:
        _recoveries.remove(recovery)


def recovery_for(exc: BaseException):
    """The one decision: the :class:`Recovery` that repairs ``exc`` in process, or None: end the process and let
    the launcher restart the job from the last commit."""
    for recovery in _recoveries:
        if recovery.recovers(exc):
            return recovery
    return None


class State:
    """What an elastic job carries across a failure: ``commit()`` saves it, ``restore()`` goes back to the last
    commit, ``sync()`` gives every rank rank 0's copy, and reset callbacks run once the world was re-formed.

    Subclasses give ``state_dict()`` / ``load_state_dict()`` (what a commit holds) and ``sync()``.

    Parameters
    ----------
    checkpoint_dir : str or path, optional
        Where commits go (default: ``$DISTLAB_RUN_DIR/elastic``, which the launcher keeps across restarts).
    group : distlab.comm.ProcessGroup, optional
        The ranks of the job (default: the world).
    async_commit : bool
        Write commits in the background (:func:`distlab.checkpoint.async_save`): a commit copies the state and
        returns; the previous commit stays the one to restore until the new one is whole.
    """

    def __init__(self, checkpoint_dir=None, group=None, async_commit: bool = False):
        self._checkpoint_dir = checkpoint_dir
        self._group = group
        self.async_commit = bool(async_commit)
        self._reset_callbacks: list = []
        self.commits = 0

    # -- where and with whom ----------------------------------------------------------------------------------
    @property
    def group(self):
        """The ranks commits, restores and syncs run over; a :class:`Recovery` that rebuilt the world in place
        sets the new group here before the loop restores the last commit."""
        if self._group is None:
            from .. import comm

            self._group = comm.world()
        return self._group

    @group.setter
    def group(self, group) -> None:
        self._group = group

    @property
    def commit_path(self) -> Path:
        """The checkpoint the commits go to (saving over it keeps the previous commit until the new one is whole)."""
        base = self._checkpoint_dir or os.environ.get(_restart.RUN_DIR_VAR)
        if not base:
            raise CheckpointException("elastic State: no place for commits: give State(checkpoint_dir=...) or run "
                                      "under `python -m distlab run`, which provides DISTLAB_RUN_DIR")
        return Path(base) / ("elastic" if not self._checkpoint_dir else "") / "commit"

    def has_commit(self) -> bool:
        try:
            read_metadata(self.commit_path)
        except CheckpointException:
            return False
        return True

    # -- Horovod's State ----------------------------------------------------------------------------------------
    def register_reset_callbacks(self, callbacks) -> None:
        """Run ``callbacks`` (no arguments) after each reset: the world re-formed, e.g. to rescale the learning
        rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (a checkpoint), then check for host changes (none are announced between restarts)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises :class:`HostsUpdatedInterrupt` here when hosts were announced; distlab's hosts change
        only between attempts, so there is nothing to check."""

    def save(self) -> None:
        """Write the state to the commit checkpoint (collective)."""
        (async_save if self.async_commit else save)({"state": self}, self.commit_path, group=self.group)
        self.commits += 1

    def restore(self) -> bool:
        """Go back to the last commit (collective); False when there is none yet (the state is left as it is)."""
        if not self.has_commit():
            return False
        load({"state": self}, self.commit_path, group=self.group)
        return True

    def sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State of plain Python values, kept as attributes: ``ObjectState(epoch=0, batch=0)``, ``state.epoch``."""

    def __init__(self, checkpoint_dir=None, group=None, async_commit: bool = False, **kwargs):
        super().__init__(checkpoint_dir, group, async_commit)
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def sync(self) -> None:
        """Every rank takes rank 0's values."""
        self.load_state_dict(self.group.broadcast_object(self.state_dict(), src=0, name="elastic sync"))


class ModelState(TrainState, State):
    """A model, its optimizers, a sampler and counters (Horovod's ``TorchState``); counters are attributes.

    A commit holds what :class:`distlab.checkpoint.TrainState` does (parameters, optimizer state keyed by name,
    DDP's buckets, the sampler's position, every generator, the counters), so a restarted job, on as many ranks
    or fewer, goes on from it: the optimizer state and a ZeroRedundancyOptimizer's shards resharded, an
    :class:`ElasticSampler`'s rest of the epoch split among the ranks there are.
    """

    def __init__(self, model, optimizer=(), *, sampler=None, checkpoint_dir=None, group=None,
                 async_commit: bool = False, **counters):
        State.__init__(self, checkpoint_dir, group, async_commit)
        TrainState.__init__(self, model, optimizer, sampler=sampler, group=group, **counters)

    def sync(self) -> None:
        """Every rank takes rank 0's parameters, buffers, counters and sampler position (the generators stay each
        rank's own; a sharded optimizer's state stays with its owners)."""
        group = self.group
        module = getattr(self.model, "module", self.model)
        for name, value in module.state_dict().items():
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                group.broadcast(value, src=0, name=f"elastic sync {name}")
        shared = {"counters": {name: getattr(self, name) for name in self._counters},
                  "sampler": self.sampler.state_dict() if self.sampler is not None else None}
        shared = group.broadcast_object(shared, src=0, name="elastic sync counters")
        for name, value in shared["counters"].items():
            setattr(self, name, value)
        if self.sampler is not None:
            self.sampler.load_state_dict(shared["sampler"])


def run(func):
    """Horovod's ``@hvd.elastic.run``: call ``func(state, ...)``, resuming from the last commit.

    On entry the last commit, if any, is restored (a restarted job's new processes) and the reset callbacks run;
    then the state is synced and ``func`` runs. A failure goes to :func:`recovery_for`: repaired in process by a
    registered :class:`Recovery` (then restore, reset callbacks, sync, and ``func`` again), or raised, which
    ends this rank and has the launcher restart the job (``--max-restarts``) from the last commit.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        reset = state.restore()
        skip_sync = False
        while True:
            if reset:
                state.on_reset()
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:
                recovery = recovery_for(exc)
                if recovery is None:
                    raise  # the launcher restarts every rank; the next attempt restores the last commit
                recovery.recover(exc, state)
                state.restore()
                skip_sync = False
            reset = True
    return wrapper
