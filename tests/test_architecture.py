"""The repository's shape, as CONTRIBUTING.md's twin rule and ARCHITECTURE.md describe it.

Each check is measured by tests/_architecture.py (run it by hand to see every figure). A failure names the
component, the pair of names, the cycle or the module to fix.
"""
from __future__ import annotations

import pytest

import _architecture as arch


@pytest.mark.parametrize("component", sorted(arch.TWINS))
def test_core_twin_compiles_the_hot_path_not_a_copy(component):
    total, verbatim = arch.verbatim_share(component)
    assert total > 0, f"{component}: no substantive lines found in its core twin (is TWINS up to date?)"
    share = verbatim / total
    assert share <= arch.MAX_VERBATIM_SHARE, (
        f"{component}: {verbatim} of {total} substantive core lines ({share:.1%}) appear word for word in "
        f"reference/ (at most {arch.MAX_VERBATIM_SHARE:.0%}): move what both twins run into the shared module")


@pytest.mark.parametrize("component", sorted(arch.TWINS))
def test_twins_define_their_names_in_the_same_order(component):
    assert arch.outline_disorder(component) == [], (
        f"{component}: these pairs come in a different order in core than in reference: "
        f"{arch.outline_disorder(component)}")


def test_outline_sees_both_twins_names():
    # guards the two checks above against an outline parser that finds nothing (and so never fails)
    for component in arch.TWINS:
        reference_text = "\n".join((arch.REFERENCE / name).read_text() for name in arch.TWINS[component][0])
        core_names = arch.core_outline(arch.TWINS[component][1])
        shared = set(arch.outline(reference_text)) & set(core_names)
        assert len(shared) >= 2, f"{component}: the twins share only {sorted(shared)}"


def test_no_import_cycles():
    assert arch.import_cycles() == []


def test_import_graph_sees_the_packages():
    graph = arch.import_graph()
    assert "distlab.rpc.api" in graph and "distlab.rpc.agent" in graph["distlab.rpc.api"]
    assert any(module.startswith("distlab.core.") for module in graph)


def test_modules_within_their_line_limits():
    assert arch.oversized_modules() == []


def test_imports_follow_the_layering():
    assert arch.layering_violations() == []


@pytest.mark.parametrize("importer, imported", [
    ("distlab.reference.reducer", "distlab.ddp"),
    ("distlab.core._rref", "distlab.rpc.api"),
    ("distlab.ddp", "distlab.core._reducer"),
    ("distlab.core._join", "distlab.reference.join"),
    ("distlab._common.join", "distlab.reference.join"),
    ("distlab._common.reducer", "distlab.comm"),
    ("distlab.comm.group", "distlab.collectives._engine"),
    ("distlab.rpc.rref", "distlab.distributed_autograd"),
    ("distlab.errors", "distlab._wire"),
    ("distlab.futures", "distlab.timeline"),
    ("distlab._backend", "distlab.comm"),
    ("distlab.autograd.engine", "distlab.comm"),
])
def test_each_layering_rule_can_fail(importer, imported):
    # guards test_imports_follow_the_layering against rules that never fire; and the real graph has the edges
    # the rules are about (twins import shared modules, distributed autograd imports rpc)
    assert arch.layering_violations({importer: {imported}}), f"{importer} -> {imported} was allowed"
    graph = arch.import_graph()
    assert "distlab._common.stall" in graph["distlab.reference.negotiation"]
    assert "distlab.rpc.api" in graph["distlab.distributed_autograd._state"]


def test_every_twin_file_is_in_the_one_registry():
    # the registry (src/distlab/_twins.py) is the only list: a core extension or a reference module it does not
    # name would be neither built, loaded nor checked; and every component gets its fixture from it
    import conftest
    import distlab._backend as backend

    registered_core = {core for _files, core in arch.TWINS.values()}
    registered_reference = {name for files, _core in arch.TWINS.values() for name in files}
    registered_reference |= {loaded.rpartition(".")[2] + ".py" for loaded, _core in backend.COMPONENTS.values()}
    assert {p.name for p in arch.CORE.glob("*.pyx")} == registered_core
    assert {p.name for p in arch.REFERENCE.glob("*.py")} - {"__init__.py"} == registered_reference
    assert set(backend.COMPONENTS) == set(arch.TWINS)
    assert all(hasattr(conftest, component) for component in arch.TWINS)


def test_no_private_calls_up_the_layers_or_into_another_module():
    assert arch.outstanding(arch.private_call_violations()) == []


