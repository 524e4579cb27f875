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
# # Checkpoints and restarts: a rank killed during training
#
# Two ranks train with DDP. Every third step they save a checkpoint of everything the next step depends on.
# Halfway through, rank 1 is killed with SIGKILL, as a crashed machine would be. The launcher stops rank 0,
# starts both again (`max_restarts=1`), and the new processes carry on from the last checkpoint. This notebook:
#
# 1. trains once without a failure and once with the kill, and compares the two loss curves;
# 2. looks at a checkpoint's files and metadata;
# 3. flips one byte of a checkpoint and watches every rank refuse it;
# 4. loads the 2-rank checkpoint on one rank;
# 5. shows the other recovery, without a restart: the survivors shrink the world and go on.
#
# The docs' "Checkpoints and restarts" page explains the file layout, what is atomic, and what a restart costs.

# %%
import tempfile
from pathlib import Path

import numpy as np

import distlab

print("twin:", distlab.IMPL)
workdir = Path(tempfile.mkdtemp(prefix="tutorial09-"))

# %% [markdown]
# ## Training that resumes from its checkpoints
#
# `checkpoint.TrainState` bundles the model, the optimizer, the sampler's position, every random generator
# (the model has dropout) and counters (the step, the losses so far). A run that starts loads the newest
# checkpoint there is. The kill happens only in the first attempt: `DISTLAB_RESTART_COUNT` says which
# attempt this is.

# %%
def train(kill_at, directory, steps=12, every=3):
    import os
    import signal

    from distlab import checkpoint, comm, nn, optim
    from distlab.data import DistributedSampler
    from distlab.ddp import DistributedDataParallel

    rank = comm.world().rank
    attempt = int(os.environ.get("DISTLAB_RESTART_COUNT", "0"))
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2, seed=rank),
                        nn.Linear(16, 1))
    model = DistributedDataParallel(net)
    opt = optim.Adam(model.parameters(), lr=0.05)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((96, 4)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    sampler = DistributedSampler(len(x), shuffle=True, seed=1)
    state = checkpoint.TrainState(model, opt, sampler=sampler, step=0, epoch=0, losses=[])
    saved = sorted((int(p.name[5:]) for p in Path(directory).glob("step-*")),
                   reverse=True)
    if saved:
        checkpoint.load({"train": state}, Path(directory) / f"step-{saved[0]}")
        print(f"attempt {attempt}: resumed from step {state.step}")
    while state.step < steps:
        sampler.set_epoch(state.epoch)
        for batch in sampler.batches(8):
            opt.zero_grad()
            loss = nn.MSELoss()(model(distlab.tensor(x[batch])), distlab.tensor(y[batch]))
            loss.backward()
            opt.step()
            state.step += 1
            state.losses.append(float(loss.data))
            if state.step == kill_at and rank == 1 and attempt == 0:
                print(f"rank 1: killed after step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % every == 0:
                checkpoint.save({"train": state}, Path(directory) / f"step-{state.step}")
            if state.step == steps:
                break
        else:
            state.epoch += 1
    return state.losses


# %% [markdown]
# ## Once without a failure, once with rank 1 killed after step 8
#
# The last checkpoint before the kill is step 6: the restarted attempt does steps 7 and 8 again, from the
# same state, with the same random numbers.

# %%
plain = distlab.run(train, np=2, args=(None, str(workdir / "plain")))

# %%
killed = distlab.run(train, np=2, args=(8, str(workdir / "killed")), max_restarts=1)

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3))
for rank in range(2):
    ax.plot(range(1, 13), plain[rank], "o-", label=f"rank {rank}, no failure")
    ax.plot(range(1, 13), killed[rank], "x--", ms=9,
            label=f"rank {rank}, killed and restarted")
ax.axvline(8, color="grey", lw=0.8)
ax.text(8.1, max(plain[0]) * 0.9, "rank 1 killed", color="grey")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend(fontsize=7)
plt.show()
print("largest difference between the two runs' losses:",
      max(abs(a - b) for r in range(2) for a, b in zip(plain[r], killed[r])))
print("bit for bit equal:", plain == killed)

# %% [markdown]
# ## What a checkpoint holds
#
# One data file per rank that had something to write (`__{rank}_{generation}.distcp`) and `.metadata`,
# written last: a save cut short leaves no metadata, and a load of it is refused. A value the ranks share
# (the parameters) is written once; a value each rank has its own of (its losses, its generators) once per
# rank.

