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
# # First steps: collectives on several ranks, from a notebook
#
# A distributed training job is several processes (*ranks*) that compute on their own and agree through
# *collectives*: calls that every rank makes together, such as "sum this array across all ranks". distlab runs
# its ranks as MPI processes. From a notebook, `distlab.run(fn, np=2)` starts two ranks with `mpiexec`, runs
# `fn()` on each, and returns the list of what each rank returned. The function travels by cloudpickle, so a
# function defined in a cell works; it runs in fresh processes, so it imports what it needs itself.
#
# This notebook shows:
#
# 1. allreduce and broadcast, the two collectives data-parallel training is built on;
# 2. an asynchronous collective, overlapped with computation;
# 3. what happens when a rank does not show up: a timeout that names it;
# 4. what happens when ranks disagree about a call: `DISTLAB_DEBUG=DETAIL` names who called what;
# 5. a picture of a run, drawn from its timeline.

# %%
import distlab

print("distlab", distlab.__version__, "- active twin:", distlab.IMPL)

# %% [markdown]
# ## 1. allreduce and broadcast
#
# `comm.world()` is a process group over all ranks. `allreduce` works **in place**, as in `torch.distributed`:
# after the call, every rank's array holds the sum over ranks. Each rank starts with `rank + 1`, so with two
# ranks both end with `1 + 2 = 3`.

# %%
def allreduce_demo():
    import numpy as np
    from distlab import comm

    pg = comm.world()
    a = np.full(4, pg.rank + 1, dtype=np.float32)
    before = a.tolist()
    # op="sum" by default; also avg, min, max, product, band, bor
    pg.allreduce(a)
    return pg.rank, before, a.tolist()


for rank, before, after in distlab.run(allreduce_demo, np=2):
    print(f"rank {rank}: {before} -> {after}")

# %% [markdown]
# `broadcast` copies one rank's array into everyone's. DDP uses it once at start-up, so that every replica of the
# model begins with rank 0's parameters: the ranks initialise their weights independently, and without this
# they would train different models.

# %%
def broadcast_demo():
    import numpy as np
    from distlab import comm

    pg = comm.world()
    rng = np.random.default_rng(seed=pg.rank)  # each rank draws different "weights"
    weights = rng.standard_normal(3).round(3)
    mine = weights.tolist()
    pg.broadcast(weights, src=0)               # now everyone holds rank 0's
    return pg.rank, mine, weights.tolist()


for rank, mine, after in distlab.run(broadcast_demo, np=2):
    print(f"rank {rank}: drew {mine}, after broadcast {after}")

# %% [markdown]
# ## 2. Asynchronous collectives and progress
#
# `async_op=True` returns a `Work` at once; the reduction runs while the rank computes, and `work.wait()`
# collects it. This is how DDP overlaps gradient communication with backward. One catch: MPI moves data only
# while some MPI call runs on the rank, so a long computation should call `comm.progress()` now and then (the
# comm page of the docs shows the measurements).

# %%
def async_demo():
    import numpy as np
    from distlab import comm

    pg = comm.world()
    grad = np.full(1 << 20, pg.rank + 1.0, dtype=np.float32)      # 4 MiB
    work = pg.allreduce(grad, op="avg", async_op=True, name="grad")
    x = np.linspace(0.0, 1.0, 1 << 18)
    for _ in range(20):               # "backward" of earlier layers
        x = np.sin(x) + 0.5
        comm.progress()               # let MPI move the bytes meanwhile
    work.wait()
    return float(grad[0])


print(distlab.run(async_demo, np=2))      # the average of 1 and 2, on both ranks

# %% [markdown]
# ## 3. A rank that never arrives: a timeout that names it
#
# The most common failure of a distributed job is a hang: one rank skips a collective, and the others wait
# forever, saying nothing. In distlab every wait has a timeout (`DISTLAB_TIMEOUT`, 300 s by default; here we
# give the group's waits half a second once it is set up), and the error names the ranks that did not arrive. It knows because every rank
# posts the last collective it entered in a small shared-memory board that the others can read without its help.
#
# Below, rank 1 is "busy elsewhere" and never enters the allreduce. Rank 0 catches the error and returns it.

# %%
def timeout_demo():
    import time

    import numpy as np
    from distlab import comm
    from distlab.errors import DistTimeoutError

    pg = comm.ProcessGroup(name="demo")  # set up with the default timeout
    pg.timeout = 0.5                      # then every wait of this group: half a second
    pg.barrier()
    if pg.rank == 1:
        time.sleep(1.0)                       # never calls the allreduce
        return None
    try:
        pg.allreduce(np.ones(8, dtype=np.float32), name="grad.bucket3")
    except DistTimeoutError as exc:
        return {"message": str(exc), "missing_ranks": exc.missing_ranks,
                "op": exc.op, "seq": exc.seq}


report = distlab.run(timeout_demo, np=2)[0]
print(report["message"])
print("missing ranks:", report["missing_ranks"],
      "- operation:", report["op"], "#", report["seq"])

