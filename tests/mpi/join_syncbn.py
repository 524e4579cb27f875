"""SyncBatchNorm on 2 or 4 ranks. argv: impl ("reference", "core", "mixed": Join's and DDP's twin), output prefix
or the mode "nojoin".

1. SyncBatchNorm equals BatchNorm1d on the concatenated batch (forward, running stats, input and parameter
   gradients), for (N, C) and (N, C, L) and a different N on each rank; its gradients equal central differences
   of the global loss (a distributed gradcheck: each rank's inputs perturbed in turn). On numpy, then on the
   device stand-in.
2. Under Join alone, with uneven inputs, the ranks still training normalise with the batches actually seen.
3. DDP + SyncBatchNorm + ZeroRedundancyOptimizer under one Join with uneven inputs equals one process training on
   the union of the batches seen at each step (BatchNorm1d on the concatenation).
nojoin: the same uneven loop without Join stops with a timeout naming the statistics allreduce and the rank
   that ran out (rank 0), instead of hanging.
"""
import pickle
import sys

import numpy as np

import distlab
from distlab import _backend, comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.errors import DistTimeoutError
from distlab.optim import ZeroRedundancyOptimizer
from distlab.testing import RecordingGroup
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting, to_device

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = impl_arg if impl_arg != "mixed" else ("reference" if rank % 2 == 0 else "core")
Join = _backend.load("join", impl).Join
out = {}


def everyone(array):
    """Every rank's array (shapes may differ), in rank order."""
    return world.allgather_object(host(array))


# -- nojoin: the hang, bounded -------------------------------------------------------------------------------------
if prefix == "nojoin":
    bn = nn.SyncBatchNorm(3)
    try:
        for i in range(2 + rank):
            bn(distlab.tensor(np.random.default_rng(i).standard_normal((4, 3)).astype(np.float32))).sum().backward()
        print(f"rank {rank}: ran out of inputs and left", flush=True)
    except DistTimeoutError as exc:
        assert "SyncBatchNorm forward statistics" in str(exc) and exc.missing_ranks == [0], str(exc)
        print(f"rank {rank}: {exc}", flush=True)
        raise
    sys.exit(0)


# -- 1. SyncBatchNorm == BatchNorm1d on the concatenation (numpy, then the device stand-in, in one launch) ----------
for device, shape_tail in [(device, tail) for device in DEVICES for tail in ((), (3,))]:
    start_counting(device)
    rng = np.random.default_rng(7)
    rows = [3 + r for r in range(size)]  # a different batch size on every rank
    xs = [rng.standard_normal((n, 4) + shape_tail) * 2 + 1 for n in rows]
    vs = [rng.standard_normal((n, 4) + shape_tail) for n in rows]
    weight, bias = rng.standard_normal(4), rng.standard_normal(4)
    sync, local = nn.SyncBatchNorm(4, momentum=0.3, dtype=np.float64), nn.BatchNorm1d(4, momentum=0.3,
                                                                                      dtype=np.float64)
    for layer in (sync, local):
        layer.weight.data[...], layer.bias.data[...] = weight, bias
        to_device(layer, device)
    x = distlab.tensor(on(device, xs[rank].copy()), requires_grad=True)
    y = sync(x)
    (y * distlab.tensor(on(device, vs[rank]))).sum().backward()
    x_all = distlab.tensor(on(device, np.concatenate(xs)), requires_grad=True)
    y_all = local(x_all)
    (y_all * distlab.tensor(on(device, np.concatenate(vs)))).sum().backward()
    start = sum(rows[:rank])
    assert np.allclose(host(y.data), host(y_all.data[start:start + rows[rank]]), atol=1e-12)
    assert np.allclose(host(x.grad.data), host(x_all.grad.data[start:start + rows[rank]]), atol=1e-12)
    grads = np.concatenate([host(sync.weight.grad.data), host(sync.bias.grad.data)])
    world.allreduce(grads)  # DDP's sum of the per-rank shares
    assert np.allclose(grads, np.concatenate([host(local.weight.grad.data), host(local.bias.grad.data)]), atol=1e-12)
    for name in ("running_mean", "running_var"):
        assert np.allclose(host(getattr(sync, name).data), host(getattr(local, name).data), atol=1e-14), name

    assert not staged_outside_comm(device), staged_outside_comm(device)
    if shape_tail:
        continue  # the gradcheck below costs two collective forwards per input element: once is enough

    # Distributed gradcheck: L = sum over ranks of sum(y * v); perturb one element on one rank at a time.
    def global_loss():
        value = np.array([float((sync(distlab.tensor(on(device, xs[rank]))).data * on(device, vs[rank])).sum())])
        return world.allreduce(value)[0]

    eps, numerical = 1e-6, np.zeros_like(xs[rank])
    for owner in range(size):
        for index in np.ndindex(xs[owner].shape):
            saved = xs[owner][index]
            xs[owner][index] = saved + eps
            plus = global_loss()
            xs[owner][index] = saved - eps
            minus = global_loss()
            xs[owner][index] = saved
            if owner == rank:
                numerical[index] = (plus - minus) / (2 * eps)
    assert np.allclose(host(x.grad.data), numerical, atol=1e-6), np.abs(host(x.grad.data) - numerical).max()
