"""The comm layer on several ranks: allreduce, broadcast and allgather of arrays, sync and async.

Run it with ``make demo`` or ``python -m distlab run -n 2 examples/comm_demo.py [--timeline demo.json]``.
"""
import argparse

import numpy as np
from tqdm import tqdm

import distlab
from distlab import comm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="allreduce steps in the progress-bar loop")
    parser.add_argument("--size", type=int, default=1 << 16, help="float32 elements per allreduce")
    options = parser.parse_args()

    pg = comm.world()
    say = print if pg.rank == 0 else (lambda *a, **k: None)
    say(f"distlab {distlab.__version__}, twin {distlab.IMPL!r}, {pg.size} ranks")

    # allreduce: every rank contributes rank+1; the sum is 1+2+...+size everywhere.
    a = np.full(4, pg.rank + 1, dtype=np.float32)
    pg.allreduce(a)
    assert np.all(a == pg.size * (pg.size + 1) / 2), a
    say(f"allreduce(sum) of rank+1 -> {a}")

    # broadcast: rank 0's array overwrites everyone's.
    b = np.arange(5, dtype=np.int64) if pg.rank == 0 else np.zeros(5, dtype=np.int64)
    pg.broadcast(b, src=0)
    assert np.all(b == np.arange(5)), b
    say(f"broadcast from rank 0 -> {b}")

    # allgather: one row per rank.
    rows = pg.allgather(np.array([pg.rank, pg.rank ** 2], dtype=np.int32))
    assert rows.tolist() == [[r, r * r] for r in range(pg.size)], rows
    say(f"allgather of [rank, rank^2] -> {rows.tolist()}")

    # Async allreduce overlapped with (fake) compute, with a progress bar on rank 0.
    grad = np.ones(options.size, dtype=np.float32)
    for _ in tqdm(range(options.steps), desc="async allreduce", disable=pg.rank != 0, unit="step"):
        work = pg.allreduce(grad, op="avg", async_op=True, name="grad")
        _ = np.sin(np.arange(1000.0))  # compute while the reduction runs
        work.wait()
    assert np.allclose(grad, 1.0)
    pg.barrier()
    say("all collectives agreed on every rank")


if __name__ == "__main__":
    main()
