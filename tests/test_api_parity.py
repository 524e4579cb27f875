"""The twin contract, part 1: both twins of every component export the same names with the same signatures."""
import inspect

import pytest

from distlab import _backend


def _public(module):
    return {name: getattr(module, name) for name in module.__all__}


def _signature(obj):
    """Parameter names, kinds and defaults (annotations are the reference's documentation, not contract)."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind, repr(p.default)) for p in parameters]


@pytest.mark.parametrize("component", sorted(_backend.COMPONENTS))
def test_same_names_and_signatures(component):
    twins = _backend.load_twins(component)
    ref, core = (_public(twins[i]) for i in ("reference", "core"))
    assert sorted(ref) == sorted(core), f"{component}: __all__ differs"
    for name, ref_obj in ref.items():
        core_obj = core[name]
        assert callable(ref_obj) == callable(core_obj), f"{component}.{name}"
        if inspect.isclass(ref_obj):
            members = [m for m in vars(ref_obj) if not m.startswith("_") or m == "__init__"]
            for member in members:
                ref_member = getattr(ref_obj, member)
                core_member = getattr(core_obj, member, None)
                assert core_member is not None, f"{component}.{name}.{member} missing from the core twin"
                if callable(ref_member) and _signature(ref_member) is not None:
                    assert _signature(ref_member) == _signature(core_member), f"{component}.{name}.{member}"
        elif callable(ref_obj):
            assert _signature(ref_obj) == _signature(core_obj), f"{component}.{name}"


@pytest.mark.parametrize("component", sorted(_backend.COMPONENTS))
def test_core_docstrings_point_to_the_reference(component):
    core = _backend.load(component, "core")
    for name in core.__all__:
        obj = getattr(core, name)
        if callable(obj):
            assert obj.__doc__ and "distlab.reference" in obj.__doc__, f"{component}.{name}: docstring"


def test_exceptions_are_shared_not_per_twin():
    import distlab.errors

    for component in _backend.COMPONENTS:
        for module in _backend.load_twins(component).values():
            for name in module.__all__:
                obj = getattr(module, name)
                if inspect.isclass(obj) and issubclass(obj, BaseException):
                    assert obj.__module__.startswith("distlab.") and not obj.__module__.startswith(
                        ("distlab.reference", "distlab.core")), f"{name} must be defined in src/distlab"
    assert issubclass(distlab.errors.DistTimeoutError, TimeoutError)
