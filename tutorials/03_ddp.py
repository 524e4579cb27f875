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
# # DDP: gradient buckets reduced while backward runs
#
# `DistributedDataParallel` wraps a model so that `backward()` leaves every rank with the average of all
# ranks' gradients. Its reducer packs gradients into *buckets* and starts each bucket's allreduce as soon as
# the bucket is full, while backward is still computing the earlier layers. This notebook:
#
# 1. checks the promise: DDP on two half-batches gives the gradients of one full batch;
# 2. looks at the buckets, before and after the one-time rebuild in gradient-arrival order;
# 3. draws the **overlap timeline**: each gradient's arrival and each bucket's allreduce, per rank;
# 4. shows what happens when a parameter gets no gradient on one rank;
# 5. compares bucket sizes across a network link, round by round, and what the default, `"auto"`,
#    picks (figures stored from a measured run; one cell, not run by the docs, measures yours).
#
# The docs' "DDP reducer" page walks through the code this runs.

# %%
import numpy as np

import distlab
from distlab import nn

print("twin:", distlab.IMPL)

# %% [markdown]
# ## 1. Two half-batches = one full batch
#
# Each rank gets half of a batch of 8 examples. After `backward()` the gradients are averaged over ranks, and
# since the loss is a mean over examples, the average of two half-batch gradients is the full-batch gradient.
# We compare with a plain, single-process backward on the whole batch.

# %%
def make_model():
    from distlab import nn

    distlab.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


rng = np.random.default_rng(0)
X, Y = rng.standard_normal((8, 4)), rng.standard_normal((8, 1))


def gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False


DEVICE = "cuda" if gpu_present() else "cpu"
if DEVICE == "cuda":
    print("DDP runs on the GPU (cupy; the two ranks share GPU 0 if there is only one)")
else:
    print("DDP runs on the CPU: no GPU here (with cupy and a GPU, it runs there)")


def ddp_gradients(device):
    import os

    from distlab import nn
    from distlab.autograd import to_numpy
    from distlab.data import DistributedSampler
    from distlab.ddp import DistributedDataParallel

    xp = np
    if device == "cuda":
        import cupy as xp

        xp.cuda.Device(int(os.environ["RANK"]) % xp.cuda.runtime.getDeviceCount()).use()
    model = DistributedDataParallel(make_model().to(device))
    # rank r takes examples r, r + 2, r + 4, ...
    mine = DistributedSampler(len(X), shuffle=False).indices()
    x, y = distlab.tensor(xp.asarray(X[mine])), distlab.tensor(xp.asarray(Y[mine]))
    nn.MSELoss()(model(x), y).backward()
    # host copies of the gradients
    return {name: to_numpy(p.grad.data) for name, p in model.module.named_parameters()}


per_rank = distlab.run(ddp_gradients, args=(DEVICE,), np=2)

local = make_model()
nn.MSELoss()(local(distlab.tensor(X)), distlab.tensor(Y)).backward()
for name, p in local.named_parameters():
    same_on_ranks = np.array_equal(per_rank[0][name], per_rank[1][name])
    close = np.allclose(per_rank[0][name], p.grad.data, rtol=1e-5, atol=1e-7)
    print(f"{name:10s} identical on both ranks: {same_on_ranks}   "
          f"equals the full-batch gradient: {close}")

# %% [markdown]
# Identical on both ranks, bit for bit: both ranks received the same allreduce result. Equal to the full batch
# up to rounding: the sum is taken in a different order.
#
# ## 2. The buckets
#
# With a small `bucket_cap_mb`, the model's parameters fall into several buckets. DDP builds them in *reverse*
# registration order (the last layer's gradients are ready first), then, after the first iteration, rebuilds
# them once in the order the gradients actually arrived, with a small first bucket so communication starts
# early. Rank 0's layout is broadcast so that every rank reduces the same buckets in the same order.

