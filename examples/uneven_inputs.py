"""Training on uneven inputs with Join: the ranks hold different numbers of batches, nobody hangs, nobody diverges.

    python -m distlab run -n 2 examples/uneven_inputs.py
    python -m distlab run -n 4 examples/uneven_inputs.py --batches 30 --divide-by-active
    python -m distlab run -n 2 examples/uneven_inputs.py --device cuda   # on GPUs (cupy); --device fake: CI's stand-in

The data set is a list of batches, shared out by a ``DistributedSampler(uneven=True)``: unlike torch's sampler,
it neither pads nor cuts, so with 61 batches on 2 ranks rank 0 trains on 31 per epoch and rank 1 on 30; over
``--epochs`` epochs the difference adds up (rank 0 runs ``epochs`` more iterations than rank 1).
The model has a SyncBatchNorm layer (batch statistics over every rank), is wrapped in DDP, and is trained by a
ZeroRedundancyOptimizer (each rank keeps the Adam state of its shard of the parameters only); a DistributedMean
averages the loss over ranks. Every one of them talks to the other ranks every iteration, so all of them go into
one Join. Without it, the rank that runs out first leaves the loop while the others wait forever in their next
collective. Inside ``Join`` it shadows their collectives instead (zero gradients, zero batch-norm counts, its
share of the optimizer step and the parameter broadcasts, a zero-weight loss), and when the last rank
finishes, every rank holds the same model, running statistics included.
"""
from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

import distlab
from distlab import comm, nn, optim
from distlab.data import DistributedSampler
from distlab.ddp import DistributedDataParallel
from distlab.join import Join
from distlab.metrics import DistributedMean
from distlab.autograd import to_numpy
from distlab.optim import ZeroRedundancyOptimizer

from _device import add_device_argument, select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=61, help="batches of 16 examples in the data set")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data set")
    parser.add_argument("--divide-by-active", action="store_true",
                        help="divide gradients by the ranks still training instead of the world size")
    add_device_argument(parser)
    options = parser.parse_args()

    xp = select(options.device)
    pg = comm.world()
    true_w = np.array([[2.0], [-1.0], [0.5]], dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((options.batches, 16, 3)).astype(np.float32)
    x, y = xp.asarray(x), xp.asarray(x @ true_w)
    sampler = DistributedSampler(options.batches, uneven=True)  # rank r: ceil((batches - r) / size) batches

    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16, seed=0), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1, seed=1))
    if options.device != "cpu":
        net.to("cuda")
    model = DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(net))
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, lr=0.01)
    loss_fn = nn.MSELoss()
    loss_mean = DistributedMean()
    # The model first (its forward starts each iteration, so it issues Join's count), then the layers whose
    # collectives run inside it, then the optimizer and the metric, in the order the loop uses them.
    joinables = [model, *nn.SyncBatchNorm.layers_in(model), opt, loss_mean]
    mine = options.epochs * len(sampler)
    with Join(joinables, divide_by_initial_world_size=not options.divide_by_active):
        progress = tqdm(total=mine, desc=f"rank {pg.rank}: {mine} iterations", disable=pg.rank != 0)
        for epoch in range(options.epochs):
            sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
            for b in sampler:
                opt.zero_grad()
                loss = loss_fn(model(distlab.tensor(x[b])), distlab.tensor(y[b]))
                loss.backward()
                opt.step()
                loss_mean.update(float(loss.data))
                progress.update()
        progress.close()

    state = model.module.state_dict()
    for key, value in state.items():
        everyone = pg.allgather(np.ascontiguousarray(to_numpy(value)))  # a host copy of each, compared
        assert all(np.array_equal(everyone[0], v) for v in everyone), f"{key} differs across ranks"
    shard = sum(v.nbytes for s in opt.optim.state.values() for v in s.values() if hasattr(v, "nbytes"))
    shards = pg.allgather_object(shard)
    batches = pg.allgather_object(mine)
    model.module.eval()  # batch norm with the running statistics every rank agrees on; no collective in eval mode
    with distlab.no_grad():
        final = np.mean([float(loss_fn(model.module(distlab.tensor(xb)), distlab.tensor(yb)).data)
                         for xb, yb in zip(x, y)])
    if pg.rank == 0:
        print(f"ranks had {batches} iterations; every rank ends with the same "
              f"model ({len(state)} tensors, batch-norm running statistics included, "
              f"{int(state['1.num_batches_tracked'])} batches tracked)")
        print(f"Adam state per rank: {shards} bytes (unsharded: {sum(shards)}); mean training loss over all "
              f"{loss_mean.count} iterations {loss_mean.compute():.4f}; final model's loss on the whole data "
              f"set {final:.4f}")


if __name__ == "__main__":
    main()
