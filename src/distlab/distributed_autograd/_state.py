"""This worker's distributed autograd state: the container twin, the attachment to the RPC agent, the timeout,
and the ids of the contexts released here.

Every other module of the package imports this one; it imports none of them. The modules that handle RPC
message kinds register their handlers here with :func:`handles` when imported (the package imports them all),
and :func:`attach` installs them on the running agent, with the call wrapper of :mod:`.forward`.
"""
from __future__ import annotations

import collections
import threading

from distlab import _backend
from distlab.futures import default_timeout
from distlab.rpc import api as rpc_api
from distlab.rpc import wrappers as rpc_wrappers

from . import config

__all__ = ["twin", "use_twin", "handles", "provide_call_wrapper", "attach", "attached_agent", "timeout",
           "remember_released", "is_released", "forget_released"]

_twin = _backend.load("autograd_container")
_attach_lock = threading.Lock()
_attached_agent = None
_handlers: dict = {}  # RPC message kind -> handler(src, payload, meta), filled by @handles at import
_call_wrapper = None  # forward.wrap_call, registered with distlab.rpc on the first attach


def twin():
    """The container twin in use (``distlab._backend.load("autograd_container")``)."""
    return _twin


def use_twin(impl: str) -> None:
    """Switch this worker's container twin (``"reference"`` or ``"core"``) while no context is alive.

    For benchmarks that compare the twins in one job: drops the current container and re-initialises the new
    twin's with the RPC rank; the released ids are forgotten (the new container's ids start again).
    """
    global _twin
    _twin.shutdown()
    _twin = _backend.load("autograd_container", impl)
    _twin.init(rpc_api.get_agent().rank)
    forget_released()


def handles(kind: int):
    """Decorator: make the function the handler of RPC message ``kind`` on every agent this package attaches to."""
    def register(fn):
        _handlers[kind] = fn
        return fn
    return register


def provide_call_wrapper(fn) -> None:
    """Set the function registered with :func:`distlab.rpc.wrappers.register_call_wrapper` on attach."""
    global _call_wrapper
    _call_wrapper = fn


def attached_agent():
    """The agent this worker attached to (None before the first use of distributed autograd)."""
    return _attached_agent


def attach():
    """Attach to the running RPC agent (once per agent) and return it.

    Initialises the container with the RPC rank (a new RPC session with another rank gets a new container),
    registers the distributed autograd message handlers on the agent, and the call wrapper with distlab.rpc
    (which knows nothing of distributed autograd: the dependency runs from here to rpc, never back).
    """
    global _attached_agent
    agent = rpc_api.get_agent()
    if agent is _attached_agent:
        return agent
    with _attach_lock:
        if agent is not _attached_agent:
            if _twin.is_initialized() and _twin.get_container().worker_id != agent.rank:
                _twin.shutdown()
            _twin.init(agent.rank)
            forget_released()
            for kind, handler in _handlers.items():
                agent.register_handler(kind, handler)
            if _call_wrapper is not None and not rpc_wrappers.is_registered(_call_wrapper):
                rpc_wrappers.register_call_wrapper(_call_wrapper)
            _attached_agent = agent
    return agent


def timeout(agent) -> float:
    """The bound of every wait of distributed autograd: the agent's RPC timeout, or ``DISTLAB_TIMEOUT`` when the
    RPC timeout is disabled (0)."""
    return agent.rpc_timeout if agent.rpc_timeout and agent.rpc_timeout > 0 else default_timeout()


# -- released contexts -------------------------------------------------------------------------------------------
# Ids of contexts released on this worker (bounded memory): an RPC of a context that arrives after the release is
# refused instead of re-creating a context nobody will ever release again.
_released_ids: collections.deque = collections.deque(maxlen=config.RELEASED_MEMORY)
_released_set: set = set()
_released_lock = threading.Lock()


def remember_released(context_id) -> None:
    """Remember that ``context_id`` was released here (the oldest id is forgotten when the memory is full)."""
    with _released_lock:
        if context_id in _released_set:
            return
        if len(_released_ids) == _released_ids.maxlen:
            _released_set.discard(_released_ids[0])
        _released_ids.append(context_id)
        _released_set.add(context_id)


def is_released(context_id) -> bool:
    """True if ``context_id`` was released here (and is still remembered)."""
    return context_id in _released_set


def forget_released() -> None:
    """Forget the released ids (a new RPC session, or a new container whose ids start again)."""
    with _released_lock:
        _released_ids.clear()
        _released_set.clear()
