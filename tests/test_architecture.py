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
    assert arch.private_call_violations() == []


def test_each_private_call_rule_can_fail():
    # guards the test above: a mixin that calls its subclass's private method, a callee that calls back into its
    # caller's private method, and an installer called through another module's private function are all caught
    import ast

    trees = {
        "distlab.low": ast.parse("class Mixin:\n    def run(self):\n        return self._issue()\n"
                                 "def poll(group):\n    group._report()\n"),
        "distlab.high": ast.parse("from . import low\nclass Group(low.Mixin):\n    def _issue(self):\n        pass\n"
                                  "    def _report(self):\n        pass\nlow._install(1)\n"),
    }
    trees["distlab.low"].body.append(ast.parse("def _install(layer):\n    pass\n").body[0])
    graph = {"distlab.high": {"distlab.low"}, "distlab.low": set()}
    found = {(module, call) for module, _line, call, _why in arch.private_call_violations(trees, graph)}
    assert found == {("distlab.low", "self._issue"), ("distlab.low", "group._report"), ("distlab.high", "low._install")}


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