# %% [markdown]
# If a rank raises and does not catch, the whole job is aborted (so no rank is left waiting) and `distlab.run`
# raises `RankFailedError` here, with the failing rank and its traceback:

# %%
from distlab.errors import RankFailedError


def failing():
    from distlab import comm

    pg = comm.world()
    if pg.rank == 1:
        raise ValueError("rank 1 found a NaN in its loss")
    pg.barrier()


try:
    distlab.run(failing, np=2)
except RankFailedError as exc:
    print("rank", exc.rank, "failed:")
    print(str(exc).strip().splitlines()[-1])

# %% [markdown]
# ## 4. Ranks that disagree: `DISTLAB_DEBUG=DETAIL`
#
# A subtler bug: every rank calls allreduce, but with different shapes (a model that differs across ranks, a
# batch size that does not divide evenly...). MPI may hang or silently reduce garbage. With
# `DISTLAB_DEBUG=DETAIL`, every collective first compares a small *fingerprint* of the call (sequence number,
# op, dtype, shape, root) across ranks, and every rank raises the same `CollectiveMismatchError` that says who
# called what. The `env` argument of `distlab.run` sets environment variables for the ranks.

# %%
def mismatch_demo():
    import numpy as np
    from distlab import comm
    from distlab.errors import CollectiveMismatchError

    pg = comm.world()
    n = 5 if pg.rank == 1 else 4
    try:
        pg.allreduce(np.ones(n, dtype=np.float32), name="grad.bucket0")
    except CollectiveMismatchError as exc:
        return str(exc)


messages = distlab.run(mismatch_demo, np=2, env={"DISTLAB_DEBUG": "DETAIL"})
for rank, message in enumerate(messages):
    print(f"rank {rank}: {message}")

# %% [markdown]
# The check costs one small allgather per collective, which is why it is off by default: turn it on when a job
# hangs or diverges.
#
# ## 5. A picture of a run: the timeline
#
# With `DISTLAB_TIMELINE=path.json`, every collective is recorded as a span, and code can add its own spans
# with `distlab.timeline.get_timeline()`. Each rank writes its part when it exits, and
# `distlab.timeline.merge(path)` merges the parts into one Chrome trace that Perfetto (https://ui.perfetto.dev)
# opens. Here we read it back and draw it with `distlab.viz` instead.
#
# Each rank runs four "steps": it starts an asynchronous allreduce of a 2 MiB "gradient" and computes while it
# runs, driving progress.

# %%
def traced_steps():
    import numpy as np
    from distlab import comm
    from distlab.timeline import get_timeline

    pg = comm.world()
    tl = get_timeline()
    grad = np.ones(1 << 19, dtype=np.float32)
    x = np.linspace(0.0, 1.0, 1 << 18)
    for step in range(4):
        work = pg.allreduce(grad, async_op=True, name=f"grad step {step}")
        with tl.span(f"compute {step}", lane="compute"):
            for _ in range(10):
                # element-wise numpy: one core per rank, no BLAS threads
                x = np.sin(x) + 0.5
                comm.progress()
        work.wait()
    pg.barrier()


# %%
import os
import tempfile

from distlab import viz
from distlab.timeline import merge

trace_dir = tempfile.mkdtemp(prefix="distlab-tutorial-")
trace_path = os.path.join(trace_dir, "first_steps.json")
distlab.run(traced_steps, np=2, env={"DISTLAB_TIMELINE": trace_path})
merge(trace_path)
trace = viz.load_trace(trace_path)
print(len(trace.spans), "spans; the first one as written in the file:")
print(next(e for e in trace.events if e.get("ph") == "X"))

# %% [markdown]
# The trace holds *metadata* events naming each lane (`thread_name`) and *complete* events (`"ph": "X"`) with
# a start `ts` and a duration `dur`, both in microseconds, a rank (`pid`) and a lane (`tid`).
# `distlab.viz.load_trace` reads them into spans, instants and messages, and `distlab.viz.plot_timeline` draws
# one row per rank and lane, each span coloured by its kind (the first word of its name):

# %%
import matplotlib.pyplot as plt

viz.plot_timeline(trace,
                  colors={"compute": "#9bbcd9", "allreduce": "#e07b5f",
                          "barrier": "#b0b0b0"},
                  title="Async allreduce (red) running while each rank computes (blue)")
plt.show()

# %% [markdown]
# Each red span starts with its step's compute and ends when the rank saw the reduction complete, which
# happened inside the compute loop, thanks to `comm.progress()`: the reduction ran *during* the compute, and
# `wait()` found it done. Try it: delete the `comm.progress()` line in `traced_steps`, run the two cells again,
# and watch the red spans stretch past the end of each compute span (the bytes now move only inside `wait()`).
#
# The grey span at the end is the final barrier. Open the same file in Perfetto for the interactive view
# (click a span to see its sequence number and size):

# %%
print("trace written to", trace_path)
