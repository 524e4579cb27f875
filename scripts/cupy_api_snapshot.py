"""Snapshot real cupy's API, for the check that the device stand-in (``distlab.fakegpu``) calls nothing cupy lacks.

Run with a Python that has cupy (no GPU needed: only names, signatures and docstrings are read)::

    python scripts/cupy_api_snapshot.py                   # writes tests/data/cupy_api.json
    python scripts/cupy_api_snapshot.py --out other.json

It records, for each cupy namespace the stand-in mirrors (:data:`NAMESPACES`: ``cupy``, ``cupy.cuda``,
``cupy.cuda.runtime``, ``cupy.cuda.nccl``, ``cupy.cuda.memory``, ``cupy.random``, ``cupy.lib.stride_tricks``,
``cupy.linalg``), every
public name with its kind, and for a callable its parameters (name, kind, default where readable) and, where the
docstring says it, its return type; and for each cupy class the stand-in mirrors or distlab calls (:data:`CLASSES`)
every member, dunders included, its constructor's parameters and the instance attributes its docstring lists.
Cython functions are read from the first line of their docstring (``ipcOpenMemHandle(bytes handle, unsigned int
flags=...)``), Python ones with :func:`inspect.signature`. The stand-in's names that cupy lacks are listed under
``"missing"`` (read from ``src/`` of this checkout; ``tests/test_fakegpu_matches_cupy.py`` holds the reasons).

The same functions describe the stand-in's objects in that test, so both sides are read alike.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "data" / "cupy_api.json"

#: stand-in module -> the cupy namespace it stands for
NAMESPACES = {
    "distlab.fakegpu": "cupy",
    "distlab.fakegpu.cuda": "cupy.cuda",
    "distlab.fakegpu.cuda.runtime": "cupy.cuda.runtime",
    "distlab.fakegpu.cuda.nccl": "cupy.cuda.nccl",
    "distlab.fakegpu.cuda.memory": "cupy.cuda.memory",
    "distlab.fakegpu.random": "cupy.random",
    "distlab.fakegpu.lib": "cupy.lib",
    "distlab.fakegpu.lib.stride_tricks": "cupy.lib.stride_tricks",
    "distlab.fakegpu.linalg": "cupy.linalg",
}
#: the cupy classes snapshotted member by member: the stand-in's, and those distlab calls on cupy only
CLASSES = ("cupy.ndarray", "cupy.ElementwiseKernel", "cupy.RawKernel", "cupy.ufunc", "cupy.cuda.Stream",
           "cupy.cuda.ExternalStream", "cupy.cuda.Event", "cupy.cuda.Device", "cupy.cuda.BaseMemory",
           "cupy.cuda.Memory", "cupy.cuda.UnownedMemory", "cupy.cuda.MemoryPointer", "cupy.cuda.PinnedMemoryPointer",
           "cupy.cuda.memory.BaseMemory", "cupy.cuda.memory.Memory", "cupy.cuda.memory.UnownedMemory",
           "cupy.cuda.memory.MemoryPointer", "cupy.cuda.memory.CUDARuntimeError", "cupy.cuda.runtime.CUDARuntimeError",
           "cupy.cuda.nccl.NcclCommunicator", "cupy.cuda.nccl.NcclError", "cupy.random.Generator",
           "cupy.random.RandomState")
#: what functions return where the docstring does not say it (read in cupy 14.2.0's source)
_RETURNS = {
    "cupy.cuda.nccl.get_unique_id": "bytes",  # uniqueId.internal[:NCCL_UNIQUE_ID_BYTES]; a tuple before cupy 14
    "cupy.cuda.nccl.get_version": "int",
    "cupy.cuda.nccl.get_build_version": "int",
    "cupy.cuda.runtime.ipcGetMemHandle": "bytes",  # bytes(reserved), the 64-byte cudaIpcMemHandle_t
    "cupy.cuda.runtime.ipcOpenMemHandle": "intptr_t",  # <intptr_t>devPtr
    "cupy.cuda.runtime.getDeviceProperties": "dict",  # name and uuid as bytes (uuid cut at its first zero byte)
}
#: instance attributes cupy sets without listing them in the class's docstring (read in cupy's source)
_UNDOCUMENTED = {"cupy.cuda.nccl.NcclError": ["status"]}  # NcclError.__init__: self.status = status
_KINDS = {"POSITIONAL_ONLY": "positional_only", "POSITIONAL_OR_KEYWORD": "positional_or_keyword",
          "VAR_POSITIONAL": "var_positional", "KEYWORD_ONLY": "keyword_only", "VAR_KEYWORD": "var_keyword"}
#: dunders every class has, or that say nothing of an API
_PLUMBING = {"__module__", "__doc__", "__dict__", "__weakref__", "__slots__", "__qualname__", "__annotations__",
             "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__", "__init__",
             "__getattr__", "__annotate__", "__annotate_func__", "__annotations_cache__"}


def resolve(dotted: str):
    """The object at ``dotted`` (a module, or attributes below one), importing modules on the way."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))  # e.g. cupy.cuda.nccl, loaded on import only
    return obj


