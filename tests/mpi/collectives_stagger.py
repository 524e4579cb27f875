"""Horovod's re-init sequence ``init(); shutdown(); init()`` with the ranks entering it at different times, from a
healthy engine and after one rank's engine failed (each cause of failure in turn).

Re-init: Horovod's ``init()`` starts the background thread once (``InitializeHorovodOnce``, behind
``initialize_flag``) and only ``shutdown()`` clears that flag, when it joins the thread; a rank whose loop was
stopped by a peer stays initialized until its own ``shutdown()``. So the sequence pairs up whatever the delays:
each rank's first ``init()`` (a no-op once initialized) and its ``shutdown()`` close the old engine, and every
rank's second ``init()`` builds the new one. In round ``k`` rank ``r`` enters ``DELAYS[(r + k) % 3]`` seconds
after the others were released, so every rank is 0, 0.5 and 2 s late; the first round starts from a process that
never initialized. After each round one allreduce must pair up on the new engines.

Failures: before the re-init of a failure round, one rank's engine fails while every rank has an allreduce of
``boom.<round>`` in flight; every rank must stop within the cycle it is in (well before ``DISTLAB_TIMEOUT``, which
the test sets to 60 s), its handles and later calls failing with the failing rank's cause:

- ``exception``: the last rank's cycle thread raises while running the response, before its collective (the
  others wait in that allreduce);
- ``refusal``: the last rank refuses the coordinator's response list (its magic is wrong, as from a peer speaking
  another wire format): the others wait in the allreduce it never enters;
- ``exception after``: rank ``n // 2`` raises after the allreduce completed (the others wait in the next cycle);
- ``set exception``: rank 0 raises running a response of the process set ``[0, n-1]`` (its other member waits in
  the set's allreduce, the ranks outside the set in the global set's next cycle);
- ``coordinator``: rank 0's coordinator raises in the cycle that negotiates it (the others wait in its broadcast,
  which carries the stop and the reason instead; before that, rank 0 died alone and the others' shutdown() took
  DISTLAB_TIMEOUT, so rank 0's new init() timed out).

A killed process is ``collectives_killed.py``'s (the launcher ends the job). Argument: ``mixed`` makes even ranks
use the reference twin and odd ranks the core twin (so a failing and a hearing rank may run different twins).
"""
import os
import sys
import time

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from mpi4py import MPI  # noqa: E402

from distlab import collectives as hvd  # noqa: E402
from distlab.collectives import _engine  # noqa: E402
from distlab.errors import MessageFormatError  # noqa: E402

