"""A parameter server holding the model through an RRef; trainers pull weights and push gradients over RPC.

Run: ``python -m distlab run -n 3 examples/parameter_server.py`` (rank 0 serves, ranks 1.. train; any n >= 2).
On GPUs: ``... examples/parameter_server.py --device cuda`` (cupy; ``--device fake``: the CI stand-in).

Rank 0 wraps a ``ParameterServer`` in a local ``RRef`` and hands it to every trainer with ``rpc_async``
(owner -> user fork). Each trainer calls the server through the RRef's proxy
(``ps.rpc_sync().get_weights()`` / ``ps.rpc_sync().apply_gradients(...)``: runs on the owner), fits a
linear model on its own shard of synthetic data, and returns its final loss. Each trainer also builds a
``remote`` RRef to its data shard on the server and passes it back and forth (user -> owner), so the
example exercises the RRef protocol's forks; ``rref_debug_info()`` shows the counts, and the graceful
shutdown checks that no RRef leaked.

With ``--device cuda`` the weights live on the server's GPU and each trainer's data on its own: every trainer
sets a device map to the server (``RpcBackendOptions(device_maps={"worker0": {my GPU: the server's GPU}})``), so
its gradients land on the server's device and the weights it pulls come back to its own (the inverse map), with
no host array in between in user code.
"""
import argparse
import os
import sys
import threading

import numpy as np

import distlab.rpc as rpc
from distlab.autograd import to_numpy
from distlab.rpc import RpcBackendOptions, RRef, rref_debug_info

from _device import add_device_argument, select, this_rank

xp = np  # the array module of --device (main sets it on every rank)

FEATURES = 8
STEPS = 60
LR = 0.1


class ParameterServer:
    """The model (one weight vector) and an SGD step, guarded by a lock (trainers call concurrently)."""

    def __init__(self, features):
        self.weights = xp.zeros(features)
        self.lock = threading.Lock()
        self.updates = 0

    def get_weights(self):
        with self.lock:
            return self.weights.copy()

    def apply_gradients(self, grad):
        with self.lock, this_rank(xp):
            self.weights -= LR * grad
            self.updates += 1
            return self.updates


def make_shard(seed, n=256):
    rng = np.random.default_rng(seed)
    true_w = np.arange(1, FEATURES + 1, dtype=np.float64) / FEATURES
    x = rng.normal(size=(n, FEATURES))
    return x, x @ true_w + 0.01 * rng.normal(size=n)


def shard_norm(shard_rref):
    x, y = shard_rref.local_value()
    return float(np.linalg.norm(x))


def run_trainer(ps, trainer_rank):
    # A shard built on the server and referenced from here (remote -> UserRRef), then sent back to its owner.
    shard_on_server = rpc.remote(0, make_shard, (trainer_rank,))
    assert rpc.rpc_sync(0, shard_norm, (shard_on_server,)) > 0
    with this_rank(xp):  # this runs on an RPC thread: make this rank's GPU current
        x, y = (xp.asarray(a) for a in make_shard(trainer_rank))
        loss = None
        for _ in range(STEPS):
            w = ps.rpc_sync().get_weights()
            err = x @ w - y
            loss = float((err ** 2).mean())
            ps.rpc_sync().apply_gradients(2 * x.T @ err / len(y))
    return loss


def main():
    global xp
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    options = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        sys.exit(f"examples/parameter_server.py needs 2 or more ranks (a server and at least one trainer), got "
                 f"{world}: python -m distlab run -n 3 examples/parameter_server.py")
    xp = select(options.device)
    options_rpc = None
    if options.device != "cpu" and rank > 0:  # a trainer's device arrays land on the server's device
        count = xp.cuda.runtime.getDeviceCount()
        options_rpc = RpcBackendOptions(device_maps={"worker0": {rank % count: 0}})
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=options_rpc)
    if rank == 0:
        ps = RRef(ParameterServer(FEATURES))
        futures = [rpc.rpc_async(f"worker{t}", run_trainer, (ps, t)) for t in range(1, world)]
        losses = [f.wait(120) for f in futures]
        server = ps.local_value()
        print(f"parameter server: {server.updates} updates, weights {np.round(to_numpy(server.weights), 2)}")
        print(f"trainers' final losses: {[round(v, 5) for v in losses]}")
        print(f"rref_debug_info on the server: {rref_debug_info()}")
        assert max(losses) < 1e-2, losses
    rpc.shutdown()
    if rank == 0:
        print("parameter server example OK (graceful shutdown: no RRef leaked)")


if __name__ == "__main__":
    main()
