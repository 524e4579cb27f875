"""Record torch's own PowerSGD hooks on fixed gradients into ``powersgd_torch.npz`` (the parity test's anchor).

Needs torch (not a dependency of distlab): ``pip install torch`` into a scratch environment, then::

    python tests/data/make_powersgd_torch.py

Two gloo ranks on this machine run ``powerSGD_hook`` (and ``batched_powerSGD_hook``) on two buckets of
gradients drawn from a seeded generator, for a few iterations (two plain allreduces, then compressed steps),
for several configurations. torch draws its first Q from its own generator, which numpy cannot reproduce, so
the script hands both sides the same initial Q: it fills each bucket's Q memory before the first compressed
step (then torch, warm-started, orthogonalises that Q instead of drawing one) and records it. Recorded per
rank, iteration and bucket: the gradients given, the reduced bucket, P, Q and the error memory after the step.

torch 2.13's ``batched_powerSGD_hook`` passes a 2-D matrix to its batched orthogonalisation, which asserts a
3-D batch; the script orthogonalises it as a batch of one (the evident intent) to record the rest.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "powersgd_torch.npz"
ITERATIONS = 4
START = 2
#: Two buckets, as DDP would hand them to the hook: Linear-like weights and biases, a 4-D (conv-like) gradient
#: and a small matrix that does not compress enough at rank 4.
BUCKETS = ([(24, 16), (24,), (24, 16), (24,), (16, 24), (16,)], [(6, 4, 2, 2), (6,), (4, 4), (40, 12)])
CONFIGS = {  # name -> (hook, PowerSGDState keyword arguments)
    "rank1": ("powerSGD_hook", dict(matrix_approximation_rank=1)),
    "rank2_eps": ("powerSGD_hook", dict(matrix_approximation_rank=2, orthogonalization_epsilon=1e-8)),
    "rank4": ("powerSGD_hook", dict(matrix_approximation_rank=4)),
    "rank4_no_feedback": ("powerSGD_hook", dict(matrix_approximation_rank=4, use_error_feedback=False)),
    "rank2_rate0": ("powerSGD_hook", dict(matrix_approximation_rank=2, min_compression_rate=0)),
    "batched1": ("batched_powerSGD_hook", dict(matrix_approximation_rank=1)),
    "batched3": ("batched_powerSGD_hook", dict(matrix_approximation_rank=3)),
}


def gradients(rank: int, iteration: int, b: int) -> np.ndarray:
    """The flat bucket ``b`` of rank ``rank`` at ``iteration`` (low-rank plus noise, so compression matters)."""
    rng = np.random.default_rng([rank, iteration, b])
    parts = []
    for shape in BUCKETS[b]:
        rows = shape[0]
        cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        low = rng.standard_normal((rows, 2)) @ rng.standard_normal((2, cols))
        parts.append((low + 0.1 * rng.standard_normal((rows, cols))).astype(np.float32).ravel())
    return np.concatenate(parts)


def initial_q(config: str, b: int, rank_r: int, batched: bool) -> np.ndarray:
    """The Q both sides start from: per compressed matrix (in torch's order) cols x r, flattened."""
    rng = np.random.default_rng([99, b, len(config)])
    return rng.standard_normal(_pq_sizes(b, rank_r, batched, CONFIGS[config][1])[1]).astype(np.float32)


def _pq_sizes(b, r, batched, kwargs):
    """Elements of every P and of every Q of bucket ``b`` at rank ``r``."""
    if batched:
        total = sum(int(np.prod(s)) for s in BUCKETS[b])
        return (int(np.ceil(np.sqrt(total))) * r,) * 2
    rate = kwargs.get("min_compression_rate", 2)
    shapes = {}
    for shape in BUCKETS[b]:
        rows = shape[0]
        cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        rr = min(rows, cols, r)
        if (rows + cols) * rr * rate < rows * cols:
            shapes.setdefault((rows, cols), []).append((rows * rr, cols * rr))
    return tuple(sum(pq[i] for v in shapes.values() for pq in v) for i in (0, 1))


def run(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    original = ps._orthogonalize
    ps._orthogonalize = lambda m, epsilon=0: original(m if m.dim() == 3 else m.unsqueeze(0), epsilon)

    class Bucket:  # what DDP hands a hook
        def __init__(self, flat, b):
            self.flat, self.b = flat, b

        def buffer(self):
            return self.flat

        def index(self):
            return self.b

        def is_last(self):
            return self.b == len(BUCKETS) - 1

        def gradients(self):
            out, offset = [], 0
            for shape in BUCKETS[self.b]:
                n = int(np.prod(shape))
                out.append(self.flat[offset:offset + n].view(shape))
                offset += n
            return out

    try:
        queue.put((rank, _record(ps, torch, Bucket)))
    finally:
        dist.destroy_process_group()


def _record(ps, torch, Bucket) -> dict:
    rank = torch.distributed.get_rank()
    record = {}
    for config, (hook_name, kwargs) in CONFIGS.items():
        hook = getattr(ps, hook_name)
        batched = hook_name.startswith("batched")
        state = ps.PowerSGDState(None, start_powerSGD_iter=START, **kwargs)
        for it in range(ITERATIONS):
            for b in range(len(BUCKETS)):
                if it == START:  # same initial Q on both sides: warm start then orthogonalises it
                    q0 = initial_q(config, b, kwargs["matrix_approximation_rank"], batched)
                    state.q_memory_dict[b] = torch.from_numpy(q0.copy())
                    if batched:
                        state.q_memory_dict[b] = state.q_memory_dict[b].view(-1, kwargs["matrix_approximation_rank"])
                    p_size = _pq_sizes(b, kwargs["matrix_approximation_rank"], batched, kwargs)[0]
                    state.p_memory_dict[b] = torch.empty(p_size)
                    if batched:
                        state.p_memory_dict[b] = state.p_memory_dict[b].view(-1, kwargs["matrix_approximation_rank"])
                    record[f"{config}/q0/b{b}"] = q0
                grads = torch.from_numpy(gradients(rank, it, b))
                out = hook(state, Bucket(grads.clone(), b)).wait()
                out = out[0] if isinstance(out, list) else out
                prefix = f"{config}/r{rank}/it{it}/b{b}"
                if it >= START - 1:
                    record[f"{prefix}/out"] = out.numpy().copy()
                if it >= START:
                    record[f"{prefix}/p"] = state.p_memory_dict[b].numpy().ravel().copy()
                    record[f"{prefix}/q"] = state.q_memory_dict[b].numpy().ravel().copy()
                    if b in state.error_dict:
                        record[f"{prefix}/err"] = state.error_dict[b].numpy().copy()
    return record


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    records = {}
    for _ in procs:
        _, rec = queue.get(timeout=60)
        records.update(rec)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            sys.exit(f"a torch rank failed (exit {p.exitcode})")
    records["torch_version"] = np.array(torch.__version__)
    np.savez_compressed(OUT, **records)
    print(f"{len(records)} arrays, {OUT.stat().st_size} bytes: {OUT}")


if __name__ == "__main__":
    main()
