"""Horovod-style training over the collectives engine that loses two ranks and goes on (Open MPI,
``--fault-tolerance``, 4 ranks). argv: impl ("mixed": even ranks the reference twin, odd ranks the core).

The gradients are averaged by negotiated allreduces (``collectives.allreduce``: the engine's cycle thread
negotiates them), and each epoch ends with ``collectives.join()``. Two failures:

1. the last rank is SIGKILLed at step 5 just before it submits its gradient: the survivors wait in that
   negotiated allreduce (the engine's cycle over the dead rank fails);
2. rank 1 (of the job as it started) is SIGKILLed at the end of epoch 0, while the others wait in ``join()``.

Each time the survivors' pending handle fails with ProcessFailedError; elastic.run shrinks the world, starts the
engine again on the survivors, rolls back to the last commit (in memory), re-splits the sampler and goes on. The
model counts (weight[i] grows by exactly 1 each time sample i is applied): at the end every weight is EPOCHS, no
committed sample lost or repeated. The process sets registered at the start are registered again each time with
their surviving ranks (one keeps both survivors, the other loses both). Every survivor prints
``elastic_engine done``.
"""
import os
import signal
import sys

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import distlab  # noqa: E402
from distlab import collectives as hvd, comm, nn  # noqa: E402
from distlab.collectives import elastic  # noqa: E402

FIRST_RANK, FIRST_SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
N, BATCH, EPOCHS = 40, 2, 2
EYE = np.eye(N, dtype=np.float32)
hvd.init()
evens, odds = hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])  # registered again on the survivors
model = nn.Linear(N, 1, bias=False)
model.weight.data[...] = 0
sampler = elastic.ElasticSampler(N, shuffle=True, seed=5)
state = elastic.ModelState(model, (), sampler=sampler, epoch=0, batch=0, steps=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    for epoch in range(state.epoch, EPOCHS):
        state.epoch = epoch
        for indices in state.sampler.batches(BATCH):
            state.steps += 1
            if state.steps == 5 and FIRST_RANK == FIRST_SIZE - 1:
                die()  # the others wait in the negotiated allreduce of this step
            model.zero_grad()
            (model(distlab.tensor(EYE[indices])).sum() * -1.0).backward()
            total = hvd.allreduce(model.weight.grad.data, name="grad", op=hvd.Sum)  # the sum over the ranks
            model.weight.data[...] -= total
            state.batch += 1
            state.sampler.record_batch(state.batch, BATCH)
            if state.batch % 2 == 0:
                state.commit()
        if epoch == 0 and FIRST_RANK == 1:
            die()  # the others wait in join()
        hvd.join()
        state.epoch, state.batch = epoch + 1, 0
        state.sampler.set_epoch(epoch + 1)
        state.commit()


train(state)
counts = model.weight.data[0]
assert np.array_equal(counts, np.full(N, float(EPOCHS))), (FIRST_RANK, counts)
assert hvd.size() == FIRST_SIZE - 2 and comm.world().size == FIRST_SIZE - 2, (hvd.size(), comm.world().size)
assert [r["failed_ranks"] for r in state.recoveries] == [[FIRST_SIZE - 1], [1, FIRST_SIZE - 1]], state.recoveries
assert resets == [FIRST_SIZE - 1, FIRST_SIZE - 2], resets
# the survivors (0 and 2) are ranks 0 and 1 now: their process set was registered again, the other one is gone
assert evens.ranks == [0, 1] and evens.included() and evens.size() == 2, evens
assert hvd.allreduce(np.ones(2), name="evens", op=hvd.Sum, process_set=evens).tolist() == [2.0, 2.0]
assert odds.process_set_id is None, odds
ops = [r["op"] for r in state.recoveries]
print(f"elastic_engine done: rank {FIRST_RANK} -> {hvd.rank()} of {hvd.size()}, failed in {ops}", flush=True)
