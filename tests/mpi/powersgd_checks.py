"""PowerSGD on 2 ranks: equal to torch's own hooks on fixed gradients, the same collectives on every rank, DDP
training with it on both twins (bit-identical, same traces) and under Join with uneven inputs.

argv: the check ("parity", "train", "join" or "timeout"), then for "train"/"join" the twin ("reference", "core" or
"mixed": even ranks the reference) and an output prefix (parameters and traces per rank, compared by the test).
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
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting, to_device

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
    """Every configuration torch recorded: the reduced bucket, P, Q and the error memory, step by step; on numpy,
    then on the strict device stand-in."""
    record = np.load(DATA / "powersgd_torch.npz")
    hooks = {"powerSGD_hook": powerSGD_hook, "batched_powerSGD_hook": batched_powerSGD_hook}
    group = RecordingGroup(world)
    worst = 0.0
    runs = [(config, False) for config in gen.CONFIGS] + [("rank1", True), ("rank4", True)]
    # the Qs sent after backward (default), or at each next bucket's launch; on numpy, then on the stand-in
    for device, config, q_at_launch in [(device, *run) for device in DEVICES for run in runs]:
        hook_name, kwargs = gen.CONFIGS[config]
        state = PowerSGDState(group, start_powerSGD_iter=gen.START, **kwargs)
        state._q_at_launch = q_at_launch
        for it in range(gen.ITERATIONS):
            buckets = []
            for b, shapes in enumerate(gen.BUCKETS):
                if it == gen.START:  # the Q torch started from (warm start then orthogonalises it)
                    state.q_memory_dict[b] = on(device, record[f"{config}/q0/b{b}"].copy())
                buckets.append(grad_bucket(on(device, gen.gradients(rank, it, b)), b, shapes))
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
                    value = host(value)
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
    p0, p1, q0, q1 = (f"bucket{b} powerSGD {x}" for x in "PQ" for b in (0, 1))
    # every P at its bucket's launch, every Q after (with two buckets, sending Q0 at bucket 1's launch gives the
    # same order)
    assert names[:4] == names[-4:] == [p0, p1, q0, q1], names
    print(f"[{rank}] parity with torch {record['torch_version']}: worst relative difference {worst:.2e}")


def mlp(seed=0):
    from distlab import nn

    return nn.Sequential(nn.Linear(8, 32, seed=seed), nn.ReLU(), nn.Linear(32, 32, seed=seed + 1), nn.ReLU(),
                         nn.Linear(32, 4, seed=seed + 2))


def batches(count, seed, device="cpu"):
    import distlab

    rng = np.random.default_rng([seed, rank])
    return [(on(device, distlab.tensor(rng.standard_normal((16, 8)).astype(np.float32))),
             on(device, distlab.tensor(rng.standard_normal((16, 4)).astype(np.float32)))) for _ in range(count)]


def ddp_with_powersgd(impl, group, wrap=None, device="cpu", **kwargs):
    from distlab.ddp import DistributedDataParallel

    model = DistributedDataParallel(to_device(mlp(), device), bucket_cap_mb=0.002, impl=impl)  # several buckets
    state = PowerSGDState(group, start_powerSGD_iter=2, **kwargs)
    model.register_comm_hook(state, powerSGD_hook if wrap is None else wrap(powerSGD_hook))
    return model, state


def fused_equals_stepping_after(impl, data, want, device):
    """PowerSGD inside hook_then_optimizer (each bucket's parameters updated as it is finished) ends with the
    parameters of stepping after backward."""
    from distlab import nn, optim
    from distlab.ddp_comm_hooks import OptimizerHookState, hook_then_optimizer

    opt_holder = []  # the optimizer needs the model's parameters, the model needs the hook

    def wrap(hook):
        return lambda state, bucket: hook_then_optimizer(hook, OptimizerHookState(opt_holder[0]))(state, bucket)

    model, _ = ddp_with_powersgd(impl, None, wrap=wrap, device=device, matrix_approximation_rank=2)
    opt_holder.append(optim.SGD(model.parameters(), lr=0.05))
    loss_fn = nn.MSELoss()
    for x, y in data:
        opt_holder[0].zero_grad()
        loss_fn(model(x), y).backward()  # the hook stepped each bucket's parameters
    for a, b in zip([p.data for p in model.parameters()], want):
        assert np.array_equal(host(a), host(b)), "PowerSGD under hook_then_optimizer differs from stepping after " \
            "backward"


def train_on(impl, device):
    """8 steps of DDP with PowerSGD (rank 2) on ``device``: the same model on every rank after each step, the
    same under hook_then_optimizer. Returns the parameters (on the host), the trace of collectives and the losses."""
    from distlab import nn, optim

    start_counting(device)
    group = RecordingGroup(world)
    model, state = ddp_with_powersgd(impl, group, device=device, matrix_approximation_rank=2)
    opt = optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    losses = []
    for x, y in batches(1, 1, device) * 8:  # one batch over and over: the loss must fall
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.data))
        flat = np.concatenate([host(p.data).ravel() for p in model.parameters()])
        assert all(np.array_equal(flat, other) for other in world.allgather_object(flat)), "replicas diverged"
    assert state.iter == 8 and len(state.error_dict) == len(model.reducer.get_grad_buckets())
    assert any("powerSGD Q" in (t[1] or "") for t in group.trace)
    fused_equals_stepping_after(impl, batches(1, 1, device) * 8, [p.data for p in model.parameters()], device)
    # the Qs are drawn on the host, as the anchor draws them on the CPU, and copied in
    staged = {k: n for k, n in staged_outside_comm(device).items()
              if k != ("from_host", "distlab.ddp_comm_hooks.powersgd")}
    assert not staged, staged
    return [host(p.data) for p in model.parameters()], group.trace, losses


def train(impl, prefix):
    """:func:`train_on` numpy, then on the strict device stand-in (bit-equal, the same trace); the parameters and
    the trace written for the test to compare across twins and a mixed world."""
    impl = impl if impl != "mixed" else ("reference" if rank % 2 == 0 else "core")
    (params, trace, losses), on_device = (train_on(impl, device) for device in DEVICES)
    assert all(np.array_equal(a, b) for a, b in zip(params, on_device[0])), "the stand-in differs from numpy"
    assert trace == on_device[1] and losses == on_device[2]
    with open(f"{prefix}.{rank}.pkl", "wb") as f:
        pickle.dump({"params": params, "trace": trace, "losses": losses}, f)


def join(impl, prefix):
    """Uneven inputs (rank r has 4 + 3 r batches) under Join: no hang, every rank ends with the same model, a
    joined rank's error memory is left alone, and (error feedback off) its shadow contributes exact zeros:
    the last rank ends bit-identical to a run where the exhausted ranks step on a zero loss instead. On numpy, then
    on the strict device stand-in, bit-equal."""
    from distlab import nn, optim

    loss_fn = nn.MSELoss()
    mine = 4 + 3 * rank
    most = 4 + 3 * (size - 1)
    results = {}
    for device, feedback in [(device, feedback) for device in DEVICES for feedback in (True, False)]:
        for joined in (True, False):
            model, state = ddp_with_powersgd(impl, None, device=device, matrix_approximation_rank=1,
                                             use_error_feedback=feedback)
            opt = optim.SGD(model.parameters(), lr=0.05)
            data = batches(most, 2, device)
            errors_at_join = None

            def step(x, y, scale=1.0):
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                (loss * scale).backward()
                opt.step()

            if joined:
                with model.join():
                    for x, y in data[:mine]:
                        step(x, y)
                    errors_at_join = {b: e.copy() for b, e in state.error_dict.items()}
            else:
                for i, (x, y) in enumerate(data):
                    step(x, y, 1.0 if i < mine else 0.0)
            flat = np.concatenate([host(p.data).ravel() for p in model.parameters()])
            assert all(np.array_equal(flat, o) for o in world.allgather_object(flat)), "models differ after join"
            if joined and feedback and mine < most:
                assert all(np.array_equal(host(state.error_dict[b]), host(e)) for b, e in errors_at_join.items()), \
                    "a joined rank's shadow changed its error memory"
            results[(device, feedback, joined)] = flat
    for device in DEVICES:
        assert np.array_equal(results[(device, False, True)], results[(device, False, False)]), \
            "the joined ranks' shadow did not contribute zeros"
        assert not np.array_equal(results[(device, True, True)], results[(device, False, True)])
    assert all(np.array_equal(v, results[("cuda",) + k[1:]]) for k, v in results.items() if k[0] == "cpu"), \
        "the stand-in differs from numpy"
    with open(f"{prefix}.{rank}.pkl", "wb") as f:
        pickle.dump({"params": results[("cpu", True, True)]}, f)


def timeout():
    """A rank that never reduces its bucket: the other's wait times out naming PowerSGD's allreduce and the rank."""
    import time

    from distlab.errors import DistTimeoutError

    group = comm.ProcessGroup(name="powersgd timeout", timeout=1.5)
    state = PowerSGDState(group, start_powerSGD_iter=2)
    state.iter = 2
    world.barrier()
    if rank == size - 1:
        time.sleep(5.0)
    else:
        future = powerSGD_hook(state, grad_bucket(gen.gradients(rank, 0, 0), 0, gen.BUCKETS[0]))
        try:
            future.wait()
            raise AssertionError("must time out")
        except DistTimeoutError as exc:
            assert exc.missing_ranks == [size - 1] and exc.name == "bucket0 powerSGD P", (exc.missing_ranks, exc)
            assert "bucket0 powerSGD P" in str(exc) and f"ranks [{size - 1}] have not entered it" in str(exc)
            assert future.exception() is exc
    print(f"[{rank}] timeout named the bucket and the rank")


gen = load_generator()
if check == "parity":
    parity()
elif check == "train":
    train(sys.argv[2], sys.argv[3])
elif check == "join":
    join(sys.argv[2], sys.argv[3])
elif check == "timeout":
    timeout()
else:
    raise SystemExit(f"unknown check {check!r}")
