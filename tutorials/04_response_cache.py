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
# # Horovod's response cache: negotiation that becomes one bit-vector allreduce
#
# In Horovod, every rank submits *named* tensors (`allreduce_async(grad, name="grad.3")`) whenever its
# backward produces them, in whatever order. Before anything is reduced, the ranks must agree on which tensors
# every rank has submitted, so that they all run the same collectives in the same order. A background thread
# does this every few milliseconds (a *cycle*):
#
# - **slow path**: the ranks send their lists of requests to a coordinator (rank 0), which answers with the
#   collectives to run (fusing small allreduces into one buffer);
# - **fast path**: once a tensor has been negotiated, every rank keeps the answer in a **response cache**, with
#   the same slot number (*bit*) on every rank. A rank that submits the same tensor again only says "bit 3 is
#   ready here"; a single bitwise-AND allreduce of everyone's bit vector tells every rank which cached tensors
#   are ready everywhere. No gathering of requests, no coordinator.
#
# distlab re-implements this (`distlab.collectives`, a Horovod-style front over the negotiation twins). This
# notebook watches the cache at work through `collectives.stats()`: hits, misses, invalid entries, and which
# path each cycle took.

# %%
import distlab

print("twin:", distlab.IMPL)

# %% [markdown]
# ## A training loop, iteration by iteration
#
# Each rank submits five named "gradients" per iteration, **in a different order on each rank** (rank 1
# reverses it), then waits for them. Half-way through, the model changes: at iteration 8 a new tensor appears,
# and at iteration 12 one tensor changes shape. We record the change of each counter over each iteration.

# %%
def train(iterations=18):
    import numpy as np

    from distlab import collectives as hvd

    hvd.init()
    rank = hvd.rank()
    grads = {f"grad.{i}": np.full(64 * (i + 1), rank + 1.0, dtype=np.float32)
             for i in range(5)}
    rows = []
    for it in range(iterations):
        if it == 8:
            # a new parameter: a miss, then hits
            grads["grad.new"] = np.ones(32, dtype=np.float32)
        if it == 12:
            # a changed shape: entry invalid
            grads["grad.2"] = np.ones(100, dtype=np.float32)
        names = sorted(grads) if rank == 0 else sorted(grads, reverse=True)
        before = hvd.stats()
        handles = [hvd.allreduce_async(grads[name], name=name) for name in names]
        results = [hvd.synchronize(h) for h in handles]
        after = hvd.stats()
        keys = ("cycles", "fast_path", "slow_path",
                "hits", "misses", "invalid", "requeued")
        row = {key: after[key] - before[key] for key in keys}
        # the same average on every element
        row["agreed"] = all(np.allclose(r, r.flat[0]) for r in results)
        rows.append(row)
    hvd.shutdown()
    return rows


rows = distlab.run(train, np=2)[0]
print("iter  hits misses invalid requeued  slow fast cycles")
for it, row in enumerate(rows):
    print(f"{it:4d}  {row['hits']:4d} {row['misses']:6d} {row['invalid']:7d} "
          f"{row['requeued']:8d}  "
          f"{row['slow_path']:4d} {row['fast_path']:4d} {row['cycles']:6d}")
print("every result agreed:", all(row["agreed"] for row in rows))

# %% [markdown]
# Reading the table (rank 0's counters; the exact numbers vary a little from run to run, because they depend
# on how the cycles fall between the two ranks' submissions):
#
# - **Iteration 0**: five misses. Nothing is cached yet, so the ranks negotiate through the coordinator (the
#   slow path), although they submitted the tensors in opposite orders. The responses are then cached, in the
#   same slots on both ranks.
# - **Later iterations**: hits, on the fast path: one small allreduce of a bit vector per cycle. A hit is counted
#   per *lookup*: a tensor this rank has submitted but the other rank has not yet is *requeued* (ready here, not
#   everywhere) and looked up again in the next cycle, so some iterations count more hits than tensors.
# - **Iteration 8**: `grad.new` is a miss, so the cycle takes the slow path; the coordinator's answer covers the
#   new tensor, and the cached tensors ready in the same cycle go along.
# - **Iteration 12**: `grad.2` arrives with a new shape. Its cache entry no longer matches: the lookup is
#   *invalid* (also counted as a miss), every rank erases the entry, and the tensor is renegotiated. A stale entry
#   must never be reused, or the ranks would run an allreduce with the old size.
#
# ## The hit rate, and the cache turned off
#
# `DISTLAB_CACHE_CAPACITY=0` disables the cache (Horovod's `HOROVOD_CACHE_CAPACITY=0`): every cycle then takes
# the slow path.

# %%
rows_off = distlab.run(train, np=2, env={"DISTLAB_CACHE_CAPACITY": "0"})[0]
print("cache off: slow-path cycles", sum(r["slow_path"] for r in rows_off),
      "fast-path cycles",
      sum(r["fast_path"] for r in rows_off), "hits", sum(r["hits"] for r in rows_off))

# %%
import matplotlib.pyplot as plt


def hit_rate(rs):
    # an invalid lookup is also a miss
    return [r["hits"] / max(1, r["hits"] + r["misses"]) for r in rs]


fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(hit_rate(rows), marker="o", label="cache on (capacity 1024)")
ax.plot(hit_rate(rows_off), marker="x", label="cache off (capacity 0)")
for it, label in ((8, "new tensor"), (12, "shape changed")):
    ax.axvline(it, color="grey", linestyle=":", linewidth=1)
    ax.text(it + 0.15, 0.05, label, fontsize=8, color="grey")
ax.set_ylim(-0.05, 1.05)
ax.set_xlabel("iteration")
ax.set_ylabel("cache hit rate")
ax.set_title("Response cache hits per iteration (2 ranks, 5-6 named tensors)")
ax.legend(loc="center right")
fig.tight_layout()
plt.show()

# %% [markdown]
# In steady state every tensor hits, and negotiation costs one allreduce of a few 64-bit words per cycle,
# whatever the number of tensors, instead of gathering every rank's list of names at the coordinator. That is
# why Horovod keeps the cache on by default: training repeats the same tensors every iteration.
#
# The cache is only correct if it is identical on every rank: the same entries in the same slots, evicted in
# the same order. Every rank therefore performs the same cache operations in the same order, driven by the
# responses all ranks receive, never by local events. The reference twin, `distlab.reference.response_cache`,
# is where to read how.
