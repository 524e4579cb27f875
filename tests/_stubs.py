"""Typed stubs of the compiled core twin: ``core/_<name>.pyi`` beside each extension, as mpi4py ships its own.

A stub gives an editor, a type checker and a reader what the compiled module hides: its names, their signatures
and types. The core twin's contract is the reference twin's (same ``__all__``, same signatures, checked by
tests/test_api_parity.py), so each stub is generated from the reference modules' source: every public name of
``__all__`` with its annotated signature and a body of ``...``, and the names a twin shares from
``distlab._common`` re-exported from there. tests/test_stubs.py checks that each stub on disk is what this
module generates and that its names and signatures are the compiled module's.

``python tests/_stubs.py`` rewrites the stubs (run it after changing a reference twin's public signatures).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import _architecture as arch

HEADER = '''"""Stub of the compiled {core} (the core twin of {reference}).

Generated from the reference twin by tests/_stubs.py (do not edit; run ``python tests/_stubs.py``); the
documentation is the reference twin's.
"""
'''


def _components() -> dict[str, tuple[str, str]]:
    """component -> (reference module, core module), as distlab._backend.COMPONENTS has them."""
    return {name: (f"distlab.reference.{loaded}", f"distlab.core.{core}")
            for name, (_files, loaded, core) in arch.registry().items()}


def stub_path(component: str) -> Path:
    return arch.CORE / (_components()[component][1].rpartition(".")[2] + ".pyi")


def _signature(node: ast.FunctionDef) -> str:
    """``def name(params) -> returns: ...`` with every default written ``...``."""
    args = node.args
    args.defaults = [ast.Constant(...) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(...) for d in args.kw_defaults]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"def {node.name}({ast.unparse(args)}){returns}: ..."


def _decorators(node: ast.FunctionDef) -> list[str]:
    keep = {"property", "staticmethod", "classmethod"}
    return [f"@{ast.unparse(d)}" for d in node.decorator_list
            if ast.unparse(d) in keep or ast.unparse(d).endswith((".setter", ".getter"))]


def _class_lines(node: ast.ClassDef, inherited: list[ast.FunctionDef]) -> list[str]:
    lines = [f"class {node.name}:"]
    own = [item for item in node.body if isinstance(item, ast.FunctionDef)]
    names = {item.name for item in own}
    for item in own + [f for f in inherited if f.name not in names]:
        if item.name.startswith("_") and item.name != "__init__":
            continue
        lines += [f"    {d}" for d in _decorators(item)]
        lines += ["    " + _signature(item)]
    if len(lines) == 1:
        lines.append("    ...")
    return lines


def _tree(module) -> ast.Module:
    return ast.parse(inspect.getsource(module))


def _find(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    return None


def _shared_methods(cls) -> list[ast.FunctionDef]:
    """The methods a reference class inherits from its bases in distlab._common (the core binds them)."""
    out = []
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("distlab._common"):
            node = _find(_tree(sys.modules[base.__module__]), base.__name__)
            out += [item for item in node.body if isinstance(item, ast.FunctionDef)]
    return out


def _only_used(line: str, used: str, own: list[str]) -> str:
    """An import statement cut down to the names ``used`` mentions and the stub does not define itself ('' when
    none, or when it imports the reference twin)."""
    node = ast.parse(line).body[0]
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distlab.reference"):
        return ""
    node.names = [a for a in node.names if (a.asname or a.name) not in own and re.search(rf"\b{re.escape(a.asname or a.name.split('.')[0])}\b", used)]
    return ast.unparse(node) if node.names else ""


def stub_text(component: str) -> str:
    reference_name, core_name = _components()[component]
    reference = importlib.import_module(reference_name)
    defining = []  # the reference modules that define the public names, in order of first use
    for name in reference.__all__:
        module = getattr(getattr(reference, name), "__module__", reference_name) or reference_name
        if module.startswith("distlab.reference") and module not in defining:
            defining.append(module)
    imports: list[str] = []
    for module in defining:
        tree = _tree(sys.modules[module])
        typing_only = [stmt for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body]  # a stub is for type checkers: what they import, it imports
        for node in tree.body + typing_only:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                    isinstance(node, ast.ImportFrom) and (node.level or node.module == "__future__")):
                line = ast.unparse(node)
                if line not in imports:
                    imports.append(line)
    body: list[str] = []
    reexports: list[str] = []
    for name in reference.__all__:
        obj = getattr(reference, name)
        module = getattr(obj, "__module__", None)
        if module and module.startswith("distlab.reference") and (inspect.isclass(obj) or inspect.isfunction(obj)):
            node = _find(_tree(sys.modules[module]), name)
            if isinstance(node, ast.ClassDef):
                body += [""] + _class_lines(node, _shared_methods(obj)) + [""]
            else:
                body += [_signature(node)]
        elif inspect.isclass(obj) or inspect.isfunction(obj):  # a re-export, imported at the top as a stub should
            reexports.append(f"from {obj.__module__} import {obj.__name__} as {name}")
        else:
            body += [f"{name}: {type(obj).__name__}"]
    used = "\n".join(body)
    imports = list(dict.fromkeys(line for line in (_only_used(line, used, reference.__all__) for line in imports)
                                 if line))
    text = HEADER.format(core=core_name, reference=reference_name) + "".join(line + "\n" for line in imports + reexports)
    text += f"\n__all__ = {reference.__all__!r}\n\n" + used
    return "\n".join(line.rstrip() for line in text.splitlines()).replace("\n\n\n\n", "\n\n\n").strip() + "\n"


def main() -> int:
    for component in _components():
        stub_path(component).write_text(stub_text(component), encoding="utf-8")
        print(f"wrote {stub_path(component).relative_to(arch.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
