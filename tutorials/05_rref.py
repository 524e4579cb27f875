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
# # RRefs: remote references and the fork tree behind them
#
# With PyTorch RPC (and `distlab.rpc`), `remote("worker1", f)` runs `f` on worker1 and returns at once an
# **RRef**: a reference to the result, which stays on worker1 (the *owner*). The holder of an RRef is a *user*.
# Sending an RRef to another worker, as an argument or a return value, creates a new user there: a **fork**,
# whose *parent* is the sender. The owner must keep the value while any user exists anywhere, and free it when
# the last one is gone, with no central bookkeeper and no guarantee on message order. Two rules make that safe
# (the docs' "RPC and the RRef protocol" page walks through the code):
#
# - **G1**: the owner is notified, exactly once, when any user is deleted;
# - **G2**: a parent does not delete its reference until the owner has confirmed the child it forked, so the
#   owner can never see the count drop to zero while a fork is still in flight.
#
# This notebook builds a small fork tree on three workers and watches the owner's bookkeeping as references
# come and go, then draws the tree.

# %%
import distlab

print("twin:", distlab.IMPL)

# %% [markdown]
# ## The scenario
#
# - worker0 asks worker1 to create an array: `a = remote("worker1", np.arange, (4,))`. worker1 owns it; worker0
#   holds a user RRef.
# - worker0 creates a `Holder` object on worker2 (another RRef) and passes `a` to it: worker2 now holds a fork
#   of `a`, child of worker0's.
# - worker2 drops its reference, then worker0 drops its own.
#
# After each step worker0 asks the owner for its counts (`rref_debug_info`): owner RRefs (values it keeps
# alive) and forks (users it knows of). A deletion notice travels asynchronously, so after a drop we poll until
# the owner's count changes.

# %%
class Holder:
    """An object living on worker2 that keeps whatever RRefs it is given."""

    def __init__(self):
        self.kept = []

    def keep(self, rref, timeout=10.0):
        import time

        self.kept.append(rref)                  # worker2's own user RRef: a fork
        deadline = time.monotonic() + timeout
        # the owner answers worker2's fork request asynchronously
        while not rref.confirmed_by_owner():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the owner did not confirm {rref!r} within {timeout} s")
            time.sleep(0.001)
        return repr(rref)

    def drop(self):
        self.kept.clear()     # the last Python reference goes: the user is released


def scenario():
    import os
    import time

    import numpy as np

    import distlab.rpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}")  # every rank joins; worker0 drives the scenario
    steps, ids = [], {}

    def owner_counts(label):
        steps.append((label, rpc.rpc_sync("worker1", rpc.rref_debug_info)))

    def wait_for_forks(n, timeout=10.0):       # deletion notices are asynchronous
        deadline = time.monotonic() + timeout
        while rpc.rpc_sync("worker1", rpc.rref_debug_info)["num_forks"] != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the owner still counts forks other than {n}")
            time.sleep(0.01)

    if rank == 0:
        owner_counts("start")
        a = rpc.remote("worker1", np.arange, (4,))
        print("worker0 sees", a.to_here(), "owned by", a.owner_name())
        ids["worker0"] = repr(a)
        owner_counts("worker0: remote()")
        holder = rpc.remote("worker2", Holder)
        # a travels to worker2: a fork, child of worker0's
        ids["worker2"] = holder.rpc_sync().keep(a)
        owner_counts("worker0 -> worker2: fork")
        holder.rpc_sync().drop()
        wait_for_forks(1)
        owner_counts("worker2 drops its fork")
        del a
        wait_for_forks(0)
        owner_counts("worker0 drops its RRef")
    rpc.shutdown()            # graceful: waits until no reference is left anywhere
    return steps, ids


steps, ids = distlab.run(scenario, np=3)[0]
print(f"{'step':28s} owner RRefs  forks")
for label, counts in steps:
    print(f"{label:28s} {counts['num_owner_rrefs']:11d} {counts['num_forks']:6d}")

# %% [markdown]
# The owner's value lives exactly as long as some user exists: one owner RRef from `remote()` until worker0's
# drop, and one fork per user. worker2 announced its fork to the owner itself, with a message of its own, and
# `keep` returned only once the owner had confirmed it (`confirmed_by_owner()`), so the owner already counted
# it; until that confirmation, worker0's reference could not have been deleted (G2). The two users, with their
# ids:

# %%
for worker, text in ids.items():
    print(worker, text)

# %% [markdown]
# Every RRef carries the id of the value (`rref_id`, the same for both) and its own `fork_id`. An id is a pair
# (the worker that created it, a counter local to that worker), so no coordinator has to hand ids out: here
# worker0 created both fork ids, since it made both references (the second when it sent `a` to worker2).
#
# ## The fork tree, and the owner's counts over the scenario

# %%
import matplotlib.pyplot as plt

fig, (tree, counts) = plt.subplots(1, 2, figsize=(10, 3.2),
                                   gridspec_kw={"width_ratios": [1, 1.4]})

import re


def fork_label(text):
    """'fork <created_on>.<local_id>' from a UserRRef's repr.

    The repr holds ``fork_id=GloballyUniqueId(created_on=.., local_id=..)``.
    """
    found = re.search(r"fork_id=\D*(\d+)\D+(\d+)", text)
    return f"fork {found.group(1)}.{found.group(2)}" if found else "fork"


owner = "worker1\nowner: the array"
user0 = f"worker0\nuser ({fork_label(ids['worker0'])})"
user2 = f"worker2\nuser ({fork_label(ids['worker2'])})"
nodes = {owner: (0.5, 0.85), user0: (0.25, 0.45), user2: (0.75, 0.12)}
edges = [(owner, user0, "remote()"),
         (user0, user2, "sent as an argument\n(child of worker0's)")]
for a, b, label in edges:
    (x0, y0), (x1, y1) = nodes[a], nodes[b]
    tree.annotate("", xy=(x1, y1 + 0.08), xytext=(x0, y0 - 0.08),
                  arrowprops={"arrowstyle": "->", "color": "#555555"})
    tree.text((x0 + x1) / 2 + 0.03, (y0 + y1) / 2, label, fontsize=7, color="#555555")
for name, (x, y) in nodes.items():
    face = "#e8f0f8" if "owner" in name else "#fbe9e3"
    tree.text(x, y, name, ha="center", va="center", fontsize=8,
              bbox={"boxstyle": "round", "facecolor": face})
tree.set_xlim(0, 1.1)
tree.set_ylim(0, 1)
tree.axis("off")
tree.set_title("Who holds what (ids from the run)", fontsize=9)

labels = [label for label, _ in steps]
counts.step(range(len(steps)), [c["num_forks"] for _, c in steps], where="post",
            marker="o", label="forks")
counts.step(range(len(steps)), [c["num_owner_rrefs"] for _, c in steps], where="post",
            marker="s", label="owner RRefs (values kept alive)")
counts.set_xticks(range(len(steps)))
counts.set_xticklabels(labels, rotation=25, ha="right", fontsize=7)
counts.set_yticks([0, 1, 2])
counts.set_ylim(-0.2, 2.9)
counts.set_title("The owner's counts (worker1)", fontsize=9)
counts.legend(fontsize=7, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# What could go wrong without the protocol's rules: had worker0 dropped `a` while its message to worker2 was
# still in flight, and had the owner counted only confirmed users, the owner would have seen zero users, freed
# the array, and worker2's fork would point at nothing. G2 prevents it: worker0's deletion notice waits until
# the owner has confirmed worker2's fork. And `rpc.shutdown()` is graceful: it waits until every user has been
# deleted and every owner has nothing left to keep, and reports any leaked reference by name.
