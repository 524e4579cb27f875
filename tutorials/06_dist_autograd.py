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
# # Distributed autograd: backward through RPCs
#
# When a forward pass sends tensors to other workers (`rpc_sync`, `rpc_async`, RRef proxies), local autograd
# loses track: the receiver sees a fresh leaf. Distributed autograd (PyTorch's, and `distlab.distributed_autograd`)
# stitches the pieces back together. Inside `with dist_autograd.context() as context_id`:
#
# - every RPC carries `(context id, message id, sender)`; the **sender** records a `SendRpcBackward` for the
#   tensors that need gradients, the **receiver** a `RecvRpcBackward` per such tensor (and the reply does the same
#   the other way);
# - each worker keeps, per context, its send and recv functions by message id, the workers it talked to, and the
#   gradients of the pass (never `.grad`);
# - `backward(context_id, [loss])` runs the local graph; a recv function sends its gradients to the worker that
#   holds the matching send function, which continues there, and so on until every worker is done.
#
# This notebook runs a 3-stage chain over three workers, looks at what each worker recorded, checks the gradients
# against the same graph computed locally, and watches the contexts disappear everywhere when the `with` ends.

# %%
import distlab

print("twin:", distlab.IMPL)


# %%
class Stage:
    """One stage of the model, on one worker: tanh(x @ W), then the next stage's RRef
    (if any)."""

    def __init__(self, weight, next_stage=None):
        from distlab.autograd import Tensor

        self.w = Tensor(weight, requires_grad=True)
        self.next = next_stage

    def forward(self, x):
        y = (x @ self.w).tanh()
        # the next stage, if any, through a nested RPC
        return y if self.next is None else self.next.rpc_sync().forward(y)

    def report(self, context_id):
        """What this worker recorded for the context, and the gradient of its W."""
        from distlab import distributed_autograd as dist_autograd

        ctx = dist_autograd.get_container().retrieve_context(context_id)
        grad = dist_autograd.get_gradients(context_id).get(self.w)
        return {"known workers": sorted(ctx.known_worker_ids()),
                "send functions": len(ctx.send_functions()),
                "recv functions": len(ctx.recv_functions()),
                "grad of W": None if grad is None else grad.data}


def scenario():
    import os

    import numpy as np

    import distlab.rpc as rpc
    from distlab import distributed_autograd as dist_autograd
    from distlab.autograd import Tensor

    def contexts_alive():
        from distlab import distributed_autograd as dist_autograd

        return dist_autograd.get_container().num_autograd_contexts()

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}")
    out = None
    if rank == 0:
        rng = np.random.default_rng(0)
        weights = [rng.standard_normal((4, 4)) for _ in range(2)]
        second = rpc.remote("worker2", Stage, (weights[1],))
        first = rpc.remote("worker1", Stage, (weights[0], second))
        x = Tensor(rng.standard_normal((2, 4)), requires_grad=True)
        with dist_autograd.context() as context_id:
            y = first.rpc_sync().forward(x)  # worker0 -> worker1 -> worker2, and back
            loss = (y * y).sum()
            ctx = dist_autograd.get_container().retrieve_context(context_id)
            before = {0: {"known workers": sorted(ctx.known_worker_ids()),
                          "send functions": len(ctx.send_functions()),
                          "recv functions": len(ctx.recv_functions())},
                      1: first.rpc_sync().report(context_id),
                      2: second.rpc_sync().report(context_id)}
            dist_autograd.backward(context_id, [loss])
            after = {1: first.rpc_sync().report(context_id),
                     2: second.rpc_sync().report(context_id)}
            grad_x = dist_autograd.get_gradients(context_id)[x].data
        alive = [rpc.rpc_sync(w, contexts_alive) for w in range(3)]
        out = {"context id": context_id, "x": x.data, "weights": weights,
               "before": before, "after": after, "grad x": grad_x, "x.grad": x.grad,
               "alive after": alive}
        del first, second
    rpc.shutdown()            # graceful: every worker waits for the others
    return out


result = distlab.run(scenario, np=3)[0]
print(f"context id {result['context id']:#x}: worker 0 minted it "
      "(the high 16 bits are the worker id)")

# %% [markdown]
# ## What each worker recorded during the forward pass
#
# Worker 0 sent `x` to worker 1 (a send function on 0, a recv function on 1); worker 1 sent its output to
# worker 2 (send on 1, recv on 2); the replies came back the same way (send on 2, recv on 1; send on 1, recv on
# 0). Every RPC also records its destination as a *known worker* (and the callee its caller), so the context
# can be released there later. Nothing has a gradient yet.

# %%
for worker, info in result["before"].items():
    print(f"worker {worker}: knows {info['known workers']}, "
          f"{info['send functions']} send / "
          f"{info['recv functions']} recv functions, "
          f"gradient of its W so far: {info.get('grad of W')}")

# %% [markdown]
# ## After `backward`: the gradients are in the context on each worker, equal to local autograd
#
# `x.grad` is untouched: a distributed pass keeps its gradients in its context (several passes may run at
# once on a parameter server).

# %%
import numpy as np

from distlab.autograd import Tensor

# W of worker 1 and 2
ws = [None] + [Tensor(w.copy(), requires_grad=True) for w in result["weights"]]
x = Tensor(result["x"].copy(), requires_grad=True)
y = x
for w in ws[1:]:
    y = (y @ w).tanh()
(y * y).sum().backward()

print("x.grad on worker 0 after the distributed pass:", result["x.grad"])
print("gradient of x equals local:",
      np.allclose(result["grad x"], x.grad.data, rtol=1e-12))
for worker, info in result["after"].items():
    print(f"worker {worker}: gradient of its W equals local:",
          np.allclose(info["grad of W"], ws[worker].grad.data, rtol=1e-12))

# %% [markdown]
# ## Leaving the context releases it everywhere
#
# Worker 0 released its context and told the workers it knows (worker 1), which told the ones it knows
# (worker 2), each answering once done; so right after the `with` block no worker holds the context.

# %%
print("contexts alive per worker after the with block:", result["alive after"])

# %% [markdown]
# ## The messages of the backward pass, as a sequence diagram
#
# With `DISTLAB_TIMELINE` set, the RPC agent records every message at both ends. We run the scenario again,
# recording, and draw what happened from the start of `dist_autograd.backward` (a span on worker 0's
# `dist_autograd` lane) to the release of the context: the `prepare` messages that find the workers taking part,
# the one-way `backward` messages carrying gradients (one per send/recv pair), the answers, then `cleanup`.

# %%
import os
import tempfile

import matplotlib.pyplot as plt

from distlab import viz
from distlab.timeline import merge

trace_dir = tempfile.mkdtemp(prefix="distlab-dist-autograd-")
trace_path = os.path.join(trace_dir, "dist_autograd.json")
distlab.run(scenario, np=3, env={"DISTLAB_TIMELINE": trace_path})
merge(trace_path)
trace = viz.load_trace(trace_path)
viz.plot_sequence(trace, window=("dist backward", "release context"), collectives=False,
                  names={0: "worker0 (x)", 1: "worker1 (stage 1)",
                         2: "worker2 (stage 2)"},
                  title="Distributed backward: prepare, gradients, answers")
plt.show()