def test_each_private_call_rule_can_fail():
    # guards the test above: a mixin that calls its subclass's private method, a callee that calls back into its
    # caller's private method, an installer called through another module's private function, and a call into a
    # sibling's private method are all caught
    import ast

    trees = {
        "distlab.low": ast.parse("class Mixin:\n    def run(self):\n        return self._issue()\n"
                                 "def poll(group):\n    group._report()\n"),
        "distlab.high": ast.parse("from . import low\nclass Group(low.Mixin):\n    def _issue(self):\n        pass\n"
                                  "    def _report(self):\n        pass\nlow._install(1)\n"),
        # a sibling mixin's private method (rooted.py calling operations.py's _movable)
        "distlab.sibling": ast.parse("class Rooted:\n    def gather(self):\n        return self._movable()\n"),
        "distlab.other": ast.parse("class Operations:\n    def _movable(self):\n        pass\n"),
    }
    trees["distlab.low"].body.append(ast.parse("def _install(layer):\n    pass\n").body[0])
    graph = {"distlab.high": {"distlab.low"}, "distlab.low": set(), "distlab.sibling": set(), "distlab.other": set()}
    found = {(module, call) for module, _line, call, _why in arch.private_call_violations(trees, graph)}
    assert found == {("distlab.low", "self._issue"), ("distlab.low", "group._report"), ("distlab.high", "low._install"),
                     ("distlab.sibling", "self._movable")}


@pytest.mark.parametrize("component", sorted(arch.TWINS))
def test_core_lines_up_with_the_reference_file_for_file(component):
    assert arch.layout_mismatches(component) == []


def test_every_core_file_has_a_reference_counterpart():
    # a file of core/ belongs to a registered extension (a .pyx, a .pxi it includes, or its .pyi stub) and is named
    # after a reference module
    units = {f for _files, core in arch.TWINS.values() for f in arch.core_files(core)}
    units |= {core.replace(".pyx", ".pyi") for _files, core in arch.TWINS.values()}
    for path in sorted(arch.CORE.glob("*.p[yx][xid]")):
        assert path.name in units, f"core/{path.name} belongs to no registered core extension"
        assert (arch.REFERENCE / f"{path.name.lstrip('_').split('.')[0]}.py").exists(), (
            f"core/{path.name} has no reference counterpart")


