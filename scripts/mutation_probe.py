"""The mutation probe of the reference twins (``make mutation-probe``): which small deliberate mistakes the tests catch.

For each module of ``reference/`` it lists every *mutation site* of the module's code (a comparison flipped or
moved across its boundary, an arithmetic, bitwise or boolean operator swapped, a ``not`` or a minus dropped, a
boolean constant negated, a small integer constant changed by one), draws ``--mutants`` of them with a seeded
generator, and for each one runs the module's own tests and its MPI scenario tests (``MODULE_TESTS``) against the
module with that one change. A mutant is *killed* when a test fails (or the run exceeds its time bound: a hang is
caught too), and *survives* when every test passes. Mutants that cannot change behaviour (an equivalent mutant,
e.g. a default that every caller overrides) are listed with a reason each in ``scripts/mutation_equivalent.json``
and left out of the kill rate: ``killed / (drawn - equivalent)``.

How a mutant runs without touching the working tree: the probe copies the repository's tracked files and the
compiled core into a scratch directory, and puts a ``distlab`` package there made of links to the copy
(``src/distlab``'s entries, ``reference`` and ``core``) first on ``PYTHONPATH``, ahead of the editable install's
finder (which Python consults after ``sys.path``). The MPI ranks inherit the variable, so they run the mutant too.
Each mutant rewrites one file of the copy (``ast.unparse`` of the changed tree) and runs ``pytest -x`` over the
module's tests, twin-parametrised ids of the core twin deselected (``-k "not core"``), at the lowest CPU priority,
in a session of its own that is killed at its bound.

Why not mutmut: mutmut 3 runs the tests inside its own copy (``mutants/``) with every function trampolined and
picks the tests per function from an in-process trace; ``distlab.reference`` is ``reference/`` mapped into the
package by ``package_dir``, the tests run as ``python -P`` against the installed package, and the tests that kill
most mutants run the twins inside MPI ranks, which an in-process trace never sees.

Usage: ``python scripts/mutation_probe.py join reducer --mutants 20 --seed 1`` (no module: every module);
``--list`` prints the drawn mutants without running them; ``--json out.json`` writes every outcome. The probe is
CPU heavy: run one module at a time, one probe at a time.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT = REPO / "scripts" / "mutation_equivalent.json"

#: Each reference module's own tests, then its MPI scenario tests (run in this order, stopping at the first failure).
MODULE_TESTS = {
    "autograd_container": ["test_autograd_container.py", "test_dist_engine.py", "test_dist_autograd_mpi.py"],
    "autograd_context": ["test_autograd_container.py", "test_dist_engine.py", "test_dist_autograd_mpi.py"],
    "coordinator": ["test_negotiation_controller.py", "test_negotiation_groups.py", "test_negotiation_hardening.py",
                    "test_response_cache.py", "test_collectives.py"],
    "fingerprint": ["test_fingerprint.py", "test_comm_mpi.py::test_detail_mismatch_raises_on_every_rank",
                    "test_comm_mpi.py::test_refused_calls_keep_the_group_in_step"],
    "fsdp_collectives": ["test_fsdp.py", "test_fsdp_steps.py", "test_fsdp_mpi.py"],
    "fsdp_param": ["test_fsdp.py", "test_fsdp_steps.py", "test_fsdp_mpi.py"],
    "fsdp_param_group": ["test_fsdp.py", "test_fsdp_steps.py", "test_fsdp_mpi.py"],
    "join": ["test_join.py", "test_join_mpi.py"],
    "messages": ["test_negotiation_messages.py", "test_negotiation_hardening.py", "test_negotiation_controller.py",
                 "test_collectives.py"],
    "negotiation": ["test_negotiation_controller.py", "test_negotiation_groups.py", "test_negotiation_hardening.py",
                    "test_response_cache.py", "test_collectives.py"],
    "reducer": ["test_reducer.py", "test_bucketing.py", "test_ddp_mpi.py"],
    "response_cache": ["test_response_cache.py", "test_negotiation_controller.py", "test_negotiation_hardening.py",
                       "test_collectives.py"],
    "rpc_framing": ["test_rpc_framing.py", "test_rpc_local.py", "test_rpc_mpi.py"],
    "rpc_wait": ["test_rpc_wait.py", "test_rpc_mpi.py"],
    "rref": ["test_rref_protocol.py", "test_rref_parity.py", "test_rpc_mpi.py"],
    "rref_context": ["test_rref_protocol.py", "test_rref_parity.py", "test_rref_fuzz.py", "test_rpc_mpi.py"],
    "rref_impl": ["test_rref_protocol.py", "test_rref_parity.py", "test_rref_fuzz.py", "test_rpc_mpi.py"],
}
#: Tests of the core twin are deselected: the mutant is in the reference twin, which every facade and scenario
#: without a twin of its own runs too (DISTLAB_IMPL=reference).
DESELECT = "not core"

_NEGATED = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
            ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
           ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr,
           ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.Pow: ast.Mult}
_SYMBOL = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
           ast.LShift: "<<", ast.RShift: ">>", ast.Pow: "**", ast.And: "and", ast.Or: "or"}
SMALL = range(-10, 11)   # integer constants mutated by one


@dataclass
class Mutant:
    """One change: the ``index``-th site of the module (in the probe's walk order), and how to describe it."""

    module: str
    index: int
    line: int
    source: str        # the line of the original source, stripped
    change: str        # "== -> !=", "True -> False", "1 -> 2", "drop not", ...
    occurrence: int = 0  # how many earlier sites of the module have the same line text and change

    @property
    def key(self) -> str:
        """How the equivalent list names it: robust to lines moving (not to the line itself changing)."""
        nth = f" #{self.occurrence + 1}" if self.occurrence else ""
        return f"{self.module}: {self.source} :: {self.change}{nth}"


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, ``__all__``, annotations, f-strings, ``if TYPE_CHECKING`` bodies."""
    skip: set[int] = set()

    def drop(node):
        skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            drop(body[0])
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            drop(node)
        if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            drop(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                drop(node.returns)
            for decorator in node.decorator_list:
                drop(decorator)
        if isinstance(node, ast.JoinedStr):
            drop(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            drop(node)
    return skip


def _sites(tree: ast.Module):
    """Yield ``(node, change, apply)`` for every mutation site, in a fixed order (``apply()`` mutates in place)."""
    skip = _skipped(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                kinds = [_NEGATED.get(type(op))] + ([_BOUNDARY[type(op)]] if type(op) in _BOUNDARY else [])
                for new in filter(None, kinds):
                    yield node, f"{_SYMBOL[type(op)]} -> {_SYMBOL[new]}", _setter(node.ops, i, new())
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BINARY:
            new = _BINARY[type(node.op)]
            yield node, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[new]}", _attr_setter(node, "op", new())
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            yield node, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[new]}", _attr_setter(node, "op", new())
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            what = "not" if isinstance(node.op, ast.Not) else "unary minus"
            yield node, f"drop {what}", _attr_setter(node, "op", ast.UAdd() if what != "not" else _Keep())
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            yield node, f"{node.value} -> {not node.value}", _attr_setter(node, "value", not node.value)
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in SMALL:
            yield node, f"{node.value} -> {node.value + 1}", _attr_setter(node, "value", node.value + 1)


class _Keep(ast.UAdd):
    """``not x`` becomes ``+x`` spelled as ``x`` (``ast.unparse`` writes UAdd as ``+``): see _DropNot."""


class _DropNot(ast.NodeTransformer):
    def visit_UnaryOp(self, node):  # noqa: N802 - ast's naming
        self.generic_visit(node)
        return node.operand if isinstance(node.op, _Keep) else node


def _setter(items, index, value):
    def apply():
        items[index] = value
    return apply


def _attr_setter(node, name, value):
    def apply():
        setattr(node, name, value)
    return apply


def mutants_of(module: str, source: str) -> list[Mutant]:
    """Every mutation site of ``module``'s ``source``."""
    lines = source.splitlines()
    found, seen = [], {}
    for i, (node, change, _apply) in enumerate(_sites(ast.parse(source))):
        text = lines[node.lineno - 1].strip()
        occurrence = seen[text, change] = seen.get((text, change), -1) + 1
        found.append(Mutant(module, i, node.lineno, text, change, occurrence))
    return found


def mutated_source(source: str, index: int) -> str:
    """``source`` with its ``index``-th site changed."""
    tree = ast.parse(source)
    for i, (_node, _change, apply) in enumerate(_sites(tree)):
        if i == index:
            apply()
            break
    else:
        raise IndexError(f"no mutation site {index}")
    return ast.unparse(ast.fix_missing_locations(_DropNot().visit(tree))) + "\n"


def draw(mutants: list[Mutant], count: int, seed: int) -> list[Mutant]:
    """``count`` mutants drawn with ``random.Random(seed)`` (all of them when there are fewer), in source order."""
    chosen = list(mutants) if count >= len(mutants) else random.Random(seed).sample(mutants, count)
    return sorted(chosen, key=lambda m: (m.line, m.index))


def load_equivalent() -> dict[str, str]:
    """The reviewed equivalent mutants: key -> reason."""
    if not EQUIVALENT.exists():
        return {}
    return {entry["mutant"]: entry["reason"] for entry in json.loads(EQUIVALENT.read_text())}


class Scratch:
    """A copy of the repository (tracked files, or the tree of commit ``at``, and the compiled core) and a
    ``distlab`` package linked to it."""

    def __init__(self, at: str | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="distlab-mutation-"))
        self.repo = self.root / "repo"
        self.repo.mkdir()
        if at is not None:   # a commit's tree (``main``: what the tests caught before a change)
            archive = subprocess.run(["git", "archive", at], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(self.repo)], input=archive, check=True)
        else:
            files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
            for name in filter(None, files.decode().split("\0")):
                source = REPO / name
                if source.is_file():
                    (self.repo / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, self.repo / name)
        for built in (REPO / "core").glob("*.so"):
            shutil.copy2(built, self.repo / "core" / built.name)
        package = self.root / "site" / "distlab"
        package.mkdir(parents=True)
        for entry in (self.repo / "src" / "distlab").iterdir():
            (package / entry.name).symlink_to(entry)
        (package / "reference").symlink_to(self.repo / "reference")
        (package / "core").symlink_to(self.repo / "core")

    def env(self) -> dict:
        env = dict(os.environ, PYTHONPATH=str(self.root / "site"), PYTHONDONTWRITEBYTECODE="1",
                   DISTLAB_IMPL="reference")
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def write(self, module: str, text: str) -> None:
        (self.repo / "reference" / f"{module}.py").write_text(text)
        shutil.rmtree(self.repo / "reference" / "__pycache__", ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run_tests(scratch: Scratch, module: str, bound: float) -> tuple[str, float, str]:
    """Run ``module``'s tests in the scratch copy: ``("passed" | "failed" | "timeout", seconds, last lines)``."""
    tests = [f"tests/{name}" for name in MODULE_TESTS[module]]
    command = ["nice", "-n", "19", sys.executable, "-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-k", DESELECT, *tests]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=scratch.repo, env=scratch.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=bound)
        outcome = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        outcome = "timeout"
    except BaseException:   # interrupted: leave no test run behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    tail = "\n".join(out.decode(errors="replace").strip().splitlines()[-3:])
    return outcome, time.monotonic() - start, tail


