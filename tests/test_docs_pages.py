"""What the docs must show a learner (docs/_scripts/check_pages.py, run by `make docs`): the checker itself on
small pages, the width rule on the docs' sources (no build needed), and the built site when `make docs` made one."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
SITE = DOCS / "_build" / "html"


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_pages", DOCS / "_scripts" / "check_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_pages = _load_checker()

EXECUTED = """
<div class="cell docutils container"><div class="cell_input docutils container">
<div class="highlight-ipython3 notranslate"><div class="highlight"><pre>print(1)</pre></div></div></div>
<div class="cell_output docutils container">
<div class="output stream highlight-myst-ansi notranslate"><div class="highlight"><pre>1
</pre></div></div></div></div>
<div class="cell docutils container"><div class="cell_output docutils container">
<img alt="a" src="../_images/abc.png" /></div></div>
"""
CODE_ONLY = """
<div class="cell docutils container"><div class="cell_input docutils container">
<div class="highlight-ipython3 notranslate"><div class="highlight"><pre>plt.show()</pre></div></div></div></div>
<img alt="a logo outside any cell" src="../_static/logo.png" />
"""


def test_an_executed_tutorial_passes_and_a_page_of_code_only_does_not():
    assert check_pages.tutorial_problems("t.html", check_pages.parse(EXECUTED)) == []
    problems = check_pages.tutorial_problems("t.html", check_pages.parse(CODE_ONLY))
    assert len(problems) == 2 and "no figure" in problems[0] and "no printed output" in problems[1]


def test_a_protocol_page_needs_a_generated_flow_figure():
    drawn = check_pages.parse('<figure><img alt="flow" src="../_images/rref_remote.svg" /></figure>')
    other = check_pages.parse('<img alt="a drawing" src="../_images/overlap_probe.png" />')
    flows = {"rref_remote.svg", "join_ddp.svg"}
    assert check_pages.protocol_problems("p.html", drawn, flows) == []
    assert "no message-flow figure" in check_pages.protocol_problems("p.html", other, flows)[0]


def _block(language, text, output=False):
    pre = f'<div class="highlight-{language} notranslate"><div class="highlight"><pre>{text}</pre></div></div>'
    return f'<div class="cell_output docutils container">{pre}</div>' if output else pre


def test_a_flow_figure_wider_than_the_column_is_named(tmp_path):
    (tmp_path / "fits.svg").write_text('<?xml version="1.0"?>\n<svg xmlns="x" width="504pt" height="900pt">')
    (tmp_path / "wide.svg").write_text('<svg xmlns="x" width="720pt" height="300pt" viewBox="0 0 720 300">')
    problems = check_pages.figure_width_problems(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("wide.svg: 720pt wide")


def test_a_block_fits_when_its_estimated_width_fits_the_column():
    # the calibration (check_pages' docstring): 7.80 px per character plus 28 px of padding, in a 736 px column
    # (a tutorial cell's input 732 px): 90 characters fit, 91 scroll (738 px, as Chromium measured)
    assert check_pages.WIDEST == 90
    wide = "x" * (check_pages.WIDEST + 1)
    fits = "x" * check_pages.WIDEST
    page = check_pages.parse(_block("text", f"a\n{wide}\nb") + _block("sh", fits) + _block("python", wide)
                             + _block("myst-ansi", wide, output=True)
                             + f'<div class="cell_input">{_block("ipython3", fits)}</div>')
    problems, wrapped = check_pages.width_problems("w.html", page)
    assert [p.split(" block")[0] for p in problems] == ["w.html: a text", "w.html: a python"]
    assert "738 px in a 736 px column" in problems[0] and wrapped == 0
    assert page.blocks[-1].inset == check_pages.CELL_INSET_PX and page.blocks[-1].fits


def test_quoted_code_wraps_and_is_counted_not_failed():
    wide = "y" * 120
    page = check_pages.parse(f'<div class="quoted highlight-python notranslate"><div class="highlight">'
                             f'<pre>{wide}\nshort\n{wide}</pre></div></div>')
    assert check_pages.width_problems("q.html", page) == ([], 2)
    # and the site's CSS does wrap it, with a hanging indent
    css = (DOCS / "_static" / "distlab.css").read_text()
    assert re.search(r"div\.quoted div\.highlight pre \{\s*white-space: pre-wrap;", css)


def _table(*rows):
    cells = "".join("<tr>" + "".join(f"<td><p>{cell}</p></td>" for cell in row) + "</tr>" for row in rows)
    return f'<div class="table-wrapper"><table class="docutils">{cells}</table></div>'


def _code(name, breaks=False):
    parts = name.replace(".", ".\0").split("\0") if breaks else [name]
    return ('<code class="docutils literal notranslate">'
            + "<wbr>".join(f'<span class="pre">{part}</span>' for part in parts) + "</code>")


def test_a_table_is_as_wide_as_its_longest_words():
    names = ["distlab.comm.ProcessGroup.allgather_object", "distlab.collectives.broadcast_optimizer_state",
             "distlab.distributed_autograd.DistributedOptimizer"]
    unbroken = check_pages.parse(_table([_code(n) for n in names], ["a", "b", "c"]))
    broken = check_pages.parse(_table([_code(n, breaks=True) for n in names], ["a", "b", "c"]))
    # 42 + 45 + 49 characters of code at 7.80 px, 7.2 px of code padding and 17 px of cell each
    assert round(unbroken.tables[0].px) == round((42 + 45 + 49) * 7.80 + 3 * (7.2 + 17))
    assert check_pages.width_problems("t.html", unbroken)[0][0].startswith("t.html: a table about 1133 px")
    assert check_pages.width_problems("t.html", broken) == ([], 0)  # broken after the dots, it fits
    # prose: Arial's advance widths at 16 px, bold in a header cell
    assert check_pages.text_px("mmm") == 3 * 833 * 16 / 1000
    assert check_pages.text_px("ab", bold=True) > check_pages.text_px("ab")


def test_the_width_rule_on_markdown_sources():
    wide = "y" * (check_pages.WIDEST + 1)
    source = "\n".join(["```", wide, "```", "```python", wide, "```", "```{literalinclude} x.py", "```",
                        "````md", "```sh", wide, "```", "````", wide])
    problems = check_pages.fenced_block_problems("s.md", source)
    # the bare block, the Python written on the page and the nested sh; not a directive, not prose
    assert [p.split(":")[1] for p in problems] == ["2", "5", "11"]


def test_every_fenced_block_of_the_docs_fits_the_page():
    pages = [p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md"]
    assert len(pages) > 10
    problems = [problem for page in pages
                for problem in check_pages.fenced_block_problems(str(page.relative_to(DOCS)), page.read_text())]
    assert problems == []


def test_the_tutorials_code_fits_the_page():
    source = "\n".join(["# %% [markdown]", "# " + "p" * 120, "# %%", "x = 1", "y = " + "2" * 100])
    assert [p.split(":")[1] for p in check_pages.tutorial_code_problems("t.py", source)] == ["5"]
    tutorials = sorted((DOCS.parent / "tutorials").glob("[0-9]*.py"))
    assert len(tutorials) >= 7
    assert [problem for path in tutorials
            for problem in check_pages.tutorial_code_problems(path.name, path.read_text())] == []


def _site_is_current() -> bool:
    """A site built after every change to the pages' sources (Sphinx writes .buildinfo at the end of each build)."""
    stamp = SITE / ".buildinfo"
    if not stamp.exists():
        return False
    sources = [*(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md"),
               DOCS / "conf.py",
               *(DOCS.parent / "tutorials").glob("*.py"), *(DOCS / "_static").iterdir()]
    return max(p.stat().st_mtime for p in sources) <= stamp.stat().st_mtime


@pytest.mark.skipif(not _site_is_current(), reason="no built site, or one older than the docs: run `make docs`")
def test_the_built_site_shows_executed_tutorials_and_flow_figures():
    problems, _ = check_pages.check(SITE, DOCS / "_generated" / "flows")
    assert problems == []


def test_the_overview_pages_describe_every_entry():
    # the API landing page: every module page listed once, in its hidden toctree, with a description; every
    # module page titled by its module's name
    api = DOCS / "api"
    index = (api / "index.rst").read_text()
    pages = sorted(p.stem for p in api.glob("*.rst") if p.stem != "index")
    described = re.findall(r"^- :doc:`(\w+)`: \S.*$", index, flags=re.M)
    toctree = re.findall(r"^   (\w+)$", index.split(".. toctree::")[1], flags=re.M)
    assert sorted(described) == pages and toctree == described
    assert [p for p in pages if not (api / f"{p}.rst").read_text().startswith("``distlab")] == []
    # the Tutorials page: every tutorial in order, with what it teaches and how long it takes
    tutorials = sorted(p.stem for p in (DOCS.parent / "tutorials").glob("[0-9]*.py"))
    page = (DOCS / "tutorials.md").read_text()
    listed = re.findall(r"^\d+\. \{doc\}`[^<]+<tutorials/(\w+)>` \(about \d+ minutes", page, flags=re.M)
    assert listed == tutorials
    assert page.count("*You will learn*") == len(tutorials)


def test_the_docs_build_measures_nothing_and_configures_no_network():
    # a tutorial cell that brings up the virtual cluster, or asks whether it runs as root, is one the reader runs:
    # tagged skip-execution (myst-nb and nbclient leave it out), so every build shows the same stored figures
    for path in sorted((DOCS.parent / "tutorials").glob("[0-9]*.py")):
        for cell in re.split(r"^# %%", path.read_text(), flags=re.M)[1:]:
            if re.search(r"cluster\.(up|down)\(|geteuid\(", cell):
                assert cell.startswith(' tags=["skip-execution"]'), f"{path.name}: a live cell runs at build time"
    stored = json.loads((DOCS / "_data" / "tutorial_03_bucket_caps.json").read_text())
    assert {"command", "machine", "date", "results"} <= set(stored) and re.match(r"\d{4}-\d\d-\d\d$", stored["date"])


def _flow_figures():
    spec = importlib.util.spec_from_file_location("make_flow_figures", DOCS / "_scripts" / "make_flow_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_flow_figures = _flow_figures()


def _drawn(**changes):
    rows = [{"kind": "collective", "label": "allreduce negotiation bits", "ranks": [0, 1]},
            {"kind": "collective", "label": "allreduce fused x2", "ranks": [0, 1]}]
    drawn = {"rows": rows, "legend": ["collective, across the ranks in it"],
             "labels": [{"kind": "collective", "text": r["label"], "shown": r["label"], "shortened": False}
                        for r in rows]}
    drawn.update(changes)
    return drawn


def test_a_flow_figure_must_bear_out_its_caption():
    caption = ("The same two tensors in a later step: both ranks hit the cache, the bit-vector allreduce (AND) "
               "finds the common hits, and the fused allreduce runs without any gather or broadcast.")
    assert make_flow_figures.claim_problems("negotiation_cached", _drawn(), caption) == []
    # two bit-vector allreduces for one cycle where the caption says one; a gather; a cut label; no legend; a
    # caption that no longer says what the figure is checked for
    bits = _drawn()["rows"][0]
    assert "does not show" in make_flow_figures.claim_problems(
        "negotiation_cached", _drawn(rows=[bits, *_drawn()["rows"]]))[0]
    assert make_flow_figures.claim_problems("negotiation_cached", _drawn(rows=_drawn()["rows"] * 2)) == []
    gather = {"kind": "collective", "label": "allgather_object negotiation requests", "ranks": [0, 1]}
    assert ["without any gather" in p for p in make_flow_figures.claim_problems(
        "negotiation_cached", _drawn(rows=[bits, gather]))] == [True]
    cut = [{"kind": "note", "text": "negotiate process_set.add.0", "shown": "negotiate process_set.…",
            "shortened": True}]
    assert make_flow_figures.claim_problems("x", _drawn(labels=cut, legend=[])) == [
        "x: label shortened to 'negotiate process_set.…' ('negotiate process_set.add.0' does not fit)",
        "x: no legend"]
    assert "no longer says" in make_flow_figures.claim_problems("negotiation_cached", _drawn(), "Two cycles.")[0]


def _flows_are_current() -> bool:
    stamp = DOCS / "_generated" / "flows" / ".stamp"
    return stamp.exists() and stamp.read_text() == make_flow_figures.inputs_hash()


@pytest.mark.skipif(not _flows_are_current(), reason="no flow figures drawn from today's sources: run `make docs`")
def test_every_flow_figure_has_a_legend_whole_labels_and_the_caption_it_shows():
    captions = make_flow_figures.captions()
    assert sorted(captions) == sorted(make_flow_figures.SCENARIOS)  # every figure shown, with a caption
    problems = []
    for name in make_flow_figures.SCENARIOS:
        drawn = json.loads((DOCS / "_generated" / "flows" / f"{name}.drawn.json").read_text())
        problems += make_flow_figures.claim_problems(name, drawn, captions[name])
    assert problems == []


def test_getting_started_shows_what_make_demo_prints():
    # every line `make demo` echoes, from the first run's stages to the three next steps, as the page shows it
    makefile = (DOCS.parent / "Makefile").read_text()
    echoed = re.findall(r'^\t@echo "(.+)"$', makefile[makefile.index("$(STAMP):"):makefile.index("\ntest:")],
                        flags=re.M)
    page = (DOCS / "getting-started.md").read_text()
    shown = [line.replace("$(VENV)", ".venv").replace("$(NP)", "2").replace("\\\"", "\"") for line in echoed]
    assert len(shown) >= 15
    assert [line for line in shown if line not in page] == []


def _ext(name):
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", DOCS / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = sorted(p for p in DOCS.rglob("*.md") if p.parts[len(DOCS.parts)] not in ("_build", "tests", "_generated")
               and p.name != "README.md")


def test_every_measured_figure_of_the_pages_comes_from_a_record():
    figures = _ext("figures")
    typed = [f"{page.relative_to(DOCS)}:{line}: {figure}" for page in PAGES
             for line, figure in figures.hand_typed_figures(page.read_text())]
    assert typed == []


def test_a_figure_typed_by_hand_is_found_where_a_reader_sees_it():
    figures = _ext("figures")
    page = "\n".join([
        "The step takes 12.5 ms, 1.4x the floor.",                      # 1: two figures
        "It takes {{ bench_x.figures.step }} (`5 ms` in code is not).",  # 2: none
        "```python",
        "time.sleep(0.5)  # 3 ms",                                       # 4: inside a fence
        "```",
        "| size | raw | distlab |",
        "| --- | --- | --- |",
        "| 4 KiB | 5.9 | 7.7 |",                                         # 8: decimals of a table
        "A 3 s timeout fires after 800 ms. <!-- not measured: the example's timeout -->",
        "NCCL 2.30 and 100 x Linear(256, 256)",                          # 10: a version, a count
    ])
    assert figures.hand_typed_figures(page) == [(1, "12.5 ms"), (1, "1.4x"), (8, "5.9"), (8, "7.7")]


def test_every_figure_a_page_quotes_is_in_its_record():
    # what the build does with StrictUndefined: a name the record lacks (a figure that no run measured) fails
    jinja2 = pytest.importorskip("jinja2")
    figures = _ext("figures")
    records = figures.load()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    missing = []
    for page in PAGES:
        for expression in re.findall(r"\{\{(.*?)\}\}", page.read_text(), flags=re.S):
            try:
                env.from_string("{{" + expression + "}}").render(records)
            except jinja2.exceptions.UndefinedError as exc:
                missing.append(f"{page.relative_to(DOCS)}: {expression.strip()[:60]}: {exc}")
    assert missing == []
    with pytest.raises(jinja2.exceptions.UndefinedError):
        env.from_string("{{ bench_reducer.figures.no_such_figure }}").render(records)


def test_a_record_table_shows_its_units_and_gives_its_cells_by_name():
    figures = _ext("figures")
    record = figures.prepare({"tables": {"t": {"columns": ["link", "step [ms]", "over floor [x]"],
                                               "rows": [["1 Gbit/s", 34.5, 1.06], ["one host", "33.9 ms", 1.4]]}}})
    assert record["md"]["t"].splitlines() == ["| link | step | over floor |", "| --- | --- | --- |",
                                              "| 1 Gbit/s | 34.5 ms | 1.06x |", "| one host | 33.9 ms | 1.4x |"]
    assert record["rows"]["t"]["1 Gbit/s"]["step"] == "34.5 ms"
    assert record["num"]["t"]["one host"]["step"] == 33.9


SNIPPET_PAGE = """# A page

```{snippet} python
raise SystemExit("the snippet fails")
```

It takes 12 ms, typed by hand, and {{ bench_reducer.figures.no_such_figure }}.

```python
print("a plain block")
```

```{snippet} sh
:no-run: needs a GPU

make gpu-check
```

```{snippet} python
:ranks: 2

import os
print("rank", os.environ["RANK"])
```
"""


def test_make_docs_fails_on_a_snippet_that_raises_a_figure_typed_by_hand_and_one_its_record_lacks(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    import subprocess

    (tmp_path / "index.md").write_text(SNIPPET_PAGE)
    (tmp_path / "conf.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(DOCS / '_ext')!r})\n"
        "import figures, snippets\n"
        "extensions = ['myst_parser', 'snippets', 'figures']\n"
        "myst_enable_extensions = ['substitution']\n"
        "myst_substitutions = figures.load()\n"
        "snippet_sources_stamp = 'test'\n")
    env = {**__import__("os").environ, "DISTLAB_IMPL": "reference"}
    done = subprocess.run([sys.executable, "-P", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(tmp_path), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "exited 1, not 0" in done.stderr and "the snippet fails" in done.stderr
    assert "a measured figure typed by hand: '12 ms'" in done.stderr
    assert "no_such_figure" in done.stderr
    assert "a python code block that neither runs nor says why not" in done.stderr
    html = (tmp_path / "html" / "index.html").read_text()
    assert "Not run when the docs are built: needs a GPU." in html
    assert "[0] rank 0" in html and "[1] rank 1" in html