# %%
from distlab import checkpoint

step6 = workdir / "killed" / "step-6"
print(sorted(p.name for p in step6.iterdir()))
metadata = checkpoint.read_metadata(step6)
for key in ["train.model.0.weight", "train.optim.state.0.weight.exp_avg",
            "train.counters.step", "train.counters.losses"]:
    item = metadata["items"][key]
    chunks = [(c["file"], c["length"], c.get("ranks")) for c in item["chunks"]]
    what = f"{item['kind']} {item['dtype'] or ''} {item['shape'] or ''}"
    print(f"{key}: {what} -> {chunks}")

# %% [markdown]
# ## A flipped byte is refused, on every rank
#
# Every piece has a checksum in the metadata; a rank checks each piece it reads before it uses a byte,
# and the ranks agree before any array is changed.

# %%
damaged = workdir / "damaged"
import shutil

shutil.copytree(step6, damaged)
chunk = metadata["items"]["train.model.0.weight"]["chunks"][0]
victim = damaged / chunk["file"]
raw = bytearray(victim.read_bytes())
raw[chunk["offset"] + 10] ^= 1  # one bit of one weight of the first layer
victim.write_bytes(bytes(raw))
print("flipped a bit in", chunk["file"], "at byte", chunk["offset"] + 10)


def try_load(directory):
    from distlab.errors import CheckpointException

    state = {"train": {"model": {"0.weight": np.zeros((16, 4), np.float32)}}}
    try:
        checkpoint.load(state, directory)
    except CheckpointException as exc:
        return str(exc)
    return "loaded"


for rank, message in enumerate(distlab.run(try_load, np=2, args=(str(damaged),))):
    print(f"rank {rank}: {message[:150]}...")

# %% [markdown]
# ## On one rank
#
# The checkpoint does not depend on the number of ranks that saved it: here one rank loads the model and the
# optimizer state the two ranks saved at step 12.

# %%
def load_on_one(directory):
    from distlab import nn, optim

    distlab.manual_seed(99)  # other weights, to be overwritten
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = optim.Adam(net.parameters(), lr=0.05)
    model_sd, optim_sd = checkpoint.get_state_dict(net, opt)
    state = {"train": {"model": model_sd, "optim": optim_sd, "counters": {"step": 0}}}
    checkpoint.load(state, directory)
    checkpoint.set_state_dict(net, opt, model_state_dict=model_sd,
                              optim_state_dict=optim_sd)
    return state["train"]["counters"]["step"], float(np.abs(net[0].weight.data).sum())


print(distlab.run(load_on_one, np=1, args=(str(workdir / "killed" / "step-12"),)))
shutil.rmtree(workdir)

# %% [markdown]
# ## Without a restart: the survivors go on
#
# A restart costs the job's start-up again. Over Open MPI started with fault tolerance (`python -m distlab run
# --fault-tolerance`, MPI's ULFM) the survivors need none: `distlab.collectives.elastic` catches the error a
# dead rank causes, shrinks the world to the survivors, rebuilds DDP on them, rolls back to the last commit (kept
# in memory) and goes on in the same processes. `examples/elastic_shrink.py` is such a loop, through
# `elastic.train`: 3 ranks, the last one killed with SIGKILL in the middle of the backward pass of step 7, commits
# every 4 steps, so the two survivors go back to step 4 and finish the epochs alone. On an MPI without ULFM
# (MPICH, which this page was built with) the launcher refuses before any rank starts, naming the reason, and the
# cell shows the output of a recorded run instead. The docs' "Fault tolerance" page compares the two ways.

# %%
import json

from distlab.errors import FaultToleranceUnsupportedError
from distlab.launch import launch_script

checkout = next(folder for folder in Path(distlab.__file__).resolve().parents
                if (folder / "examples" / "elastic_shrink.py").exists())
example = str(checkout / "examples" / "elastic_shrink.py")
try:
    job = launch_script(example, np=3, fault_tolerance=True, capture=True, timeout=120)
    print(job.stdout, "\n".join(job.summary), sep="\n")
except FaultToleranceUnsupportedError as exc:
    print(f"not here: {str(exc)[:160]}...\n")
    runs = checkout / "docs" / "_data" / "runs"
    record = json.loads((runs / "elastic_shrink.json").read_text())
    print(f"recorded on {record['machine']} ({record['date']}):")
    print(f"$ {record['command']}\n{record['output']}")
