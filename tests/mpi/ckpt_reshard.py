"""Checkpoints saved at one world size, loaded at another. argv: mode ("save" or "load"), directory, impl.

save (4 ranks), on numpy and on the device stand-in:
1. DDP + Adam after 3 steps, through get_state_dict: each replicated array is written once (one chunk each).
2. DDP + ZeroRedundancyOptimizer(Adam) after 3 steps: each parameter's state is written by its owner, through
   async_save while two more steps train (the checkpoint holds step 3, not what the steps wrote meanwhile).
3. a sharded module built by hand (dimension-0 blocks by torch's chunk rule, uneven, some ranks empty) with SGD
   momentum: get_state_dict wraps the momentum into ShardedArrays of the parameter's global shape and offsets.
4. (numpy) the Horovod-style DistributedOptimizer(Adam) after 3 steps.
Rank 0 pickles the expected whole state of 1, 2 and 4 beside the checkpoints.

load (2 or 3 ranks): a fresh model and optimizer (no optimizer state yet) load each checkpoint and hold exactly
the saved state: the replicated state, the ZeRO state with the new owners (consolidated on rank 0 and compared),
the sharded blocks and their momentum at the new split. One more step runs. A template with another shape, and a
key the checkpoint lacks, are refused on every rank naming the key.
"""
import pickle
import sys
from pathlib import Path

import numpy as np

import distlab
from distlab import ShardedArray, checkpoint, collectives as hvd, comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.errors import CheckpointException
from distlab.optim import ZeroRedundancyOptimizer
from scenario_checks import DEVICES, expect, host, on, to_device, twin_of

mode, directory, impl_arg = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
loss_fn = nn.MSELoss()
SHARDED = {"a": ((10, 3), np.float32), "b": ((5,), np.float64), "c": ((2, 4), np.float32)}


def mlp(seed):
    distlab.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def train(model, opt, device, steps, start=0):
    for i in range(start, start + steps):
        rng = np.random.default_rng(100 * rank + i)
        x = rng.standard_normal((4, 5)).astype(np.float32)
        y = rng.standard_normal((4, 3)).astype(np.float32)
        opt.zero_grad()
        loss_fn(model(distlab.tensor(on(device, x))), distlab.tensor(on(device, y))).backward()
        opt.step()


def whole_state(ddp, opt):
    """{"model": {name: array}, "optim": {name: {key: value}}} on rank 0, host copies (ZeRO consolidated)."""
    names = [name for name, _ in ddp.module.named_parameters()]
    model = {name: host(p.data) for name, p in ddp.module.named_parameters()}
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        if rank != 0:
            return None
        by_index = opt.state_dict()["state"]
    else:
        by_index = opt.state_dict()["state"]
    state = {names[i]: {k: (host(v) if hasattr(v, "shape") else v) for k, v in s.items()} for i, s in by_index.items()}
    return {"model": model, "optim": state}


class Plain:
    """A module seen as DDP is (``.module``), for whole_state."""

    def __init__(self, module):
        self.module = module


