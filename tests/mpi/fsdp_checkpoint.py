"""A sharded model's checkpoint (distlab.checkpoint on fully_shard's state dicts) resumes at another world size.

argv: directory, "save" or "load". "save" (4 ranks) trains 3 steps with Adam, saves the model's shards and the
optimizer's sharded state, and writes (rank 0) the whole parameters saved and those one more step reaches. "load"
(2 or 3 ranks) builds the same model, loads the checkpoint (resharded from 4 blocks to 2 or 3): the model's live
shards are filled in place by ``checkpoint.load`` alone (each ShardedArray's ``local`` is the parameter's own
array), then the optimizer's state is set; the same fourth step must reach the same parameters.
"""
import sys
from pathlib import Path

import numpy as np

import distlab
from distlab import checkpoint, comm, nn, optim
from distlab.fsdp import StateDictOptions, fully_shard, get_model_state_dict

world = comm.world()
rank = world.rank
path, mode = Path(sys.argv[1]), sys.argv[2]


def build():
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(6, 7), nn.Tanh()), nn.Sequential(nn.Linear(7, 5), nn.Tanh()),
                        nn.Linear(5, 3))
    fully_shard(net[0])
    fully_shard(net[1])
    return fully_shard(net)


model = build()
opt = optim.Adam(model.parameters(), lr=0.01)
x = distlab.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6))


def step():
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    opt.step()


def whole():
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


if mode == "save":
    for _ in range(3):
        step()
    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    assert all(isinstance(v, distlab.ShardedArray) for v in model_sd.values())
    checkpoint.save({"model": model_sd, "optim": optim_sd}, str(path / "ckpt"))
    saved = whole()
    step()
    reached = whole()
    if rank == 0:
        np.savez(path / "saved.npz", **saved)
        np.savez(path / "reached.npz", **reached)
else:
    step()  # the optimizer's state exists, shaped like this world's shards: the template to load into
    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    params = dict(model.named_parameters())
    assert all(model_sd[name].local is params[name].data for name in params), "the live shards, not copies"
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.load(state, str(path / "ckpt"))
    loaded, saved = whole(), np.load(path / "saved.npz")  # the model filled in place by load alone
    for key in saved.files:
        assert np.array_equal(saved[key], loaded[key]), (key, saved[key], loaded[key])
    checkpoint.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step()
    reached, expected = whole(), np.load(path / "reached.npz")
    for key in expected.files:
        assert np.allclose(expected[key], reached[key], rtol=1e-6, atol=1e-7), (key, expected[key], reached[key])
    print(f"rank {rank}: resumed at {world.size} ranks, the run saved at 4 continues alike", flush=True)
