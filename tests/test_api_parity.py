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
    # Defaults compare by value: an IntEnum default in one twin equals the plain int in the other.
    return [(p.name, p.kind, p.default) for p in parameters]


def _split_top_level(text):
    """Split a parameter list at commas outside brackets."""
    pieces, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{" and 1 or 0
        depth -= char in ")]}" and 1 or 0
        if char == "," and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in pieces + [current] if p.strip()]


def _drop_c_types(piece):
    """``int owner=0`` -> ``owner=0``: Cython embeds C types of typed arguments in the signature."""
    name, eq, default = piece.partition("=")
    return name.split()[-1] + (eq + default if eq else "")


def _constructor_signature(cls, module):
    """A class's constructor parameters, without ``self``.

    A Cython ``cdef class`` exposes no ``__init__`` signature to inspect; with ``embedsignature`` its docstring
    starts with ``Name(params)``, whose defaults are evaluated here in the defining module's namespace.
    """
    try:
        found = _signature(cls.__init__)[1:]
        # object.__init__ (a cdef class initialised in __cinit__) says only (*args, **kwargs): look further.
        if not all(kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for _, kind, _ in found):
            return found
    except TypeError:
        pass
    first_line = (cls.__doc__ or "").split("\n", 1)[0]
    prefix = f"{cls.__name__}("
    if not first_line.startswith(prefix) or not first_line.endswith(")"):
        return None
    params = ", ".join(_drop_c_types(piece) for piece in _split_top_level(first_line[len(prefix):-1]))
    fake = eval(f"lambda {params}: None", dict(vars(module)))  # noqa: S307 - our own compiled docstring
    return _signature(fake)


@pytest.mark.parametrize("component", sorted(_backend.COMPONENTS))
def test_same_names_and_signatures(component):
    twins = _backend.load_twins(component)
    ref, core = (_public(twins[i]) for i in ("reference", "core"))
    assert sorted(ref) == sorted(core), f"{component}: __all__ differs"
    for name, ref_obj in ref.items():  # noqa: PLR1702
        core_obj = core[name]
        assert callable(ref_obj) == callable(core_obj), f"{component}.{name}"
        if inspect.isclass(ref_obj):
            if "__init__" in vars(ref_obj):
                ref_init = _constructor_signature(ref_obj, twins["reference"])
                core_init = _constructor_signature(core_obj, twins["core"])
                assert ref_init == core_init, f"{component}.{name}(): constructor signatures differ"
            members = [m for m in vars(ref_obj) if not m.startswith("_")]
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
    core, reference = _backend.load(component, "core"), _backend.load(component, "reference")
    for name in core.__all__:
        obj = getattr(core, name)
        if obj is getattr(reference, name, None):
            continue  # one object shared by both twins (from distlab._common): documented where it is defined
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
