"""DDP on several ranks equals single-process training on the whole batch, for every reducer feature.

argv: impl ("reference", "core" or "mixed": even ranks reference, odd ranks core), output prefix.
Each rank writes <prefix>.rank<N>.pkl: per configuration, the final parameters and the collective trace, so the
test can compare twins bit for bit and trace for trace.
"""
import os
import pickle
import sys

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.ddp_comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from distlab.testing import RecordingGroup
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting, to_device

impl_arg, prefix = sys.argv[1], sys.argv[2]
world = comm.world()
rank, size = world.rank, world.size
impl = impl_arg if impl_arg != "mixed" else ("reference" if rank % 2 == 0 else "core")
SHARD = 4


class Net(nn.Module):
    def __init__(self, sparse=False, spare=False):
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=sparse)
        self.fc1 = nn.Linear(6, 16, seed=1)
        self.fc2 = nn.Linear(16, 16, seed=2)
        self.head = nn.Linear(16, 3, seed=3)
        if spare:
            self.spare = nn.Linear(16, 3, seed=4)  # used only on some steps (or never: static graph)

    def forward(self, tokens, use_spare=False):
        h = self.fc1(self.emb(tokens).mean(axis=1)).tanh()
        h = self.fc2(h).tanh()
        out = self.head(h)
        if use_spare:
            out = out + self.spare(h)
        return out


def batch(step, rows, device):
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, 10, size=(SHARD * size, 5))
    target = rng.standard_normal((SHARD * size, 3)).astype(np.float32)
    return distlab.tensor(on(device, tokens[rows])), distlab.tensor(on(device, target[rows]))


def make(sparse, spare, device):
    distlab.manual_seed(0)
    return to_device(Net(sparse, spare), device)


CONFIGS = {
    "default": dict(),
    "small_buckets": dict(ddp=dict(bucket_cap_mb=200 / 2**20)),
    "bucket_view": dict(ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=300 / 2**20)),
    # gradients computed in their views, then accumulated there by a no_sync micro-batch, or counted first
    "bucket_view_no_sync": dict(ddp=dict(gradient_as_bucket_view=True, find_unused_parameters=True), micro=2,
                                spare=lambda s: s == 0),
    "bucket_view_static": dict(ddp=dict(gradient_as_bucket_view=True, static_graph=True,
                                        bucket_cap_mb=300 / 2**20), spare=lambda s: False),
    "find_unused": dict(ddp=dict(find_unused_parameters=True, bucket_cap_mb=300 / 2**20), spare=lambda s: s % 2 == 1),
    "static": dict(ddp=dict(static_graph=True, bucket_cap_mb=300 / 2**20), spare=lambda s: False),
    "no_sync": dict(ddp=dict(find_unused_parameters=True), micro=2, spare=lambda s: s == 0),
    "allreduce_hook": dict(hook=allreduce_hook),
    "fp16_hook": dict(hook=fp16_compress_hook, tol=2e-3),
    "bf16_hook": dict(hook=bf16_compress_hook, tol=3e-2),
    "sparse": dict(sparse=True, ddp=dict(bucket_cap_mb=300 / 2**20)),
    "mixed_precision": dict(ddp=dict(reduce_dtype=np.float16), tol=2e-3),
}

results = {}
for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    for name, config in CONFIGS.items():
        spare = config.get("spare", lambda s: False)
        has_spare = "spare" in config
        micro = config.get("micro", 1)
        sparse = config.get("sparse", False)
        group = RecordingGroup(world)
        model = DDP(make(sparse, has_spare, device), process_group=group, impl=impl, **config.get("ddp", {}))
        if "hook" in config:
            model.register_comm_hook(None, config["hook"])
        local = make(sparse, has_spare, device)
        opt, local_opt = optim.SGD(model.parameters(), lr=0.05), optim.SGD(local.parameters(), lr=0.05)
        loss_fn = nn.MSELoss()
        start_counting(device)  # the models are on the device: from here on only the comm layer stages
        for step in range(4):
            opt.zero_grad()
            local_opt.zero_grad()
            for m in range(micro):
                mine = np.arange(rank * SHARD, (rank + 1) * SHARD)
                tokens, target = batch(10 * step + m, mine, device)
                use_spare = spare(step * micro + m) if micro > 1 else spare(step)
                if m < micro - 1:
                    with model.no_sync():
                        (loss_fn(model(tokens, use_spare), target) / micro).backward()
                else:
                    (loss_fn(model(tokens, use_spare), target) / micro).backward()
                tokens, target = batch(10 * step + m, np.arange(SHARD * size), device)
                (loss_fn(local(tokens, use_spare), target) / micro).backward()
            opt.step()
            local_opt.step()
        tol = config.get("tol", 1e-5)
        for (pname, a), b in zip(model.module.named_parameters(), local.parameters()):
            a, b = host(a.data), host(b.data)
            assert np.allclose(a, b, atol=tol, rtol=tol), (name, pname, np.abs(a - b).max())
        if config.get("ddp", {}).get("gradient_as_bucket_view"):  # real views into the buckets, on either device
            buffers = [b.buffer() for b in model.reducer.get_grad_buckets()]
            for pname, p in model.module.named_parameters():
                assert p.grad is None or any(np.shares_memory(p.grad.data, buf) for buf in buffers), (name, pname)
        if device != "cpu":  # dense device buckets live in memory every rank maps (the ipc transport's)
            mapped = world.device_comm == "ipc" and os.environ.get("DISTLAB_SHARED_MEMORY", "1") != "0"
            assert all((b.arena is not None) == mapped for b in model.reducer.buckets
                       if not b.expect_sparse_gradient), name
        if name == "find_unused":
            assert model.reducer.get_logging_data()["find_unused_parameters"]
        if name == "small_buckets":
            assert model.reducer.has_rebuilt_bucket
        results[f"{device}:{name}"] = {"params": [host(p.data) for p in model.module.parameters()],
                                        "trace": group.trace}
        assert not staged_outside_comm(device), (name, staged_outside_comm(device))
with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(results, fh)
print(f"rank {rank} ({impl}): {len(CONFIGS)} DDP configurations x {len(DEVICES)} devices match local training",
      flush=True)
