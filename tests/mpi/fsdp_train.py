"""FSDP (``distlab.fsdp.fully_shard``) on 2, 3 or 4 ranks against DDP, on numpy and the device stand-in.

argv: impl ("reference", "core" or "mixed": even ranks reference, odd ranks core), output prefix. Each rank writes
<prefix>.rank<N>.pkl: per configuration, the final parameters (the full state dict), the losses and the collective
trace, so the test compares twins and devices bit for bit and trace for trace. Checked here, on every rank:

1. training equals DDP's (losses and parameters; bit for bit on 2 ranks, where any order of two addends is one
   sum; within float64 rounding on 3 and 4) for ZeRO-3, the default, ZeRO-2 and reshard_after_forward=2;
   ZeRO-2 equals ZeRO-3 bit for bit; the collectives per step are torch's counts for N blocks and a root;
2. every distlab optimizer steps the sharded parameters as it steps DDP's;
3. accumulation with set_requires_gradient_sync(False) equals DDP's no_sync;
4. mixed precision: all-gathers in param_dtype, reduce-scatters in reduce_dtype, float32 shards stepped;
5. hybrid sharding (4 ranks, a 2 x 2 mesh) equals flat sharding;
6. state dicts: shards with their global shape and offsets, a full state dict equal to DDP's, loading either;
7. uneven inputs under Join equal DDP under Join (both divide factors);
8. bad input raises the same error on every rank, and the ranks stay usable;
9. (2 ranks) torch's own fully_shard, recorded by tests/data/make_fsdp_torch.py: the same losses and parameters
   within float32 rounding, and the same number of all-gathers and reduce-scatters per step.
"""
import copy
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.fsdp import (DeviceMesh, MixedPrecisionPolicy, StateDictOptions, fully_shard, get_model_state_dict,
                          set_model_state_dict)
from distlab.testing import RecordingGroup
from distlab import _backend
from scenario_checks import DEVICES, expect, host, on, staged_outside_comm, start_counting, to_device, twin_of

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
Join = _backend.load("join", impl).Join
loss_fn = nn.MSELoss()
results = {}


class Block(nn.Module):
    def __init__(self, fan_in, fan_out, seed):
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out, seed=seed)

    def forward(self, x):
        return self.fc(x).tanh()