# %%
def bucket_layouts():
    from distlab import nn, optim
    from distlab.ddp import DistributedDataParallel

    # about 4 KB per bucket
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.004)
    names = [name for name, _ in model.module.named_parameters()]
    opt = optim.SGD(model.parameters(), lr=0.01)
    layouts = []
    for step in range(3):
        layouts.append([[names[i] for i in bucket]
                        for bucket in model.reducer.get_logging_data()["bucket_indices"]])
        opt.zero_grad()
        nn.MSELoss()(model(distlab.tensor(X)), distlab.tensor(Y)).backward()
        opt.step()
    return layouts


layouts = distlab.run(bucket_layouts, np=2)[0]
print("before the first iteration:", layouts[0])
print("after the rebuild:         ", layouts[2])

# %% [markdown]
# ## 3. The overlap timeline
#
# Now a larger model (six 256-wide layers, about 1.6 MB of gradients) in buckets of about 0.4 MB, trained for a
# few steps with `DISTLAB_TIMELINE` set. The reducer records, per rank, a mark when each gradient arrives (lane
# `reducer grads`) and a span from each bucket's launch to its completion (lane `reducer buckets`).

# %%
def traced_training(steps=6):
    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel

    pg = comm.world()
    distlab.manual_seed(1)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(256, 1)),
                                    bucket_cap_mb=0.4)
    opt = optim.SGD(model.parameters(), lr=0.001)
    rng = np.random.default_rng(pg.rank)
    x, y = rng.standard_normal((128, 256)), rng.standard_normal((128, 1))
    for _ in range(steps):
        opt.zero_grad()
        nn.MSELoss()(model(distlab.tensor(x)), distlab.tensor(y)).backward()
        opt.step()
    n_buckets = len(model.reducer.get_logging_data()["bucket_indices"])
    return n_buckets, len(model.reducer.params)


# %%
import os
import tempfile

from distlab import viz
from distlab.timeline import merge

trace_path = os.path.join(tempfile.mkdtemp(prefix="distlab-ddp-"), "ddp.json")
runs = distlab.run(traced_training, np=2, env={"DISTLAB_TIMELINE": trace_path})
n_buckets, n_params = runs[0]
merge(trace_path)
trace = viz.load_trace(trace_path)
print(f"{n_params} parameters in {n_buckets} buckets; "
      f"{len(trace.events)} events in {trace_path}")

# %% [markdown]
# We draw the last iteration with `distlab.viz.plot_bucket_overlap`: per rank, backward as a bar from the
# iteration's first gradient to its last (a tick per gradient), each bucket's allreduce below it, and the end of
# backward as a dotted line; time is measured from that rank's first gradient of the iteration.

# %%
import matplotlib.pyplot as plt

viz.plot_bucket_overlap(trace)
plt.show()

# %% [markdown]
# Every bucket whose red span starts left of the dotted line was reduced while backward was still computing:
# that is the overlap DDP's buckets exist for. (A span ends when the rank *sees* the allreduce complete, which
# happens only inside an MPI call: each gradient hook calls `comm.progress()`, and `finalize_backward` waits. A
# span ending exactly at a gradient mark was found complete by that hook.)
#
# The last bucket can only start after the last gradient, so its allreduce is the part of communication that
# backward cannot hide. Smaller buckets shorten that tail but pay an allreduce's fixed cost more often:
# `bucket_cap_mb` is that trade-off. Open the trace file in https://ui.perfetto.dev to see the same events
# interactively, with the `comm world` lane showing the collectives themselves.
#
# ## 4. A parameter that gets no gradient
#
# A model whose forward skips a layer on one rank (here rank 1 never uses `head_a`): that layer's hook never
# fires there, its bucket never completes, and the ranks' collectives no longer match. DDP cannot guess; with
# `find_unused_parameters=True` it walks the graph each iteration to find such parameters, contributes zeros for
# them, and agrees with the other ranks on which were unused everywhere.

