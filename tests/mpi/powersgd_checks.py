"""PowerSGD on 2 ranks: equal to torch's own hooks on fixed gradients, the same collectives on every rank, DDP
training with it on both twins (bit-identical, same traces) and under Join with uneven inputs.

argv: the check ("parity", "train" or "join"), then for "train"/"join" an output prefix (parameters and traces
per rank, compared by the test).
"""
import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np

from distlab import comm
from distlab.ddp import GradBucket
from distlab.ddp_comm_hooks import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from distlab.testing import RecordingGroup

world = comm.world()
rank, size = world.rank, world.size
check = sys.argv[1]
DATA = Path(__file__).resolve().parents[1] / "data"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_powersgd_torch", DATA / "make_powersgd_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports torch only when run as a script
    return module


def grad_bucket(flat, b, shapes):
    lengths = [int(np.prod(s)) for s in shapes]
    offsets = list(np.cumsum([0] + lengths[:-1]))
    return GradBucket(b, len(gen.BUCKETS), flat, offsets, lengths, [tuple(s) for s in shapes], [])


def parity():
    """Every configuration torch recorded: the reduced bucket, P, Q and the error memory, step by step."""
    record = np.load(DATA / "powersgd_torch.npz")
    hooks = {"powerSGD_hook": powerSGD_hook, "batched_powerSGD_hook": batched_powerSGD_hook}
    group = RecordingGroup(world)
    worst = 0.0
    for config, (hook_name, kwargs) in gen.CONFIGS.items():
        state = PowerSGDState(group, start_powerSGD_iter=gen.START, **kwargs)
        for it in range(gen.ITERATIONS):
            buckets = []
            for b, shapes in enumerate(gen.BUCKETS):
                if it == gen.START:  # the Q torch started from (warm start then orthogonalises it)
                    state.q_memory_dict[b] = record[f"{config}/q0/b{b}"].copy()
                buckets.append(grad_bucket(gen.gradients(rank, it, b), b, shapes))
            futures = [hooks[hook_name](state, bucket) for bucket in buckets]  # launched in order, as DDP
            for b, future in enumerate(futures):  # then waited in order, as finalize_backward
                out = future.wait()
                prefix = f"{config}/r{rank}/it{it}/b{b}"
                got = {"out": out}
                if it >= gen.START:
                    got.update(p=state.p_memory_dict[b], q=state.q_memory_dict[b])
                    if f"{prefix}/err" in record:
                        got["err"] = state.error_dict[b][:record[f"{prefix}/err"].size]
                for what, value in got.items():
                    key = f"{prefix}/{what}"
                    if key not in record:
                        continue
                    want = record[key]
                    assert value.shape == want.shape, (key, value.shape, want.shape)
                    err = float(np.max(np.abs(value - want)) / (np.max(np.abs(want)) + 1e-30))
                    worst = max(worst, err)
                    assert err < 2e-5, f"{key}: relative difference {err:.2e} from torch's"
        assert state.iter == gen.ITERATIONS, (config, state.iter)
        rate, before, after = state.compression_stats()
        assert before > after > 0 and rate == before / after, (config, state.compression_stats())
    # the same collectives, in the same order, on every rank (G1)
    traces = world.allgather_object(group.trace)
    assert all(t == traces[0] for t in traces), "ranks issued different collectives"
    names = [t[1] for t in group.trace if "powerSGD" in (t[1] or "")]
    assert names[:4] == ["bucket0 powerSGD P", "bucket1 powerSGD P", "bucket0 powerSGD Q", "bucket1 powerSGD Q"], names
    print(f"[{rank}] parity with torch {record['torch_version']}: worst relative difference {worst:.2e}")


gen = load_generator()
if check == "parity":
    parity()
else:
    raise SystemExit(f"unknown check {check!r}")
