"""distlab.rpc: RPC over MPI point-to-point and remote references (RRefs) with PyTorch's RRef protocol.

``init_rpc``/``shutdown``, ``rpc_sync``/``rpc_async``/``remote``, ``RRef``, ``rref_debug_info``; the agent
(listener thread, thread pool, futures matched by message id) is :class:`distlab.rpc.agent.RpcAgent`, and the
RRef protocol state is the active twin's ``RRefContext`` (``distlab._backend.load("rref")``).
"""
from .agent import CallInfo, WorkerInfo, current_call
from .api import cheap, get_agent, get_worker_info, init_rpc, is_initialized, remote, rpc_async, rpc_sync, shutdown
from .rref import RRef, rref_debug_info

__all__ = ["init_rpc", "shutdown", "get_worker_info", "rpc_sync", "rpc_async", "remote", "cheap", "get_agent",
           "is_initialized", "WorkerInfo", "CallInfo", "current_call", "RRef", "rref_debug_info"]