def chunk(n, parts, index):
    """torch.chunk's block ``index`` of ``n`` rows in ``parts`` (empty past the end)."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(start + step, n)


class ShardedToy(nn.Module):
    """A sharded module as fully_shard makes one: parameters hold this rank's dimension-0 block; state_dict gives
    ShardedArrays with the unsharded names."""

    def __init__(self, device):
        super().__init__()
        self.blocks = {}
        for name, (shape, dtype) in SHARDED.items():
            start, stop = chunk(shape[0], size, rank)
            whole = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
            setattr(self, name, nn.Parameter(on(device, whole[start:stop].copy())))
            self.blocks[name] = (shape, (start,) + (0,) * (len(shape) - 1))

    def state_dict(self, prefix=""):
        return {prefix + name: ShardedArray(getattr(self, name).data, *self.blocks[name]) for name in SHARDED}


def sharded_step(toy, opt, device):
    for name, (shape, dtype) in SHARDED.items():
        start, stop = chunk(shape[0], size, rank)
        grad = np.cos(np.arange(np.prod(shape))).astype(dtype).reshape(shape)[start:stop]
        getattr(toy, name).grad = distlab.tensor(on(device, grad))
    opt.step()


def expected_sharded(name):
    """The whole parameter and momentum after sharded_step at any world size (elementwise, so the same)."""
    shape, dtype = SHARDED[name]
    grad = np.cos(np.arange(np.prod(shape))).astype(dtype).reshape(shape)
    whole = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
    return whole - dtype(0.5) * grad, grad


def save_all(device):
    ddp = DDP(to_device(mlp(0), device), impl=impl)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    train(ddp, opt, device, 3)
    model_sd, optim_sd = checkpoint.get_state_dict(ddp, opt)
    metadata = checkpoint.save({"model": model_sd, "optim": optim_sd, "step": 3}, directory / f"ddp-{device}")
    for fqn, item in metadata["items"].items():
        assert item["kind"] == "object" or len(item["chunks"]) == 1, (fqn, item["chunks"])  # written once
    written = sum(info["size"] for info in metadata["files"].values())
    expected = sum(p.data.nbytes for p in ddp.parameters()) * 3  # parameters, exp_avg, exp_avg_sq
    assert expected <= written < expected + 4096, (written, expected)
    reference = whole_state(ddp, opt)

    zddp = DDP(to_device(mlp(1), device), impl=impl)
    zero = ZeroRedundancyOptimizer(zddp.parameters(), optimizer_class=optim.Adam, lr=0.01)
    train(zddp, zero, device, 3)
    model_sd, optim_sd = checkpoint.get_state_dict(zddp, zero)
    owned = {name for name, s in optim_sd["state"].items() if s}
    assert len(owned) < len(list(zddp.parameters())), owned  # a shard only
    zero_reference = whole_state(zddp, zero)
    future = checkpoint.async_save({"model": model_sd, "optim": optim_sd}, directory / f"zero-{device}")
    train(zddp, zero, device, 2, start=3)  # the arrays change while the files are written: the save holds step 3
    assert future.wait(120)["generation"] == 1

    toy = ShardedToy(device)
    sgd = optim.SGD(toy.parameters(), lr=0.5, momentum=0.9)
    sharded_step(toy, sgd, device)
    model_sd, optim_sd = checkpoint.get_state_dict(toy, sgd)
    for name in SHARDED:
        momentum = optim_sd["state"][name]["momentum_buffer"]
        assert isinstance(momentum, ShardedArray) and momentum.global_shape == SHARDED[name][0], momentum
    checkpoint.save({"model": model_sd, "optim": optim_sd}, directory / f"sharded-{device}")
    horovod_reference = None
    if device == "cpu":
        net = mlp(2)
        hopt = hvd.DistributedOptimizer(optim.Adam(net.parameters(), lr=0.01),
                                        named_parameters=net.named_parameters())
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        train(net, hopt, device, 3)
        model_sd, optim_sd = checkpoint.get_state_dict(net, hopt)
        checkpoint.save({"model": model_sd, "optim": optim_sd}, directory / "horovod")
        horovod_reference = whole_state(Plain(net), hopt.optimizer)
    if rank == 0:
        with open(directory / f"reference-{device}.pkl", "wb") as fh:
            pickle.dump({"ddp": reference, "zero": zero_reference, "horovod": horovod_reference}, fh)


def assert_state(ddp, opt, reference, what):
    got = whole_state(ddp, opt)
    if got is None:
        return
    for name, value in reference["model"].items():
        assert np.array_equal(got["model"][name], value), (what, name)
    assert set(got["optim"]) == set(reference["optim"]), (what, set(got["optim"]), set(reference["optim"]))
    for name, state in reference["optim"].items():
        for key, value in state.items():
            assert np.array_equal(np.asarray(got["optim"][name][key]), np.asarray(value)), (what, name, key)


def load_all(device):
    with open(directory / f"reference-{device}.pkl", "rb") as fh:
        reference = pickle.load(fh)
    ddp = DDP(to_device(mlp(7), device), impl=impl)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    model_sd, optim_sd = checkpoint.get_state_dict(ddp, opt)
    assert all(state == {} for state in optim_sd["state"].values())  # nothing yet: empty slots to fill
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    checkpoint.load(state, directory / f"ddp-{device}")
    checkpoint.set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 3
    assert_state(ddp, opt, reference["ddp"], "ddp")
    train(ddp, opt, device, 1, start=3)

    zddp = DDP(to_device(mlp(8), device), impl=impl)
    zero = ZeroRedundancyOptimizer(zddp.parameters(), optimizer_class=optim.Adam, lr=0.01)
    model_sd, optim_sd = checkpoint.get_state_dict(zddp, zero)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, directory / f"zero-{device}")
    checkpoint.set_state_dict(zddp, zero, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_state(zddp, zero, reference["zero"], "zero")
    train(zddp, zero, device, 1, start=3)

    if device == "cpu":
        net = mlp(9)
        hopt = hvd.DistributedOptimizer(optim.Adam(net.parameters(), lr=0.01),
                                        named_parameters=net.named_parameters())
        model_sd, optim_sd = checkpoint.get_state_dict(net, hopt)
        state = {"model": model_sd, "optim": optim_sd}
        checkpoint.load(state, directory / "horovod")
        checkpoint.set_state_dict(net, hopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert_state(Plain(net), hopt.optimizer, reference["horovod"], "horovod")
        train(net, hopt, device, 1, start=3)

    toy = ShardedToy(device)
    sgd = optim.SGD(toy.parameters(), lr=0.5, momentum=0.9)
    model_sd, optim_sd = checkpoint.get_state_dict(toy, sgd)
    assert all(isinstance(s, checkpoint.ShardedSlot) for s in optim_sd["state"].values()), optim_sd["state"]
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, directory / f"sharded-{device}")
    checkpoint.set_state_dict(toy, sgd, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, (shape, _) in SHARDED.items():
        start, stop = chunk(shape[0], size, rank)
        param, momentum = expected_sharded(name)
        assert np.array_equal(host(getattr(toy, name).data), param[start:stop]), (name, rank)
        assert np.array_equal(host(sgd.state[getattr(toy, name)]["momentum_buffer"]), momentum[start:stop]), name
    sharded_step(toy, sgd, device)

    bad = {"model": {"0.weight": np.zeros((16, 6), np.float32)}}
    expect(CheckpointException, lambda: checkpoint.load(bad, directory / f"ddp-{device}"),
           "'model.0.weight' does not match the checkpoint", "float32[16, 6]", "float32[16, 5]")
    expect(CheckpointException, lambda: checkpoint.load({"nothing": np.zeros(1)}, directory / f"ddp-{device}"),
           "Missing key in checkpoint state_dict: nothing", f"rank {rank}")


hvd.init()
for device in DEVICES:
    if mode == "save":
        save_all(device)
    else:
        load_all(device)
hvd.shutdown()
print(f"ckpt_reshard {mode} done", flush=True)
