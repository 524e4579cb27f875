"""Hybrid sharding across 2 virtual hosts, 2 ranks each: only shards cross the link. argv: impl.

Ranks 0 and 1 are on host 1, ranks 2 and 3 on host 2 (the cluster places them in blocks). With a 2 x 2 mesh
(replicate across hosts, shard within a host) every all-gather and reduce-scatter stays on its host, and what
crosses the link is each rank's reduced gradient shard, all-reduced with the rank holding the same shard on the
other host: per step and host, its two shards, the whole (padded) gradient once. Measured with the host's link
byte counter around training steps, against that payload, and against flat sharding over the 4 ranks (whose
all-gathers cross the link) and DDP; and hybrid's parameters equal flat sharding's.
"""
import sys

import numpy as np

import distlab
from distlab import comm, nn, optim
from distlab.ddp import DistributedDataParallel as DDP
from distlab.fsdp import DeviceMesh, StateDictOptions, fully_shard, get_model_state_dict
from scenario_checks import twin_of

impl = twin_of(comm.world().rank, sys.argv[1] if len(sys.argv) > 1 else "core")
world = comm.world()
rank, size = world.rank, world.size
assert size == 4, "2 hosts x 2 ranks"
WIDTH, BLOCKS, STEPS = 128, 4, 3


def link_bytes() -> int:
    """Bytes this rank's host has sent on its links (every interface of its namespace but loopback)."""
    with open("/proc/self/net/dev") as f:
        rows = [line.split(":", 1) for line in f.readlines()[2:]]
    return sum(int(stats.split()[8]) for name, stats in rows if name.strip() != "lo")


def build():
    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)],
                         nn.Linear(WIDTH, 4))


def shard(net, group):
    for block in list(net)[:BLOCKS]:
        fully_shard(block, group=group, impl=impl)
    return fully_shard(net, group=group, impl=impl)


def measure(model):
    opt = optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(rank)
    batches = [distlab.tensor(rng.standard_normal((8, WIDTH)).astype(np.float32)) for _ in range(STEPS + 1)]

    def step(x):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    step(batches[0])  # the first step checks the model across ranks: not counted
    world.barrier()
    before = link_bytes()
    for x in batches[1:]:
        step(x)
    world.barrier()
    return (link_bytes() - before) / STEPS


mesh = DeviceMesh((2, 2), ("replicate", "shard"))
assert mesh.get_group("shard").size == 2 and mesh.get_group("replicate").size == 2
hybrid = shard(build(), mesh)
hybrid_bytes = measure(hybrid)
flat = shard(build(), None)
flat_bytes = measure(flat)
ddp_bytes = measure(DDP(build(), bucket_cap_mb=25))
params = sum(p.data.size for p in build().parameters())
padded = sum(-(-p.shape[0] // 2) * 2 * (p.data.size // p.shape[0]) for p in build().parameters())
payload = padded * 4  # per step and host: its 2 shards of every group, 4 bytes an element, all-reduced once
print(f"rank {rank}: per step and host, hybrid sent {hybrid_bytes / 1e6:.3f} MB on the link (shards "
      f"{payload / 1e6:.3f} MB), flat sharding {flat_bytes / 1e6:.3f} MB, DDP {ddp_bytes / 1e6:.3f} MB", flush=True)
assert payload <= hybrid_bytes <= 1.25 * payload, (hybrid_bytes, payload)  # shards, plus TCP/IP headers
assert flat_bytes >= 2 * hybrid_bytes, (flat_bytes, hybrid_bytes)
whole = [get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)) for m in (hybrid, flat)]
for key in whole[0]:
    assert np.allclose(whole[0][key], whole[1][key], rtol=1e-5, atol=1e-6), key
print(f"rank {rank}: only shards crossed the link", flush=True)
