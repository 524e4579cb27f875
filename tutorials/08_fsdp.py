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
# # Fully sharded data parallel: each rank keeps a shard
#
# DDP keeps a whole copy of the model, its gradients and the optimizer's state on every rank. `fully_shard`
# keeps 1/N of each, and gathers a block's parameters only while the block computes. This notebook measures
# the memory each rank holds against DDP's, watches one step's collectives group by group, and shows hybrid
# sharding across two hosts, where only shards cross the link. The docs' "Fully sharded data parallel" page
# walks through the code.

# %%
import distlab

print("twin:", distlab.IMPL)

# %% [markdown]
# ## Memory per rank
#
# A model of 8 blocks of Linear(256, 256), Adam in float32: 16 bytes a parameter (4 of parameter, 4 of
# gradient, 8 of Adam's two moments). Each rank measures, with `tracemalloc` (which sees numpy's arrays),
# the most memory a training step holds, for DDP and for `fully_shard` with `reshard_after_forward=False`
# (ZeRO-2: the gathered parameters stay until backward ends) and `True` (ZeRO-3: freed after forward,
# gathered again for backward). A one-row batch keeps the activations negligible.

# %%
def peak_memory():
    import tracemalloc

    import numpy as np

    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.fsdp import fully_shard

    def model(kind):
        distlab.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)]
        net = nn.Sequential(*blocks)
        if kind == "DDP":
            return DistributedDataParallel(net, bucket_cap_mb=25)
        for block in net:
            fully_shard(block, reshard_after_forward=(kind == "ZeRO-3"))
        return fully_shard(net)

    x = distlab.tensor(np.ones((1, 256), dtype=np.float32))
    peaks = {}
    for kind in ("DDP", "ZeRO-2", "ZeRO-3"):
        net = model(kind)  # built (and its modules imported) before measuring
        opt = optim.Adam(net.parameters(), lr=1e-3)
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            opt.zero_grad()
            (net(x) ** 2).mean().backward()
            opt.step()
        peaks[kind] = (tracemalloc.get_traced_memory()[1] - start) / 2**20
        tracemalloc.stop()
    params = sum(p.global_shape[0] * np.prod(p.global_shape[1:], dtype=int)
                 for p in net.parameters())
    return {"peaks": peaks, "params": int(params), "size": comm.world().size}


runs = distlab.run(peak_memory, np=2)
params, size = runs[0]["params"], runs[0]["size"]
formula = {"DDP": 16 * params, "ZeRO-2": 4 * params + 12 * params / size,
           "ZeRO-3": 16 * params / size}
print(f"{params:,} parameters, {size} ranks")
for kind, peak in runs[0]["peaks"].items():
    print(f"{kind:>6}: peak {peak:5.2f} MiB on rank 0, "
          f"ZeRO's formula {formula[kind] / 2**20:5.2f} MiB")

# %% [markdown]
# The peaks count what ZeRO's formula counts, plus what a step needs for a moment. DDP's gradients are also
# copied into its buckets; a sharded step also holds one block's whole parameters and gradients, and the flat
# buffers its collectives use (reused from block to block). Adam's state, the largest part, is created by the
# first step: every rank keeps only its shard's.

# %%
import matplotlib.pyplot as plt

kinds = list(runs[0]["peaks"])
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(range(3), [runs[0]["peaks"][k] for k in kinds], color="#6a8caf",
       label="measured peak")
ax.scatter(range(3), [formula[k] / 2**20 for k in kinds], color="black", zorder=3,
           label="ZeRO's formula")
ax.set_xticks(range(3))
ax.set_xticklabels(kinds)
ax.set_ylabel("MiB per rank")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## One step, group by group
#
# Two blocks, each its own group, and the root (the head). A timeline records a step on two ranks; the
# sequence diagram shows the collectives. In forward, each group is all-gathered before it computes, the root
# first; in backward, the blocks are gathered again in reverse order (the root kept its parameters: it is the
# first backward needs) and each group's reduce-scatter follows its backward.

# %%
import tempfile
from pathlib import Path


def one_step():
    import numpy as np

    from distlab import comm, nn, optim
    from distlab.fsdp import fully_shard
    from distlab.timeline import get_timeline

    distlab.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                        nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))
    for block in (net[0], net[1]):
        fully_shard(block)
    model = fully_shard(net)
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    for step in range(2):
        if step == 1:  # the first step also checks the model across ranks
            comm.world().barrier()
            get_timeline().instant("step", lane="scenario")
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    get_timeline().instant("step end", lane="scenario")
    return [tuple(p.shape) for p in model.parameters()]


trace_path = str(Path(tempfile.mkdtemp()) / "fsdp.json")
shapes = distlab.run(one_step, np=2, env={"DISTLAB_TIMELINE": trace_path})
print("rank 0's shards:", shapes[0])
print("rank 1's shards:", shapes[1])

# %% [markdown]
# Each rank holds 2 of each block's 4 rows, and the head's single row lives on rank 0 (rank 1's shard of it is
# empty: torch's chunk rule gives ceil(1 / 2) = 1 row to each rank until the rows run out).

