"""The device stand-in (``distlab.fakegpu``) against real cupy 14's API, so that code CI proves on the stand-in
does not meet a name, a parameter or a keyword cupy lacks on its first GPU run.

Without cupy, the checks read ``tests/data/cupy_api.json`` (made from cupy 14.2.0 by
``scripts/cupy_api_snapshot.py``); where cupy imports (the GPU check), the ``gpu`` tests run the same checks
against live cupy and compare the snapshot with it. What is checked:

- every public name of the stand-in's namespaces exists in cupy's, of a compatible kind (a stand-in name cupy
  lacks must be in :data:`ALLOWED`, with its reason); so does every numpy name the facade forwards;
- every public member of the stand-in's classes (and every instance attribute) exists on cupy's class;
- every callable takes cupy's parameters: the same names in the same order (a prefix or subset of cupy's, never a
  parameter cupy lacks, a positional one where cupy's is keyword-only, or a default that differs);
- every call distlab's own code makes through an array module (``xp.cuda.Event(disable_timing=True)``,
  ``runtime.ipcOpenMemHandle(...)``, ``xp.unique(..., return_inverse=True)``...) names something cupy has and
  passes only arguments its signature takes.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import cupy_api_snapshot as api  # noqa: E402

sys.path.remove(str(REPO / "scripts"))

SNAPSHOT = json.loads((REPO / "tests" / "data" / "cupy_api.json").read_text())

#: The stand-in's names cupy lacks, each for a reason; nothing under src/distlab outside the stand-in may use them
#: through an array module (the call-site check below refuses it).
ALLOWED = {
    # distlab's instruments, the reason the stand-in exists: what a GPU would do, counted by the module that asked
    "cupy.transfers": "counts host transfers (tests only)",
    "cupy.total": "counts host transfers (tests only)",
    "cupy.round_trips": "counts host round trips (tests only)",
    "cupy.launches": "counts kernel launches (tests only)",
    "cupy.launch_total": "counts kernel launches (tests only)",
    "cupy.reset": "forgets both counts (tests only)",
    "cupy.use_as_cuda": "makes 'cuda' mean the stand-in (tests and --device fake only)",
    # distlab.autograd._kernels.multi_tensor_kernel builds RawKernels on cupy (CupyMultiTensorKernel) and takes the
    # stand-in's counted form with getattr(xp, "MultiTensorKernel", <numpy's>): never called as xp.MultiTensorKernel
    "cupy.MultiTensorKernel": "the stand-in's form of distlab's multi-tensor kernel (a RawKernel on cupy)",
}
#: Mismatches being fixed on another branch, by the start of the problem they cause; each must still occur (a stale
#: entry fails the test, so the list only shrinks).
PENDING: dict = {}
#: kinds a stand-in name may have for each kind cupy's has
_COMPATIBLE = {"module": {"module", "object"}, "class": {"class"}, "function": {"function"},
               "ufunc": {"function", "ufunc"}, "constant": {"constant"}, "object": {"object"}}
#: stand-in class -> sample instances, for their instance attributes
_SAMPLES = {
    "cupy.ndarray": lambda xp: [xp.zeros(2)],
    "cupy.cuda.Stream": lambda xp: [xp.cuda.Stream(), xp.cuda.Stream(null=True), xp.cuda.Stream(non_blocking=True)],
    "cupy.cuda.ExternalStream": lambda xp: [xp.cuda.ExternalStream(0x1234)],
    "cupy.cuda.Event": lambda xp: [xp.cuda.Event(), xp.cuda.Stream().record()],
    "cupy.cuda.Device": lambda xp: [xp.cuda.Device(0)],
    "cupy.ElementwiseKernel": lambda xp: [xp.ElementwiseKernel("T x", "T y", "y = x", "copy")],
    "cupy.random.Generator": lambda xp: [xp.random.default_rng(0)],
    "cupy.random.RandomState": lambda xp: [xp.random.RandomState(0)],
    "cupy.cuda.nccl.NcclError": lambda xp: [xp.cuda.nccl.NcclError(4)],
}


def _stand_in():
    from distlab import fakegpu

    return fakegpu


# -- comparing ---------------------------------------------------------------------------------------------------
def _literal(text: str):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ("text", text.replace("<class '", "").replace("'>", ""))
    return (type(value).__name__, value)


#: the Python type a value of each C type cupy declares arrives or leaves as
_PY_TYPES = {"bytes": "bytes", "str": "str", "int": "int", "size_t": "int", "intptr_t": "int", "ptrdiff_t": "int",
             "Py_ssize_t": "int", "unsigned int": "int", "bint": "bool", "bool": "bool", "tuple": "tuple",
             "dict": "dict", "float": "float", "double": "float", "list": "list"}


def type_problem(what: str, mine, theirs) -> str | None:
    """Where the stand-in annotates a type and cupy declares one, they agree (``bytes``, not ``tuple``)."""
    want = _PY_TYPES.get(theirs or "")
    if not mine or want is None:
        return None
    allowed = {part.strip() for part in mine.split("|")}
    if want in allowed or allowed & {"object", "Any"} or want == "int" and "bool" in allowed:
        return None
    return f"{what} is {mine} here, {theirs} ({want}) in cupy"


def param_problems(mine: list, theirs: list, constants: dict | None = None) -> list[str]:
    """Why a callable taking ``mine`` would accept a call cupy's (taking ``theirs``) refuses, or bind it apart
    (``constants``: the namespace whose names a default may be, ``flags=cudaIpcMemLazyEnablePeerAccess``)."""
    problems = []
    names = [p["name"] for p in theirs]
    kinds = {p["kind"] for p in theirs}
    cursor = 0
    for i, p in enumerate(mine):
        name, kind = p["name"], p["kind"]
        if kind in ("var_positional", "var_keyword"):
            if kind not in kinds:
                problems.append(f"takes {'*' if kind == 'var_positional' else '**'}{name}, cupy does not")
            continue
        if name not in names:
            if "var_keyword" not in kinds or kind == "positional_only":
                problems.append(f"takes {name!r}, cupy does not")
            continue
        j = names.index(name)
        q = theirs[j]
        if j < cursor:
            problems.append(f"{name!r} comes in another order than cupy's")
        cursor = max(cursor, j + 1)
        if kind in ("positional_only", "positional_or_keyword"):
            if q["kind"] == "keyword_only":
                problems.append(f"{name!r} may be passed by position, cupy's is keyword-only")
            elif i != j:
                problems.append(f"{name!r} is positional parameter {i}, cupy's {j}")
        if kind != "positional_only" and q["kind"] == "positional_only":
            problems.append(f"{name!r} may be passed by keyword, cupy's is positional-only")
        problem = type_problem(repr(name), p.get("type"), q.get("type"))
        if problem:
            problems.append(problem)
        if "default" in p and "default" not in q:
            problems.append(f"{name!r} is optional, cupy requires it")
        elif "default" in p and _literal(p["default"]) != _literal(_named(q["default"], constants or {})):
            problems.append(f"{name!r} defaults to {p['default']}, cupy's to {q['default']}")
    given = {p["name"] for p in mine}
    varargs = {p["kind"] for p in mine} & {"var_positional", "var_keyword"}
    for q in theirs:
        if "default" not in q and q["kind"] not in ("var_positional", "var_keyword") and q["name"] not in given \
                and not varargs:
            problems.append(f"cupy requires {q['name']!r}, which it does not take")
    return problems


def _named(default: str, constants: dict) -> str:
    """A default that names one of cupy's constants, as the constant's value."""
    entry = constants.get(default)
    return repr(entry["value"]) if entry is not None and "value" in entry else default


def _signature_of(value, name):
    """The stand-in's parameters and return type, or None for a numpy function forwarded as it is (checked at the
    call sites)."""
    if getattr(value, "__qualname__", "").startswith("_device_function.<locals>"):
        return None, None
    return api.parameters(value, name)


def _callable_problems(where: str, value, name: str, entry: dict, constants: dict) -> list[str]:
    mine, returns = _signature_of(value, name)
    problems = []
    if mine is not None and "params" in entry:
        problems += [f"{where}{_sig(entry)}: {p}" for p in param_problems(mine, entry["params"], constants)]
    problem = type_problem("the result", returns, entry.get("returns"))
    if problem and entry["kind"] != "class":
        problems.append(f"{where}: {problem}")
    return problems


def _stand_in_namespaces():
    """(stand-in path, cupy path, namespace) of each cupy namespace the stand-in has (it need not have them all)."""
    _stand_in()
    for stand_in, cupy_path in api.NAMESPACES.items():
        try:
            yield stand_in, cupy_path, api.resolve(stand_in)
        except (ImportError, AttributeError):
            continue


def _stand_in_classes(fakegpu, cupy_api: dict):
    """(cupy class path, stand-in class) for every class of the stand-in's namespaces that cupy has."""
    for stand_in, cupy_path, module in _stand_in_namespaces():
        for name in api.public_names(module):
            value = getattr(module, name)
            if isinstance(value, type) and name in cupy_api["namespaces"][cupy_path] \
                    and api.kind_of(value) == "class" and value.__module__.startswith("distlab."):
                yield f"{cupy_path}.{name}", value


