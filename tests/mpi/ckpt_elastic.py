"""Horovod's elastic API over restarts: every sample of an epoch applied exactly once, whatever the world size.
argv: impl, commit directory (or "run-dir" for the launcher's DISTLAB_RUN_DIR), crash ("none", "RANK:STEP" to
SIGKILL rank RANK after step STEP in the first attempt, or "host:STEP" to kill every rank of the last virtual host
and cut its link after step STEP), output prefix.

The model counts: weight[i] grows by exactly 1 each time sample i is applied (a linear layer on one-hot rows,
loss scaled so that DDP's average is the sum over ranks, SGD with lr 1). An ElasticSampler splits the epoch; the
state is committed every second step; a crash loses the steps since the last commit, which the next attempt (on
as many ranks, or fewer) does again from the commit. At the end the weight must be all ones: no committed sample
lost, none repeated. Reset callbacks run in an attempt that resumed from a commit.
"""
import os
import pickle
import signal
import sys

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.collectives import elastic
from distlab.ddp import DistributedDataParallel as DDP
from scenario_checks import host, twin_of

impl_arg, where, crash, prefix = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
world = comm.world()
rank, size = world.rank, world.size
attempt = int(os.environ.get("DISTLAB_RESTART_COUNT", "0"))
N, BATCH, EPOCHS = 44, 3, 2


def crash_now(step: int) -> None:
    if crash == "none" or attempt > 0:
        return
    who, _, at = crash.partition(":")
    if int(at) != step:
        return
    if who == "host":  # the last host dies: its link goes down and every rank on it is killed
        from pyroute2 import IPRoute

        from distlab.cluster import current_host

        mine = current_host()
        if mine == world.allgather_object(mine)[-1]:
            with IPRoute() as ipr:  # each of the host's ranks cuts it, so that it is cut whoever dies first
                ipr.link("set", index=ipr.link_lookup(ifname=mine)[0], state="down")
            os.kill(os.getpid(), signal.SIGKILL)
    elif int(who) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


model = nn.Linear(N, 1, bias=False)
model.weight.data[...] = 0
ddp = DDP(model, impl=twin_of(rank, impl_arg))
opt = optim.SGD(ddp.parameters(), lr=1.0)
sampler = elastic.ElasticSampler(N, shuffle=True, seed=3)
state = elastic.ModelState(ddp, opt, sampler=sampler, checkpoint_dir=None if where == "run-dir" else where,
                           epoch=0, batch=0, steps=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(size)])
eye = np.eye(N, dtype=np.float32)


@elastic.run
def train(state):
    for epoch in range(state.epoch, EPOCHS):
        state.epoch = epoch
        for batch in state.sampler.batches(BATCH):
            opt.zero_grad()
            out = ddp(distlab.tensor(eye[batch]))
            (out.sum() * (-float(size))).backward()
            opt.step()
            state.batch += 1
            state.steps += 1
            state.sampler.record_batch(state.batch, BATCH)
            crash_now(state.steps)
            if state.batch % 2 == 0:
                state.commit()
        state.epoch, state.batch = epoch + 1, 0
        state.sampler.set_epoch(epoch + 1)
        state.commit()


resumed = state.has_commit()
train(state)
counts = host(model.weight.data)[0]
assert np.array_equal(counts, np.full(N, float(EPOCHS))), (rank, size, counts)
assert bool(resets) == resumed, (resets, resumed)
with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump({"size": size, "resets": resets, "attempt": attempt, "steps": state.steps}, fh)
print(f"ckpt_elastic done: {size} ranks, attempt {attempt}, resets {resets}", flush=True)