DELAYS = (0.0, 0.5, 2.0)
STOP_BOUND = 20.0   # seconds: far below DISTLAB_TIMEOUT (60 s), so a stop that waited for a timeout fails here
world = MPI.COMM_WORLD
r, n = world.Get_rank(), world.Get_size()
ROUNDS = (("healthy", None), ("healthy", None), ("exception", n - 1), ("refusal", n - 1),
          ("exception after", n // 2), ("set exception", 0), ("coordinator", 0))


def staggered(round_):
    """The sequence, ``DELAYS[(r + round_) % 3]`` seconds late; returns what this rank saw along it."""
    world.Barrier()
    time.sleep(DELAYS[(r + round_) % 3])
    hvd.init()
    seen = [hvd.is_initialized(), hvd.rank(), hvd.size()]
    hvd.shutdown()
    seen.append(hvd.is_initialized())
    hvd.init()
    seen += [hvd.is_initialized(), hvd.rank(), hvd.size()]
    return seen


def fail_in_execute(name, after=False):
    """This rank's cycle thread raises while running the response of ``name`` (before or after its collective)."""
    original = _engine.execute

    def failing(engine, state, response):
        if name not in response.tensor_names:
            return original(engine, state, response)
        _engine.execute = original            # once: the next engine runs the real one
        if after:
            original(engine, state, response)
        raise RuntimeError(f"injected failure running {name!r}")

    _engine.execute = failing


def refuse_response_list(name):
    """This rank receives the response list naming ``name`` with a wrong magic, and refuses it."""
    channel = _engine.current.world.channel
    original = channel.broadcast

    def corrupted(payload):
        out = bytes(original(payload))
        if name.encode() in out:
            channel.broadcast = original
            out = b"XXXX" + out[4:]
        return out

    channel.broadcast = corrupted


def fail_in_coordinator(name):
    """Rank 0's coordinator raises in the cycle whose request lists name ``name``."""
    controller = _engine.current.world.controller

    class Failing(type(controller.coordinator)):
        def coordinate(self, gathered, cache, cache_hits):
            if any(name.encode() in bytes(payload) for payload in gathered):
                raise RuntimeError(f"injected failure coordinating {name!r}")
            return super().coordinate(gathered, cache, cache_hits)

    old = controller.coordinator
    controller.coordinator = Failing(old.size, old.process_set_id, old.fusion_threshold, old.stall)


def provoke(cause, failing, round_):
    """Every rank has ``boom.<round>`` in flight when ``failing``'s engine fails; check what each rank learns."""
    name = f"boom.{round_}"
    ps = hvd.add_process_set([0, n - 1]) if cause == "set exception" else hvd.global_process_set
    if r == failing:
        if cause == "refusal":
            refuse_response_list(name)
        elif cause == "coordinator":
            fail_in_coordinator(name)
        else:
            fail_in_execute(name, after=cause == "exception after")
    start = time.monotonic()
    handle = hvd.allreduce_async(np.ones(2), name=name, process_set=ps) if r in (ps.ranks or range(n)) else None
    try:
        outcome = hvd.synchronize(handle) if handle is not None else None
    except Exception as exc:  # noqa: BLE001 - checked below
        outcome = exc
    engine = _engine.current
    assert engine.stopped.wait(STOP_BOUND), f"{cause}: rank {r}'s engine did not stop"
    took = time.monotonic() - start
    if cause == "coordinator":      # stopped in the protocol: every rank, rank 0 too, says the same
        expected = ("distlab.collectives stopped: the coordinator (rank 0) failed in its negotiation cycle "
                    f"(RuntimeError: injected failure coordinating {name!r}); see rank 0's log")
    elif r == failing:
        expected_type = MessageFormatError if cause == "refusal" else RuntimeError
        assert isinstance(engine.error, expected_type), (cause, repr(engine.error))
        return
    else:
        words = ("refused a negotiation message (MessageFormatError:" if cause == "refusal" else
                 f"failed in its background loop (RuntimeError: injected failure running {name!r})")
        expected = f"distlab.collectives stopped: rank {failing} {words}"
    assert str(engine.error).startswith(expected), (cause, str(engine.error))
    assert f"see rank {failing}'s log" in str(engine.error), str(engine.error)
    if cause != "exception after" and handle is not None:     # its collective never ran: the handle says why
        assert isinstance(outcome, hvd.NotInitializedError) and str(outcome).startswith(expected), repr(outcome)
    try:
        hvd.allreduce(np.ones(1), name=f"later.{round_}")
        raise AssertionError("a call after the stop must fail")
    except hvd.NotInitializedError as exc:
        assert str(exc).startswith(expected), str(exc)
    print(f"rank {r}: {cause} on rank {failing} reached this rank after {took:.2f} s", flush=True)


for round_, (cause, failing) in enumerate(ROUNDS):
    if cause != "healthy":
        provoke(cause, failing, round_)
    seen = staggered(round_)
    assert seen == [True, r, n, False, True, r, n], (round_, seen)
    total = hvd.allreduce(np.full(2, r + 1.0), name=f"after.{round_}", op=hvd.Sum)
    assert total.tolist() == [n * (n + 1) / 2] * 2, (round_, total)
    print(f"rank {r}: round {round_} ({cause}, {DELAYS[(r + round_) % 3]:g} s late) paired", flush=True)
hvd.shutdown()
print(f"rank {r}: stagger OK impl={os.environ.get('DISTLAB_IMPL', 'auto')}", flush=True)