def _own_members(cls) -> list[str]:
    """The members a stand-in class defines (its distlab bases' too), dunders included, not object's."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        names.update(vars(klass))
    return sorted(n for n in names if n not in api._PLUMBING and not (n.startswith("_") and not n.endswith("__")))


def namespace_problems(cupy_api: dict) -> list[str]:
    fakegpu = _stand_in()
    problems = []
    for stand_in, cupy_path, module in _stand_in_namespaces():
        theirs = cupy_api["namespaces"][cupy_path]
        for name in api.public_names(module):
            where = f"{cupy_path}.{name}"
            value = getattr(module, name)
            entry = theirs.get(name)
            if entry is None:
                if where not in ALLOWED:
                    problems.append(f"{where}: the stand-in has it, cupy {cupy_api['cupy']} does not")
                continue
            kind = api.kind_of(value)
            if kind not in _COMPATIBLE[entry["kind"]]:
                problems.append(f"{where}: a {kind} in the stand-in, a {entry['kind']} in cupy")
                continue
            if kind == "constant" and entry.get("type") != type(value).__name__:
                problems.append(f"{where}: a {type(value).__name__} in the stand-in, a {entry.get('type')} in cupy")
            if kind in ("function", "class"):
                problems += _callable_problems(where, value, name, entry, theirs)
    for name in sorted(n for n in dir(np) if not n.startswith("_")):  # what the facade forwards from numpy
        if name not in cupy_api["namespaces"]["cupy"] and hasattr(fakegpu, name):
            problems.append(f"cupy.{name}: the stand-in forwards numpy's, cupy {cupy_api['cupy']} has none")
    return problems


def _sig(entry) -> str:
    return "(" + ", ".join(p["name"] for p in entry.get("params", [])) + ")"


def class_problems(cupy_api: dict) -> list[str]:
    fakegpu = _stand_in()
    problems = []
    for cupy_path, cls in _stand_in_classes(fakegpu, cupy_api):
        theirs = cupy_api["classes"].get(cupy_path)
        if theirs is None:
            problems.append(f"{cupy_path}: add it to CLASSES in scripts/cupy_api_snapshot.py and regenerate")
            continue
        known = set(theirs["members"]) | set(theirs.get("instance_attributes", ()))
        for name in _own_members(cls):
            where = f"{cupy_path}.{name}"
            if name not in known and not hasattr(object, name):
                problems.append(f"{where}: the stand-in has it, cupy {cupy_api['cupy']} does not")
                continue
            entry = theirs["members"].get(name)
            if entry is None or name.startswith("__"):
                continue
            kind = api.member_kind(cls, name)
            data = {"property", "attribute"}
            if (kind in data) != (entry["kind"] in data) or ((kind == "staticmethod") != (entry["kind"] ==
                                                                                         "staticmethod")):
                problems.append(f"{where}: a {kind} in the stand-in, a {entry['kind']} in cupy")
                continue
            if kind not in data:
                namespace = cupy_api["namespaces"].get(cupy_path.rpartition(".")[0], {})
                problems += _callable_problems(where, getattr(cls, name), name, entry, namespace)
        for sample in _SAMPLES.get(cupy_path, lambda xp: [])(fakegpu):
            attrs = set(getattr(sample, "__dict__", {})) | {s for k in type(sample).__mro__
                                                            for s in getattr(k, "__slots__", ())}
            for name in sorted(a for a in attrs if not a.startswith("_")):
                if name not in known:
                    problems.append(f"{cupy_path}: its instances have {name!r}, cupy's do not")
    return problems


# -- distlab's call sites ----------------------------------------------------------------------------------------
#: how distlab's code names an array module (numpy or cupy): variables and attributes of these names
_MODULE_NAMES = {"xp", "cupy", "cp"}
_MODULE_ATTRS = {"xp", "_xp", "cupy"}
_NCCL, _COMMUNICATOR = ["cuda", "nccl"], ["cuda", "nccl", "NcclCommunicator"]
#: what the device transports call cupy's NCCL module and its communicators (types the scan cannot infer)
_TYPED = {"src/distlab/comm/transports/nccl.py": {"lib": _NCCL, "nccl": _NCCL, "self._lib": _NCCL,
                                                  "comm": _COMMUNICATOR, "state.nccl": _COMMUNICATOR,
                                                  "self.comm": _COMMUNICATOR, "self.nccl": _COMMUNICATOR},
          "src/distlab/comm/transports/hierarchical.py": {"lib": _NCCL, "self._lib": _NCCL,
                                                          "scatter.nccl": _COMMUNICATOR,
                                                          "gather.nccl": _COMMUNICATOR},
          # where ``module`` is the device array module (cupy on a GPU)
          "src/distlab/rpc/devices.py": {"self.module": []},
          "src/distlab/comm/device.py": {"module": []},
          "src/distlab/autograd/_array.py": {"module": []}}


def _chain(node):
    """``xp.cuda.runtime.getDevice`` -> ("xp", ["cuda", "runtime", "getDevice"]) (roots: names and self.X)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, parts[::-1]
    return None, []


