# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Join: training on uneven inputs
#
# Two ranks train with DDP, but rank 0 has 4 batches and rank 1 only 2. This notebook shows what goes wrong
# without Join, how `with model.join():` fixes it, and, from a timeline, the collectives a rank that ran out
# issues to keep the others company. The docs' "Join" page walks through the code.

# %%
import distlab

print("twin:", distlab.IMPL)

# %% [markdown]
# ## Without Join: the rank with more data waits for a partner that left
#
# Rank 1 finishes its 2 batches and returns. Rank 0 starts its third backward pass, whose bucket allreduce has
# no partner. We give the ranks a 3-second `DISTLAB_TIMEOUT` so that the wait ends with an error, and catch it.

# %%
def train(batches_per_rank, use_join, divide_by_initial_world_size=True):
    import numpy as np

    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.errors import DistTimeoutError

    pg = comm.world()
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001)  # tiny: two buckets
    opt = optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(pg.rank)
    batches = [(rng.standard_normal((4, 4)), rng.standard_normal((4, 1)))
               for _ in range(batches_per_rank[pg.rank])]

    def loop():
        for x, y in batches:
            opt.zero_grad()
            nn.MSELoss()(model(distlab.tensor(x)), distlab.tensor(y)).backward()
            opt.step()

    try:
        if use_join:
            with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
                loop()
        else:
            loop()
    except DistTimeoutError as exc:
        return {"error": str(exc)}
    return {"weights": [p.data.copy() for p in model.module.parameters()]}


results = distlab.run(train, args=([4, 2], False), np=2, env={"DISTLAB_TIMEOUT": "3"})
print("rank 0:", results[0].get("error", "finished"))
print("rank 1:", results[1].get("error", "finished"))

# %% [markdown]
# Rank 1 finished and left; rank 0's allreduce of `bucket0` timed out, and the error says why: rank 1 never
# entered it. (Without the timeout, the classic outcome is a silent hang.)
#
# ## With Join
#
# The same training inside `with model.join():`. When rank 1 runs out, it does not leave: in `Join.__exit__` it
# shadows each of rank 0's remaining iterations, allreducing zeros in place of gradients, until every rank has
# run out. Then every rank takes the final model from the last rank to finish.

# %%
import numpy as np

results = distlab.run(train, args=([4, 2], True), np=2)
same = all(np.array_equal(a, b)
           for a, b in zip(results[0]["weights"], results[1]["weights"]))
print("both ranks finished; final models identical:", same)

# %% [markdown]
# ## What the ranks did: the collectives, side by side
#
# Every rank must issue the same collectives in the same order (same operation, same size), or MPI would match
# unrelated calls. We run the Join training again with `DISTLAB_DEBUG=DETAIL`, which compares a fingerprint of
# every collective across the ranks before running it and raises on any difference: the run finishing is the
# proof that rank 1's shadowing matched rank 0's training call for call. A timeline records the calls.

# %%
import os
import tempfile

from distlab import viz
from distlab.timeline import merge

trace_path = os.path.join(tempfile.mkdtemp(prefix="distlab-join-"), "join.json")
distlab.run(train, args=([4, 2], True), np=2,
            env={"DISTLAB_TIMELINE": trace_path, "DISTLAB_DEBUG": "DETAIL"})
merge(trace_path)
trace = viz.load_trace(trace_path)
# the collectives matched across ranks by sequence number;
# DETAIL's own fingerprint checks left out
calls = [c for c in trace.collectives() if "DETAIL" not in c.name]
print("DETAIL found no mismatch. The collectives, each issued by ranks",
      sorted({c.ranks for c in calls}))
for c in calls:
    print(f"#{c.seq:<3d} {c.name}")

# %% [markdown]
# After DDP's start-up (checking the model, broadcasting rank 0's weights), each iteration is: Join's
# notification (`join: ranks still training`: rank 1 adds 1 while it trains, 0 once it has joined), the
# gradient-sync flag, then one allreduce per bucket (iteration 2 also broadcasts the buckets rebuilt in arrival
# order). From the third iteration on, rank 1 issues the same calls from its join hook, with zeros. The last
# `join: ranks still training` sums to 0: everyone has joined. Then the ranks agree on the last joiner
# (`join: common rank`) and broadcast its final model.
#
# The same as a sequence diagram, from rank 1's third notification on (when it had no data left): one lifeline
# per rank, time downwards, each collective a band across the ranks that took part, and the notes Join records
# on the `join` lane of a rank that has joined.