def probe(module: str, count: int, seed: int, equivalent: dict, listing: bool, at: str | None = None) -> dict:
    """Draw ``count`` mutants of ``module`` and run each; returns the module's record."""
    if at is None:
        source = (REPO / "reference" / f"{module}.py").read_text()
    else:
        source = subprocess.run(["git", "show", f"{at}:reference/{module}.py"], cwd=REPO, capture_output=True,
                                check=True, text=True).stdout
    every = mutants_of(module, source)
    drawn = draw(every, count, seed)
    record = {"module": module, "sites": len(every), "drawn": len(drawn), "mutants": [], "equivalent": 0,
              "killed": 0, "considered": 0}
    if not every:
        print(f"{module}: no mutation site (it only re-exports)", flush=True)
        return record
    if listing:
        for m in drawn:
            mark = "  (equivalent)" if m.key in equivalent else ""
            print(f"  {module}:{m.line}: {m.change:<14} {m.source}{mark}")
        return record
    scratch = Scratch(at)
    try:
        scratch.write(module, ast.unparse(ast.parse(source)) + "\n")   # the unmutated module, as every mutant is
        outcome, seconds, tail = run_tests(scratch, module, 1800)
        if outcome != "passed":
            raise SystemExit(f"{module}: the tests do not pass on the unmutated module ({outcome}):\n{tail}")
        bound = max(60.0, 1.5 * seconds)   # a mutant that hangs costs this long (without a per-test bound)
        print(f"{module}: {len(every)} sites, {len(drawn)} drawn (seed {seed}); unmutated run {seconds:.0f} s, "
              f"bound per mutant {bound:.0f} s", flush=True)
        for m in drawn:
            if m.key in equivalent:
                result, seconds, tail = "equivalent", 0.0, equivalent[m.key]
            else:
                scratch.write(module, mutated_source(source, m.index))
                result, seconds, tail = run_tests(scratch, module, bound)
                result = {"failed": "killed", "timeout": "killed (timeout)", "passed": "SURVIVED"}[result]
            print(f"  {module}:{m.line}: {m.change:<14} {result:<17} {seconds:5.0f} s  {m.source}", flush=True)
            record["mutants"].append({"line": m.line, "change": m.change, "source": m.source, "key": m.key,
                                      "result": result, "seconds": round(seconds, 1)})
    finally:
        scratch.close()
    results = [x["result"] for x in record["mutants"]]
    record["equivalent"] = results.count("equivalent")
    record["killed"] = sum(r.startswith("killed") for r in results)
    record["considered"] = len(results) - record["equivalent"]
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"reference modules (default: all of {sorted(MODULE_TESTS)})")
    parser.add_argument("--mutants", type=int, default=20, help="mutants drawn per module (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="the draw's seed (default 1)")
    parser.add_argument("--list", action="store_true", help="print the drawn mutants, run nothing")
    parser.add_argument("--json", help="write every outcome to this file")
    parser.add_argument("--at", help="probe the tree of this commit (e.g. main) instead of the working tree")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # clean up as on Ctrl-C
    modules = args.modules or sorted(MODULE_TESTS)
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; known: {sorted(MODULE_TESTS)}")
    equivalent = load_equivalent()
    records = [probe(m, args.mutants, args.seed, equivalent, args.list, args.at) for m in modules]
    if args.list:
        return 0
    print(f"\n{'module':<20} {'killed':>8} {'of':>4} {'rate':>7}   equivalent")
    for r in records:
        rate = r["killed"] / r["considered"] if r["considered"] else 1.0
        print(f"{r['module']:<20} {r['killed']:>8} {r['considered']:>4} {rate:>7.0%}   {r['equivalent']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "mutants": args.mutants, "modules": records},
                                              indent=1))
    return 0 if all(r["killed"] >= 0.95 * r["considered"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
