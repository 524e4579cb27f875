"""Horovod-style data-parallel training: an MLP, hvd.DistributedOptimizer, uneven data and join().

The DistributedOptimizer submits each gradient's allreduce the moment backward has accumulated it (a
post-accumulate-grad hook), under its parameter's name, so ranks may submit in any order; the background cycle
negotiates them, fuses them into one buffer, and after the first step the response cache turns each negotiation
into a single bit-vector allreduce (the "fast path", counted below). Each rank reads its share of the data set
from a DistributedSampler, and higher ranks use less of it (uneven inputs): a rank that runs out calls
``join()`` and, from then on, contributes zeros to the others' allreduces until every rank has joined; join
returns the last rank to join, whose model trained to the end, and every rank then takes that model.

    python -m distlab run -n 2 examples/horovod_style_training.py
    python -m distlab run -n 4 --timeline hvd.json examples/horovod_style_training.py   # open in Perfetto
    DISTLAB_IMPL=reference python -m distlab run -n 2 examples/horovod_style_training.py
    python -m distlab run -n 2 examples/horovod_style_training.py --device cuda   # on GPUs (cupy)
"""
from __future__ import annotations

import argparse
from itertools import islice

import numpy as np

import distlab
from distlab import collectives as hvd
from distlab import nn, optim
from distlab.data import DistributedSampler
from train_ddp import spirals  # the same data set as the DDP example (examples/ is on sys.path when run)

from _device import add_device_argument, select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--target", type=float, default=0.85, help="exit 1 if the final accuracy is below this")
    add_device_argument(parser)
    options = parser.parse_args()

    xp = select(options.device)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = (xp.asarray(a) for a in spirals(600))
    sampler = DistributedSampler(len(y), num_replicas=size, rank=rank, uneven=True)

    model = nn.Sequential(nn.Linear(2, options.hidden, seed=10 + rank), nn.ReLU(),
                          nn.Linear(options.hidden, options.hidden, seed=20 + rank), nn.ReLU(),
                          nn.Linear(options.hidden, 3, seed=30 + rank))
    if options.device != "cpu":
        model.to("cuda")
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=options.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    steps = max(len(sampler) - 40 * rank, 0) // options.batch   # uneven inputs: higher ranks use fewer examples
    for epoch in range(options.epochs):
        sampler.set_epoch(epoch)
        for idx in islice(sampler.batches(options.batch), steps):
            opt.zero_grad()
            loss = loss_fn(model(distlab.tensor(x[idx])), distlab.tensor(y[idx]))
            loss.backward()
            opt.step()
        if rank == 0 and epoch % 5 == 4:
            print(f"epoch {epoch + 1}: loss {float(loss.data):.3f}", flush=True)
    last = hvd.join()                         # ranks with fewer steps wait here, contributing zeros
    # A rank that joined early stopped updating its model; the last rank to join trained to the end.
    hvd.broadcast_parameters(model.named_parameters(), root_rank=last)

    with distlab.no_grad():
        predicted = model(distlab.tensor(x)).data.argmax(axis=1)
    accuracy = float((predicted == y).mean())
    stats = hvd.stats()
    accuracies = hvd.allgather(np.array([accuracy]), name="accuracy")
    if rank == 0:
        print(f"{size} ranks ({stats['impl']}): {steps} steps on rank 0, last rank to join: {last}; "
              f"negotiation cycles: {stats['fast_path']} fast path, {stats['slow_path']} slow path; "
              f"accuracy {accuracy:.3f}")
    assert np.allclose(accuracies, accuracies[0]), f"ranks' models diverged: {accuracies}"
    hvd.shutdown()
    if accuracy < options.target:
        raise SystemExit(f"accuracy {accuracy:.3f} is below the target {options.target}")


if __name__ == "__main__":
    main()
