"""distlab.rpc.wrappers: the registry through which distributed autograd rewrites RPCs without rpc importing it."""
from __future__ import annotations

import pytest

from distlab.rpc import wrappers


@pytest.fixture
def clean_registry():
    saved = wrappers.registered
    wrappers.registered = ()
    yield wrappers
    wrappers.registered = saved


def test_no_wrapper_leaves_the_call_alone(clean_registry):
    assert clean_registry.wrap_call(1, print, (1,), None) is None


def test_wrappers_compose_in_order_and_unwrap_in_reverse(clean_registry):
    seen = []

    def outer(dst, func, args, kwargs, remote):
        seen.append(("outer", dst, func, args, remote))
        return "f1", ("a1",) + tuple(args), {"k": 1}, lambda reply: ("outer", reply)

    def skip(dst, func, args, kwargs, remote):
        seen.append(("skip", func))
        return None

    def inner(dst, func, args, kwargs, remote):
        seen.append(("inner", func, args, kwargs))
        return "f2", args, kwargs, lambda reply: ("inner", reply)

    remove_outer = clean_registry.register_call_wrapper(outer)
    clean_registry.register_call_wrapper(skip)
    clean_registry.register_call_wrapper(inner)
    func, args, kwargs, unwrap = clean_registry.wrap_call(3, print, (7,), None, remote=True)
    assert (func, args, kwargs) == ("f2", ("a1", 7), {"k": 1})
    assert seen == [("outer", 3, print, (7,), True), ("skip", "f1"), ("inner", "f1", ("a1", 7), {"k": 1})]
    assert unwrap("reply") == ("outer", ("inner", "reply"))  # the last wrapper's unwrap runs first
    remove_outer()
    assert not clean_registry.is_registered(outer) and clean_registry.is_registered(inner)
    assert clean_registry.wrap_call(3, print, (7,), None)[0] == "f2"
    clean_registry.unregister_call_wrapper(outer)  # unregistering twice is harmless


def test_registration_errors(clean_registry):
    with pytest.raises(TypeError, match="must be callable"):
        clean_registry.register_call_wrapper(42)

    def wrapper(*args):
        return None

    clean_registry.register_call_wrapper(wrapper)
    with pytest.raises(ValueError, match="registered already"):
        clean_registry.register_call_wrapper(wrapper)


def test_rpc_never_imports_distributed_autograd():
    import _architecture

    graph = _architecture.import_graph()
    rpc_modules = [m for m in graph if m == "distlab.rpc" or m.startswith("distlab.rpc.")]
    assert rpc_modules
    for module in rpc_modules:
        assert not any(t.startswith("distlab.distributed_autograd") for t in graph[module]), module
    assert any(t.startswith("distlab.rpc") for t in graph["distlab.distributed_autograd._state"])