# -- reading a callable's parameters ---------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def doc_signature(obj, name: str):
    """``(params, returns)`` from the first docstring line ``name(TYPE a, b=1, *, c=None) -> T`` (Cython's
    embedded signature), or None when the docstring does not start with one."""
    doc = (getattr(obj, "__doc__", None) or "").lstrip()
    first = doc.split("\n", 1)[0]
    match = re.match(r"(?:[\w.]*\.)?(?:%s|__init__)\((.*)\)\s*(?:->\s*(\S.*?))?\s*$" % re.escape(name), first)
    if match is None:
        return None
    params, kind = [], "positional_or_keyword"
    for part in _split_top(match.group(1)):
        part = part.replace("\\*", "*")
        if part == "/":
            for p in params:
                p["kind"] = "positional_only"
            continue
        if part == "*":
            kind = "keyword_only"
            continue
        left, eq, default = part.partition("=")
        words = left.split()
        pname = words[-1]
        entry = {"name": pname.lstrip("*"), "kind": kind}
        if len(words) > 1:
            entry["type"] = " ".join(words[:-1])  # the type Cython enforces (bytes, intptr_t, ...)
        if pname.startswith("**"):
            entry["kind"] = "var_keyword"
        elif pname.startswith("*"):
            entry["kind"], kind = "var_positional", "keyword_only"
        if eq:
            entry["default"] = default.strip()
        params.append(entry)
    if params and params[0]["name"] == "self":
        params = params[1:]
    return params, match.group(2)


def _default(value) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}".replace("builtins.", "")
    return repr(value)


def parameters(obj, name: str):
    """``(params, returns)`` of a callable: its signature where Python can read one, else its docstring's."""
    target = obj
    if isinstance(obj, type):
        target = obj.__init__ if "__init__" in vars(obj) or not hasattr(obj, "__new__") else obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    read = doc_signature(obj, name) or (doc_signature(target, "__init__") if isinstance(obj, type) else None)
    if sig is not None and not _opaque(sig):
        params = [{"name": p.name, "kind": _KINDS[p.kind.name],
                   **({} if p.default is p.empty else {"default": _default(p.default)}),
                   **({} if p.annotation is p.empty else {"type": _annotation(p.annotation)})}
                  for p in sig.parameters.values()]
        if params and params[0]["name"] == "self":
            params = params[1:]
        returns = None if sig.return_annotation is sig.empty else _annotation(sig.return_annotation)
        return params, read[1] if read else returns
    return read if read else (None, None)


def _annotation(value) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


def _opaque(sig) -> bool:
    """A signature that says nothing (``(*args, **kwargs)``, Cython's generic constructor)."""
    params = list(sig.parameters.values())
    return bool(params) and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name.startswith("_")
                                for p in params)


def returns_from_doc(obj):
    """The type a Google-style ``Returns:`` section names (``cupy.cuda.Event: The recorded event.``)."""
    doc = getattr(obj, "__doc__", None) or ""
    match = re.search(r"\n\s*Returns:\s*\n\s*([\w.\[\], ]+?):", doc)
    return match.group(1).strip() if match else None


# -- describing objects ------------------------------------------------------------------------------------------
def kind_of(value) -> str:
    if isinstance(value, types.ModuleType) or (isinstance(value, type) and value.__name__ == "runtime"
                                                and value.__module__ == "distlab.fakegpu.cuda"):
        return "module"
    if isinstance(value, type):
        return "class"
    if isinstance(value, (bool, int, float, complex, str, bytes)) or value is None:
        return "constant"
    if type(value).__name__ == "ufunc":
        return "ufunc"
    if callable(value):
        return "function"
    return "object"


def describe(value, name: str) -> dict:
    """One name's entry: kind, and for a callable its parameters and return type."""
    entry = {"kind": kind_of(value)}
    if entry["kind"] in ("function", "class", "ufunc"):
        params, returns = parameters(value, name)
        if params is not None:
            entry["params"] = params
        returns = returns or (returns_from_doc(value) if entry["kind"] == "function" else None)
        if returns:
            entry["returns"] = returns
    elif entry["kind"] == "constant":
        entry["type"] = type(value).__name__
        if isinstance(value, (bool, int, float, str)):
            entry["value"] = value
    return entry


def member_kind(cls, name: str) -> str:
    """How ``cls`` holds ``name``: method, property, staticmethod, classmethod or attribute."""
    for klass in inspect.getmro(cls):
        raw = vars(klass).get(name)
        if raw is None:
            continue
        if isinstance(raw, staticmethod):
            return "staticmethod"
        if isinstance(raw, classmethod) or type(raw).__name__ == "classmethod_descriptor":
            return "classmethod"
        if isinstance(raw, property) or type(raw).__name__ in ("getset_descriptor", "member_descriptor"):
            return "property"
        if callable(raw):
            return "method"
        return "attribute"
    return "attribute"


