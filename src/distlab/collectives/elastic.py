"""Horovod's elastic API: ``run``, ``State``, ``ObjectState``, ``ModelState``, ``ElasticSampler``, over the
launcher's restarts or in process over MPI's fault tolerance (mirrors horovod/common/elastic.py and
horovod/torch/elastic/).

Horovod's ``@hvd.elastic.run`` loops: sync the state, run the training function; when a collective fails
(``HorovodInternalError``) roll the state back to the last ``commit()``, re-form the job without the failed host
(a Gloo re-rendezvous: its MPI mode cannot), run the reset callbacks, and go on, in the same processes. distlab
does it two ways. Under ``python -m distlab run --fault-tolerance`` (Open MPI's ULFM) the survivors do what
Horovod does, over MPI: the error a failed rank causes (:class:`~distlab.errors.ProcessFailedError`) is claimed
by :class:`ShrinkRecovery`, which shrinks the world to the survivors (:func:`distlab.comm.recovery.rebuild`),
rebuilds the state's DDP on it, and the loop rolls back to the last commit kept in memory, re-splits the
sampler, runs the reset callbacks and goes on. Otherwise it takes the road torchrun takes: the launcher stops
every rank and starts the job again (``--max-restarts N``, on a virtual cluster without the hosts that died), and
the new processes find the last commit on disk::

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

``commit()`` keeps a copy of the state in memory (:mod:`distlab.checkpoint.memory`), what an in-process rollback
restores, and saves it as a checkpoint (:mod:`distlab.checkpoint`: whole or absent, resharded on load) in
``checkpoint_dir`` (default: ``$DISTLAB_RUN_DIR/elastic``, a directory the launcher keeps for the whole job, across
its restarts; under fault tolerance with neither, the commit stays in memory only). ``run`` restores the last commit
when it starts (then runs the reset callbacks: the world may have changed).

A plain DDP loop gets the same through :func:`train` (a DDP over the state's model, rebuilt on the survivors)::

    state = elastic.ModelState(DistributedDataParallel(model), optimizer, sampler=sampler, epoch=0, batch=0)
    elastic.train(state, step, epochs=3, batch_size=32, commit_every=10)   # step(ddp, batch_indices)

One place decides what a failure means: :func:`recovery_for`. Without fault tolerance and with no
:class:`Recovery` registered (the default), every failure is left to the launcher's restart; under fault
tolerance a failed process is :class:`ShrinkRecovery`'s. A recovery registered with :func:`register_recovery`
claims the failures it can repair (it is asked first), rebuilds the world in place, and the loop then restores
the last commit, runs the reset callbacks and goes on in the same process.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

from .. import _restart
from ..checkpoint import async_save, load, memory, read_metadata, save
from ..checkpoint.stateful import TrainState
from ..comm import recovery as comm_recovery
from ..comm import ulfm
from ..data import ElasticSampler
from ..errors import CheckpointException
from . import _engine, ops

__all__ = ["run", "train", "State", "ObjectState", "ModelState", "ElasticSampler", "HostsUpdatedInterrupt",
           "Recovery", "ShrinkRecovery", "register_recovery", "unregister_recovery", "recovery_for"]

log = logging.getLogger("distlab.elastic")


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
    the launcher restart the job from the last commit. Under fault tolerance (``DISTLAB_FAULT_TOLERANCE=1``) a
    :class:`ShrinkRecovery` is asked after the registered ones."""
    for recovery in _recoveries:
        if recovery.recovers(exc):
            return recovery
    if ulfm.enabled() and _SHRINK.recovers(exc):
        return _SHRINK
    return None


class ShrinkRecovery(Recovery):
    """Go on without the failed ranks, in the same processes, over MPI's ULFM (``distlab run --fault-tolerance``).

    Claims an error caused by a failed process (:func:`distlab.comm.ulfm.process_failure`: a
    :class:`~distlab.errors.ProcessFailedError`, or MPI's own report of one from wherever the step met it), and on
    every survivor: shrinks the world to the survivors (:func:`distlab.comm.recovery.rebuild`: revoke, agree,
    shrink), sets the launcher's ``RANK`` and ``WORLD_SIZE`` to this rank's place in the new world (what an
    :class:`ElasticSampler` splits by), starts the collectives engine again on it if one runs (each process set
    registered with ``add_process_set`` is registered again with its surviving ranks, renumbered, and the
    :class:`~distlab.collectives.ProcessSet` the program holds is updated in place; a set that lost every rank is
    removed), and RPC if it runs
    (:func:`distlab.rpc.reinit`: the same worker names; its RRefs are gone), and moves the state onto it
    (:meth:`State.regroup`: a DDP model is rebuilt on the new group). :func:`run` then rolls back to the last
    commit and runs the reset callbacks.

    ``history`` (and the state's ``recoveries``) lists what each recovery did on this rank: the failed ranks (of
    the world the job started with), the new world size, the failed operation, when it began (``at``, the wall
    clock) and each step's seconds.
    """

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout
        self.history: list[dict] = []

    def recovers(self, exc: BaseException) -> bool:
        return _failure(exc) is not None

    def recover(self, exc: BaseException, state: "State") -> None:
        failure = _failure(exc)
        noticed, start = time.time(), time.monotonic()
        engine = _engine.current  # the collectives engine, if this job runs one: its groups are revoked too
        engine_groups = [s.group for s in engine.sets.values() if s.group is not None] if engine else []
        rebuilt = comm_recovery.rebuild(timeout=self.timeout, old=state.group, revoke=engine_groups)
        new = rebuilt.world
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(new.rank), str(new.size)
        if engine is not None:  # started again on the survivors, with their process sets
            kept = sorted(engine.registered.items())
            ops.shutdown(self.timeout)
            ops.init()
            _register_again(kept, rebuilt.ranks)
        rpc = sys.modules.get("distlab.rpc")
        if rpc is not None and rpc.is_initialized():  # RPC too, with the same names (its RRefs are gone)
            rpc.reinit(self.timeout)
        state.regroup(new)
        seconds = dict(rebuilt.seconds, regroup=time.monotonic() - start - sum(rebuilt.seconds.values()))
        record = {"failed_ranks": list(rebuilt.failed_ranks), "world_size": new.size, "at": noticed,
                  "op": failure.op if failure is not None else None, "seconds": seconds}
        self.history.append(record)
        state.recoveries.append(record)
        if new.rank == 0:
            log.warning("elastic: %s; went on with the %d survivors in %.3f s (rolling back to commit #%d)",
                        str(failure).split(". Rebuild")[0], new.size, time.monotonic() - start, state.commits)