def _lookup(cupy_api: dict, path: list[str]):
    """What ``cupy.<path>`` is in the API: ("ok", entry) / ("missing", where) / ("opaque", None) past a value."""
    namespace, entries, cls = "cupy", cupy_api["namespaces"]["cupy"], None
    for i, part in enumerate(path):
        where = ".".join(["cupy", *path[:i + 1]])
        if cls is not None:
            entry = cls["members"].get(part)
            if entry is None and part not in cls.get("instance_attributes", ()):
                return "missing", where
            return ("ok", entry) if i == len(path) - 1 else ("opaque", None)
        if f"{namespace}.{part}" in cupy_api["namespaces"]:
            namespace = f"{namespace}.{part}"
            entries = cupy_api["namespaces"][namespace]
            continue
        entry = entries.get(part)
        if entry is None:
            return "missing", where
        if i == len(path) - 1:
            return "ok", entry
        if f"{namespace}.{part}" in cupy_api["classes"]:
            cls = cupy_api["classes"][f"{namespace}.{part}"]
            continue
        return "opaque", None
    return "ok", ({"kind": "module"} if cls is None else cls)


def _call_problems(call: ast.Call, entry: dict) -> list[str]:
    params = entry.get("params")
    if params is None:
        return []
    if entry["kind"] == "class" and not params:
        return []
    positional = [p for p in params if p["kind"] in ("positional_only", "positional_or_keyword")]
    var_pos = any(p["kind"] == "var_positional" for p in params)
    var_kw = any(p["kind"] == "var_keyword" for p in params)
    problems = []
    if not any(isinstance(a, ast.Starred) for a in call.args) and len(call.args) > len(positional) and not var_pos:
        problems.append(f"{len(call.args)} positional arguments, cupy takes {len(positional)}")
    names = {p["name"] for p in params if p["kind"] not in ("positional_only", "var_positional", "var_keyword")}
    for keyword in call.keywords:
        if keyword.arg is not None and keyword.arg not in names and not var_kw:
            problems.append(f"keyword {keyword.arg!r}, which cupy's does not take")
    return problems