# %%
from distlab import viz
from distlab.timeline import merge

merge(trace_path)
trace = viz.load_trace(trace_path)
viz.plot_sequence(trace, window=("step", "step end"),
                  title="One ZeRO-3 step on two ranks")
plt.show()

# %% [markdown]
# The same step as a timeline: on the `fsdp` lane each group's forward and backward computation and the copies
# in and out of the flat buffers; on the `comm` lanes the collectives, from issue to completion. A prefetched
# all-gather (the next group's in forward, the previous group's in backward) and the reduce-scatter in flight are
# drawn under the computation they overlap.

# %%
viz.plot_timeline(trace, ranks=[0], window=("step", "step end"),
                  title="rank 0: one ZeRO-3 step")
plt.show()

# %% [markdown]
# ## Collective counts: torch's
#
# For N blocks and a root, FSDP2 issues N+1 all-gathers in forward; in backward N+1 reduce-scatters, and N
# all-gathers by default, N+1 with `reshard_after_forward=True`, none with False. A recording process group
# counts them, for N = 3.

# %%
def counts():
    import numpy as np

    from distlab import comm, nn, optim
    from distlab.fsdp import fully_shard
    from distlab.testing import RecordingGroup

    out = {}
    for reshard in (None, True, False):
        distlab.manual_seed(0)
        group = RecordingGroup(comm.world())
        blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
        net = nn.Sequential(*blocks, nn.Linear(4, 1))
        for block in list(net)[:3]:
            fully_shard(block, group=group, reshard_after_forward=reshard)
        model = fully_shard(net, group=group, reshard_after_forward=reshard)
        opt = optim.SGD(model.parameters(), lr=0.1)
        x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
        for _ in range(2):
            group.trace.clear()
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        ops = [op for op, *_ in group.trace]
        out[str(reshard)] = (ops.count("allgather"), ops.count("reduce_scatter"))
    return out


for reshard, (gathers, scatters) in distlab.run(counts, np=2)[0].items():
    print(f"reshard_after_forward={reshard:>5}: {gathers} all-gathers "
          f"(4 in forward), {scatters} reduce-scatters")

# %% [markdown]
# ## Hybrid sharding across hosts
#
# Across hosts, the link is the bottleneck. A 2-D mesh `(hosts, ranks per host)` shards within each host and
# replicates across hosts: the all-gathers and reduce-scatters stay on the host, and each rank all-reduces only
# its reduced gradient shard with the rank holding the same shard on the other host. The figures below were
# measured on distlab's virtual cluster (two network namespaces joined by a link, `python -m distlab
# cluster`): 4 ranks, 2 per host, 3 steps of 4 blocks of Linear(128, 128), the bytes each host sent on its
# link per step (from the link's byte counter), for hybrid sharding, flat sharding over the 4 ranks and DDP.
# The cell after them measures yours (it needs root).

# %%
import json


def stored_figures(name="tutorial_08_hybrid.json"):
    """The figures stored in the docs tree (docs/_data), found from distlab's sources."""
    for folder in Path(distlab.__file__).resolve().parents:
        if (folder / "docs" / "_data" / name).exists():
            return json.loads((folder / "docs" / "_data" / name).read_text())
    raise FileNotFoundError(f"docs/_data/{name}: run this from a distlab checkout")


def show(figures):
    for kind, sent in figures["link MB per step and host"].items():
        print(f"{kind:>7}: {sent:6.3f} MB per step and host")
    print(f"the shards' payload: {figures['shards MB']:.3f} MB")


stored = stored_figures()
print(f"measured {stored['date']} on {stored['machine']}, by: {stored['command']}")
show(stored)

# %% tags=["skip-execution"]
import os
import subprocess
import sys

if os.geteuid() != 0:
    raise PermissionError("the virtual cluster needs root: run this notebook as root")
script = Path(distlab.__file__).resolve().parents[2] / "tests" / "mpi" / "fsdp_hybrid.py"
env = {**os.environ, "DISTLAB_CLUSTER_NAME": "dltut08"}
try:  # 4 ranks placed in blocks: ranks 0 and 1 on the first host, 2 and 3 on the second
    command = [sys.executable, "-m", "distlab", "run", "-n", "4", "--cluster", "2"]
    job = subprocess.run(command + [str(script), "core"], capture_output=True, text=True,
                         env=env)
finally:
    down = [sys.executable, "-m", "distlab", "cluster", "down", "--name", "dltut08"]
    subprocess.run(down)
print(job.stdout)

# %% [markdown]
# Hybrid sharding sends each host's two shards of the gradient once per step, the whole gradient, as DDP's
# allreduce does; flat sharding over the four ranks sends far more, since every all-gather crosses the link.
# Hybrid keeps a copy of the model per host (half of DDP's memory here), in exchange for the bytes.

# %%
figures = stored["link MB per step and host"]
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.barh(list(figures), list(figures.values()), color="#6aa56a")
ax.axvline(stored["shards MB"], color="black", linestyle=":", linewidth=1)
ax.set_xlabel("MB sent on the link per step and host")
fig.tight_layout()
plt.show()
