"""The twin switch: which implementation of the twinned components is active.

``DISTLAB_IMPL`` selects it:

``auto`` (default)
    the Cython core twin. If it is not compiled, importing distlab fails with an ImportError that says how to
    build it. There is never a silent fallback to the reference twin.
``core``
    the same, stated explicitly.
``reference``
    the readable pure-Python twin.

Each twinned component is registered once, in :data:`distlab._twins.TWINS`; :data:`COMPONENTS` gives its
reference module and its core module, both of which define the same ``__all__``. Facade modules (``distlab.ddp``, ...) call :func:`load` to get the active one.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from types import ModuleType

from ._env import choice
from ._twins import TWINS
from .errors import CoreNotBuiltError

__all__ = ["IMPLS", "COMPONENTS", "requested_impl", "active_impl", "check_core_built", "load", "load_twins",
           "core_available"]

IMPLS = ("reference", "core")

#: component name -> (reference module, core module), read from the one registry, :data:`distlab._twins.TWINS`.
COMPONENTS: dict[str, tuple[str, str]] = {
    name: (f"distlab.reference.{loaded}", f"distlab.core.{core}") for name, (_files, loaded, core) in TWINS.items()
}

BUILD_HINT = (
    "build it with `make build` (or `pip install -e .` in the repository), "
    "or set DISTLAB_IMPL=reference to use the pure-Python twin"
)


def requested_impl() -> str:
    """Return the value of ``DISTLAB_IMPL`` (``auto``, ``reference`` or ``core``), validated."""
    return choice("DISTLAB_IMPL", "auto", ("auto",) + IMPLS)


def active_impl() -> str:
    """Return the twin in use: ``"core"`` for ``auto`` and ``core``, else ``"reference"``."""
    return "reference" if requested_impl() == "reference" else "core"


def check_core_built() -> None:
    """Raise :class:`~distlab.errors.CoreNotBuiltError` unless every core module of :data:`COMPONENTS` is compiled.

    Looks the extension modules up without loading them (loading one imports mpi4py, which initialises MPI).
    """
    for _reference_name, core_name in COMPONENTS.values():
        try:
            spec = importlib.util.find_spec(core_name)
        except ImportError as exc:
            spec, reason = None, str(exc)
        else:
            reason = "no compiled module found"
        if spec is None or not spec.origin or not spec.origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            raise CoreNotBuiltError(f"the distlab core twin ({core_name}) is not compiled: {reason}; {BUILD_HINT}")


def _import_twin(module_name: str, impl: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if impl != "core":
            raise
        raise CoreNotBuiltError(
            f"the distlab core twin ({module_name}) is not compiled: {exc}; {BUILD_HINT}"
        ) from exc


def load(component: str, impl: str | None = None) -> ModuleType:
    """Import and return ``component``'s module from twin ``impl`` (default: the active twin)."""
    try:
        reference_name, core_name = COMPONENTS[component]
    except KeyError:
        raise KeyError(f"unknown twinned component {component!r}; known: {sorted(COMPONENTS)}") from None
    impl = impl or active_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return _import_twin(reference_name if impl == "reference" else core_name, impl)


def load_twins(component: str) -> dict[str, ModuleType]:
    """Return ``{"reference": module, "core": module}`` for ``component`` (for tests and benchmarks)."""
    return {impl: load(component, impl) for impl in IMPLS}


def core_available() -> bool:
    """True when every core module listed in :data:`COMPONENTS` imports."""
    try:
        for component in COMPONENTS:
            load(component, "core")
    except ImportError:
        return False
    return True