_SHRINK = ShrinkRecovery()


def _register_again(kept, ranks: dict) -> None:
    """Register each of ``kept`` (``(id, ProcessSet)`` of the engine before the failure, in id order: the same on
    every survivor) again on the new engine, with its surviving ranks (``ranks``: old world rank -> new), and
    update the program's ProcessSet in place (collective over the survivors)."""
    for _, process_set in kept:
        survivors = [ranks[r] for r in process_set.ranks if r in ranks]
        if not survivors:
            process_set.process_set_id = None
            continue
        again = ops.add_process_set(survivors)
        process_set.ranks, process_set.process_set_id = again.ranks, again.process_set_id
        _engine.get().registered[again.process_set_id] = process_set


def _failure(exc: BaseException):
    """The ProcessFailedError behind ``exc`` (MPI's own report translated against the world), or None."""
    found = ulfm.process_failure(exc, None)
    if found is None and ulfm.enabled() and any(isinstance(e, MPI.Exception) for e in ulfm.chain(exc)):
        from .. import comm

        found = ulfm.process_failure(exc, comm.world().comm)
    return found


class State:
    """What an elastic job carries across a failure: ``commit()`` saves it, ``restore()`` goes back to the last
    commit, ``sync()`` gives every rank rank 0's copy, and reset callbacks run once the world was re-formed.

    Subclasses give ``state_dict()`` / ``load_state_dict()`` (what a commit holds) and ``sync()``.

    Parameters
    ----------
    checkpoint_dir : str or os.PathLike, optional
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
        self._kept = None  # the last commit, in memory (checkpoint.memory.snapshot)
        self.commits = 0
        self.recoveries: list[dict] = []  # what each in-process recovery did (ShrinkRecovery)

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

    def regroup(self, group) -> None:
        """Carry on over ``group`` (the survivors' world, after a failure): commits, restores and syncs run over it.
        Subclasses move what else uses the old group (:class:`ModelState` rebuilds its DDP)."""
        self._group = group

    @property
    def commit_path(self) -> Path:
        """The checkpoint the commits go to (saving over it keeps the previous commit until the new one is whole)."""
        base = self._where()
        if not base:
            raise CheckpointException("elastic State: no place for commits: give State(checkpoint_dir=...) or run "
                                      "under `python -m distlab run`, which provides DISTLAB_RUN_DIR")
        return Path(base) / ("elastic" if not self._checkpoint_dir else "") / "commit"

    def _where(self):
        return self._checkpoint_dir or os.environ.get(_restart.RUN_DIR_VAR)

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
        """Keep the state in memory and write it to the commit checkpoint (collective); under fault tolerance with
        no place for checkpoints, in memory only."""
        kept = memory.snapshot(self)
        if self._where() or not ulfm.enabled():
            (async_save if self.async_commit else save)({"state": self}, self.commit_path, group=self.group)
        self._kept = kept
        self.commits += 1

    def restore(self) -> bool:
        """Go back to the last commit (collective): the copy this process kept in memory, else the checkpoint (a
        restarted job's new processes); False when there is none yet (the state is left as it is)."""
        if self._kept is not None:
            memory.restore(self, self._kept)
            return True
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

    def regroup(self, group) -> None:
        """Carry on over ``group``: a DDP model is rebuilt on it (:meth:`DistributedDataParallel.rebuilt_on`: read
        ``state.model`` again after a reset), the generators' gather runs over it."""
        State.regroup(self, group)
        if callable(getattr(self.model, "rebuilt_on", None)):
            self.model = self.model.rebuilt_on(group)
        if self.rng is not None:
            self.rng.group = group

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


def train(state: ModelState, step, *, epochs: int, batch_size: int, commit_every: int = 1):
    """A plain DDP loop, elastic: ``step(ddp, indices)`` for each batch of ``state.sampler``, ``epochs`` epochs.

    The loop :func:`run` wraps: ``state.epoch`` and ``state.batch`` count where it is (give them to the
    :class:`ModelState`), the sampler records each batch, the state is committed every ``commit_every`` batches
    and at the end of each epoch. ``step`` gets the DDP model to run (``state.model``: after a failure, the one
    rebuilt on the survivors) and this rank's sample indices; it runs forward, backward and the optimizer.
    Returns the state.
    """
    if state.sampler is None:
        raise ValueError("elastic.train needs a ModelState with a sampler (an ElasticSampler)")
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")

    @run
    def loop(state):
        for epoch in range(state.epoch, epochs):
            state.epoch = epoch
            for indices in state.sampler.batches(batch_size):
                step(state.model, indices)
                state.batch += 1
                state.sampler.record_batch(state.batch, batch_size)
                if state.batch % commit_every == 0:
                    state.commit()
            state.epoch, state.batch = epoch + 1, 0
            state.sampler.set_epoch(epoch + 1)
            state.commit()
        return state

    return loop(state)
