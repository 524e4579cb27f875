"""Data-parallel training of an MLP with DistributedDataParallel over MPI.

Every rank builds the same model (DDP broadcasts rank 0's parameters anyway), reads its own shard of a
synthetic 3-class spiral data set (a DistributedSampler, reshuffled every epoch), and steps SGD; DDP's reducer averages the gradients in buckets that are
reduced while backward still runs. Rank 0 shows a progress bar, then the accuracy and its mean loss over
the last epoch.

    python -m distlab run -n 2 examples/train_ddp.py
    python -m distlab run -n 2 --timeline ddp.json examples/train_ddp.py   # then open ddp.json in Perfetto
    DISTLAB_IMPL=reference python -m distlab run -n 2 examples/train_ddp.py  # the pure-Python reducer
    python -m distlab run -n 2 examples/train_ddp.py --powersgd 2     # gradients compressed to rank 2 (PowerSGD)
    python -m distlab run -n 2 examples/train_ddp.py --device cuda   # on GPUs (cupy), as accurate as on the CPU

The timeline shows, per rank, each gradient's arrival ("reducer grads"), each bucket's allreduce in flight
("reducer buckets") and the collectives themselves ("comm world"): buckets launched before the last gradient
arrived are communication overlapped with backward.
"""
from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

import distlab
from distlab import comm, nn, optim
from distlab.data import DistributedSampler
from distlab.ddp import DistributedDataParallel
from distlab.ddp_comm_hooks import PowerSGDState, powerSGD_hook

from _device import add_device_argument, select


def spirals(n_per_class: int, classes: int = 3, seed: int = 0):
    """A classic non-linear toy problem: interleaved spiral arms, one per class."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, n_per_class)
        t = np.linspace(c * 4.0, (c + 1) * 4.0, n_per_class) + rng.normal(0, 0.15, n_per_class)
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], axis=1))
        ys.append(np.full(n_per_class, c))
    x, y = np.concatenate(xs).astype(np.float32), np.concatenate(ys)
    order = rng.permutation(len(y))
    return x[order], y[order]


def build_model(hidden: int, depth: int) -> nn.Module:
    layers, width = [], 2
    for i in range(depth):
        layers += [nn.Linear(width, hidden, seed=10 + i), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 3, seed=99))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bucket-cap-mb", type=lambda v: v if v == "auto" else float(v), default=0.01,
                        help="small buckets show overlap clearly; 'auto' lets the reducer choose after one step")
    parser.add_argument("--target", type=float, default=0.9, help="exit 1 if the final accuracy is below this")
    parser.add_argument("--powersgd", type=int, default=0, metavar="RANK",
                        help="compress the gradients with PowerSGD at this matrix rank (0: plain allreduce)")
    parser.add_argument("--powersgd-start", type=int, default=10,
                        help="PowerSGD's start_powerSGD_iter: plain allreduce for this many steps first")
    add_device_argument(parser)
    options = parser.parse_args()

    xp = select(options.device)
    pg = comm.world()
    x, y = (xp.asarray(a) for a in spirals(600))
    sampler = DistributedSampler(len(y), num_replicas=pg.size, rank=pg.rank)  # this rank's share, as torch's

    model = build_model(options.hidden, options.depth)
    if options.device != "cpu":
        model.to("cuda")
    model = DistributedDataParallel(model, bucket_cap_mb=options.bucket_cap_mb)
    if options.powersgd:
        model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=options.powersgd,
                                               start_powerSGD_iter=options.powersgd_start), powerSGD_hook)
    opt = optim.SGD(model.parameters(), lr=options.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    steps = len(sampler) // options.batch
    bar = tqdm(total=options.epochs * steps, desc=f"DDP on {pg.size} ranks ({distlab.IMPL})",
               disable=pg.rank != 0, unit="step")
    epoch_losses = []
    for epoch in range(options.epochs):
        epoch_losses = []
        sampler.set_epoch(epoch)  # a new permutation of the whole data set, the same on every rank
        for idx in sampler.batches(options.batch, drop_last=True):
            opt.zero_grad()
            loss = loss_fn(model(distlab.tensor(x[idx])), distlab.tensor(y[idx]))
            loss.backward()
            opt.step()
            epoch_losses.append(float(loss.data))
            bar.update()
            bar.set_postfix(loss=f"{float(loss.data):.3f}", refresh=False)
    bar.close()

    mine = DistributedSampler(len(y), num_replicas=pg.size, rank=pg.rank, shuffle=False).indices()
    with distlab.no_grad():
        predicted = model(distlab.tensor(x[mine])).data.argmax(axis=1)
    counts = np.array([int((predicted == y[mine]).sum()), len(mine)], dtype=np.int64)
    pg.allreduce(counts)
    accuracy = counts[0] / counts[1]
    buckets = model.reducer.get_logging_data()["bucket_indices"]
    if pg.rank == 0:
        print(f"accuracy {accuracy:.3f} on {counts[1]} examples across {pg.size} ranks; "
              f"{len(buckets)} buckets after rebuild; loss {np.mean(epoch_losses):.4f}")  # rank 0, last epoch
    if accuracy < options.target:
        raise SystemExit(f"accuracy {accuracy:.3f} is below the target {options.target}")


if __name__ == "__main__":
    main()