print(f"rank {rank}: SyncBatchNorm equals BatchNorm1d on the concatenated batch", flush=True)

mine, most = 2 + rank, 2 + size - 1


def batch(r, i):
    g = np.random.default_rng(100 * r + i)
    return g.standard_normal((4, 3)).astype(np.float32) * 3 + 1, g.standard_normal((4, 2)).astype(np.float32)


def net(group=None):
    distlab.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8, seed=1), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2, seed=2))
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, group) if group is not None else model


loss_fn = nn.MSELoss()
for device in DEVICES:  # sections 2 and 3 on numpy, then on the strict device stand-in, in one launch
    start_counting(device)
    # -- 2. Join alone: the ranks still training see only the batches that exist ---------------------------------------
    bn = to_device(nn.SyncBatchNorm(3), device)
    with Join([bn]):
        for i in range(mine):
            y = bn(distlab.tensor(on(device, batch(rank, i)[0])))
            y.sum().backward()
            active = [r for r in range(size) if 2 + r > i]
            expected = to_device(nn.BatchNorm1d(3), device)(
                distlab.tensor(on(device, np.concatenate([batch(r, i)[0] for r in active]))))
            position = active.index(rank)
            assert np.allclose(y.data, expected.data[4 * position:4 * position + 4], atol=1e-5), i
    # every rank ends with the running statistics of the last joiner
    assert all(np.array_equal(a, everyone(bn.running_mean.data)[0]) for a in everyone(bn.running_mean.data))
    assert int(bn.num_batches_tracked.data) == most
    print(f"rank {rank} ({device}): SyncBatchNorm under Join OK", flush=True)



    # -- 3. DDP + SyncBatchNorm + ZeRO under one Join == one process on the union ------------------------------------
    group = RecordingGroup(world)  # the model's layers and the optimizer on one group: Join checks it
    model = DDP(to_device(net(group), device), process_group=group, bucket_cap_mb=100 / 2**20, impl=impl)
    # SGD, not Adam: the bias of the Linear before a batch norm gets a gradient that is zero up to rounding, and Adam
    # would turn that rounding noise into full-size steps.
    zero = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, process_group=group, lr=0.1, momentum=0.9)
    with Join([model, *nn.SyncBatchNorm.layers_in(model), zero], divide_by_initial_world_size=False):
        for i in range(mine):
            x, y = batch(rank, i)
            zero.zero_grad()
            loss_fn(model(distlab.tensor(on(device, x))), distlab.tensor(on(device, y))).backward()
            zero.step()
    single = to_device(net(), device)
    single_opt = optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for i in range(most):
        active = [r for r in range(size) if 2 + r > i]
        x = np.concatenate([batch(r, i)[0] for r in active])
        y = np.concatenate([batch(r, i)[1] for r in active])
        single_opt.zero_grad()
        loss_fn(single(distlab.tensor(on(device, x))), distlab.tensor(on(device, y))).backward()
        single_opt.step()
    state, expected = model.module.state_dict(), single.state_dict()
    for key in expected:
        a, b = host(state[key]), host(expected[key])
        assert np.allclose(a, b, atol=2e-5), (key, np.abs(a - b).max())
    for key, value in state.items():  # and every rank holds the same model
        assert all(np.array_equal(host(value), theirs) for theirs in everyone(value)), key
    out[f"ddp+syncbn+zero on {device}"] = {"params": [host(state[k]) for k in sorted(state)], "trace": group.trace}
    print(f"rank {rank} ({device}): DDP + SyncBatchNorm + ZeRO under Join equals one process on the union", flush=True)
    assert not staged_outside_comm(device), staged_outside_comm(device)

with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(out, fh)
print(f"rank {rank} ({impl}): syncbn scenarios OK", flush=True)
