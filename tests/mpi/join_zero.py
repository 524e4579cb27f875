"""ZeroRedundancyOptimizer on 2 or 4 ranks. argv: impl ("reference", "core", "mixed": DDP's reducer and Join's
twin), output prefix.

1. ZeRO equals the plain optimizer, bit for bit (Adam, SGD with momentum, Adagrad; per-parameter broadcasts and
   parameters_as_bucket_view), and each rank keeps the state of its own shard only (torch's greedy partition).
2. consolidate_state_dict / state_dict / load_state_dict: the consolidated state equals the plain optimizer's, a
   rank without it is refused clearly, and training resumed from it continues identically.
3. add_param_group equals the plain optimizer with the same groups; old parameters keep their owners.
4. Under Join with uneven inputs (rank r has 3 + r batches), DDP + ZeRO equals a local simulation of the same
   schedule, and every rank issues the same collectives (the joined ranks shadow the step's broadcasts).
"""
import pickle
import sys

import numpy as np

import distlab
from distlab import _backend, comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.optim import ZeroRedundancyOptimizer
from distlab.testing import RecordingGroup
from scenario_checks import (DEVICES, assert_parameters_equal, host, on, replay_uneven_inputs, staged_outside_comm,
                             start_counting, to_device)

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = impl_arg if impl_arg != "mixed" else ("reference" if rank % 2 == 0 else "core")
Join = _backend.load("join", impl).Join
loss_fn = nn.MSELoss()
out = {}


def net():
    distlab.manual_seed(0)
    return to_device(nn.Sequential(nn.Linear(5, 16, seed=1), nn.Tanh(), nn.Linear(16, 8, seed=2), nn.Tanh(),
                                   nn.Linear(8, 2, seed=3)), device)


def batch(r, i):
    rng = np.random.default_rng(1000 * r + i)
    return rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)


def train_step(model, opt, r, i):
    x, y = batch(r, i)
    opt.zero_grad()
    loss_fn(model(distlab.tensor(on(device, x))), distlab.tensor(on(device, y))).backward()
    opt.step()


def greedy_owners(params, world_size):
    """torch's partition, computed independently: largest first, to the least loaded (lowest rank on ties)."""
    load, owner = [0] * world_size, {}
    for index in sorted(range(len(params)), key=lambda i: -params[i].data.size):
        best = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = best
        load[best] += params[index].data.size
    return owner


