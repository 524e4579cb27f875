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
# # The autograd engine, and the hooks DDP is built on
#
# DDP does not change how gradients are computed; it listens to the backward pass. It needs three things from
# the autograd engine, and this notebook shows each on distlab's engine (`distlab.autograd`, a small mirror of
# PyTorch's):
#
# 1. a **graph** it can walk, to find parameters that got no gradient this step;
# 2. a hook that fires **the moment a parameter's gradient is complete** (the post-accumulate-grad hook), in an
#    order that starts with the last layer;
# 3. a way to run code **once backward has finished** (`queue_callback`).
#
# Then we train a small network, first in one process and then data-parallel on two ranks with a hand-written
# "DDP" of a dozen lines, built from exactly these pieces.

# %%
import numpy as np

import distlab
from distlab import autograd, nn, optim

distlab.manual_seed(0)  # weights drawn by nn layers are now reproducible
print("twin:", distlab.IMPL)

# %% [markdown]
# ## 1. The graph
#
# Operations on tensors that require grad record a backward node on their output. `grad_fn` is the node that
# produced a tensor; `walk_graph` visits every node reachable from it. Leaves that require grad (parameters)
# end in an `AccumulateGrad` node, which writes `.grad`.

# %%
# input data: no gradient wanted
x = distlab.tensor(np.ones((4, 3)))
# parameters (leaves)
w1 = distlab.tensor(np.random.rand(3, 5), requires_grad=True)
w2 = distlab.tensor(np.random.rand(5, 1), requires_grad=True)
# a parameter this step does not use
unused = distlab.tensor(np.zeros(2), requires_grad=True)

loss = ((x @ w1).relu() @ w2).sum()
print("loss.grad_fn:", loss.grad_fn)
for node in autograd.walk_graph(loss):
    print("  ", type(node).__name__)

leaves = autograd.graph_leaves(loss)
print("w1 reachable:", w1 in leaves, "| w2 reachable:", w2 in leaves,
      "| unused reachable:", unused in leaves)

# %% [markdown]
# `graph_leaves` is DDP's `find_unused_parameters`: a parameter that cannot be reached from this step's output
# will get no gradient, so the reducer must not wait for it (or it would wait forever).
#
# ## 2. When does each gradient arrive?
#
# The engine runs a node only once every gradient flowing into it has arrived, newest node first. A leaf's
# `AccumulateGrad` runs as soon as it is ready, so each parameter's post-accumulate-grad hook fires the moment
# its gradient is final, not at the end of backward. We register a hook on every parameter of a 3-layer MLP and
# record the order.

# %%
model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(),
                      nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
names = [name for name, _ in model.named_parameters()]
print("registration (forward) order:", names)

order = []
for name, p in model.named_parameters():
    p.register_post_accumulate_grad_hook(lambda t, name=name: order.append(name))


def finalize():
    order.append("<finalize: backward is over>")


def first_hook_queues_finalize(t):
    # DDP's reducer queues finalize_backward from its first hook of the step,
    # the same way.
    if len(order) == 1:
        autograd.queue_callback(finalize)


for p in model.parameters():
    p.register_post_accumulate_grad_hook(first_hook_queues_finalize)

out = model(distlab.tensor(np.random.rand(8, 2)))
out.sum().backward()
print("hook order:")
for i, name in enumerate(order):
    print(f"  {i}: {name}")

# %% [markdown]
# The hooks fire in reverse: the last layer's gradients are complete first. That is why DDP puts parameters in
# buckets in reverse registration order: the first bucket fills early in backward, and its allreduce can run
# while the engine still computes the earlier layers' gradients. The queued callback ran last, after every hook:
# the place to wait for all the reductions.
#
# ## 3. Train a small network
#
# A 2-16-16-1 MLP learns `y = sin(3x)` on 64 points with Adam: `zero_grad`, forward, loss, `backward`, `step`,
# as in PyTorch.

# %%
def make_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-1, 1, size=(n, 1))
    return np.hstack([xs, xs ** 2]), np.sin(3 * xs)


def make_model():
    distlab.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


inputs, targets = make_data()
net = make_model()
opt = optim.Adam(net.parameters(), lr=0.02)
loss_fn = nn.MSELoss()
losses = []
for step in range(150):
    opt.zero_grad()
    loss = loss_fn(net(distlab.tensor(inputs)), distlab.tensor(targets))
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")

# %% [markdown]
# ## 4. The same training, data-parallel on two ranks, with a hand-written "DDP"
#
# Each rank takes half of the batch. After backward, each rank's gradients describe only its half; averaging
# them across ranks gives exactly the gradient of the whole batch (the loss is a mean). So if every rank starts
# from the same weights and applies the same averaged gradient, the replicas stay identical and train like one
# model on the full batch.
#
# The hooks do the averaging: each parameter's hook starts an **asynchronous** allreduce of its gradient the
# moment it is ready (overlapping the rest of backward), and a callback queued by the first hook waits for all
# of them when backward ends. DDP's reducer adds buckets, unused-parameter handling and much more, but this is
# its skeleton.

# %%
def data_parallel_training(steps=150):
    import numpy as np

    from distlab import autograd, comm

    pg = comm.world()
    net = make_model()
    for p in net.parameters():
        pg.broadcast(p.data, src=0)  # every replica starts from rank 0's weights
    pending = []

    def wait_all():                                   # runs once backward is over
        for work in pending:
            work.wait()
        pending.clear()

    def reduce_when_ready(p):                         # runs the moment p.grad is final
        if not pending:
            autograd.queue_callback(wait_all)
        pending.append(pg.allreduce(p.grad.data, op="avg", async_op=True))

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(reduce_when_ready)

    inputs, targets = make_data()
    mine = slice(pg.rank, None, pg.size)              # this rank's half of the batch
    opt = optim.Adam(net.parameters(), lr=0.02)
    loss_fn = nn.MSELoss()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(net(distlab.tensor(inputs[mine])), distlab.tensor(targets[mine]))
        loss.backward()           # gradients are averaged across ranks when this returns
        opt.step()
        local = np.array([loss.item()])
        losses.append(float(pg.allreduce(local, op="avg")[0]))  # the full batch's loss
    return losses, [p.data.copy() for p in net.parameters()]


per_rank = distlab.run(data_parallel_training, np=2)
(losses_r0, weights_r0), (losses_r1, weights_r1) = per_rank
same = all(np.array_equal(a, b) for a, b in zip(weights_r0, weights_r1))
print("replicas identical after training:", same)
print(f"2-rank loss: first {losses_r0[0]:.4f}, last {losses_r0[-1]:.4f}")

# %% [markdown]
# `make_model` and `make_data`, defined in earlier cells, travelled to the ranks with the function (cloudpickle
# sends what a notebook function refers to). The replicas ended bit-identical: every rank applied the same
# averaged gradients. The loss curves of one process on the full batch and two ranks on half each should
# nearly coincide; they differ only by floating-point rounding, because the average over ranks adds the same
# numbers in a different order.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(losses, label="1 process, full batch")
ax.plot(losses_r0, "--", label="2 ranks, half the batch each, gradients averaged")
ax.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("MSE loss")
ax.set_title("An MLP learning sin(3x)")
ax.legend()
fig.tight_layout()
plt.show()