# %%
import matplotlib.pyplot as plt

notifications = [c for c in calls if c.name == "allreduce join: ranks still training"]
viz.plot_sequence(trace, window=(notifications[2].start, None), notes=("join",),
                  collectives=lambda c: "DETAIL" not in c.name,
                  names={0: "rank 0 (4 batches)", 1: "rank 1 (2 batches)"},
                  title="Rank 1 has run out of data: it shadows rank 0's collectives")
plt.show()

# %% [markdown]
# ## What the joined rank contributes: the divide factor
#
# In the shadowed iterations only rank 0 has gradients; rank 1 adds zeros. `divide_by_initial_world_size`
# decides what the sum is divided by: the world size (2, the default: late steps are half as large, as if rank 1
# contributed zero gradients) or the number of ranks still training (1: each step is the average over the ranks
# that had data). The two choices end in different models:

# %%
by_world = distlab.run(train, args=([4, 2], True, True), np=2)[0]["weights"]
by_active = distlab.run(train, args=([4, 2], True, False), np=2)[0]["weights"]
print("final models differ:",
      not all(np.allclose(a, b) for a, b in zip(by_world, by_active)))
print("largest difference in a weight:",
      max(float(np.abs(a - b).max()) for a, b in zip(by_world, by_active)))

# %% [markdown]
# ## More joinables: SyncBatchNorm and ZeroRedundancyOptimizer
#
# DDP is not the only thing that talks to the other ranks every iteration. A `SyncBatchNorm` layer allreduces
# its batch statistics in forward (sum, sum of squares, count per channel) and its gradient sums in backward, so
# that every rank normalises with the statistics of the global batch. A `ZeroRedundancyOptimizer` keeps each
# parameter's optimizer state on one rank only, and broadcasts the updated parameters after each step.
#
# First the model with SyncBatchNorm, under `model.join()` as before: DDP is shadowed, the batch-norm layer is
# not. Rank 0's third forward pass waits in the statistics allreduce for rank 1, which has joined and is
# shadowing DDP's collectives only. (PyTorch's SyncBatchNorm is not joinable: there this hangs.)

# %%
def train_bn(batches_per_rank, joinables):
    import numpy as np

    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.errors import DistTimeoutError
    from distlab.join import Join
    from distlab.optim import ZeroRedundancyOptimizer

    pg = comm.world()
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    model = DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(net))
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, lr=0.01)
    rng = np.random.default_rng(pg.rank)
    batches = [(rng.standard_normal((4, 4)), rng.standard_normal((4, 1)))
               for _ in range(batches_per_rank[pg.rank])]
    members = {"ddp": [model],
               "all": [model, *nn.SyncBatchNorm.layers_in(model), opt]}[joinables]
    try:
        with Join(members):
            for x, y in batches:
                opt.zero_grad()
                nn.MSELoss()(model(distlab.tensor(x)), distlab.tensor(y)).backward()
                opt.step()
    except DistTimeoutError as exc:
        return {"error": str(exc)}
    return {"state": {k: v.copy() for k, v in model.module.state_dict().items()}}


results = distlab.run(train_bn, args=([4, 2], "ddp"), np=2, env={"DISTLAB_TIMEOUT": "3"})
print("rank 0:", results[0].get("error", "finished"))

# %% [markdown]
# The error names the collective (`SyncBatchNorm forward statistics`) and the rank that never entered it.
#
# Now every joinable in one Join: the model first (its forward is where an iteration starts, so it issues Join's
# count), then the batch-norm layers, then the optimizer. A rank that ran out contributes zero counts to the
# statistics, so the ranks still training normalise with the batches that exist; it steps its own shard of the
# optimizer state with the gradients DDP's shadowing leaves it, and takes part in every broadcast.

# %%
results = distlab.run(train_bn, args=([4, 2], "all"), np=2)
states = [r["state"] for r in results]
print("both ranks finished; identical models, running statistics included:",
      all(np.array_equal(states[0][k], states[1][k]) for k in states[0]))
print("batches tracked by the batch-norm layer:", int(states[0]["1.num_batches_tracked"]))