#: the code a GPU run executes on cupy: distlab (not the stand-in), and the device check's scripts, scenarios,
#: benchmark and examples
_CALLERS = ("src/distlab/**/*.py", "tests/mpi/*.py", "tests/test_*gpu*.py", "benchmarks/bench_gpu.py",
            "scripts/gpu_check.py", "examples/*.py")


def call_site_problems(cupy_api: dict) -> list[str]:
    """Every access through an array module in the code a GPU run executes, checked against cupy."""
    problems = []
    for path in sorted({p for pattern in _CALLERS for p in REPO.glob(pattern)}):
        if "fakegpu" in path.parts or path.name == "test_fakegpu_matches_cupy.py":
            continue
        tree = ast.parse(path.read_text())
        typed = _TYPED.get(str(path.relative_to(REPO)), {})
        aliases = {}  # local names bound to a namespace reached from an array module (runtime = xp.cuda.runtime)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                root, parts = _chain(node.value)
                if _is_module(root, parts, node.value) and parts:
                    found = _lookup(cupy_api, _strip(root, parts))
                    if found[0] == "ok" and found[1] is not None and found[1]["kind"] == "module":
                        aliases[node.targets[0].id] = _strip(root, parts)
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or isinstance(parents.get(id(node)), ast.Attribute):
                continue  # the outermost attribute of each chain
            root, parts = _chain(node)
            chain = _typed(typed, root, parts)
            if chain is not None:
                pass
            elif root in aliases:
                chain = aliases[root] + parts
            elif _is_module(root, parts, node):
                chain = _strip(root, parts)
            else:
                continue
            if not chain or chain[-1].startswith("__"):
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}: cupy.{'.'.join(chain)}"
            status, entry = _lookup(cupy_api, chain)
            if status == "missing":
                if f"cupy.{'.'.join(chain)}" not in ALLOWED:
                    problems.append(f"{where}: cupy {cupy_api['cupy']} has no {entry}")
                continue
            call = parents.get(id(node))
            if status == "ok" and entry is not None and isinstance(call, ast.Call) and call.func is node:
                problems += [f"{where}(...): {p}" for p in _call_problems(call, entry)]
        for node in ast.walk(tree):  # getattr(xp.cuda, "name", default)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                root, parts = _chain(node.args[0])
                chain = _typed(typed, root, parts)
                if chain is None:
                    chain = aliases[root] + parts if root in aliases else _strip(root, parts) \
                        if _is_module(root, parts, node.args[0]) else None
                name = node.args[1].value
                if chain is None or name.startswith("__"):
                    continue
                full = f"cupy.{'.'.join([*chain, name])}"
                if _lookup(cupy_api, [*chain, name])[0] == "missing" and full not in ALLOWED:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: getattr({full}): cupy "
                                    f"{cupy_api['cupy']} has no such name")
    return problems


