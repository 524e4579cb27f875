"""FSDP when a rank is missing or the input is bad: every wait gives up naming the group's collective and the
missing rank, bad input is refused on every rank, and the step's timeline has its lanes.

argv: impl ("reference", "core" or "mixed"). Run on 3 ranks with a timeline (the test reads its lanes):

1. the last rank skips a forward: the others' all-gather of the first group times out naming it
   ("fsdp all-gather <root>": the root gathers first) and the missing rank; the same for a skipped backward (a reduce-scatter or the
   backward's all-gather, named by its group);
2. bad input, refused on every rank before anything is sent or changed: a whole state dict broadcast from rank 0
   that lacks a key or has another shape, a rank's block that is not its own, a whole parameter of another shape (checked before any is loaded);
3. after the errors the ranks are in step: a step trains.
"""
import sys

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.errors import DistTimeoutError
from distlab.fsdp import StateDictOptions, fully_shard, get_model_state_dict, set_model_state_dict
from scenario_checks import expect, twin_of

impl = twin_of(comm.world().rank, sys.argv[1])
world = comm.world()
rank, last = world.rank, world.size - 1
loss_fn = nn.MSELoss()


def build(group=None):
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(net[0], group=group, impl=impl)
    return fully_shard(net, group=group, impl=impl)


def batch():
    rng = np.random.default_rng(rank)
    return (distlab.tensor(rng.standard_normal((4, 6)).astype(np.float32)),
            distlab.tensor(rng.standard_normal((4, 3)).astype(np.float32)))


def step(model, opt):
    x, y = batch()
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


# -- 1. a missing rank: the wait names the group's collective and the rank ----------------------------------------
for where in ("forward", "backward"):
    group = comm.ProcessGroup(name=f"fsdp {where} timeout", timeout=1.0)
    model = build(group)
    opt = optim.SGD(model.parameters(), lr=0.1)
    step(model, opt)  # every rank: the model is checked and the groups initialised
    x, y = batch()
    if rank != last:
        def run():
            out = model(x)
            if where == "backward":
                loss_fn(out, y).backward()
        exc = expect(DistTimeoutError, run, "fsdp ", f"ranks [{last}] have not entered it")
        assert exc.missing_ranks == [last], exc
        if where == "forward":
            assert exc.name == "fsdp all-gather <root>" and exc.op == "allgather", (exc.name, exc.op, str(exc))
        else:
            assert exc.name.split()[1] in ("all-gather", "reduce-scatter"), (exc.name, str(exc))
    elif where == "backward":
        model(x)  # the last rank runs forward only
    world.barrier()
print(f"rank {rank}: timeouts name the collective and the missing rank", flush=True)

# -- 2. bad input, refused on every rank ----------------------------------------------------------------------------
model = build()
opt = optim.SGD(model.parameters(), lr=0.1)
step(model, opt)
whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
before = {k: v.copy() for k, v in whole.items()}
broadcast = StateDictOptions(broadcast_from_rank0=True)
lacking = {k: v for k, v in whole.items() if k != "2.bias"} if rank == 0 else {}
expect(RuntimeError, lambda: set_model_state_dict(model, lacking, options=broadcast), "rank 0's state dict",
       "lacks '2.bias'")
reshaped = dict(whole, **{"0.weight": np.zeros((6, 6), np.float32)}) if rank == 0 else {}
expect(RuntimeError, lambda: set_model_state_dict(model, reshaped, options=broadcast), "rank 0's state dict",
       "'0.weight' of shape (6, 6), the model's is (7, 6)")
shards = model.state_dict()
moved = dict(shards, **{"0.weight": distlab.ShardedArray(np.zeros((0, 6), np.float32), (7, 6), (7, 0))})
expect(RuntimeError, lambda: model.load_state_dict(moved), "0.weight: the saved block at offsets (7, 0)",
       "is not this rank's block", "distlab.checkpoint")
zeroed = {k: np.zeros_like(v) for k, v in whole.items()}  # loaded in key order, "0.weight" would come first
expect(RuntimeError, lambda: model.load_state_dict(dict(zeroed, **{"2.weight": np.zeros((2, 7), np.float32)})),
       "size mismatch for 2.weight")
after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
assert all(np.array_equal(before[k], after[k]) for k in before), "a refused load changed nothing"
set_model_state_dict(model, whole if rank == 0 else {}, options=broadcast)  # a good one loads
print(f"rank {rank}: bad state dicts refused on every rank", flush=True)

# -- 3. still in step -------------------------------------------------------------------------------------------------
step(model, opt)
print(f"rank {rank}: fsdp faults OK", flush=True)
