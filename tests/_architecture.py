"""Measurements of the repository's shape, used by tests/test_architecture.py and runnable by hand.

``python tests/_architecture.py`` prints every measurement: the share of each core twin's substantive lines
copied word for word from reference/, whether the names both twins of a component define appear in the same
order, the import cycles among distlab's modules, and the modules over their line limit.

The rules they check (CONTRIBUTING.md, "The twin rule"):

- a core module compiles, typed, the hot path of its reference twin; everything else lives once, in a module both
  twins import, so at most :data:`MAX_VERBATIM_SHARE` of a core twin's substantive lines (25+ characters, not a
  comment, not a docstring opening) appear verbatim in reference/ (the signatures, imports and calls of shared
  functions that the twin contract makes alike are not counted, on either side);
- the names both twins define (top-level functions and classes, and methods as ``Class.method``) appear in the
  same order, so a reader can hold them side by side; C helpers that only the core needs sit after the marker
  :data:`CORE_ONLY_MARKER` and are not compared;
- no import cycle anywhere in src/distlab, reference/ or core/ (every import statement counts, also inside
  functions, except under ``if TYPE_CHECKING:``);
- core/ is laid out like reference/, file for file (:func:`layout_mismatches`);
- no module under src/distlab over :data:`MAX_SRC_LINES` lines, no reference module over :data:`MAX_REFERENCE_LINES`,
  no file of core/ over :data:`MAX_CORE_LINES`;
- imports go in the direction ARCHITECTURE.md draws (:func:`layering_violations`);
- calls go that way too: no call of a private name only a module above defines, and no call of another module's
  private function (:func:`private_call_violations`).
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "distlab"
REFERENCE = REPO / "reference"
CORE = REPO / "core"

MAX_VERBATIM_SHARE = 0.15
MAX_SRC_LINES = 500
MAX_REFERENCE_LINES = 450
MAX_CORE_LINES = 500
CORE_ONLY_MARKER = "# --- core-only helpers"


def registry() -> dict[str, tuple[tuple[str, ...], str, str]]:
    """The registry of twins, src/distlab/_twins.py, read as a file (as setup.py reads it)."""
    namespace: dict = {}
    exec((SRC / "_twins.py").read_text(encoding="utf-8"), namespace)
    return namespace["TWINS"]


#: component -> (reference modules in reading order, core module), from the registry. The core module's
#: ``include``d .pxi files are read in place.
TWINS: dict[str, tuple[tuple[str, ...], str]] = {
    name: (tuple(f"{module}.py" for module in files), f"{core}.pyx")
    for name, (files, _loaded, core) in registry().items()
}


# ---------------------------------------------------------------------------------------------- core sources
def core_source(core_file: str) -> str:
    """The text of a core module with its ``include "x.pxi"`` lines replaced by the included files."""
    out = []
    for line in (CORE / core_file).read_text(encoding="utf-8").splitlines():
        match = re.match(r'\s*include\s+"([^"]+)"', line)
        out.extend(core_source(match.group(1)).splitlines() if match else [line])
    return "\n".join(out)


def core_files(core_file: str) -> list[str]:
    """The files of a core extension: each ``include``d .pxi where it is included (recursively), then the module
    itself."""
    out = []
    for line in (CORE / core_file).read_text(encoding="utf-8").splitlines():
        match = re.match(r'\s*include\s+"([^"]+)"', line)
        if match:
            out += [f for f in core_files(match.group(1)) if f not in out]
    return out + [core_file]


def core_outline(core_file: str) -> list[str]:
    """The names a core extension defines, file by file in :func:`core_files` order, each file's outline stopping
    at its own :data:`CORE_ONLY_MARKER`."""
    return [name for f in core_files(core_file) for name in outline((CORE / f).read_text(encoding="utf-8"))]


def _stem(core_or_reference_file: str) -> str:
    return core_or_reference_file.lstrip("_").split(".")[0]


def layout_mismatches(component: str) -> list[str]:
    """How a component's core files fail to line up with its reference files, file for file.

    Each core file is named after a reference module (``_messages.pxi`` after ``messages.py``); in include order,
    the names of the core files (a name repeated by consecutive files counted once) are the reference modules in
    reading order, then the module ``load`` returns; and every name a core file shares with the reference twin is
    defined in that file's reference counterpart.
    """
    reference_files, core_file = TWINS[component]
    files = core_files(core_file)
    stems = [s for i, s in enumerate(map(_stem, files)) if i == 0 or s != _stem(files[i - 1])]
    loaded = registry()[component][1]
    expected = list(dict.fromkeys([_stem(f) for f in reference_files] + [loaded]))
    problems = [] if stems == expected else [f"core files {files} do not line up with reference {expected}"]
    reference_names = {_stem(f): set(outline((REFERENCE / f).read_text(encoding="utf-8")))
                       for f in reference_files}
    everywhere = set().union(*reference_names.values())
    for f in files:
        for name in outline((CORE / f).read_text(encoding="utf-8")):
            if name in everywhere and name not in reference_names.get(_stem(f), ()):
                problems.append(f"{f} defines {name}, which reference/{_stem(f)}.py does not")
    return problems


def _substantive(text: str) -> list[str]:
    quote = chr(34) * 3
    lines = (line.strip() for line in text.splitlines())
    return [s for s in lines if len(s) >= 25 and not s.startswith(("#", quote, "'''"))]


def _contract_lines(text: str) -> set[str]:
    """The lines of a reference module that the twin contract makes a core twin repeat: the headers of its
    functions and classes (same names, same signatures), its import statements (the shared names both twins
    import), and its calls of what ``distlab._common`` shares (a statement that is such a call, returns it or
    assigns it: the code written once is called by both, not copied). :func:`verbatim_share` does not count them."""
    lines = text.splitlines()
    tree = ast.parse(text)
    shared = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and (node.module or "").startswith("distlab._common") for alias in node.names}
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            spans.append((node.lineno, node.body[0].lineno - 1))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            spans.append((node.lineno, node.end_lineno))
        elif isinstance(node, (ast.Expr, ast.Return, ast.Assign)) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Name) and node.value.func.id in shared:
            spans.append((node.lineno, node.end_lineno))
    return {lines[i - 1].strip() for first, last in spans for i in range(first, last + 1)}


def verbatim_share(component: str) -> tuple[int, int]:
    """(substantive core lines, how many of them appear word for word in a reference/ module's code), both
    without the lines the twin contract makes alike (:func:`_contract_lines`)."""
    reference_lines, contract = set(), set()
    for path in REFERENCE.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        alike = _contract_lines(text)
        contract |= alike
        reference_lines |= set(_substantive(text)) - alike
    core_lines = [line for line in _substantive(core_source(TWINS[component][1])) if line not in contract]
    return len(core_lines), sum(line in reference_lines for line in core_lines)


# --------------------------------------------------------------------------------------------------- outline
_CLASS = re.compile(r"^(\s*)(?:cdef\s+|cpdef\s+)?class\s+(\w+)")
_FUNC = re.compile(r"^(\s*)(?:async\s+)?(?:def|cdef|cpdef)\s+(?:[\w\[\],\.\*]+\s+)*?\*?(\w+)\s*\(")


def outline(text: str) -> list[str]:
    """Names defined at module level and in classes (``Class.method``), in order of definition.

    Stops at :data:`CORE_ONLY_MARKER`. Nested functions and ``cdef extern`` declarations are skipped.
    """
    names: list[str] = []
    class_stack: list[tuple[int, str]] = []
    extern_indent = None
    for line in text.splitlines():
        if line.strip().startswith(CORE_ONLY_MARKER):
            break
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if extern_indent is not None:
            if indent > extern_indent:
                continue
            extern_indent = None
        if re.match(r"\s*cdef\s+extern\b", line):
            extern_indent = indent
            continue
        while class_stack and indent <= class_stack[-1][0]:
            class_stack.pop()
        match = _CLASS.match(line)
        if match:
            if indent == 0:
                names.append(match.group(2))
                class_stack = [(0, match.group(2))]
            continue
        match = _FUNC.match(line)
        if match:
            if indent == 0:
                names.append(match.group(2))
            elif class_stack and indent > class_stack[-1][0] and len(class_stack) == 1:
                names.append(f"{class_stack[-1][1]}.{match.group(2)}")
    return names


def outline_disorder(component: str) -> list[tuple[str, str]]:
    """Pairs (a, b) of names both twins define where the core has a before b and the reference b before a.

    Only adjacent pairs of the core's shared names are reported, so one misplaced name shows up once or twice.
    """
    reference_files, core_file = TWINS[component]
    reference_names: list[str] = []
    for name in reference_files:
        reference_names += outline((REFERENCE / name).read_text(encoding="utf-8"))
    position = {}
    for index, name in enumerate(reference_names):
        position.setdefault(name, index)
    shared = [name for name in core_outline(core_file) if name in position]
    return [(a, b) for a, b in zip(shared, shared[1:]) if position[a] > position[b]]


# ---------------------------------------------------------------------------------------------------- imports
def _module_files() -> dict[str, Path]:
    files = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder, package in ((REFERENCE, "distlab.reference"), (CORE, "distlab.core")):
        for path in list(folder.glob("*.py")) + list(folder.glob("*.pyx")):
            stem = path.stem
            files[package if stem == "__init__" else f"{package}.{stem}"] = path
    return files


def _import_targets(module: str, path: Path, known: set[str]) -> set[str]:
    """The distlab modules ``module`` imports (the named module, not its parent packages)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":
        # Cython is not Python: keep only the (possibly parenthesised, multi-line) Python import statements.
        statements = re.findall(r"^[ \t]*((?:from[ \t]+[\w.]+[ \t]+)?import[ \t]+(?:\([^)]*\)|[^\n]*))",
                                core_source(path.name), flags=re.M)
        text = "\n".join(" ".join(s.split()) for s in statements)
    tree = ast.parse(text)
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    targets.add(f"{source}.{alias.name}")
                elif source in known:
                    targets.add(source)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    files = _module_files()
    known = set(files)
    return {module: _import_targets(module, path, known) for module, path in files.items()}


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


#: The public facades: the modules a twin must never import (they load the twins, not the other way round).
FACADES = ("distlab.ddp", "distlab.ddp_comm_hooks", "distlab.join", "distlab.fsdp", "distlab.metrics",
           "distlab.collectives", "distlab.rpc", "distlab.distributed_autograd", "distlab.nn", "distlab.optim", "distlab.launch",
           "distlab.cluster", "distlab.viz")
#: Modules that import nothing from distlab (or only what is listed): the leaves everything else may use.
LEAVES = {"distlab.errors": set(), "distlab._wire": set(), "distlab.timeline": set(), "distlab._env": set(),
          "distlab._twins": set(), "distlab.futures": {"distlab.errors"},
          "distlab._backend": {"distlab.errors", "distlab._env", "distlab._twins"}}


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def layering_violations(graph: dict[str, set[str]] | None = None) -> list[tuple[str, str, str]]:
    """(importer, imported, rule broken) for each import of ``graph`` (default: :func:`import_graph`) against
    the direction ARCHITECTURE.md draws."""
    twins = ("distlab.reference", "distlab.core")
    rules = [
        ("a twin never imports a facade", lambda a, b: _within(a, twins) and _within(b, FACADES)),
        ("a reference twin never imports a core twin, nor the reverse",
         lambda a, b: _within(a, twins) and _within(b, twins) and a.split(".")[1] != b.split(".")[1]),
        ("only twins import twins (facades use _backend.load)",
         lambda a, b: not _within(a, twins) and _within(b, twins)),
        ("a shared module imports no twin, facade or comm",
         lambda a, b: _within(a, ("distlab._common",)) and _within(b, twins + FACADES + ("distlab.comm",))),
        ("comm imports none of the components built on it", lambda a, b: _within(a, ("distlab.comm",))
         and _within(b, FACADES + twins + ("distlab._common",))),
        ("distributed autograd imports rpc, never the reverse",
         lambda a, b: _within(a, ("distlab.rpc",)) and _within(b, ("distlab.distributed_autograd",))),
        ("a leaf imports nothing from distlab (but what LEAVES allows)",
         lambda a, b: a in LEAVES and b not in LEAVES[a]),
        ("the autograd engine imports only itself",
         lambda a, b: _within(a, ("distlab.autograd",)) and not _within(b, ("distlab.autograd",))),
    ]
    out = []
    for importer, targets in sorted((import_graph() if graph is None else graph).items()):
        for imported in sorted(targets):
            out += [(importer, imported, rule) for rule, broken in rules if broken(importer, imported)]
    return out


# ------------------------------------------------------------------------------------------------ private calls
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _python_modules() -> dict[str, ast.Module]:
    return {module: ast.parse(path.read_text(encoding="utf-8")) for module, path in _module_files().items()
            if path.suffix == ".py"}


def _defined_names(tree: ast.Module, receivers: tuple[str, ...] | None = None) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes (``x._y = ...``; with
    ``receivers``, only attributes set on those names, such as ``self``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and (receivers is None or (
                            isinstance(sub.value, ast.Name) and sub.value.id in receivers)):
                        names.add(sub.attr)
    return names


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def private_call_violations(trees: dict[str, ast.Module] | None = None,
                            graph: dict[str, set[str]] | None = None) -> list[tuple[str, int, str, str]]:
    """(module, line, call, why) for each call of a private name that reaches across modules the wrong way.

    Two rules, over src/distlab and reference/ (``trees``, default every module; ``graph``, default
    :func:`import_graph`):

    - a call ``x._name(...)`` (``self._name(...)`` included) of a name that only modules above it (that import it,
      directly or not) or beside it (neither imports the other) define: a call up the layers or across them, hidden
      from the import graph (a mixin calling its subclass or a sibling mixin, a callee calling back into its
      caller's private methods);
    - a call ``module._name(...)`` of another distlab module's private function: private names are not an
      interface between modules (an installer such as ``api._install_layer(...)`` hides a back-edge this way).
    """
    trees = _python_modules() if trees is None else trees
    graph = import_graph() if graph is None else graph
    defined = {module: _defined_names(tree) for module, tree in trees.items()}
    below = {module: _reach(graph, module) for module in trees}
    out = []
    for module, tree in sorted(trees.items()):
        aliases = {}  # local name -> distlab module, for `from . import x` and `import distlab.x as y`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = module.rpartition(".")[0] if node.level else ""
                if node.level > 1:
                    base = ".".join(module.split(".")[: -node.level])
                source = ".".join(p for p in (base, node.module or "") if p)
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _private(node.func.attr)):
                continue
            name, receiver = node.func.attr, node.func.value
            call = ast.unparse(node.func)
            if isinstance(receiver, ast.Name) and aliases.get(receiver.id) in trees:
                target = aliases[receiver.id]
                if target != module:
                    out.append((module, node.lineno, call, f"calls a private function of {target}"))
                continue
            if name in defined[module]:
                continue
            definers = [m for m in trees if name in defined[m]]
            if module in PRIVATE_ACCESS_EXCEPTIONS.get(name, ()) or any(_unit(m) == _unit(module) for m in definers):
                continue  # allowed on purpose, or one unit's own (see private_access_violations)
            above = sorted(m for m in definers if module in below[m])
            aside = sorted(m for m in definers if m not in below[module] and module not in below[m])
            if definers and len(above) + len(aside) == len(definers):
                where = "above it, in " if not aside else "only in modules it does not import (a sibling): "
                out.append((module, node.lineno, call, f"{name} is defined {where}{', '.join(above + aside)}"))
    return out


# ------------------------------------------------------------------------------------------- private access
#: Packages whose modules share their private names on purpose, as one unit: the local autograd engine (its
#: Tensor's slots and grad mode are the engine's own), the device stand-in (its arrays' host buffer), and the comm
#: hooks (PowerSGD's matrices module is its own).
PRIVATE_UNITS = ("distlab.autograd", "distlab.fakegpu", "distlab.ddp_comm_hooks")
#: Private names read outside their unit on purpose, each with the modules that may: the anchors' own interfaces
#: that this pass leaves as they are. (The reducer's Join methods are private in torch's Reducer too, where
#: distributed.py's _DDPJoinHook calls them; the distributed engine reaches into the local engine as torch's
#: DistEngine does.)
PRIVATE_ACCESS_EXCEPTIONS = {
    "_get_zeros_like_grad_buckets": ("distlab.ddp",), "_run_comm_hook": ("distlab.ddp",),
    "_get_local_used_map": ("distlab.ddp",), "_push_all_rebuilt_params": ("distlab.ddp",),
    "_state": ("distlab.distributed_autograd.engine",), "_grad_node": ("distlab.distributed_autograd.forward",),
    "_wrap": ("distlab.optim.optimizer", "distlab._common.autograd_container"),
    "_join_config": ("distlab.reference.join",),  # torch's Join reads Joinable._join_config so
    "_tasks": ("distlab.distributed_autograd.engine",),
    # Left to their owners (the launcher's, the RPC package's): delete an entry once it is gone.
    "_launch": ("distlab._cli",), "_set_rpc_timeout": ("distlab.rpc",),
}


#: Code that predates these checks and does not meet them yet, by module or core file: :func:`outstanding` leaves
#: its violations out of the tests, and ``test_each_reshape_still_owed_is_owed`` fails on an entry with nothing left
#: to forgive, so the list only shrinks. Empty: nothing is owed.
RESHAPE_OWED: tuple = ()


def outstanding(found: list[tuple]) -> list[tuple]:
    """The violations in ``found`` (tuples whose first item is the module or core file) outside :data:`RESHAPE_OWED`."""
    return [violation for violation in found if violation[0] not in RESHAPE_OWED]


def _unit(module: str) -> str:
    return next((unit for unit in PRIVATE_UNITS if module == unit or module.startswith(unit + ".")), module)


def _owned_names(tree: ast.Module) -> set[str]:
    """The names a module owns: its functions and classes, what it assigns at module or class level, the attributes
    it sets on ``self``/``cls`` (or declares in ``__slots__``, or sets with ``object.__setattr__(self, ...)``), and
    what it imports."""
    names = _defined_names(tree, ("self", "cls"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(t, ast.Name) and t.id == "__slots__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                         and isinstance(c.value, str))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant):
            names.add(node.args[1].value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _private_accesses(tree: ast.Module):
    """(line, receiver node, name, text) of every private attribute a module reads, writes or calls: ``x._name``,
    ``getattr(x, "_name")`` (and ``setattr``, ``hasattr``), ``x.__dict__.get("_name")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.value, node.attr, ast.unparse(node)
        elif isinstance(node, ast.Call) and node.args and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            func = ast.unparse(node.func)
            if func in ("getattr", "setattr", "hasattr", "delattr"):
                yield node.lineno, node.args[0], node.args[1].value, ast.unparse(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and ast.unparse(node.func).endswith("__dict__.get") and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _private(node.args[0].value):
            yield node.lineno, node.func.value.value, node.args[0].value, ast.unparse(node)


def private_access_violations(trees: dict[str, ast.Module] | None = None,
                              graph: dict[str, set[str]] | None = None) -> list[tuple[str, int, str, str]]:
    """(module, line, access, why) for each private attribute a module reads, writes or calls that is not its own.

    Over src/distlab and reference/ (``trees``, default every module; ``graph``, default :func:`import_graph`):

    - on ``self`` or ``cls``: a private name the module owns, or one a module below it owns (a base class's, in the
      direction calls go); one that only modules above it or beside it own is a mixin reading its subclass's or a
      sibling's field, a contract no import shows;
    - on anything else (another object, another class): only a private name the module owns itself. A module that
      writes another object's private field, or pops entries from it, or calls its private method, has taken over
      state that object should own.

    Names no distlab module owns (``os._exit``, a library's privates) are not checked; :data:`PRIVATE_UNITS` count
    as one module each, and :data:`PRIVATE_ACCESS_EXCEPTIONS` lists the accesses allowed on purpose.
    """
    trees = _python_modules() if trees is None else trees
    graph = import_graph() if graph is None else graph
    owned: dict[str, set[str]] = {}
    for module, tree in trees.items():
        owned.setdefault(_unit(module), set()).update(_owned_names(tree))
    everyone = set().union(*owned.values()) if owned else set()
    out = []
    for module, tree in sorted(trees.items()):
        unit = _unit(module)
        below = {_unit(m) for m in _reach(graph, module)}
        modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for alias in node.names}
        for line, receiver, name, text in _private_accesses(tree):
            if name not in everyone or name in owned.get(unit, ()):
                continue
            if module in PRIVATE_ACCESS_EXCEPTIONS.get(name, ()):
                continue
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                if any(name in owned.get(b, ()) for b in below):
                    continue
                where = sorted(u for u, names in owned.items() if name in names)
                out.append((module, line, text, f"{name} is owned only by {', '.join(where)}, not below it"))
            elif not (isinstance(receiver, ast.Name) and receiver.id in modules and receiver.id not in owned[unit]
                      and f"{module.rpartition('.')[0]}.{receiver.id}" in trees):  # module._f: the call rule's
                where = sorted(u for u, names in owned.items() if name in names)
                out.append((module, line, text, f"reaches into {name}, owned by {', '.join(where)}"))
    return out


_CORE_DECLARATION = re.compile(r"^\s*cdef\s+(?:public\s+|readonly\s+)?(?:volatile\s+|const\s+)?(?!class\b|struct\b|enum\b|extern\b|inline\b)"
                               r"[\w\.:]+(?:\[[^\]]*\](?:\.\w+)?)?(?:\s*\*+\s*|\s+)((?:\w+\s*,\s*)*\w+)\s*(?:=.*)?"
                               r"(?:#.*)?$")
_CORE_ACCESS = re.compile(r"(?:(?<![\w.])([A-Za-z_]\w*)|(\)))\.(_[A-Za-z]\w*)\b")


def _core_code(line: str) -> str:
    """A line of Cython without its comment and string literals (what an access check should read)."""
    return re.sub(r"(\"[^\"]*\"|'[^']*')", "''", line.split("#")[0])


def core_owned_names(text: str) -> set[str]:
    """The names a core file (a .pyx, or a .pxi it includes) owns: its functions and methods, classes, structs and
    enums, the C attributes and variables it declares, and the attributes it sets on ``self``."""
    names = set(re.findall(r"self\.(_\w+)\s*=", text))
    for line in text.splitlines():
        for pattern in (_FUNC, re.compile(r"^\s*(?:cdef|ctypedef)\s+(?:class|struct|enum|\w+\*?)\s+(\w+)")):
            match = pattern.match(line)
            if match:
                names.add(match.group(match.lastindex))
        match = _CORE_DECLARATION.match(line)
        if match:
            names.update(name.strip() for name in match.group(1).split(","))
    return names


def core_private_access_violations(texts: dict[str, str] | None = None) -> list[tuple[str, int, str, str]]:
    """(file, line, access, why) for each private attribute a core file reads, writes or calls on an object other than
    ``self`` that another file owns (:func:`private_access_violations`' rule, for the .pyx and .pxi files).

    Each file of an extension is its own module, as its reference counterpart is (``_negotiation.pyx``'s controller
    reaches the cache of ``_response_cache.pxi`` through its methods, not its fields). ``texts`` (default every file
    of core/) maps a file name to its text.
    """
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(CORE.glob("*.p[yx][xi]"))} if texts is None \
        else texts
    owned = {name: core_owned_names(text) for name, text in texts.items()}
    python = set().union(*(_owned_names(tree) for tree in _python_modules().values()))
    out = []
    for name, text in sorted(texts.items()):
        for number, line in enumerate(text.splitlines(), 1):
            for match in _CORE_ACCESS.finditer(_core_code(line)):
                name_receiver, cast_receiver, attr = match.groups()
                receiver = name_receiver or cast_receiver
                if receiver in ("self", "cls") or attr.startswith("__") or attr in owned[name]:
                    continue
                where = sorted(f for f, names in owned.items() if attr in names)
                if where or attr in python:
                    out.append((name, number, f"{receiver}.{attr}",
                                f"reaches into {attr}, owned by {', '.join(where) or 'a Python module'}"))
    return out


def private_import_violations(trees: dict[str, ast.Module] | None = None) -> list[tuple[str, int, str, str]]:
    """(module, line, import, why) for each private name (not a module) a module imports from another distlab
    module: ``from .work import _busy`` hands a module global to whoever imports it, and ``from .nccl import _make``
    makes a private helper an interface. (A private *module*, ``from . import _backend``, is a module's own way in.)
    :data:`PRIVATE_UNITS` count as one module each, and :data:`PRIVATE_ACCESS_EXCEPTIONS` applies."""
    trees = _python_modules() if trees is None else trees
    out = []
    for module, tree in sorted(trees.items()):
        package = module if (SRC / "/".join(module.split(".")[1:]) / "__init__.py").exists() else \
            module.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("distlab"):
                continue
            for alias in node.names:
                name = alias.name
                if not _private(name) or f"{source}.{name}" in trees or f"{source}.{name}".startswith(
                        ("distlab.reference.", "distlab.core.")) or _unit(source) == _unit(module) \
                        or module in PRIVATE_ACCESS_EXCEPTIONS.get(name, ()):
                    continue
                out.append((module, node.lineno, f"from {source} import {name}",
                            f"imports {source}'s private {name}"))
    return out


def twin_binding_violations(trees: dict[str, ast.Module] | None = None,
                            core_texts: dict[str, str] | None = None) -> list[tuple[str, int, str]]:
    """(file, line, why) for each twin class built on shared code the old way: a reference class that inherits a
    class of ``distlab._common`` (the base calling methods only the twin defines, the twin calling methods only the
    base defines), and a core class that binds a shared function by hand (``name = Base.name`` in its body).

    A twin defines every method of its class and calls the shared module's functions, as the Join twins do
    (their set-up value from ``prepare_join``); re-exporting a shared class (``JoinHook``) is fine.
    """
    trees = {m: t for m, t in (_python_modules() if trees is None else trees).items()
             if m.startswith("distlab.reference")}
    out = []
    for module, tree in sorted(trees.items()):
        shared = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").startswith("distlab._common") for alias in node.names}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if ast.unparse(base).split(".")[0] in shared:
                        out.append((module, node.lineno, f"class {node.name} inherits {ast.unparse(base)} from "
                                                         "distlab._common"))
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(CORE.glob("*.p[yx][xi]"))} if core_texts is None \
        else core_texts
    for name, text in sorted(texts.items()):
        in_class = False
        for number, line in enumerate(text.splitlines(), 1):
            if re.match(r"(?:cdef\s+)?class\s+\w+", line):
                in_class = True
            elif line and not line[0].isspace() and not line.startswith(("#", "@")):
                in_class = False
            match = re.match(r"\s+(\w+)\s*=\s*([A-Z]\w*)\.(\w+)\s*$", _core_code(line))
            if in_class and match and match.group(1) == match.group(3):
                out.append((name, number, f"binds {match.group(2)}.{match.group(3)} by hand"))
    return out


def transport_interface_violations(trees: dict[str, ast.Module] | None = None) -> list[tuple[str, int, str]]:
    """(module, line, why) for what breaks comm's declared transport interface: a class named ``...Transport`` in
    ``distlab.comm.transports`` that does not derive from the interface (``Transport``), and a ``getattr`` or
    ``hasattr`` on a transport anywhere in ``distlab.comm`` (an optional method probed rather than declared)."""
    trees = _python_modules() if trees is None else trees
    out = []
    for module, tree in sorted(trees.items()):
        if not module.startswith("distlab.comm"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and module.startswith("distlab.comm.transports") \
                    and node.name.endswith("Transport") and node.name != "Transport" \
                    and not any(ast.unparse(base).split(".")[-1].endswith("Transport") for base in node.bases):
                out.append((module, node.lineno, f"{node.name} does not implement the Transport interface"))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") and node.args \
                    and "transport" in ast.unparse(node.args[0]).lower():
                out.append((module, node.lineno, f"probes a transport: {ast.unparse(node)}"))
    return out


#: Words that name one thing each across distlab, in class names: the word -> (the package it belongs to, what it
#: means). Negotiation's channel (its three calls over a process set) and the set's arena regions have names of their
#: own (``_MPIChannel``, ``ArenaRegions``).
ONE_MEANING = {
    "Transport": ("distlab.comm.transports", "how a process group moves device arrays, as c10d's backends"),
    "Placement": ("distlab.comm.transports", "where a rank's device is and what it can reach"),
}
#: Classes that still use a word of ONE_MEANING for another thing, left to their owner (the RPC package is being
#: reworked by its own engineer): delete an entry once it is renamed.
ONE_MEANING_EXCEPTIONS = {"distlab.rpc.transport": "Transport", "distlab.rpc.devices": "Placement"}


def name_meaning_violations(trees: dict[str, ast.Module] | None = None) -> list[tuple[str, int, str]]:
    """(module, line, why) for a class whose name uses a word of :data:`ONE_MEANING` (``Transport``,
    ``_MPITransport``) outside the package that word belongs to: one word, one thing. (Anchors' own names may
    repeat where they mirror two anchors: Horovod's ``DistributedOptimizer`` and torch's.)"""
    trees = _python_modules() if trees is None else trees
    out = []
    for module, tree in sorted(trees.items()):
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for word, (owner, meaning) in ONE_MEANING.items():
                if word in node.name and not (module == owner or module.startswith(owner + ".")) \
                        and ONE_MEANING_EXCEPTIONS.get(module) != word:
                    out.append((module, node.lineno, f"{node.name}: '{word}' means {meaning} ({owner})"))
    return out


# ------------------------------------------------------------------------------------------------ line counts
def oversized_modules() -> list[tuple[str, int, int]]:
    """(path, lines, limit) of each module over its limit."""
    out = []
    for folder, limit, pattern in ((SRC, MAX_SRC_LINES, "*.py"), (REFERENCE, MAX_REFERENCE_LINES, "*.py"),
                                   (CORE, MAX_CORE_LINES, "*.p[yx][xid]")):
        for path in sorted(folder.rglob(pattern)):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                out.append((str(path.relative_to(REPO) if path.is_relative_to(REPO) else path), lines, limit))
    return out


def main() -> int:
    total = copied = 0
    print("verbatim share of core lines found in reference/ (target <= 15% per component):")
    for component in TWINS:
        lines, dup = verbatim_share(component)
        total, copied = total + lines, copied + dup
        print(f"  {component:20} {dup:4} of {lines:4}  {100 * dup / max(lines, 1):5.1f}%")
    print(f"  {'all':20} {copied:4} of {total:4}  {100 * copied / max(total, 1):5.1f}%")
    print("twin outline order (pairs in a different order in core than in reference):")
    for component in TWINS:
        bad = outline_disorder(component)
        print(f"  {component:20} {'ok' if not bad else bad}")
    print("import cycles:")
    for cycle in import_cycles():
        print("  " + " <-> ".join(cycle))
    print("imports against the layering:")
    for importer, imported, rule in layering_violations():
        print(f"  {importer} -> {imported}: {rule}")
    print("calls of private names across modules (up the layers, or into another module's private functions):")
    for module, line, call, why in private_call_violations():
        print(f"  {module}:{line} {call}: {why}")
    print("core files that do not line up with reference/:")
    for component in TWINS:
        for problem in layout_mismatches(component):
            print(f"  {component}: {problem}")
    print("modules over their line limit:")
    for path, lines, limit in oversized_modules():
        print(f"  {path}: {lines} > {limit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