def _typed(typed: dict, root, parts):
    """The cupy path of a chain whose start ``typed`` names (``state.nccl.abort`` -> the communicator's abort)."""
    if root is None:
        return None
    for k in range(len(parts), -1, -1):
        known = typed.get(".".join([root, *parts[:k]]))
        if known is not None:
            return known + parts[k:]
    return None


def _is_module(root, parts, node) -> bool:
    if root in _MODULE_NAMES:
        return True
    return root == "self" and bool(parts) and parts[0] in _MODULE_ATTRS


def _strip(root, parts):
    return parts[1:] if root == "self" else parts


# -- the tests ---------------------------------------------------------------------------------------------------
def _live():
    """cupy's API read now (the GPU check), or a skip."""
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or without a usable CUDA runtime
        pytest.skip("needs cupy")
    return api.snapshot()


def test_the_snapshot_is_cupy_14():
    assert SNAPSHOT["cupy"].startswith("14.") and "cupy.cuda.nccl" in SNAPSHOT["namespaces"]
    assert set(SNAPSHOT["missing"]) <= set(ALLOWED), "regenerate: python scripts/cupy_api_snapshot.py"


def _unexpected(problems: list[str]) -> list[str]:
    stale = [key for key in PENDING if not any(p.startswith(key) for p in problems)]
    return [p for p in problems if not p.startswith(tuple(PENDING))] + [f"stale PENDING entry: {k}" for k in stale]


