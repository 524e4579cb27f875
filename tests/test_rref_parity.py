"""Twin contract for the RRef component, including constructors.

``tests/test_api_parity.py`` cannot read a Cython extension type's ``__init__`` signature (a slot wrapper shows
``(self, /, *args, **kwargs)``); Cython's ``embedsignature`` puts it on the first line of the class docstring
instead, so here constructors are compared through that line (C types dropped).
"""
import inspect
import re

from distlab import _backend


def _ctor_from_doc(cls):
    first = (cls.__doc__ or "").split("\n", 1)[0]
    match = re.fullmatch(rf"{cls.__name__}\((.*)\)", first)
    assert match, f"{cls.__name__}: no embedded signature in {first!r}"
    params = []
    for part in filter(None, (p.strip() for p in match.group(1).split(","))):
        name, _, default = part.partition("=")
        params.append((name.split()[-1], default or None))
    return params


def _ctor_from_python(cls):
    sig = inspect.signature(cls.__init__)
    return [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in list(sig.parameters.values())[1:]]


def test_rref_constructors_match():
    twins = _backend.load_twins("rref")
    for name in twins["reference"].__all__:
        ref_obj = getattr(twins["reference"], name)
        if inspect.isclass(ref_obj):
            assert _ctor_from_python(ref_obj) == _ctor_from_doc(getattr(twins["core"], name)), name


def test_rref_methods_match():
    twins = _backend.load_twins("rref")
    for name in twins["reference"].__all__:
        ref_obj, core_obj = getattr(twins["reference"], name), getattr(twins["core"], name)
        assert callable(core_obj), name
        if not inspect.isclass(ref_obj):
            continue
        for member in (m for m in vars(ref_obj) if not m.startswith("_")):  # private ones are cdef in core
            ref_member = getattr(ref_obj, member)
            if callable(ref_member):
                core_member = getattr(core_obj, member)
                ref_sig = [(p.name, p.kind, repr(p.default))
                           for p in inspect.signature(ref_member).parameters.values()]
                core_sig = [(p.name, p.kind, repr(p.default))
                            for p in inspect.signature(core_member).parameters.values()]
                assert ref_sig == core_sig, f"{name}.{member}"
