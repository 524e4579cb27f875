"""Join on uneven inputs: rank r gets 3 + r batches. Generic Join semantics, DDP in both divide modes against a
local simulation, DDP + DistributedMean together, early termination, errors.

argv: impl ("reference", "core", "mixed"), output prefix (traces and final parameters per rank).
"""
import pickle
import sys

import numpy as np

import distlab
from distlab import _backend, comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.metrics import DistributedMean
from distlab.testing import RecordingGroup
from scenario_checks import (DEVICES, assert_parameters_equal, host, on, replay_uneven_inputs, staged_outside_comm,
                             start_counting, to_device)

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = impl_arg if impl_arg != "mixed" else ("reference" if rank % 2 == 0 else "core")
J = _backend.load("join", impl)
Join, JoinHook, Joinable = J.Join, J.JoinHook, J.Joinable
mine = 3 + rank
most = 3 + size - 1
out = {}


# -- 1. the generic protocol with a counting joinable ----------------------------------------------------------
class CountingHook(JoinHook):
    def __init__(self, owner, **kwargs):
        self.owner, self.kwargs = owner, kwargs

    def main_hook(self):
        self.owner.main_calls += 1
        if self.owner.talks:
            self.owner.group.allreduce(np.zeros(1))  # shadow the owner's one allreduce per iteration

    def post_hook(self, is_last_joiner):
        self.owner.post_calls.append(is_last_joiner)


class Counter(Joinable):
    def __init__(self, group, talks=True):
        super().__init__()
        self.group, self.talks, self.main_calls, self.post_calls, self.kwargs = group, talks, 0, [], None

    def step(self):
        Join.notify_join_context(self)
        x = np.ones(1)
        self.group.allreduce(x)
        return x[0]

    def join_hook(self, **kwargs):
        self.kwargs = kwargs
        return CountingHook(self, **kwargs)

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.group


first, second = Counter(world), Counter(world, talks=False)  # only `first` communicates per iteration
seen = []
with Join([first, second], answer=42):
    for i in range(mine):
        seen.append(first.step())
assert first.kwargs == {"answer": 42} == second.kwargs
assert first.main_calls == second.main_calls == most - mine, (first.main_calls, most - mine)
assert first.post_calls == second.post_calls == [rank == size - 1]
# While every rank trains, the step's allreduce sums `size` ones; after rank r ran out, the shadows add zeros.
assert seen == [float(sum(1 for r in range(size) if 3 + r > i)) for i in range(mine)], seen

# Disabled Join with even inputs: nothing is shadowed, no extra collective.
plain = Counter(world)
with Join([plain], enable=False):
    for _ in range(3):
        assert plain.step() == size
assert plain.main_calls == 0 and plain.post_calls == []

# Errors.
try:
    Join([])
    raise AssertionError("Join([]) must be refused")
except ValueError as exc:
    assert "at least one joinable" in str(exc)
other = comm.ProcessGroup(name="other")
try:
    Join([Counter(world), Counter(other)])
    raise AssertionError("two process groups must be refused")
except ValueError as exc:
    assert "different process groups" in str(exc)

# throw_on_early_termination: every rank raises; the one that ran out says so.
thrower = Counter(world)
try:
    with Join([thrower], throw_on_early_termination=True):
        for _ in range(mine):
            thrower.step()
    raise AssertionError("must raise on every rank")
except RuntimeError as exc:
    if rank == 0:
        assert "rank 0 exhausted its inputs" in str(exc), str(exc)
    else:
        assert f"rank {rank}: another rank exhausted its inputs" in str(exc), str(exc)
world.barrier()


# -- 2. DDP on uneven inputs equals a local simulation, in both divide modes ------------------------------------
def net():
    distlab.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8, seed=1), nn.Tanh(), nn.Linear(8, 2, seed=2))


def shard(r, i):
    rng = np.random.default_rng(100 * r + i)
    return (rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32))


loss_fn = nn.MSELoss()
for device, divide_initial, view in ((d, i, v) for d in DEVICES  # numpy, then the strict device stand-in
                                     for i, v in ((True, False), (False, False), (True, True), (False, True))):
    start_counting(device)
    group = RecordingGroup(world)
    model = DDP(to_device(net(), device), process_group=group, bucket_cap_mb=100 / 2**20,
                gradient_as_bucket_view=view, impl=impl)
    opt = optim.SGD(model.parameters(), lr=0.1)
    metric = DistributedMean(group)
    with Join([model, metric], divide_by_initial_world_size=divide_initial):
        for i in range(mine):
            x, y = shard(rank, i)
            opt.zero_grad()
            loss = loss_fn(model(distlab.tensor(on(device, x))), distlab.tensor(on(device, y)))
            loss.backward()
            opt.step()
            metric.update(float(loss.data))  # an explicit read: the metric takes a number
    # The local simulation: at step i the ranks with more than i batches contribute.
    local = to_device(net(), device)
    local_opt = optim.SGD(local.parameters(), lr=0.1)
    replay_uneven_inputs(local, local_opt, loss_fn, shard, [3 + r for r in range(size)], device,
                         divisor=size if divide_initial else None)
    assert_parameters_equal(model, local, divide_initial, view)
    assert metric.count == sum(3 + r for r in range(size)), metric.count
    assert not staged_outside_comm(device), staged_outside_comm(device)
    out[f"ddp divide_initial={divide_initial} view={view} on {device}"] = {
        "params": [host(p.data) for p in model.module.parameters()], "trace": group.trace}

with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(out, fh)
print(f"rank {rank} ({impl}): join scenarios OK", flush=True)
