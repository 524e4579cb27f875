"""Elastic training that loses a rank and goes on in the same processes (Open MPI, ``--fault-tolerance``).
argv: impl, mode, commit directory, fork directory, output prefix, buckets ("tiny": one parameter a bucket, each
its own MPI allreduce; "auto": DDP's default, the whole model in one bucket reduced in the shared-memory arena),
device ("cpu": numpy; "cuda": the strict device stand-in, distlab.fakegpu), and optionally "hook": DDP reduces
through ``allreduce_hook`` (over its group), which the DDP rebuilt on the survivors keeps.

- mode ``kill:RANKS:STEP``: rank RANK (or the ranks RANKS, comma-separated: a host's ranks, the first killing the
  others with itself, all at once) is SIGKILLed in the middle of DDP's backward of step STEP (a gradient hook
  kills it when its first gradient arrives, right after DDP's own hook); the survivors' step fails with ProcessFailedError,
  elastic.train shrinks the world, rebuilds DDP on it, rolls back to the last commit (kept in memory; also written
  to the commit directory), re-splits the sampler and goes on. The first reset copies the commit directory, the
  commit the survivors rolled back to, to the fork directory.
- mode ``from``: a job started at the smaller world size from the fork directory's commit, to the end.

The model has a counting part and a floating-point part. Counting: weight[i] of a linear layer on one-hot rows
grows by exactly 1 each time sample i is applied (loss scaled so that DDP's average is the sum over ranks, SGD
with lr 1), so at the end it must be all EPOCHS: no committed sample lost, none repeated. Floating point: a small
linear layer on fixed random features, whose parameters the test compares bit for bit between the two modes.
Every rank writes its parameters, its recoveries and its reset count to ``<prefix>.rank<r>.pkl`` (r: its rank in
the world the job started with).
"""
import os
import pickle
import shutil
import signal
import sys

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.collectives import elastic
from distlab.ddp import DistributedDataParallel as DDP
from distlab.ddp_comm_hooks import allreduce_hook
from scenario_checks import host, on, to_device, twin_of

impl_arg, mode, commits, fork, prefix, buckets, device = sys.argv[1:8]
HOOK = sys.argv[8:] == ["hook"]  # DDP reduces through a communication hook (allreduce_hook, over DDP's group)
FIRST_RANK = int(os.environ["RANK"])
N, FEATURES, BATCH, EPOCHS = 44, 6, 3, 2
EYE = np.eye(N, dtype=np.float32)
X = np.random.default_rng(7).standard_normal((N, FEATURES)).astype(np.float32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = nn.Linear(N, 1, bias=False)
        self.fc = nn.Linear(FEATURES, 3)

    def forward(self, onehot, x):
        return self.count(onehot), self.fc(x)


distlab.manual_seed(11)
model = Net()
model.count.weight.data[...] = 0
model = to_device(model, device)
ddp = DDP(model, impl=twin_of(FIRST_RANK, impl_arg), **({"bucket_cap_mb": 1e-6} if buckets == "tiny" else {}))
if HOOK:
    ddp.register_comm_hook(ddp.process_group, allreduce_hook)
opt = optim.SGD(ddp.parameters(), lr=1.0)
sampler = elastic.ElasticSampler(N, shuffle=True, seed=3)
state = elastic.ModelState(ddp, opt, sampler=sampler, checkpoint_dir=commits if mode.startswith("kill") else fork,
                           epoch=0, batch=0, steps=0)
resets = []


def on_reset() -> None:
    world = comm.world()
    resets.append(world.size)
    if mode.startswith("kill") and len(resets) == 1 and world.rank == 0:
        shutil.copytree(os.path.join(commits, "commit"), os.path.join(fork, "commit"))
    world.barrier()


state.register_reset_callbacks([on_reset])


VICTIMS = [int(r) for r in mode.split(":")[1].split(",")] if mode.startswith("kill") else []
# every rank's pid: the first victim kills the others with itself, at once (a host's processes lost together)
PIDS = comm.world().allgather_object(os.getpid()) if VICTIMS else []


def die(_param) -> None:
    sys.stdout.flush()
    for victim in VICTIMS[1:]:
        os.kill(PIDS[victim], signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def step(ddp, indices) -> None:
    state.steps += 1
    if mode.startswith("kill"):
        at = mode.split(":")[2]
        if state.steps == int(at) and FIRST_RANK == VICTIMS[0] and not resets:
            for param in model.parameters():  # the first gradient to arrive kills it
                param.register_post_accumulate_grad_hook(die)
    size = ddp.process_group.size
    if HOOK:  # carried over to the DDP rebuilt on the survivors, with its group
        assert ddp.reducer.comm_hook is allreduce_hook and ddp.reducer.comm_hook_state is ddp.process_group
    opt.zero_grad()
    counted, features = ddp(on(device, distlab.tensor(EYE[indices])), on(device, distlab.tensor(X[indices])))
    error = features - 0.5
    (counted.sum() * (-float(size)) + (error * error).sum() * 0.01).backward()
    opt.step()


elastic.train(state, step, epochs=EPOCHS, batch_size=BATCH, commit_every=2)
counts = host(model.count.weight.data)[0]
assert np.array_equal(counts, np.full(N, float(EPOCHS))), (FIRST_RANK, counts)
world = comm.world()
with open(f"{prefix}.rank{FIRST_RANK}.pkl", "wb") as fh:
    pickle.dump({"rank": world.rank, "size": world.size, "resets": resets, "recoveries": state.recoveries,
                 "params": {name: host(p.data) for name, p in model.named_parameters()}}, fh)
print(f"elastic_shrink {mode} done: rank {FIRST_RANK} -> {world.rank} of {world.size}, resets {resets}", flush=True)