def describe_class(cls, documented=True) -> dict:
    """A class's entry: constructor parameters, every member (dunders too), documented instance attributes."""
    entry = describe(cls, cls.__name__)
    members = {}
    for name in sorted(dir(cls)):
        if name in _PLUMBING or (name.startswith("__") and getattr(cls, name, None) is getattr(object, name, 0)):
            continue
        kind = member_kind(cls, name)
        member = {"kind": kind}
        if kind in ("method", "staticmethod", "classmethod") and not name.startswith("__"):
            params, returns = parameters(getattr(cls, name), name)
            if params is not None:
                member["params"] = params
            returns = returns or returns_from_doc(getattr(cls, name))
            if returns:
                member["returns"] = returns
        members[name] = member
    entry["members"] = members
    if documented:
        entry["instance_attributes"] = instance_attributes(cls)
    return entry


def instance_attributes(cls) -> list[str]:
    """The attributes a class's docstring lists (``Attributes:`` then ``~Stream.ptr (intptr_t): ...``), its
    bases' too: what instances carry that the class itself does not show."""
    names = set()
    for klass in inspect.getmro(cls):
        doc = klass.__doc__ or ""
        section = re.search(r"\n\s*Attributes:\s*\n(.*?)(?:\n\s*\n\s*\S+:\s*\n|\Z)", doc, re.S)
        if section:
            names.update(m.group(1) for m in re.finditer(r"^\s+~?(?:[\w]+\.)*(\w+)\s*\(", section.group(1), re.M))
    return sorted(names)


def public_names(module) -> list[str]:
    """A namespace's public names: no ``_`` prefix, no foreign module, no ``from __future__`` feature."""
    import __future__

    own = getattr(module, "__name__", "")
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, __future__._Feature):
            continue
        if isinstance(value, types.ModuleType) and not value.__name__.startswith(own + "."):
            continue  # an import (numpy as np, time ...), not the namespace's own submodule
        names.append(name)
    return sorted(names)


# -- the snapshot ----------------------------------------------------------------------------------------------
def snapshot() -> dict:
    import cupy
    import numpy

    stand_in = stand_in_names()
    out = {"cupy": cupy.__version__, "numpy": numpy.__version__,
           "python": ".".join(map(str, sys.version_info[:3])), "namespaces": {}, "classes": {}}
    try:
        import cupy.cuda.nccl as nccl
        out["nccl"] = nccl.get_version() if nccl.available else None
    except Exception:  # noqa: BLE001 - recorded as absent
        out["nccl"] = None
    for path in NAMESPACES.values():
        module = resolve(path)
        names = {n for n in dir(module) if not n.startswith("_")} | set(stand_in.get(path, ()))
        entries = {}
        for name in sorted(names):
            try:
                value = getattr(module, name)
            except AttributeError:
                continue
            entries[name] = describe(value, name)
            if f"{path}.{name}" in _RETURNS:
                entries[name]["returns"] = _RETURNS[f"{path}.{name}"]
        out["namespaces"][path] = entries
    for path in CLASSES:
        out["classes"][path] = entry = describe_class(resolve(path))
        entry["instance_attributes"] = sorted(set(entry["instance_attributes"]) | set(_UNDOCUMENTED.get(path, ())))
    out["missing"] = sorted(f"{path}.{name}" for path, names in stand_in.items() for name in names
                            if name not in out["namespaces"][path])
    return out


def stand_in_names() -> dict:
    """cupy namespace -> the public names the stand-in of this checkout defines in it (``{}`` when the stand-in
    cannot be imported here: the snapshot of cupy stands without it, with no ``missing`` list)."""
    try:
        import distlab.fakegpu  # noqa: F401 - as installed (the device check's tests), or from src/ below
    except Exception:  # noqa: BLE001 - not installed, or its core not built: this checkout's, on the reference twin
        for name in [m for m in sys.modules if m == "distlab" or m.startswith("distlab.")]:
            del sys.modules[name]
        os.environ.setdefault("DISTLAB_IMPL", "reference")  # the stand-in needs no compiled core
        sys.path.insert(0, str(REPO / "src"))
        try:
            import distlab.fakegpu  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"the stand-in is not importable ({exc}): no 'missing' list", file=sys.stderr)
            return {}
    names = {}
    for stand_in, cupy_path in NAMESPACES.items():
        try:
            names[cupy_path] = public_names(resolve(stand_in))
        except (ImportError, AttributeError):
            continue
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON")
    args = parser.parse_args(argv)
    snap = snapshot()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"cupy {snap['cupy']}: {sum(map(len, snap['namespaces'].values()))} names, {len(snap['classes'])} "
          f"classes -> {args.out}; the stand-in's names cupy lacks: {snap['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