def test_every_name_of_the_stand_in_is_cupys_with_cupys_parameters():
    assert _unexpected(namespace_problems(SNAPSHOT)) == []


def test_every_member_of_the_stand_ins_classes_is_cupys_with_cupys_parameters():
    assert class_problems(SNAPSHOT) == []


def test_every_call_distlab_makes_through_an_array_module_is_one_cupy_takes():
    assert call_site_problems(SNAPSHOT) == []
    from distlab.comm.transports import nccl

    names = {*nccl._BY_NAME.values(), *nccl._OPS.values(), *nccl._BOOL_OPS.values()}  # looked up with getattr
    assert sorted(names - set(SNAPSHOT["namespaces"]["cupy.cuda.nccl"])) == []


def test_the_comparison_catches_a_foreign_or_reordered_parameter():
    """The checks can fail: cupy 13's tuple unique id, a renamed, reordered or extra parameter, a default."""
    cupy_params = SNAPSHOT["classes"]["cupy.cuda.nccl.NcclCommunicator"]["params"]

    def params(text):
        return api.parameters(eval(f"lambda {text}: None"), "<lambda>")[0]  # noqa: S307 - constant test text

    assert param_problems(params("ndev, commId, rank"), cupy_params) == []
    assert param_problems(params("ndev, comm_id, rank"), cupy_params) == [
        "takes 'comm_id', cupy does not", "cupy requires 'commId', which it does not take"]
    assert param_problems(params("ndev, rank, commId"), cupy_params) == [
        "'rank' is positional parameter 1, cupy's 2", "'commId' comes in another order than cupy's",
        "'commId' is positional parameter 2, cupy's 1"]
    get = SNAPSHOT["classes"]["cupy.ndarray"]["members"]["get"]["params"]
    assert param_problems(params("stream=None, order='F', out=None"), get) == [
        "'order' defaults to 'F', cupy's to 'C'"]
    assert param_problems(params("stream=None, *args"), get) == ["takes *args, cupy does not"]


def test_the_checks_catch_a_broken_stand_in(monkeypatch):
    """A parameter renamed in the stand-in, a name cupy lacks, a call with a keyword cupy refuses: each is caught."""
    fakegpu = _stand_in()

    def record(self, evt=None):
        return evt

    monkeypatch.setattr(fakegpu.cuda.Stream, "record", record)
    monkeypatch.setattr(fakegpu.cuda, "Memory2", type("Memory2", (), {}), raising=False)
    assert class_problems(SNAPSHOT) == ["cupy.cuda.Stream.record(event): takes 'evt', cupy does not"]
    assert _unexpected(namespace_problems(SNAPSHOT)) == [
        "cupy.cuda.Memory2: the stand-in has it, cupy 14.2.0 does not"]
    tree = ast.parse("xp.cuda.Event(disable_timing=True, interprocess=True, blocking=True)\n"
                     "xp.cuda.nccl.get_unique_id(0)\nxp.cuda.MemoryPool2()\n").body
    calls = [node.value for node in tree]
    assert _call_problems(calls[0], _lookup(SNAPSHOT, ["cuda", "Event"])[1]) == [
        "keyword 'blocking', which cupy's does not take"]
    assert _call_problems(calls[1], _lookup(SNAPSHOT, ["cuda", "nccl", "get_unique_id"])[1]) == [
        "1 positional arguments, cupy takes 0"]
    assert _lookup(SNAPSHOT, ["cuda", "MemoryPool2"]) == ("missing", "cupy.cuda.MemoryPool2")


