"""What the docs must show a learner (docs/_scripts/check_pages.py, run by `make docs`): the checker itself on
small pages, the width rule on the docs' sources (no build needed), and the built site when `make docs` made one."""
import importlib.util
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


def test_only_diagram_shell_and_text_blocks_must_fit_the_page():
    wide = "x" * (check_pages.WIDEST + 1)
    fits = "x" * check_pages.WIDEST
    page = check_pages.parse(_block("text", f"a\n{wide}\nb") + _block("sh", fits) + _block("python", wide)
                             + _block("default", wide) + _block("myst-ansi", wide, output=True))
    problems, python_lines = check_pages.width_problems("w.html", page)
    assert len(problems) == 1 and f"a text block {check_pages.WIDEST + 1} characters wide" in problems[0]
    assert python_lines == 2  # counted, not failed: Python source keeps the code's 120 columns


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


def test_getting_started_shows_what_make_demo_prints():
    # every line `make demo` echoes, from the first run's stages to the three next steps, as the page shows it
    makefile = (DOCS.parent / "Makefile").read_text()
    echoed = re.findall(r'^\t@echo "(.+)"$', makefile[makefile.index("$(STAMP):"):makefile.index("\ntest:")],
                        flags=re.M)
    page = (DOCS / "getting-started.md").read_text()
    shown = [line.replace("$(VENV)", ".venv").replace("$(NP)", "2").replace("\\\"", "\"") for line in echoed]
    assert len(shown) >= 15
    assert [line for line in shown if line not in page] == []
