"""Training on uneven inputs with Join: rank r has 20 + 10*r batches, nobody hangs, nobody diverges.

    python -m distlab run -n 2 examples/uneven_inputs.py
    python -m distlab run -n 4 examples/uneven_inputs.py --divide-by-active   # divide by ranks still training

Without Join, the rank that runs out first leaves the loop while the others wait forever in their next gradient
allreduce. Inside ``Join([model, loss_mean])`` it shadows their collectives instead (contributing zero gradients
and a zero-weight loss), and when the last rank finishes, every rank takes the model of the last rank to join.
"""
from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

import distlab
from distlab import comm, nn, optim
from distlab.ddp import DistributedDataParallel
from distlab.join import Join
from distlab.metrics import DistributedMean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=int, default=20, help="batches on rank 0; rank r has base + 10*r")
    parser.add_argument("--divide-by-active", action="store_true",
                        help="divide gradients by the ranks still training instead of the world size")
    options = parser.parse_args()

    pg = comm.world()
    batches = options.base + 10 * pg.rank
    rng = np.random.default_rng(pg.rank)
    true_w = np.array([[2.0], [-1.0], [0.5]], dtype=np.float32)

    model = DistributedDataParallel(nn.Linear(3, 1, seed=0))
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    loss_mean = DistributedMean()
    with Join([model, loss_mean], divide_by_initial_world_size=not options.divide_by_active):
        for _ in tqdm(range(batches), desc=f"rank {pg.rank}: {batches} batches", disable=pg.rank != 0):
            x = rng.standard_normal((16, 3)).astype(np.float32)
            y = x @ true_w
            opt.zero_grad()
            loss = loss_fn(model(distlab.tensor(x)), distlab.tensor(y))
            loss.backward()
            opt.step()
            loss_mean.update(float(loss.data))

    weights = pg.allgather(model.module.weight.data)
    assert all(np.array_equal(weights[0], w) for w in weights), "every rank ends with the same model"
    if pg.rank == 0:
        print(f"ranks had {[options.base + 10 * r for r in range(pg.size)]} batches; final weight "
              f"{[round(float(v), 3) for v in model.module.weight.data.ravel()]} (true {true_w.ravel().tolist()}); "
              f"mean loss over all {loss_mean.count} batches {loss_mean.compute():.4f}")


if __name__ == "__main__":
    main()
