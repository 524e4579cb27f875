"""RPC and RRefs that lose workers and go on (Open MPI, ``--fault-tolerance``, 3 or 4 ranks). argv: ``mixed``
(even ranks the reference twins, odd ranks the core).

Two failures in one job:

1. **a kill inside a handler**: every survivor but rank 0 has a slow call in flight to the last worker, then rank 0
   calls it with ``rpc_sync`` and the handler SIGKILLs its own process. Rank 0's ``rpc_sync`` and the others'
   futures fail with ProcessFailedError naming the dead worker; a call to a live worker still works on the old
   agent, a new one to the dead worker fails at once; the survivors rebuild the world
   (:func:`distlab.comm.recovery.rebuild`), a graceful ``rpc.shutdown`` of the old agent fails with
   ProcessFailedError naming the dead worker and leaves RPC stopped, and they start RPC again on the new world
   (:func:`distlab.rpc.reinit`): the same names, new ids.
2. **a kill while owning RRefs**: under ``elastic.run``, worker 1 of the new world owns RRefs that every other
   survivor holds (one of them forked on from a peer) and dies; ``to_here()`` and a proxy's future fail with
   ProcessFailedError naming it; elastic.run's recovery shrinks the world and starts RPC again; an RRef of the
   old agent then raises RRefError, and new RRefs and calls work over the survivors, up to a graceful shutdown
   with nothing leaked.

``DISTLAB_TIMEOUT`` bounds every wait: an error that never came would be a DistTimeoutError. Each survivor prints
``elastic_rpc done``.
"""
import os
import signal
import sys
import time

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

from distlab import comm, rpc  # noqa: E402
from distlab.collectives import elastic  # noqa: E402
from distlab.comm import recovery, ulfm  # noqa: E402
from distlab.errors import ProcessFailedError, RpcError, RRefError  # noqa: E402

ME, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # in COMM_WORLD: what every error names


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def slow_echo(value):
    time.sleep(20)  # still running when its worker dies
    return value


def add(a, b):
    return a + b


def make_list(*items):
    return list(items)


def gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until process ``pid`` (of this machine) has ended (a zombie counts as ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except OSError:
            return
        time.sleep(0.001)
    raise AssertionError(f"rank {ME}: process {pid} still runs {timeout:g} s after it was to die")


def check_failed(exc: BaseException, dead_world: int, dead_id: int, dead_name: str, op: str) -> None:
    assert isinstance(exc, ProcessFailedError), (ME, type(exc), exc)
    assert exc.failed_ranks == [dead_world] and exc.group_ranks == [dead_id], (ME, exc.failed_ranks, str(exc))
    assert exc.op == op and repr(dead_name) in str(exc), (ME, exc.op, str(exc))


def failure_of(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    raise AssertionError(f"rank {ME}: the call completed although its worker had died")


def kill_in_a_handler() -> None:
    victim = WORLD - 1
    name = f"w{victim}"
    world = comm.world()
    futures = [rpc.rpc_async(name, slow_echo, (ME,))] if 0 < ME < victim else []  # (a thread each there)
    world.barrier()  # those calls are in flight
    if ME == victim:
        time.sleep(60)  # its handler kills it first
    if ME == 0:
        check_failed(failure_of(lambda: rpc.rpc_sync(name, die)), victim, victim, name, "rpc call")
    for fut in futures:
        check_failed(failure_of(fut.wait), victim, victim, name, "rpc call")
    # the old agent goes on with the living, and knows the dead
    assert rpc.rpc_sync(f"w{(ME + 1) % victim}", add, (ME, 1)) == ME + 1
    check_failed(failure_of(lambda: rpc.rpc_sync(name, add, (1, 2))), victim, victim, name, "rpc call")
    check_failed(failure_of(rpc.rpc_async(name, add, (1, 2)).wait), victim, victim, name, "rpc call")
    rebuilt = recovery.rebuild(timeout=60)
    assert rebuilt.failed_ranks == [victim], rebuilt.failed_ranks
    # a graceful shutdown of the old agent cannot meet the dead worker: the survivors meet without it, each raises
    # ProcessFailedError naming it, and RPC is stopped all the same
    check_failed(failure_of(rpc.shutdown), victim, victim, name, "rpc shutdown")
    assert isinstance(failure_of(lambda: rpc.rpc_sync(f"w{(ME + 1) % victim}", add, (ME, 1))), RpcError)
    info = rpc.reinit()
    survivors = [r for r in range(WORLD) if r != victim]
    assert [w.name for w in rpc.get_worker_infos()] == [f"w{r}" for r in survivors], rpc.get_worker_infos()
    assert info.id == survivors.index(ME) and info.name == f"w{ME}", info
    assert [rpc.rpc_sync(f"w{r}", add, (r, ME)) for r in survivors] == [r + ME for r in survivors]
    print(f"rank {ME}: RPC went on after the death of w{victim} in a handler", flush=True)


def kill_while_owning_rrefs() -> None:
    first = comm.world()
    owner = [r for r in range(WORLD) if r != WORLD - 1][1]  # worker 1 of the world after the first failure
    state = elastic.ObjectState(attempt=0)
    held = []

    @elastic.run
    def run(state):
        state.attempt += 1
        world = comm.world()
        if state.attempt == 1:
            assert world.size == WORLD - 1
            if ME != owner:
                mine = rpc.remote(f"w{owner}", make_list, (ME,))
                assert mine.to_here() == [ME]
                assert mine.rpc_sync().count(ME) == 1  # the proxy knows the value's type from now on
                # a peer's RRef forked on to this worker: a child of another user
                mates = [r for r in range(WORLD) if r not in (owner, WORLD - 1)]
                passed = rpc.rpc_sync(f"w{mates[(mates.index(ME) + 1) % len(mates)]}", make_list, (mine,))[0]
                held.extend([mine, passed])
            pids = world.allgather_object(os.getpid())
            world.barrier()  # every survivor holds its RRefs
            if ME == owner:
                die()
            gone(pids[1])  # else a to_here could still be answered
            errors = [failure_of(rref.to_here) for rref in held]
            for error in errors:
                check_failed(error, owner, 1, f"w{owner}", "rpc rref_fetch")
            check_failed(failure_of(held[0].rpc_async().count(ME).wait), owner, 1, f"w{owner}", "rpc call")
            raise errors[0]  # elastic.run's recovery: shrink, RPC started again, and this function again
        # after the recovery: RPC runs again over the survivors, the old RRefs are gone
        assert world.size == WORLD - 2 and rpc.get_worker_info().id == world.rank
        for rref in held:
            assert isinstance(failure_of(rref.to_here), RRefError)
        peer = f"w{[r for r in range(WORLD) if r not in (owner, WORLD - 1)][(world.rank + 1) % world.size]}"
        fresh = rpc.remote(peer, make_list, (ME, "new"))
        assert fresh.to_here() == [ME, "new"] and fresh.rpc_sync().count("new") == 1
        del fresh
        return world.size

    assert first.size == WORLD - 1
    assert run(state) == WORLD - 2
    (recovery_record,) = state.recoveries
    assert recovery_record["failed_ranks"] == [owner, WORLD - 1], recovery_record
    assert state.attempt == 2
    print(f"rank {ME}: RPC went on after the death of w{owner}, the owner of RRefs", flush=True)


def main() -> None:
    assert ulfm.enabled() and ulfm.support().available, ulfm.support()
    rpc.init_rpc(f"w{ME}")
    kill_in_a_handler()
    kill_while_owning_rrefs()
    rpc.shutdown()  # graceful: every survivor, nothing leaked
    print(f"rank {ME}: elastic_rpc done", flush=True)


if __name__ == "__main__":
    main()
    from distlab._bootstrap import finish_rank

    finish_rank(ME)  # Open MPI's MPI_Finalize after failures may never return: leave without it
    sys.stdout.flush()
    os._exit(0)
