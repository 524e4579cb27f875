"""DDP and module buffers, on both twins: rank 0's buffers are broadcast before each forward when
broadcast_buffers is on (also a buffer the module reassigned since the last forward), left alone when off;
the wrapper's own buffers()/named_buffers() work.

Each rank feeds inputs filled with rank + 1; the module adds the input's mean to its buffers in forward and
records the values it saw on entry, so the expected values are known exactly.
"""
import numpy as np

import distlab
from distlab import comm, nn
from distlab.ddp import DistributedDataParallel as DDP
from scenario_checks import DEVICES, on, staged_outside_comm, start_counting, to_device

pg = comm.world()
rank = pg.rank
STEPS = 4


class RunningSum(nn.Module):
    """A Tensor buffer and an ndarray buffer, updated in forward either in place or by reassignment."""

    def __init__(self, reassign):
        super().__init__()
        self.fc = nn.Linear(2, 1, seed=0)
        self.register_buffer("total", distlab.tensor(np.full(2, 10.0 * rank)))  # differs until DDP syncs it
        self.register_buffer("count", np.full(1, 5.0 * rank))
        self.reassign = reassign
        self.seen = []

    def forward(self, x):
        self.seen.append((float(self.total.data[0]), float(self.count[0])))
        step = x.data.mean(axis=0)
        if self.reassign:
            self.total = self.total + step  # a new Tensor: DDP must broadcast this one, not the first
            self.count = self.count + 1.0  # a new ndarray
        else:
            self.total.data += step
            self.count += 1.0
        return self.fc(x).sum()


for device, impl in ((device, impl) for device in DEVICES for impl in ("reference", "core")):
    start_counting(device)
    for reassign in (False, True):
        for broadcast in (True, False):
            module = to_device(RunningSum(reassign), device)
            model = DDP(module, broadcast_buffers=broadcast, impl=impl)
            names = [name for name, _ in model.named_buffers()]
            assert names == ["module.total", "module.count"], names
            assert len(list(model.buffers())) == 2
            x = distlab.tensor(on(device, np.full((3, 2), rank + 1.0)))
            for _ in range(STEPS):
                model(x).backward()
            case = f"{impl} {device} reassign={reassign} broadcast_buffers={broadcast}"
            # Construction broadcasts rank 0's buffers (total 0, count 0) on both settings.
            if broadcast:  # every forward starts from rank 0's buffers, which grew by 1 per step on rank 0
                expected = [(float(k), float(k)) for k in range(STEPS)]
            else:  # each rank's buffers grow with its own inputs
                expected = [(float(k * (rank + 1)), float(k)) for k in range(STEPS)]
            assert module.seen == expected, (case, module.seen, expected)
            gathered = pg.allgather_object(module.seen)
            assert all(g == gathered[0] for g in gathered) == (broadcast or pg.size == 1), case
    assert not staged_outside_comm(device), staged_outside_comm(device)
print(f"rank {rank}: DDP buffer checks OK (numpy and the device stand-in)", flush=True)
