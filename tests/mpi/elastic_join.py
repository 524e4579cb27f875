"""DDP under ``distlab.join.Join`` that loses a rank while the others shadow it, and goes on (Open MPI,
``--fault-tolerance``, 3 or 4 ranks). argv: impl (``mixed``: even ranks the reference twins, odd ranks the core).

Uneven inputs: the last rank has most of the samples, so the others run out first and, in ``Join.__exit__``,
shadow its iterations (the count allreduce and DDP's join hook, zeros for its bucket allreduces). The last rank is
SIGKILLed in the middle of its samples: every survivor's Join fails with ProcessFailedError naming it (the
allreduce it waited in), elastic.run shrinks the world, rebuilds DDP on the survivors, rolls back to the commit
made before the epoch and runs the epoch again, under a new Join, on the smaller world. The model counts
(weight[i] grows by exactly 1 each time sample i is applied; a shadowing rank adds zeros), so at the end every
weight is 1: the samples of the failed attempt were all rolled back, and each one applied once after it. Each
survivor prints ``elastic_join done``.
"""
import os
import signal
import sys

import numpy as np

if "mixed" in sys.argv[1:]:  # Join's twin too (chosen when distlab.join is imported)
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab  # noqa: E402
from distlab import comm, nn, optim  # noqa: E402
from distlab.collectives import elastic  # noqa: E402
from distlab.ddp import DistributedDataParallel as DDP  # noqa: E402
from distlab.errors import ProcessFailedError  # noqa: E402
from distlab.join import Join  # noqa: E402
from scenario_checks import twin_of  # noqa: E402

FIRST_RANK, FIRST_SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
N, KILL_AT = 12, 4
EYE = np.eye(N, dtype=np.float32)
model = nn.Linear(N, 1, bias=False)
model.weight.data[...] = 0
ddp = DDP(model, impl=twin_of(FIRST_RANK, sys.argv[1]))
opt = optim.SGD(ddp.parameters(), lr=1.0)
state = elastic.ModelState(ddp, opt)
failures = []


def my_samples(rank: int, size: int) -> list:
    """Two samples for each rank but the last, the rest for the last one (uneven on purpose)."""
    return list(range(2 * rank, 2 * rank + 2)) if rank < size - 1 else list(range(2 * (size - 1), N))


@elastic.run
def train(state):
    world = comm.world()
    ddp = state.model  # rebuilt on the survivors after a failure
    try:
        with Join([ddp]):
            for count, i in enumerate(my_samples(world.rank, world.size)):
                if count == KILL_AT and not state.recoveries and FIRST_RANK == FIRST_SIZE - 1:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)  # the others shadow it in Join.__exit__
                opt.zero_grad()
                (ddp(distlab.tensor(EYE[[i]])).sum() * -float(world.size)).backward()
                opt.step()
    except ProcessFailedError as exc:
        failures.append(exc)
        raise


state.commit()  # before the epoch: what the survivors roll back to
train(state)
(failure,) = failures
assert failure.failed_ranks == [FIRST_SIZE - 1] and failure.op == "allreduce", (failure.failed_ranks, failure.op)
(recovery,) = state.recoveries
assert recovery["failed_ranks"] == [FIRST_SIZE - 1] and recovery["world_size"] == FIRST_SIZE - 1, recovery
weights = np.asarray(model.weight.data)[0]
assert np.array_equal(weights, np.ones(N, dtype=np.float32)), (FIRST_RANK, weights)
assert comm.world().size == FIRST_SIZE - 1
print(f"rank {FIRST_RANK}: elastic_join done", flush=True)
sys.stdout.flush()
from distlab._bootstrap import finish_rank  # noqa: E402

finish_rank(FIRST_RANK)  # Open MPI's MPI_Finalize after failures may never return: leave without it
os._exit(0)