@pytest.mark.gpu
def test_against_live_cupy():
    """Where cupy imports (the GPU check): the same checks against cupy itself, and the snapshot still says it."""
    live = _live()
    assert _unexpected(namespace_problems(live)) == [] and class_problems(live) == []
    assert call_site_problems(live) == []
    if live["cupy"] == SNAPSHOT["cupy"]:
        for path, names in SNAPSHOT["namespaces"].items():
            for name in names:
                assert name in live["namespaces"][path], f"{path}.{name}"


def test_the_checks_catch_cupy_13s_tuple_unique_id(monkeypatch):
    """The form the stand-in had before cupy 14 (``get_unique_id() -> tuple``, ``commId: tuple``) fails them."""
    nccl = _stand_in().cuda.nccl

    def get_unique_id() -> tuple:
        return ()

    def __init__(self, ndev: int, commId: tuple, rank: int):  # noqa: N803, N807
        pass

    monkeypatch.setattr(nccl, "get_unique_id", get_unique_id)
    monkeypatch.setattr(nccl.NcclCommunicator, "__init__", __init__)
    assert _unexpected(namespace_problems(SNAPSHOT)) == [
        "cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank, config): 'commId' is tuple here, bytes (bytes) in cupy",
        "cupy.cuda.nccl.get_unique_id: the result is tuple here, bytes (bytes) in cupy"]


# -- cupy's conventions, beyond signatures: the stand-in refuses what cupy refuses, with cupy's words -------------
def test_an_interprocess_event_must_disable_timing():
    xp = _stand_in()
    with pytest.raises(ValueError, match="^Timing must be disabled for interprocess events$"):
        xp.cuda.Event(interprocess=True)
    event = xp.cuda.Event(disable_timing=True, interprocess=True)
    assert xp.cuda.Stream().record(event) is event and event.done is True  # a property, as cupy's


def test_streams_are_cupys():
    xp = _stand_in()
    stream, external = xp.cuda.Stream(non_blocking=True, ptds=False, priority=None), xp.cuda.ExternalStream(5, 0)
    assert stream.is_non_blocking and not xp.cuda.Stream().is_non_blocking and stream.device_id == 0
    assert xp.cuda.Stream.null.ptr == 0 and external.ptr == 5 and external.device_id == 0
    assert hash(stream) == stream.ptr and external == xp.cuda.ExternalStream(5) and not hasattr(external, "null")
    assert xp.cuda.get_current_stream(device_id=-1) is xp.cuda.Stream.null
    start, end = stream.record(), stream.record()
    assert xp.cuda.get_elapsed_time(start_event=start, end_event=end) == 0.0
    assert xp.cuda.runtime.deviceCanAccessPeer(device=0, peerDevice=0) == 0


