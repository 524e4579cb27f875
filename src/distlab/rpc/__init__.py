"""distlab.rpc: RPC over MPI point-to-point and remote references (RRefs) with PyTorch's RRef protocol.

``init_rpc``/``shutdown`` (and ``reinit`` on the survivors of a failure), ``rpc_sync``/``rpc_async``/``remote``, ``RRef``, ``rref_debug_info``, ``get_worker_info``,
``get_worker_infos``, ``get_rpc_timeout``/``_set_rpc_timeout``, ``functions.async_execution`` (PyTorch's names); the agent
(threads taking turns at listening and running requests, callers receiving their own replies, futures matched by
message id) is :class:`distlab.rpc.agent.RpcAgent`, and the RRef protocol state is the active twin's
``RRefContext`` (``distlab._backend.load("rref")``).

MPICH progress throttling: with several threads inside MPI at once (the listener's polls, a caller's polls for
its reply, a send), MPICH's progress engine polls from each of them. ``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1`` lets one poll at a time.
On an idle machine it changes nothing; with another process busy on one of the cores, it made the rpc_sync no-op
about 3x faster and doubled async throughput (docs/measurements.md, "RPC: MPICH progress throttling"). It must be in the environment before MPI is initialised,
so importing ``distlab.rpc`` before ``mpi4py.MPI`` sets it (unless already set); launchers should export it.
"""
import os as _os
import sys as _sys

if "mpi4py.MPI" not in _sys.modules:
    _os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")

from . import functions
from .agent import CallInfo, WorkerInfo, current_call
from .api import (_set_rpc_timeout,  # noqa: F401 - PyTorch's private name, re-exported
                  cheap, get_agent, get_rpc_timeout, get_worker_info, get_worker_infos, init_rpc,
                  is_initialized, reinit, remote, rpc_async, rpc_sync, shutdown)
from .devices import RpcBackendOptions
from .rref import RRef, rref_debug_info

__all__ = ["init_rpc", "shutdown", "reinit", "get_worker_info", "get_worker_infos", "get_rpc_timeout", "rpc_sync", "rpc_async",
           "remote", "cheap", "get_agent", "is_initialized", "WorkerInfo", "CallInfo", "current_call", "RRef",
           "rref_debug_info", "functions", "RpcBackendOptions"]
