"""Training that resumes from its checkpoints; run under ``--max-restarts``. argv: impl, output prefix, checkpoint
directory, kill ("none", "RANK:DEVICE:STEP" to SIGKILL rank RANK after step STEP, or "save:RANK:DEVICE:STEP" to
SIGKILL it halfway through writing the checkpoint of step STEP), both in the first attempt only.

On numpy and on the device stand-in: DDP (small buckets, so that the layout rebuilt after the first step matters)
with Adam, a model with dropout and inputs with noise from numpy's global generator, a shuffling
DistributedSampler over 2 epochs. Every second step the whole TrainState is saved into ``step-N``; a run that
starts (again) loads the newest checkpoint that loads, so a checkpoint left partial by a rank killed while saving
is refused and the one before it used. Each rank pickles its parameters, optimizer state and losses; the test
compares a restarted run with an uninterrupted one, bit for bit.
"""
import os
import pickle
import signal
import sys
from pathlib import Path

import numpy as np

import distlab
from distlab import checkpoint, comm, nn, optim
from distlab.checkpoint import _storage
from distlab.data import DistributedSampler
from distlab.ddp import DistributedDataParallel as DDP
from distlab.errors import CheckpointException
from scenario_checks import DEVICES, host, on, to_device, twin_of

impl_arg, prefix, root, kill = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
world = comm.world()
rank, size = world.rank, world.size
impl = twin_of(rank, impl_arg)
attempt = int(os.environ.get("DISTLAB_RESTART_COUNT", "0"))
EPOCHS, BATCH, EVERY = 2, 4, 2
data = np.random.default_rng(42)
X = data.standard_normal((48, 6)).astype(np.float32)
Y = data.standard_normal((48, 2)).astype(np.float32)
killed = None
if kill != "none" and attempt == 0:
    parts = kill.split(":")
    killed = (parts[0] == "save",) + (int(parts[-3]), parts[-2], int(parts[-1]))


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def die_while_writing(path, pieces, fsync=True):
    """Write half of the pieces, then die: a save cut short on this rank."""
    pieces = list(pieces)
    write_pieces(path, pieces[:max(1, len(pieces) // 2)], fsync)
    die()


def resume(state, directory: Path) -> None:
    """Load the newest checkpoint that loads (every rank sees the same refusals: a load is collective)."""
    steps = sorted((int(p.name[5:]) for p in directory.glob("step-*")), reverse=True)
    for step in steps:
        try:
            checkpoint.load({"train": state}, directory / f"step-{step}")
            print(f"resumed {directory.name} from step {step}", flush=True)
            return
        except CheckpointException as exc:
            assert "no whole checkpoint" in str(exc), exc
            partial = "a save that did not finish" in str(exc)  # else a directory a save made before any write
            print(f"refused step-{step}: {'a partial checkpoint' if partial else 'no metadata'}", flush=True)


def train(device):
    np.random.seed(1000 + rank)
    distlab.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.25, seed=rank), nn.Linear(12, 12), nn.Tanh(),
                          nn.Linear(12, 2))
    ddp = DDP(to_device(model, device), bucket_cap_mb=0.0003, impl=impl)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    sampler = DistributedSampler(len(X), shuffle=True, seed=5)
    state = checkpoint.TrainState(ddp, opt, sampler=sampler, step=0, epoch=0, losses=[])
    directory = root / device
    resume(state, directory)
    loss_fn = nn.MSELoss()
    for epoch in range(state.epoch, EPOCHS):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        for batch in sampler.batches(BATCH):
            noise = np.random.standard_normal((len(batch), 6)).astype(np.float32) * 0.01
            opt.zero_grad()
            loss = loss_fn(ddp(distlab.tensor(on(device, X[batch] + noise))), distlab.tensor(on(device, Y[batch])))
            loss.backward()
            opt.step()
            state.step += 1
            state.losses.append(float(host(loss.data)))
            if killed and not killed[0] and killed[1:] == (rank, device, state.step):
                die()
            if state.step % EVERY == 0:
                if killed and killed[0] and killed[1:] == (rank, device, state.step):
                    _storage.write_pieces = die_while_writing
                checkpoint.save({"train": state}, directory / f"step-{state.step}")
    model_state, optim_state = checkpoint.get_state_dict(ddp, opt)
    return {"params": {k: host(v) for k, v in model_state.items()},
            "optim": {name: {k: (host(v) if hasattr(v, "shape") else v) for k, v in s.items()}
                      for name, s in optim_state["state"].items()},
            "losses": list(state.losses), "step": state.step, "buckets": ddp.bucket_state_dict()["buckets"]}


write_pieces = _storage.write_pieces
results = {device: train(device) for device in DEVICES}
with open(f"{prefix}.rank{rank}.pkl", "wb") as fh:
    pickle.dump(results, fh)
print("ckpt_train done", flush=True)
