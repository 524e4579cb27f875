"""The registry of twinned components: the one list that names each component's reference and core modules.

Every other list is read from this one: ``distlab._backend.COMPONENTS`` (the module :func:`distlab._backend.load`
returns), ``CORE_MODULES`` in setup.py (the extensions it compiles; setup.py runs this file without importing
distlab), ``TWINS`` in tests/_architecture.py (the files whose layout and order it checks) and the twin fixtures
of tests/conftest.py. Adding a component's twins is one line here plus its files.

This module imports nothing (setup.py executes it on its own, before distlab is built).
"""

__all__ = ["TWINS"]

#: component -> (reference modules in reading order, the reference module ``load`` returns, core extension).
#: The core extension ``core/_<name>.pyx`` includes one ``core/_<module>.pxi`` per reference module before it,
#: in the same order, so that core/ lines up with reference/ file for file.
TWINS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "fingerprint": (("fingerprint",), "fingerprint", "_fingerprint"),
    "reducer": (("reducer",), "reducer", "_reducer"),
    "join": (("join",), "join", "_join"),
    "rref": (("rref_impl", "rref_context"), "rref", "_rref"),
    "autograd_container": (("autograd_context", "autograd_container"), "autograd_container", "_autograd_container"),
    "negotiation": (("messages", "response_cache", "coordinator", "negotiation"), "negotiation", "_negotiation"),
    "rpc_framing": (("rpc_framing",), "rpc_framing", "_rpc_framing"),
    "rpc_wait": (("rpc_wait",), "rpc_wait", "_rpc_wait"),
    "fsdp": (("fsdp_param", "fsdp_collectives", "fsdp_param_group"), "fsdp_param_group", "_fsdp_param_group"),
}