# %%
def skipping_a_layer(find_unused):
    from distlab import comm, nn
    from distlab.ddp import DistributedDataParallel

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head_a = nn.Linear(8, 1)
            self.head_b = nn.Linear(8, 1)

        def forward(self, x, skip_a):
            h = self.body(x).tanh()
            return self.head_b(h) if skip_a else self.head_a(h) + self.head_b(h)

    pg = comm.world()
    distlab.manual_seed(0)
    model = DistributedDataParallel(TwoHeads(), find_unused_parameters=find_unused)
    out = {}
    try:
        for step in range(2):
            model.zero_grad()
            # rank 1 never uses head_a
            loss = model(distlab.tensor(X[:4]), skip_a=(pg.rank == 1)).sum()
            loss.backward()
        grad = model.module.head_a.weight.grad.data.ravel()[:3]
        out["head_a.weight grad"] = [round(float(v), 4) for v in grad]
    except RuntimeError as exc:
        out["error"] = str(exc)
    return out


print("find_unused_parameters=True:")
for rank, result in enumerate(distlab.run(skipping_a_layer, args=(True,), np=2)):
    print(f"  rank {rank}: {result}")

# %% [markdown]
# Both ranks hold the same `head_a` gradient: rank 0's, averaged with rank 1's zeros.
#
# Without `find_unused_parameters`, rank 1 waits for `head_a`'s gradient forever: its bucket never completes, so
# it never launches the allreduce that rank 0 is waiting for. Rank 1's next forward notices that the previous
# reduction never finished and raises an error naming the parameters that got no gradient; rank 0's wait times
# out (we set `DISTLAB_TIMEOUT` to 3 s) with an error naming rank 1. Both are caught above and returned:

# %%
results = distlab.run(skipping_a_layer, args=(False,), np=2, env={"DISTLAB_TIMEOUT": "3"})
for rank, result in enumerate(results):
    print(f"rank {rank}: {result.get('error', result)}\n")

# %% [markdown]
# ## 5. Bucket size against overlap, across a link
#
# On one machine the ranks' allreduce is a memory copy, done by the same cores that compute backward. Across a
# network link the bytes travel at the link's rate, and a bucket's allreduce can run while backward computes the
# next gradients, but only if the bucket is ready early: PyTorch's default layout (`bucket_cap_mb=25`: a 1 MiB
# first bucket, then 25 MiB) puts most of a 6 MB model in a bucket that is ready only when backward ends, and
# the link waits until then. Smaller buckets start the wire early, at a fixed cost per bucket. The effect is
# largest where computing and moving the bytes take about as long, so that one can hide the other; where the
# wire takes far longer than backward, no layout hides much of it, and where it takes far less, there is little
# to hide. distlab's default, `bucket_cap_mb="auto"`, lets the reducer choose: it records when gradients arrive
# in the first iteration, probes the link's latency, bandwidth and how much communication slows computation on
# this machine, and picks the cap its cost model predicts fastest (the "DDP reducer" docs page explains the
# model).
#
# distlab's virtual cluster (`python -m distlab cluster`) puts two "hosts" on this machine in network
# namespaces joined by a link shaped to a chosen rate, and runs the ranks across them over TCP. The function
# below measures DDP steps per bucket cap, one rank per host, for a model of 24 `Linear(256, 256)` (6 MB of
# gradients) at a batch of 256, large enough that backward takes about as long as the model's allreduce at
# 1 Gbit/s. It needs root and takes about a minute, so this page shows what it measured on the development
# machine, stored with the command, the machine and the date in `docs/_data/tutorial_03_bucket_caps.json`; the
# cell after them runs it live (as root). Every round's figure is kept, so the spread from round to round shows
# beside the median.

# %%
import json
from pathlib import Path

CAPS = ("auto", "25", "4", "1")


