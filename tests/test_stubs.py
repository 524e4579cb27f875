"""The typed stubs beside the compiled core (core/_<name>.pyi): up to date, and true to the compiled modules.

tests/_stubs.py generates them from the reference twin; see its docstring.
"""
import ast
import inspect

import pytest

import _stubs
from distlab import _backend


def _stub_outline(text: str) -> dict[str, list[str] | None]:
    """name -> parameter names (functions), ``Class.method`` -> parameter names, other names -> None."""
    out: dict[str, list[str] | None] = {}

    def params(node):
        args = node.args
        return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]

    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = None
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    out[f"{node.name}.{item.name}"] = params(item)
        elif isinstance(node, ast.ImportFrom):
            out.update({alias.asname: None for alias in node.names if alias.asname})
        elif isinstance(node, ast.AnnAssign):
            out[node.target.id] = None
    return out


@pytest.mark.parametrize("component", sorted(_backend.COMPONENTS))
def test_the_stub_is_up_to_date(component):
    path = _stubs.stub_path(component)
    assert path.exists() and path.read_text(encoding="utf-8") == _stubs.stub_text(component), (
        f"{path.name} is not what tests/_stubs.py generates: run `python tests/_stubs.py`")


def stub_mismatches(component: str, text: str) -> list[str]:
    """What the stub ``text`` gets wrong about the compiled module: names, or a signature's parameter names."""
    twins = _backend.load_twins(component)
    outline = _stub_outline(text)
    top_level = {name for name in outline if "." not in name}
    problems = []
    if not top_level == set(twins["core"].__all__) == set(twins["reference"].__all__):
        problems.append(f"names {sorted(top_level ^ set(twins['core'].__all__))}")
    for name, stub_params in outline.items():
        owner, _, member = name.partition(".")
        obj = getattr(twins["core"], owner, None)
        obj = getattr(obj, member, None) if member else obj
        if stub_params is None or obj is None or isinstance(obj, property):
            continue
        try:
            compiled = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue
        drop = (lambda params: params[1:] if params[:1] in (["self"], ["cls"]) else params) if member else list
        if drop(stub_params) != drop(compiled):
            problems.append(f"{name}: the stub says {stub_params}, compiled {compiled}")
    return problems


@pytest.mark.parametrize("component", sorted(_backend.COMPONENTS))
def test_the_stub_declares_the_compiled_modules_names_and_signatures(component):
    assert stub_mismatches(component, _stubs.stub_path(component).read_text(encoding="utf-8")) == []


def test_a_stale_stub_fails():
    # guards the test above: a stub that lost a name, or has a parameter the compiled function lacks, is caught
    text = _stubs.stub_text("fingerprint")
    assert stub_mismatches("fingerprint", text) == []
    assert stub_mismatches("fingerprint", text.replace("def find_mismatch(table: np.ndarray)",
                                                       "def find_mismatch(table: np.ndarray, extra)"))
    assert stub_mismatches("fingerprint", text.replace("def find_mismatch(table: np.ndarray) -> str | None: ...", ""))


def stub_untyped(text: str) -> list[str]:
    """The functions of a stub whose return, or a parameter (``self`` and ``cls`` aside), has no type."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef):
            args = node.args
            params = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            params += [a for a in (args.vararg, args.kwarg) if a is not None]
            if node.returns is None or any(a.annotation is None for a in params):
                out.append(node.name)
    return out


@pytest.mark.parametrize("component", ["reducer", "join", "fingerprint"])
def test_the_stub_is_typed(component):
    # an editor and a type checker see the types of what _backend.load hides (the reference twin's annotations)
    assert stub_untyped(_stubs.stub_path(component).read_text(encoding="utf-8")) == []


def test_an_untyped_stub_fails():
    assert stub_untyped("def f(a: int) -> int: ...\nclass C:\n    def g(self, b): ...\n    def h(self) -> None: ...\n") \
        == ["g"]
