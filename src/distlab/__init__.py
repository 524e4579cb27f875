"""distlab: the machinery inside distributed deep-learning runtimes, re-implemented over MPI.

Everything public is reachable from here, loaded on first use (PEP 562), so ``import distlab`` is cheap and
starts no MPI: ``distlab.DistributedDataParallel``, ``distlab.Join``, ``distlab.rpc.rpc_sync``,
``distlab.collectives.allreduce`` ... import their module when first touched. MPI is initialised by the first
module that needs it (``distlab.comm`` and everything built on it).

``distlab.IMPL`` names the active twin (``"core"`` or ``"reference"``, chosen by ``DISTLAB_IMPL``).
"""
import importlib as _importlib

# _malloc: glibc keeps freed memory for the next step when the program asks (keep_freed_memory(), or
# DISTLAB_MALLOC=keep, read here); importing distlab alone leaves malloc as it is
from . import _backend, _malloc, _mpi  # noqa: F401

__version__ = "0.1.0"

#: The active twin: "core" (the default, compiled Cython) or "reference" (pure Python).
IMPL: str = _backend.active_impl()

if IMPL == "core":
    # Fail now, with the build hint, rather than at first use (no silent fallback). Only the extension files are
    # looked up: loading them would import mpi4py and initialise MPI.
    _backend.check_core_built()

# No MPI library for mpi4py to load: say now how to install one (files are looked at; MPI is not started).
_mpi.check_installed()

#: Public subpackages and modules, imported on first attribute access.
_SUBMODULES = (
    "autograd", "nn", "optim", "data",
    "comm", "futures", "errors", "timeline", "launch",
    "ddp", "ddp_comm_hooks", "join", "metrics", "fsdp",
    "collectives", "rpc", "distributed_autograd",
    "cluster", "checkpoint",
)

#: Public names defined in a submodule: name -> module that defines it.
_ATTRIBUTES = {
    "run": "distlab.launch",
    "keep_freed_memory": "distlab._malloc",
    "ReduceOp": "distlab._types",
    "ShardedArray": "distlab._types",
    "Tensor": "distlab.autograd",
    "tensor": "distlab.autograd",
    "no_grad": "distlab.autograd",
    "enable_grad": "distlab.autograd",
    "manual_seed": "distlab.nn.init",
    "DistributedDataParallel": "distlab.ddp",
    "fully_shard": "distlab.fsdp",
    "Join": "distlab.join",
    "Joinable": "distlab.join",
    "JoinHook": "distlab.join",
    "DistlabError": "distlab.errors",
    "DistTimeoutError": "distlab.errors",
    "CollectiveMismatchError": "distlab.errors",
    "ProcessGroupBrokenError": "distlab.errors",
    "RankFailedError": "distlab.errors",
}

__all__ = ["IMPL", "__version__", *_ATTRIBUTES, *_SUBMODULES]


def __getattr__(name: str):
    if name in _ATTRIBUTES:
        value = getattr(_importlib.import_module(_ATTRIBUTES[name]), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'distlab' has no attribute {name!r}")
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__():
    return sorted(__all__)