def steps_per_bucket_cap(caps=CAPS, layers=24, batch=256, rounds=9, warmup=3):
    """Per round, the slower rank's time (ms) of one DDP step per bucket cap, of the
    local step, and of the model's allreduce alone; and the cap auto chose. Steps
    interleave round by round, so a slow spell of the machine hits every cap alike."""
    import time

    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel

    pg = comm.world()

    def mlp():
        distlab.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])

    rng = np.random.default_rng(pg.rank)
    x = distlab.tensor(rng.standard_normal((batch, 256), dtype=np.float32))
    y = distlab.tensor(rng.standard_normal((batch, 256), dtype=np.float32))

    def trainer(model):
        opt = optim.SGD(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad()
            nn.MSELoss()(model(x), y).backward()
            opt.step()
        return step

    def cap_mb(cap):
        return cap if cap == "auto" else int(cap)

    models = {cap: DistributedDataParallel(mlp(), bucket_cap_mb=cap_mb(cap))
              for cap in caps}
    steps = {"local": trainer(mlp())}
    steps.update({cap: trainer(model) for cap, model in models.items()})
    gradients = np.ones(sum(p.data.size for p in mlp().parameters()), dtype=np.float32)
    steps["allreduce"] = lambda: pg.allreduce(gradients)
    times = {key: [] for key in steps}
    # warm-up rounds first: DDP rebuilds its buckets after iteration 1 (auto chooses)
    for round_ in range(warmup + rounds):
        for key, step in steps.items():
            pg.barrier()
            start = time.perf_counter()
            step()
            if round_ >= warmup:
                times[key].append(round((time.perf_counter() - start) * 1e3, 2))
    per_rank = pg.allgather_object(times)
    slowest = {key: [max(r[key][i] for r in per_rank) for i in range(rounds)]
               for key in times}
    chosen = models["auto"].reducer.get_logging_data()["bucket_cap_bytes"]
    return {"rounds": slowest, "auto cap MB": round(chosen / 2**20, 2)}


def stored_figures(name="tutorial_03_bucket_caps.json"):
    """The figures stored in the docs tree (docs/_data), found from distlab's sources."""
    for folder in Path(distlab.__file__).resolve().parents:
        if (folder / "docs" / "_data" / name).exists():
            return json.loads((folder / "docs" / "_data" / name).read_text())
    raise FileNotFoundError(f"docs/_data/{name}: run this from a distlab checkout")


def summary(rounds):
    """Median, lowest and highest of a list of round times."""
    ordered = sorted(rounds)
    return ordered[len(ordered) // 2], ordered[0], ordered[-1]


def quartiles(rounds):
    """The middle half of a list of round times: its first and third quartiles."""
    ordered = sorted(rounds)
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def show(results):
    for rate, r in results.items():
        median = {key: summary(times)[0] for key, times in r["rounds"].items()}
        print(f"link {rate}: local step {median['local']:.1f} ms, allreduce alone "
              f"{median['allreduce']:.1f} ms, auto chose {r['auto cap MB']:.2g} MiB")
        for cap in CAPS:
            mid, low, high = summary(r["rounds"][cap])
            print(f"  cap {cap:>4}: median {mid:6.1f} ms, "
                  f"rounds {low:.1f} to {high:.1f} ms")
        best = min(CAPS, key=lambda cap: median[cap])
        worst = max(CAPS, key=lambda cap: median[cap])
        apart = quartiles(r["rounds"][worst])[0] > quartiles(r["rounds"][best])[1]
        ratio = median[worst] / median[best]
        overlap = "do not overlap: beyond" if apart else "overlap: within"
        verdict = f"the middle halves of their rounds {overlap} the noise"
        print(f"  slowest cap {worst} is {ratio:.2f}x the fastest, {best}: {verdict}")


stored = stored_figures()
print(f"measured {stored['date']} on {stored['machine']}")
print(f"by: {stored['command']}")
results = stored["results"]
show(results)

# %% [markdown]
# To measure on your machine, run the next cell as root (the page does not run it: the docs show the same
# figures wherever they are built). It brings up a two-host virtual cluster per link rate, measures, takes the
# cluster down, and writes the figures to `bucket_caps.json` in the notebook's folder, in the stored file's
# format; the figure below then draws yours.

# %% tags=["skip-execution"]
import os
import time

from distlab import cluster


def in_a_thread(fn, *args, **kwargs):
    """Run ``fn`` in a thread of its own: the cluster tool drives netlink through an
    asyncio loop, which cannot run inside the notebook kernel's own loop (a fresh thread
    has none)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


if os.geteuid() != 0:
    raise PermissionError("the virtual cluster needs root: run this notebook as root")
results = {}
try:
    for rate in ("1gbit", "10gbit"):
        in_a_thread(cluster.up, 2, rate, "dltut03")
        runs = in_a_thread(distlab.run, steps_per_bucket_cap, np=2, cluster="dltut03")
        results[rate] = runs[0]
finally:
    in_a_thread(cluster.down, "dltut03")
mine = {**stored, "date": time.strftime("%Y-%m-%d"), "machine": "this machine",
        "results": results}
Path("bucket_caps.json").write_text(json.dumps(mine, indent=1))
show(results)

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(results), figsize=(9, 3.4))
for ax, (rate, r) in zip(axes, results.items()):
    medians, lows, highs = zip(*(summary(r["rounds"][cap]) for cap in CAPS))
    ax.bar(range(len(CAPS)), medians, color=["#6aa56a"] + ["#e07b5f"] * 3,
           edgecolor="black", linewidth=0.5, label="median step")
    ax.errorbar(range(len(CAPS)), medians,
                yerr=[[m - lo for m, lo in zip(medians, lows)],
                      [hi - m for m, hi in zip(medians, highs)]],
                fmt="none", ecolor="black", capsize=4, linewidth=1,
                label="lowest to highest round")
    floor = max(summary(r["rounds"]["local"])[0], summary(r["rounds"]["allreduce"])[0])
    ax.axhline(floor, color="black", linestyle=":", linewidth=1, label="floor")
    ax.set_xticks(range(len(CAPS)))
    labels = [f"auto, default\n({r['auto cap MB']:.2g} MiB)"]
    labels += [f"{c} MiB" for c in CAPS[1:]]
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("DDP step, ms")
    ax.set_title(f"link {rate}: local step {summary(r['rounds']['local'])[0]:.0f} ms, "
                 f"allreduce {summary(r['rounds']['allreduce'])[0]:.0f} ms", fontsize=9)
axes[0].legend(fontsize=7, loc="lower left")
fig.tight_layout()
plt.show()

# %% [markdown]
# The dotted line is the floor, max(local step, allreduce alone): neither computing nor moving the bytes can be
# hidden entirely behind the other. Each bar is a cap's median step, its whisker the lowest to the highest of
# its rounds; the lines printed above say, per link, whether the middle halves of the slowest and the fastest
# cap's rounds overlap. Read the bars with those lines: where they say "beyond the noise", the bucket size
# matters on that link; where they say "within the noise", this run cannot tell the caps apart.
#
# What to look for on the slow link: where the wire takes about as long as backward, it helps when it starts
# early, and PyTorch's big second bucket (the rest of the model, under its 25 MiB cap) leaves it idle until
# backward ends, so small buckets win by up to the time backward takes. That needs a core free to move the bytes
# while backward computes: the link is TCP through the kernel, copied by the same cores that train, so on a
# machine whose cores are busy with other work (the stored run's was: see its `machine` line) the wire waits
# for the CPU whatever the layout, and the caps come out within the noise of one another. The overlap
# benchmark's recorded run on a quiet machine (the docs' benchmarks page, "The step against the floor", 26 MB at
# 2.5 Gbit/s) shows the effect clearly: PyTorch's 25 MiB layout pays far more over the floor than 1 MiB buckets
# there. On the fast link the allreduce is short and costs CPU that this 2-core machine also needs for backward,
# so the caps differ little. `auto` picks a cap from its measurements on every rank alike; the
# choice, with the prediction for every candidate, is in `model.reducer.get_logging_data()["auto_bucket_cap"]`.
# Across a network, `model._register_fused_optim(optim.SGD, lr=...)` also moves the optimizer's update into the
# overlap: each bucket's parameters are updated as soon as it is reduced (the docs' benchmarks page measures it).
#
# The overlap benchmark (`benchmarks/bench_overlap.py`) measures the same on a 26 MB model at three link
# rates, both twins, with and without `gradient_as_bucket_view`; the docs' benchmarks page shows its table.