for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # -- 1. equivalence with the plain optimizer, and the shard each rank keeps ---------------------------------------
    for opt_cls, kw in ((optim.Adam, dict(lr=0.01)), (optim.SGD, dict(lr=0.05, momentum=0.9)),
                        (optim.Adagrad, dict(lr=0.05))):
        for bucket_view in (False, True):
            plain_model, zero_model = DDP(net(), impl=impl), DDP(net(), impl=impl)
            plain = opt_cls(plain_model.parameters(), **kw)
            zero = ZeroRedundancyOptimizer(zero_model.parameters(), opt_cls, parameters_as_bucket_view=bucket_view,
                                           **kw)
            for i in range(4):
                train_step(plain_model, plain, rank, i)
                train_step(zero_model, zero, rank, i)
            for (name, a), b in zip(plain_model.module.named_parameters(), zero_model.module.parameters()):
                assert np.array_equal(a.data, b.data), (opt_cls.__name__, bucket_view, name)
            params = list(zero_model.parameters())
            owners = greedy_owners(params, size)
            mine = {i for i, o in owners.items() if o == rank}
            assert {i for i, p in enumerate(params) if p in zero.optim.state} == mine, (rank, owners)
            if bucket_view:  # a parameter's data is a view into its owner's bucket
                for i, p in enumerate(params):
                    assert np.shares_memory(p.data, zero._buckets[owners[i]])
    print(f"rank {rank} ({device}): ZeRO equals the plain optimizer", flush=True)

    # -- 2. consolidate, state_dict, load_state_dict -------------------------------------------------------------------
    plain_model, zero_model = DDP(net(), impl=impl), DDP(net(), impl=impl)
    plain = optim.Adam(plain_model.parameters(), lr=0.01)
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), optim.Adam, lr=0.01)
    for i in range(2):
        train_step(plain_model, plain, rank, i)
        train_step(zero_model, zero, rank, i)
    target = size - 1
    zero.consolidate_state_dict(to=target)
    if rank == target:
        full, expected = zero.state_dict(), plain.state_dict()
        assert list(full["state"]) == list(expected["state"]) == list(range(6))
        for index, state in expected["state"].items():
            assert full["state"][index]["step"] == state["step"] == 2
            for key in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(full["state"][index][key], state[key]), (index, key)
        assert full["param_groups"][0]["params"] == list(range(6)) and full["param_groups"][0]["lr"] == 0.01
    else:
        full = None
        try:
            zero.state_dict()
            raise AssertionError("state_dict() without a consolidated state must be refused")
        except RuntimeError as exc:
            assert f"call consolidate_state_dict(to={rank}) on every rank first" in str(exc).lower(), str(exc)
    full = world.broadcast_object(full, src=target)
    resumed_model = DDP(net(), impl=impl)
    resumed_model.load_state_dict(zero_model.state_dict())
    resumed = ZeroRedundancyOptimizer(resumed_model.parameters(), optim.Adam, lr=123.0)
    resumed.load_state_dict(full)
    assert resumed.param_groups[0]["lr"] == 0.01 and resumed.optim.param_groups[0]["lr"] == 0.01
    assert len(resumed.optim.state) == len(zero.optim.state)  # only the own shard's state is kept
    for i in range(2, 4):
        train_step(plain_model, plain, rank, i)
        train_step(resumed_model, resumed, rank, i)
    for a, b in zip(plain_model.module.parameters(), resumed_model.module.parameters()):
        assert np.array_equal(a.data, b.data)
    try:
        resumed.load_state_dict({"state": {}, "param_groups": []})
        raise AssertionError("a state dict with other groups must be refused")
    except ValueError as exc:
        assert "different number of parameter groups" in str(exc)
    print(f"rank {rank} ({device}): consolidate, state_dict and load_state_dict OK", flush=True)

    # -- 3. add_param_group --------------------------------------------------------------------------------------------
    plain_model, zero_model = DDP(net(), impl=impl), DDP(net(), impl=impl)
    groups = lambda model: ([p for n, p in model.module.named_parameters() if n.startswith(("0.", "2."))],  # noqa: E731
                            [p for n, p in model.module.named_parameters() if n.startswith("4.")])
    (plain_first, plain_head), (zero_first, zero_head) = groups(plain_model), groups(zero_model)
    plain = optim.SGD(plain_first, lr=0.05, momentum=0.9)
    zero = ZeroRedundancyOptimizer(zero_first, optim.SGD, lr=0.05, momentum=0.9)
    owners_before = dict(zero._param_to_rank)
    for i in range(2):
        train_step(plain_model, plain, rank, i)
        train_step(zero_model, zero, rank, i)
    plain.add_param_group({"params": plain_head, "lr": 0.2})
    zero.add_param_group({"params": zero_head, "lr": 0.2})
    assert all(zero._param_to_rank[key] == owner for key, owner in owners_before.items())
    assert len(zero.optim.param_groups) == 2 and zero.param_groups[1]["lr"] == 0.2
    for i in range(2, 5):
        train_step(plain_model, plain, rank, i)
        train_step(zero_model, zero, rank, i)
    for a, b in zip(plain_model.module.parameters(), zero_model.module.parameters()):
        assert np.array_equal(a.data, b.data)
    print(f"rank {rank} ({device}): add_param_group OK", flush=True)

    # -- 4. Join with uneven inputs ------------------------------------------------------------------------------------
    mine = 3 + rank
    for bucket_view in (False, True):
        group = RecordingGroup(world)
        model = DDP(net(), process_group=group, bucket_cap_mb=200 / 2**20, impl=impl)
        zero = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, process_group=group,
                                       parameters_as_bucket_view=bucket_view, lr=0.01)
        with Join([model, zero], divide_by_initial_world_size=False):
            for i in range(mine):
                train_step(model, zero, rank, i)
        local = net()
        local_opt = optim.Adam(local.parameters(), lr=0.01)
        replay_uneven_inputs(local, local_opt, loss_fn, batch, [3 + r for r in range(size)], device)
        assert_parameters_equal(model, local, bucket_view)
        everyone = world.allgather_object([(op, shape, dtype) for op, _name, shape, dtype, _ in group.trace])
        assert all(trace == everyone[0] for trace in everyone), "every rank issues the same collectives"
        out[f"join bucket_view={bucket_view} on {device}"] = {
            "params": [host(p.data) for p in model.module.parameters()], "trace": group.trace}
    print(f"rank {rank} ({device}): ZeRO under Join OK", flush=True)
    assert not staged_outside_comm(device), staged_outside_comm(device)

with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(out, fh)
print(f"rank {rank} ({impl}): zero scenarios OK", flush=True)