class Net(nn.Module):
    """Three blocks (7 rows: uneven shards on 4 ranks) and a root-owned head (3 rows: rank 3 holds none)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(6, 7, 1), Block(7, 6, 2), Block(6, 6, 3)])
        self.head = nn.Linear(6, 3, seed=4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(device, dtype=np.float32):
    distlab.manual_seed(0)
    net = Net()
    for p in net.parameters():
        p.data = p.data.astype(dtype)
    return to_device(net, device)


def shard(net, group=None, **kwargs):
    for block in net.blocks:
        fully_shard(block, group=group, impl=impl, **kwargs)
    return fully_shard(net, group=group, impl=impl, **kwargs)


def batch(step, r, device, dtype=np.float32):
    rng = np.random.default_rng(1000 * step + r)
    x = rng.standard_normal((4, 6)).astype(dtype)
    y = rng.standard_normal((4, 3)).astype(dtype)
    return distlab.tensor(on(device, x)), distlab.tensor(on(device, y))


def step(model, opt, x, y):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return float(host(loss.data))


def full_params(model):
    """Every parameter, whole, by name (FSDP: the full state dict gathered on every rank)."""
    if isinstance(model, DDP):
        return {k: host(v) for k, v in model.module.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: host(v) for k, v in full.items()}


def same(a, b, what, exact):
    for key in a:
        if exact:
            assert np.array_equal(a[key], b[key]), (what, key, np.abs(a[key] - b[key]).max())
        else:
            assert np.allclose(a[key], b[key], rtol=1e-12, atol=1e-14), (what, key, np.abs(a[key] - b[key]).max())


def count(trace, op, kind=None):
    return sum(1 for t in trace if t[0] == op and (kind is None or kind in str(t[1])))


def train_pair(device, dtype, steps=3, fsdp_kwargs=None, opt_cls=optim.Adam, opt_kwargs=None, group=None):
    """DDP and FSDP from the same weights on the same data: returns (ddp losses, fsdp losses, models, trace of
    FSDP's last step)."""
    opt_kwargs = opt_kwargs or dict(lr=0.01)
    ddp = DDP(build(device, dtype), impl=impl)
    recording = RecordingGroup(world) if group is None else group
    model = shard(build(device, dtype), group=recording, **(fsdp_kwargs or {}))
    od, of = opt_cls(ddp.parameters(), **opt_kwargs), opt_cls(model.parameters(), **opt_kwargs)
    ld, lf = [], []
    for s in range(steps):
        x, y = batch(s, rank, device, dtype)
        ld.append(step(ddp, od, x, y))
        if s == steps - 1:
            trace = recording.trace if group is None else group.trace
            trace.clear()
        lf.append(step(model, of, x, y))
    trace = list(recording.trace if group is None else group.trace)
    return ld, lf, ddp, model, trace


for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    exact = size == 2
    # -- 1. equals DDP; ZeRO-2 == ZeRO-3; torch's collective counts --------------------------------------------------
    modes = {"zero3": True, "default": None, "zero2": False}
    if size == 4:
        modes["k2"] = 2
    per_mode = {}
    for mode, raf in modes.items():
        dtype = np.float32 if exact else np.float64
        ld, lf, ddp, model, trace = train_pair(device, dtype, fsdp_kwargs=dict(reshard_after_forward=raf))
        assert np.allclose(ld, lf, rtol=1e-12) and (ld == lf or not exact), (mode, ld, lf)
        params = full_params(model)
        same(full_params(ddp), params, mode, exact)
        n = len(model.blocks)
        forward_ag, backward_ag = n + 1, {True: n + 1, None: n, False: 0, 2: n + 1}[raf]
        assert count(trace, "allgather") == forward_ag + backward_ag, (mode, trace)
        assert count(trace, "reduce_scatter") == n + 1, (mode, trace)
        assert all(t[0] in ("allgather", "reduce_scatter") for t in trace), (mode, trace)
        for p in model.parameters():  # the optimizer stepped the shards, in their own dtype
            assert p.data.dtype == dtype and p.data.shape[0] <= -(-p.global_shape[0] // size), (mode, p.data.shape)
        per_mode[mode] = params
        results[f"{device}:{mode}"] = dict(params=params, losses=lf, trace=trace)
    same(per_mode["zero2"], per_mode["zero3"], "zero2 == zero3", True)
    print(f"rank {rank} ({device}): fully_shard equals DDP, ZeRO-2 == ZeRO-3, torch's counts", flush=True)

    # -- 2. every optimizer steps the shards as it steps DDP's parameters ----------------------------------------------
    for opt_cls, kw in ((optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)), (optim.AdamW, dict(lr=0.01)),
                        (optim.Adagrad, dict(lr=0.1)), (optim.RMSprop, dict(lr=0.01, momentum=0.5)),
                        (optim.Adadelta, dict(lr=1.0)), (optim.Adamax, dict(lr=0.01)), (optim.Rprop, dict(lr=0.01))):
        dtype = np.float32 if exact else np.float64
        ld, lf, ddp, model, _ = train_pair(device, dtype, steps=2, opt_cls=opt_cls, opt_kwargs=kw)
        same(full_params(ddp), full_params(model), opt_cls.__name__, exact)
        results[f"{device}:{opt_cls.__name__}"] = dict(params=full_params(model), losses=lf, trace=[])
    print(f"rank {rank} ({device}): every optimizer steps the shards", flush=True)

    # -- 3. accumulation without communication == DDP's no_sync --------------------------------------------------------
    dtype = np.float32 if exact else np.float64
    ddp = DDP(build(device, dtype), impl=impl)
    recording = RecordingGroup(world)
    model = shard(build(device, dtype), group=recording)
    od, of = optim.SGD(ddp.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        od.zero_grad()
        of.zero_grad()
        for micro in range(3):
            x, y = batch(10 * s + micro, rank, device, dtype)
            if micro < 2:
                with ddp.no_sync():
                    loss_fn(ddp(x), y).backward()
            else:
                loss_fn(ddp(x), y).backward()
            model.set_requires_gradient_sync(micro == 2)
            recording.trace.clear()
            loss_fn(model(x), y).backward()
            assert count(recording.trace, "reduce_scatter") == (4 if micro == 2 else 0), recording.trace
        od.step()
        of.step()
    same(full_params(ddp), full_params(model), "accumulation", exact)
    results[f"{device}:accumulation"] = dict(params=full_params(model), losses=[], trace=list(recording.trace))
    # microbatches that each reduce, the reductions waited for at the last backward only (set_is_last_backward)
    ddp = DDP(build(device, dtype), impl=impl)
    model = shard(build(device, dtype))
    model.set_requires_gradient_sync(True)
    od, of = optim.SGD(ddp.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=0.1)
    od.zero_grad()
    of.zero_grad()
    for micro in range(3):
        x, y = batch(20 + micro, rank, device, dtype)
        loss_fn(ddp(x), y).backward()
        model.set_is_last_backward(micro == 2)
        loss_fn(model(x), y).backward()
    od.step()
    of.step()
    ours = full_params(model)  # DDP adds each averaged gradient in .grad before the next average: other rounding
    for key, value in full_params(ddp).items():
        assert np.allclose(value, ours[key], rtol=1e-5, atol=1e-7), ("set_is_last_backward", key)
    print(f"rank {rank} ({device}): set_requires_gradient_sync(False) equals no_sync", flush=True)

    # -- 4. mixed precision ------------------------------------------------------------------------------------------
    for name, policy in (("fp16", MixedPrecisionPolicy(param_dtype=np.float16)),
                         ("fp16_reduce32", MixedPrecisionPolicy(param_dtype=np.float16, reduce_dtype=np.float32)),
                         ("bf16", MixedPrecisionPolicy(param_dtype="bfloat16"))):
        ld, lf, ddp, model, trace = train_pair(device, np.float32, fsdp_kwargs=dict(mp_policy=policy))
        ag = {t[3] for t in trace if t[0] == "allgather"}
        rs = {t[3] for t in trace if t[0] == "reduce_scatter"}
        assert ag == {str(policy.param_dtype)}, (name, ag)
        assert rs == {str(policy.reduce_dtype or policy.param_dtype)}, (name, rs)
        assert all(p.data.dtype == np.float32 for p in model.parameters()), name
        assert np.allclose(ld, lf, atol=0.05), (name, ld, lf)
        results[f"{device}:{name}"] = dict(params=full_params(model), losses=lf, trace=trace)
    print(f"rank {rank} ({device}): mixed precision", flush=True)

    # -- 5. hybrid sharding == flat sharding (4 ranks: 2 replicas x 2 shards) ----------------------------------------
    if size == 4:
        recording = RecordingGroup(world)
        mesh = DeviceMesh((2, 2), ("replicate", "shard"), group=recording)
        model = shard(build(device, np.float64), group=mesh)
        of = optim.Adam(model.parameters(), lr=0.01)
        lh = []
        for s in range(3):
            if s == 2:
                recording.trace.clear()
            lh.append(step(model, of, *batch(s, rank, device, np.float64)))
        trace = list(recording.trace)
        n = len(model.blocks)
        assert count(trace, "allgather") == 2 * n + 1 and count(trace, "reduce_scatter") == n + 1, trace
        assert count(trace, "allreduce") == n + 1, trace  # each group's reduced row, among its replicas
        _, lf, _, flat, _ = train_pair(device, np.float64)
        assert np.allclose(lh, lf, rtol=1e-12), (lh, lf)
        same(full_params(flat), full_params(model), "hybrid", False)
        assert all(p.data.shape[0] <= -(-p.global_shape[0] // 2) for p in model.parameters())
        results[f"{device}:hybrid"] = dict(params=full_params(model), losses=lh, trace=trace)
        print(f"rank {rank} ({device}): hybrid sharding equals flat sharding", flush=True)

    # -- 6. state dicts ----------------------------------------------------------------------------------------------
    assert staged_outside_comm(device) == {}, staged_outside_comm(device)  # training never stages through the host
    ld, lf, ddp, model, _ = train_pair(device, np.float32, steps=2)
    sharded, gathered = model.state_dict(), full_params(model)
    for key, value in sharded.items():
        whole = gathered[key]
        assert isinstance(value, distlab.ShardedArray) and value.global_shape == whole.shape, key
        rows = -(-whole.shape[0] // size)
        assert value.offsets[0] == min(rank * rows, whole.shape[0]), (key, value.offsets)
        assert np.array_equal(host(value.local), whole[value.slices()]), key
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (set(full) == set(sharded)) if rank == 0 else full == {}, (rank, list(full))
    fresh = shard(build(device))  # from DDP's whole arrays
    fresh.load_state_dict(ddp.module.state_dict())
    same(full_params(ddp), full_params(fresh), "load full", True)
    again = shard(build(device))  # from the shards
    again.load_state_dict(model.state_dict())
    same(gathered, full_params(again), "load sharded", True)
    last = shard(build(device))  # rank 0's whole arrays, broadcast
    set_model_state_dict(last, full_params(ddp) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    same(full_params(ddp), full_params(last), "broadcast from rank 0", True)
    x, y = batch(7, rank, device)  # training goes on alike
    assert step(ddp, optim.SGD(ddp.parameters(), lr=0.1), x, y) == step(last, optim.SGD(last.parameters(), lr=0.1),
                                                                        x, y) or not exact
    print(f"rank {rank} ({device}): state dicts", flush=True)
    start_counting(device)  # cpu_offload copied to the host, and rank 0 loaded host arrays, on purpose

    # -- 7. uneven inputs under Join == DDP under Join ---------------------------------------------------------------
    for divide_by_initial in (True, False):
        ddp = DDP(build(device, np.float64), impl=impl)
        recording = RecordingGroup(world)
        model = shard(build(device, np.float64), group=recording)
        od, of = optim.Adam(ddp.parameters(), lr=0.01), optim.Adam(model.parameters(), lr=0.01)
        batches = 2 + rank
        with ddp.join(divide_by_initial_world_size=divide_by_initial):
            for s in range(batches):
                step(ddp, od, *batch(s, rank, device, np.float64))
        with model.join(optimizer=of, divide_by_initial_world_size=divide_by_initial):
            for s in range(batches):
                step(model, of, *batch(s, rank, device, np.float64))
        same(full_params(ddp), full_params(model), f"join {divide_by_initial}", False)
        assert count(recording.trace, "reduce_scatter") == 4 * (1 + size), recording.trace
        results[f"{device}:join_{divide_by_initial}"] = dict(params=full_params(model), losses=[],
                                                             trace=list(recording.trace))
    print(f"rank {rank} ({device}): uneven inputs under Join equal DDP's", flush=True)
    model = shard(build(device))  # the last rank has no input at all: nothing to replay, every rank says so
    opt = optim.SGD(model.parameters(), lr=0.1)

    def train_unevenly():
        with model.join(optimizer=opt):
            for s in range(0 if rank == size - 1 else 2):
                step(model, opt, *batch(s, rank, device))

    expect(RuntimeError, train_unevenly, f"ranks [{size - 1}] joined before training one iteration")

    # -- 8. errors, the same on every rank -----------------------------------------------------------------------------
    net = shard(build(device))
    expect(RuntimeError, lambda: fully_shard(net, impl=impl), "can only be applied to a module once")
    expect(AssertionError, lambda: copy.deepcopy(net), "FSDP does not support deepcopy", "state dict")
    expect(ValueError, lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)]), impl=impl),
           "containers that do not implement forward")
    expect(ValueError, lambda: fully_shard(build(device), reshard_after_forward=size + 1, impl=impl),
           f"should be a factor of {size}")
    tie = build(device)
    tie.blocks[0].extra = tie.blocks[2].fc  # one Linear reachable from two blocks
    fully_shard(tie.blocks[2], impl=impl)
    expect(ValueError, lambda: fully_shard(tie.blocks[0], impl=impl), "shared with a parameter already managed",
           "fully_shard([module_a, module_b])")
    odd = build(device)
    if rank == size - 1:
        odd.head = to_device(nn.Linear(6, 4, seed=4), device)  # this rank's model differs
    shard(odd)
    expect(ValueError, lambda: odd(batch(0, rank, device)[0]), "differ across ranks", f"ranks [{size - 1}]",
           "before the first all-gather")
    part = world.new_group([0])
    partial = build(device)
    shard(partial, group=part)  # rank 0 shards over itself, the others over the world
    expect(ValueError, lambda: partial(batch(0, rank, device)[0]), "FSDP shards over every rank of the world")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine = shard(build(device))  # the ranks are still in step: training works after the errors
        step(fine, optim.SGD(fine.parameters(), lr=0.1), *batch(0, rank, device))
    print(f"rank {rank} ({device}): errors on every rank", flush=True)

    # -- 9. torch's fully_shard, recorded ------------------------------------------------------------------------------
    if size == 2:
        record = np.load(Path(__file__).resolve().parent.parent / "data" / "fsdp_torch.npz")
        for config, raf in (("zero3", True), ("default", None), ("zero2", False)):
            net = build(device)
            for name, p in net.named_parameters():
                p.data[...] = on(device, record[f"weights/{name}"])
            recording = RecordingGroup(world)
            model = shard(net, group=recording, reshard_after_forward=raf)
            opt = optim.Adam(model.parameters(), lr=0.01)
            for s in range(3):
                rng = np.random.default_rng([7, s, rank])
                x, y = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
                recording.trace.clear()
                loss = step(model, opt, distlab.tensor(on(device, x)), distlab.tensor(on(device, y)))
                assert np.isclose(loss, record[f"{config}/r{rank}/loss{s}"], rtol=1e-5), (config, s, loss)
            for kind in ("allgather", "reduce_scatter"):
                assert count(recording.trace, kind) == int(record[f"{config}/r{rank}/{kind}"]), (config, kind)
            for name, value in full_params(model).items():
                assert np.allclose(value, record[f"{config}/r{rank}/{name}"], rtol=1e-5, atol=1e-6), (config, name)
        print(f"rank {rank} ({device}): torch's fully_shard (recorded, {record['torch_version']}) trains alike",
              flush=True)

    assert staged_outside_comm(device) == {}, staged_outside_comm(device)

with open(f"{prefix}.rank{rank}.pkl", "wb") as f:
    pickle.dump(results, f)
print(f"rank {rank}: fsdp scenario done", flush=True)