def test_a_core_laid_out_differently_fails(tmp_path, monkeypatch):
    # guards the two tests above: includes out of the reference's order, a name in the wrong file, and a core
    # file over its limit are each reported
    for path in arch.CORE.glob("*.p[yx]i"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    for path in arch.CORE.glob("*.pyx"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(arch, "CORE", tmp_path)
    assert arch.layout_mismatches("negotiation") == []
    main = (tmp_path / "_negotiation.pyx").read_text(encoding="utf-8")
    swapped = main.replace('include "_response_cache.pxi"\ninclude "_coordinator.pxi"',
                           'include "_coordinator.pxi"\ninclude "_response_cache.pxi"')
    (tmp_path / "_negotiation.pyx").write_text(swapped, encoding="utf-8")
    assert any("do not line up" in problem for problem in arch.layout_mismatches("negotiation"))
    moved = main.replace('include "_coordinator.pxi"\n',
                         'include "_coordinator.pxi"\n\n\ndef fuse_responses(responses, threshold):\n    pass\n')
    (tmp_path / "_negotiation.pyx").write_text(moved, encoding="utf-8")
    assert "_negotiation.pyx defines fuse_responses, which reference/negotiation.py does not" in (
        arch.layout_mismatches("negotiation"))
    (tmp_path / "_coordinator.pxi").write_text("pass\n" * (arch.MAX_CORE_LINES + 1), encoding="utf-8")
    assert any(path.endswith("_coordinator.pxi") for path, _lines, _limit in arch.oversized_modules())


def test_no_private_access_across_modules():
    assert arch.outstanding(arch.private_access_violations()) == []


def test_each_private_access_rule_can_fail():
    # guards the test above with the patterns this rule was written for: a module popping another object's private
    # entries (Work popping group._pending), writing its private field (missing.py writing group._broken), probing it
    # with getattr or its __dict__ (pieces' state machine), a mixin reading a field only its subclass sets, a sibling
    # mixin's private method; the module's own fields, and a base's read from below, pass
    import ast

    trees = {
        "distlab.steps": ast.parse("class Steps:\n    _lock = None\n    def __init__(self):\n        self._own = 1\n"),
        "distlab.work": ast.parse("def complete(work, group):\n    group._pending.pop(work)\n"
                                  "def fail(group):\n    group._broken = 'timed out'\n"
                                  "def probe(group):\n    return getattr(group, '_link', None) or "
                                  "group.__dict__.get('_link')\n"),
        "distlab.ops": ast.parse("from . import steps\nclass Ops(steps.Steps):\n    def call(self):\n"
                                 "        return self._transport, self._movable(), self._lock, self._own\n"),
        "distlab.rooted": ast.parse("class Rooted:\n    def _movable(self):\n        pass\n"),
        "distlab.group": ast.parse("from . import ops\nclass Group(ops.Ops):\n    def __init__(self):\n"
                                   "        self._pending, self._broken, self._link, self._transport = {}, None, None, 1\n"),
    }
    graph = {"distlab.group": {"distlab.ops"}, "distlab.ops": {"distlab.steps"}, "distlab.steps": set(),
             "distlab.work": set(), "distlab.rooted": set()}
    found = {(module, access) for module, _line, access, _why in arch.private_access_violations(trees, graph)}
    assert found == {("distlab.work", "group._pending"), ("distlab.work", "group._broken"),
                     ("distlab.work", "getattr(group, '_link', None)"), ("distlab.work", "group.__dict__.get('_link')"),
                     ("distlab.ops", "self._transport"), ("distlab.ops", "self._movable")}


def test_no_private_names_imported_from_another_module():
    assert arch.private_import_violations() == []


def test_a_private_import_fails():
    # guards the test above: a module global handed over by import (comm's _busy set), a private helper imported
    import ast

    trees = {"distlab.work": ast.parse("_busy = set()\ndef _check_tag(tag):\n    pass\n"),
             "distlab.steps": ast.parse("from .work import _busy, _check_tag\nfrom . import _backend\n"),
             "distlab._backend": ast.parse("x = 1\n")}
    found = {(module, text) for module, _line, text, _why in arch.private_import_violations(trees)}
    assert found == {("distlab.steps", "from distlab.work import _busy"),
                     ("distlab.steps", "from distlab.work import _check_tag")}


def test_core_files_reach_no_other_files_private_fields():
    assert arch.outstanding(arch.core_private_access_violations()) == []


def test_a_core_file_reaching_into_another_fails():
    # guards the test above: the negotiation controller writing the cache coordinator's and the cache's C fields
    # (what it did before it called their methods); a class's own fields, and another file's public ones, pass
    texts = {
        "_response_cache.pxi": "cdef class CacheCoordinator:\n    cdef vector[uint64_t] _hits\n"
                               "    cdef readonly bint uncached_in_queue\n    cdef bint _uncached_in_queue\n"
                               "    cdef list _responses\n    def f(self):\n        self._hits.clear()\n",
        "_negotiation.pyx": "cdef class Controller:\n    cdef object _lock\n    def cycle(self, CacheCoordinator c, cache):\n"
                            "        c._hits[0] |= 1\n        c._uncached_in_queue = True  # c._nothing\n"
                            "        x = (<ResponseCache>cache)._responses\n        self._lock = c.uncached_in_queue\n",
    }
    found = {(name, access) for name, _line, access, _why in arch.core_private_access_violations(texts)}
    assert found == {("_negotiation.pyx", "c._hits"), ("_negotiation.pyx", "c._uncached_in_queue"),
                     ("_negotiation.pyx", ")._responses")}


def test_twins_share_code_through_functions_not_a_base_class():
    assert arch.outstanding(arch.twin_binding_violations()) == []


def test_a_twin_on_a_shared_base_fails():
    # guards the test above: a reference class inheriting a _common base, a core class binding its methods by hand
    import ast

    trees = {"distlab.reference.reducer": ast.parse(
        "from distlab._common.reducer import ReducerBase, GradBucket\nclass Reducer(ReducerBase):\n    pass\n"
        "class Other:\n    pass\n")}
    core = {"_reducer.pyx": "cdef class Reducer:\n    cdef object x\n    _configure = ReducerBase._configure\n"
                            "    get_grad_buckets = ReducerBase.get_grad_buckets\n    alias = other.thing\n"}
    found = arch.twin_binding_violations(trees, core)
    assert [(where, why.split(" ")[0]) for where, _line, why in found] == [
        ("distlab.reference.reducer", "class"), ("_reducer.pyx", "binds"), ("_reducer.pyx", "binds")]


def test_every_device_transport_implements_the_interface():
    assert arch.transport_interface_violations() == []
    from distlab.comm.transports import Transport

    assert sorted(Transport.__abstractmethods__) == ["allgather", "allreduce", "broadcast", "reduce_scatter",
                                                     "takes"]


def test_a_transport_off_the_interface_fails():
    # guards the test above: a transport class that does not derive from the interface, and a group probing its
    # transport for an optional method
    import ast

    trees = {"distlab.comm.transports.fast": ast.parse("class FastTransport:\n    pass\nclass Helper:\n    pass\n"),
             "distlab.comm.group": ast.parse("make = getattr(self._transport, 'shared_arrays', None)\n")}
    assert [why.split(" ")[0] for _m, _line, why in arch.transport_interface_violations(trees)] == ["probes",
                                                                                                    "FastTransport"]


def test_one_meaning_per_name():
    assert arch.name_meaning_violations() == []


def test_a_second_meaning_fails():
    # guards the test above: negotiation's channel and the set's arena allocator under the words comm owns
    import ast

    trees = {"distlab.collectives._engine": ast.parse("class _MPITransport:\n    pass\n"),
             "distlab.collectives._placement": ast.parse("class Placement:\n    pass\n"),
             "distlab.comm.transports.base": ast.parse("class Transport:\n    pass\n")}
    assert sorted(m for m, _line, _why in arch.name_meaning_violations(trees)) == [
        "distlab.collectives._engine", "distlab.collectives._placement"]


def test_each_reshape_still_owed_is_owed():
    # the list of code that predates the checks only shrinks: an entry whose module meets every check goes
    found = {violation[0] for check in (arch.private_call_violations, arch.private_access_violations,
                                        arch.core_private_access_violations, arch.twin_binding_violations)
             for violation in check()}
    assert [entry for entry in arch.RESHAPE_OWED if entry not in found] == []
