"""``distlab.checkpoint``: distributed checkpoints that load at any world size (mirrors
``torch.distributed.checkpoint``, DCP).

::

    from distlab import checkpoint

    model_sd, optim_sd = checkpoint.get_state_dict(ddp_model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd, "step": step}, "ckpt/step-100")

    # later, at any world size: build the model and optimizer, then fill them
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    checkpoint.load(state, "ckpt/step-100")
    checkpoint.set_state_dict(ddp_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

- :func:`save`: each rank writes its own pieces into ``__{rank}_{generation}.distcp`` (a replicated array once,
  by the rank with the fewest bytes planned), then the metadata, last, through write, fsync and rename: a
  checkpoint is whole or absent. Every piece and every file has a checksum, checked on load.
- :func:`async_save`: the arrays are copied to host memory at once, the writing overlaps the next steps.
- :func:`load`: fills a state dict in place, resharding: saved at W ranks, loaded at W'. A partial, corrupt or
  mismatched checkpoint is refused on every rank, naming the file and the key, before anything is changed.
- :func:`get_state_dict` / :func:`set_state_dict`: a model's and its optimizers' state keyed by parameter name
  (DDP, ZeroRedundancyOptimizer, the Horovod-style ``DistributedOptimizer``, sharded modules).
- :class:`TrainState` and :class:`RNGState`: the rest of a run's state (sampler position, random generators,
  counters, DDP's bucket layout), so that a resumed run continues bit for bit.

The docs page "Checkpoints and restarts" explains the file layout, what is atomic, and what a restart costs.
"""
from ..errors import CheckpointException
from ._flatten import ShardedSlot
from ._load import load
from ._save import async_save, save
from ._storage import METADATA, read_metadata
from .state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .stateful import RNGState, TrainState

__all__ = ["save", "load", "async_save", "get_state_dict", "set_state_dict", "get_model_state_dict",
           "get_optimizer_state_dict", "set_model_state_dict", "set_optimizer_state_dict", "StateDictOptions",
           "RNGState", "TrainState", "ShardedSlot", "CheckpointException", "METADATA", "read_metadata", "verify"]


def verify(checkpoint_id) -> dict:
    """Check a whole checkpoint on this process alone: its metadata, and the size and checksum of every file.

    Returns the metadata; raises :class:`CheckpointException` naming the first bad file.
    """
    from pathlib import Path

    from . import _storage

    directory = Path(checkpoint_id)
    metadata = _storage.read_metadata(directory)
    for name, info in sorted(metadata["files"].items()):
        mapped = _storage.MappedFile(directory, name, info)
        try:
            mapped.piece(0, info["size"], info["checksum"], f"the whole file {name}")
        finally:
            mapped.close()
    return metadata