def test_nccl_errors_and_arguments_are_cupys():
    """``NcclError(status)``: NCCL's name and words (the stand-in's cause after them); pointers, counts and streams
    are C integers, so a MemoryPointer or a Stream object is refused as Cython refuses it."""
    import pickle

    nccl = _stand_in().cuda.nccl
    error = nccl.NcclError(5)
    assert error.status == 5 and str(error) == "NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN " \
        "for details)"
    copy = pickle.loads(pickle.dumps(nccl._error(4, "the cause")))
    assert type(copy) is nccl.NcclError and copy.status == 4 and str(copy).endswith("details) (the cause)")
    with pytest.raises(TypeError, match="Argument 'commId' has incorrect type"):
        nccl.NcclCommunicator(1, tuple(nccl.get_unique_id()), 0)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    try:
        a = _stand_in().zeros(4, np.float32)
        stream = _stand_in().cuda.Stream()
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            comm.allReduce(a.data, a.data, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            comm.allReduce(a.data.ptr, a.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream)
        comm.allReduce(a.data.ptr, a.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()
    finally:
        comm.destroy()


def test_array_methods_take_cupys_arguments_only():
    xp = _stand_in()
    a = xp.asarray(np.arange(6, dtype=np.float32))
    for call in (lambda: a.sum(where=a > 0), lambda: a.max(initial=0), lambda: a.copy(order="C", subok=True),
                 lambda: a.astype(np.float64, device="cpu"), lambda: a.fill()):
        with pytest.raises(TypeError):
            call()
    assert a.reshape(2, 3, order="C").shape == (2, 3) and a.astype(np.float64, copy=False).dtype == np.float64
    a.put(xp.asarray(np.array([7])), xp.asarray(np.array([1.0], np.float32)))  # cupy's put wraps (numpy's raises)
    assert a.get()[1] == 1.0


def test_get_and_set_refuse_as_cupy_does():
    xp = _stand_in()
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(TypeError, match="^Only numpy.ndarray can be obtained fromcupy.ndarray$"):
        a.get(out=[0] * 6)
    with pytest.raises(TypeError, match="^float64 array cannot be obtained from float32 array$"):
        a.get(out=np.empty((2, 3)))
    with pytest.raises(ValueError, match=r"^Shape mismatch. Expected shape: \(2, 3\), actual shape: \(3, 2\)$"):
        a.get(out=np.empty((3, 2), np.float32))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        a.get(out=np.empty((2, 6), np.float32)[:, ::2])
    with pytest.raises(TypeError, match="^Only numpy.ndarray can be set to cupy.ndarray$"):
        a.set([0] * 6)
    fortran = xp.asarray(np.zeros((2, 3), np.float32)).T  # F-contiguous: cupy sets it
    fortran.set(np.ones((3, 2), np.float32))
    assert fortran.get().sum() == 6
    assert xp.asnumpy(a, blocking=False).shape == (2, 3)


def test_the_facade_has_cupys_names_only():
    xp = _stand_in()
    for name in ("insert", "geomspace", "object_", "str_", "errstate", "emath", "fft", "MemoryPointer", "nccl",
                 "scatter_add", "frombuffer"):
        assert not hasattr(xp, name), name
    assert not hasattr(xp.linalg, "matrix_norm") and not hasattr(xp.linalg, "vecdot")
    q, r = xp.linalg.qr(xp.asarray(np.eye(3)))
    assert isinstance(q, xp.ndarray) and float(xp.linalg.norm(r)) == pytest.approx(3 ** 0.5)
    with pytest.raises(ValueError, match="Unable to avoid copy"):
        xp.asarray(np.zeros(2), copy=False)
    with pytest.raises(NotImplementedError):
        xp.array(np.zeros(2), subok=True)
    assert xp.array(np.zeros(2), None, True, "K", False, 3).shape == (1, 1, 2)  # ndmin is the sixth, as cupy's


def test_random_draws_are_cupys():
    """cupy's Generator has no normal, choice or permutation: code drawing them on the stand-in would fail on cupy."""
    xp = _stand_in()
    rng = xp.random.default_rng(3)
    assert not any(hasattr(rng, name) for name in ("normal", "choice", "permutation", "shuffle", "bit_generator"))
    assert np.array_equal(rng.standard_normal((2, 2)).get(), np.random.default_rng(3).standard_normal((2, 2)))
    xp.random.seed(seed=1)
    assert sorted(xp.random.permutation(a=4).get().tolist()) == [0, 1, 2, 3]
