"""Walk the built site in headless Chromium at 1280 px, as a newcomer reads it, and report what misleads.

    python docs/_scripts/walk_site.py [docs/_build/html] [--width 1280] [--browser chromium] [--quote]

Chromium is Debian's ``chromium`` package (``apt-get install -y chromium``, as root); each page is loaded with
``--headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update
--disable-sync --no-first-run`` and a fresh ``--user-data-dir``, once the page has laid out, a small script
measures it in the browser (``--dump-dom``). Per page it checks the eight ways a page misled before:

1. **Snippets.** Every code block is a snippet that ran (its note says so) or says visibly why not, code quoted
   from the sources, an executed notebook cell, or a diagram; the RRef page's opening snippet has the callee
   call ``to_here()``, defines ``rank`` and prints 3.0; the DDP page's opening snippet defines what it uses.
2. **One GPU story.** No page says what the GPU pages contradict ("runs on cupy arrays wherever", "do not run
   on cupy yet", "the rest crashed", "ran on an H100", "not measured yet", the hand run's 71.6 ms outside the
   changelog); the GPU, support and running-at-scale pages show the one status paragraph.
3. **Numbers from their records.** No substitution left unfilled (``{{``); the reducer page's wire time over
   the local step is the benchmarks page's; the link-rate table's accuracy is explained beside it.
4. **Tutorial 03, section 5.** Its output prints each cap's rounds (the spread) and a verdict per link, and
   the figure has whiskers (a legend entry "lowest to highest round").
5. **The support table.** Each component's table fits the column and a 1000 px screen, every cell links to a
   test page that exists, and no cell of DDP or Join says "not implemented" for CUDA IPC.
6. **Present tense.** No "the day's other", "used to", "(before", "predate", "earlier rule" outside the
   changelog.
7. **Layout.** No code block scrolls sideways; a wrapped line of a wrapping block continues further in than its line starts (a hanging indent);
   on a page taller than three screens the page's contents are visible beside the text; the index's first
   block is whole commands and whole comments.
8. **The DDP port.** ``coming-from`` shows a torch script and its distlab port side by side, the port run.

It prints each problem and ``walk_site: N problems in M pages``; the exit status is 1 if there is one.
``--quote`` also prints the opening lines of the RRef and GPU pages as the browser shows them.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from measure_pages import probe_pages  # the same folder: Chromium's start-up and the page's probe

_PROBE = r"""
<script>
window.addEventListener("load", () => {
  const article = document.querySelector("article") || document.body;
  const out = {height: document.documentElement.scrollHeight, screen: window.innerHeight,
               text: article.innerText, blocks: [], wraps: [], tables: [], toc: null, links: []};
  article.querySelectorAll("pre").forEach((pre) => {
    const kinds = [];
    for (let el = pre; el && el !== article; el = el.parentElement) kinds.push(...el.classList);
    const snippet = pre.closest(".snippet");
    const note = snippet ? snippet.querySelector("p.snippet-note") : null;
    const visible = note ? (note.offsetHeight > 0 && getComputedStyle(note).visibility !== "hidden") : false;
    out.blocks.push({classes: kinds, text: pre.innerText.slice(0, 400), note: note ? note.innerText : null,
                     note_visible: visible, scroll: pre.scrollWidth, client: pre.clientWidth});
  });
  article.querySelectorAll("pre span.line").forEach((line) => {
    const range = document.createRange();
    range.selectNodeContents(line);
    const rects = [...range.getClientRects()].filter((r) => r.width > 0);
    const tops = [...new Set(rects.map((r) => Math.round(r.top)))];
    if (tops.length < 2) return;
    const first = Math.min(...rects.filter((r) => Math.round(r.top) === tops[0]).map((r) => r.left));
    const startText = line.textContent.length - line.textContent.trimStart().length;
    const pre = line.closest("pre");
    const charWidth = parseFloat(getComputedStyle(pre).fontSize) * 0.6;
    const lineStart = first + startText * charWidth;
    const rest = Math.min(...rects.filter((r) => Math.round(r.top) !== tops[0]).map((r) => r.left));
    out.wraps.push({indent: startText, first: first, start: lineStart, rest: rest, char: charWidth,
                    text: line.textContent.slice(0, 60)});
  });
  article.querySelectorAll("table").forEach((table) => {
    const box = table.parentElement;
    const section = table.closest("section");
    const heading = section ? section.querySelector("h1, h2, h3") : null;
    out.tables.push({scroll: box.scrollWidth, client: box.clientWidth, height: table.offsetHeight,
                     head: heading ? heading.innerText : "", text: table.innerText.slice(0, 2000),
                     links: [...table.querySelectorAll("a")].map((a) => a.getAttribute("href"))});
  });
  const toc = document.querySelector(".toc-drawer");
  if (toc) {
    const box = toc.getBoundingClientRect();
    out.toc = {left: box.left, width: box.width, links: toc.querySelectorAll("a").length,
               visible: box.width > 0 && box.left < window.innerWidth && box.right <= window.innerWidth + 1};
  }
  const result = document.createElement("pre");
  result.id = "walked";
  result.textContent = JSON.stringify(out);
  document.body.appendChild(result);
});
</script>
"""

#: Words no page but the changelog may say: what was, or what a GPU page contradicts.
STALE = [r"runs on cupy arrays wherever it runs on numpy", r"do not run on cupy yet", r"the rest crashed",
         r"default arg\w* crash",
         r"ran on an H100", r"ran by hand on an H100", r"not measured yet", r"71\.6 ms", r"[Tt]he day's other",
         r"\bused to\b", r"\(before[:,]", r"\bpredate", r"earlier rule", r"four times its local step"]
#: Pages that may quote the past: the changelog itself, generated indices.
HISTORY = {"changelog.html", "genindex.html", "py-modindex.html", "search.html"}


def load(site: Path, width: int, browser: str) -> dict[str, dict]:
    return probe_pages(site, _PROBE, "walked", width, browser, skip=HISTORY - {"changelog.html"})


def block_problems(name: str, page: dict) -> list[str]:
    found = []
    for block in page["blocks"]:
        classes = set(block["classes"])
        if block["scroll"] > block["client"] + 1:
            found.append(f"{name}: a code block scrolls sideways ({block['scroll']} > {block['client']} px): "
                         f"{block['text'][:50]!r}")
        if "snippet-code" in classes or "snippet-output" in classes:
            if not block["note"] or not block["note_visible"]:
                found.append(f"{name}: a snippet without a visible note: {block['text'][:50]!r}")
            elif not block["note"].startswith(("Ran ", "Not run when the docs are built: ")):
                found.append(f"{name}: a snippet's note says neither how it ran nor why not: {block['note']!r}")
        elif classes & {"quoted", "cell_input", "cell_output", "highlight-default", "highlight-none"}:
            continue
        else:
            found.append(f"{name}: a code block that neither ran nor says why not: {block['text'][:50]!r}")
    return found


def page_problems(name: str, page: dict) -> list[str]:
    found = block_problems(name, page)
    text = page["text"]
    if "{{" in text:
        found.append(f"{name}: a substitution left unfilled: {text[text.index('{{'):][:60]!r}")
    if name != "changelog.html" and not name.startswith(("api/", "tests/")):
        for pattern in STALE:
            hit = re.search(pattern, text)
            if hit:
                around = text[max(0, hit.start() - 60):hit.end() + 40].replace("\n", " ")
                found.append(f"{name}: says {hit.group(0)!r} ({around!r})")
    for wrap in page["wraps"]:
        if wrap["rest"] < wrap["start"] + 2 * wrap["char"]:
            found.append(f"{name}: a wrapped line continues at {wrap['rest'] - wrap['first']:.0f} px, its line "
                         f"starts at {wrap['start'] - wrap['first']:.0f} px: {wrap['text']!r}")
    if page["height"] > 3 * page["screen"] and text.count("\n") > 40:
        toc = page["toc"]
        if not toc or not toc["visible"] or toc["links"] < 2:
            found.append(f"{name}: {page['height']} px tall, and the page's contents are not visible beside it")
    return found


def special_problems(pages: dict[str, dict]) -> list[str]:
    found = []
    rref = pages.get("protocols/rref.html", {})
    first = next((b for b in rref.get("blocks", []) if "snippet-code" in b["classes"]), None)
    if not first or "to_here()" not in first["text"] or "rank =" not in first["text"]:
        found.append("protocols/rref.html: the opening snippet does not call to_here() on the callee or define rank")
    elif "sum on worker2: 3.0" not in rref["text"]:
        found.append("protocols/rref.html: the opening snippet's output does not show the sum 3.0")
    reducer = pages.get("protocols/reducer.html", {})
    first = next((b for b in reducer.get("blocks", []) if "snippet-code" in b["classes"]), None)
    if not first or "loss_fn =" not in first["text"] or "Ran on 2 ranks" not in (first["note"] or ""):
        found.append("protocols/reducer.html: the opening snippet does not define loss_fn, or did not run")
    gpu_story = "No run of this version has reached a real GPU"
    for name in ("gpu.html", "support.html", "running-at-scale.html"):
        if gpu_story not in pages.get(name, {}).get("text", ""):
            found.append(f"{name}: the GPU status paragraph is missing")
    wire = re.search(r"take ([\d.]+) ms to allreduce, ([\d.]+) times its ([\d.]+) ms local step",
                     reducer.get("text", ""))
    bench = pages.get("benchmarks.html", {}).get("text", "")
    if not wire or f"{wire.group(1)} ms" not in bench or f"{wire.group(3)} ms" not in bench:
        found.append("protocols/reducer.html: the wire time and local step do not match the benchmarks page's")
    scale = pages.get("running-at-scale.html", {}).get("text", "")
    if not re.search(r"accuracy column is the model.s after those 2 epochs", scale):
        found.append("running-at-scale.html: the link-rate table's accuracy is not explained")
    tutorial = pages.get("tutorials/03_ddp.html", {}).get("text", "")
    if not re.search(r"cap\s+25: median\s+[\d.]+ ms, rounds [\d.]+ to [\d.]+ ms", tutorial) or \
            not re.search(r"(beyond|within) the noise", tutorial):
        found.append("tutorials/03_ddp.html: section 5 prints no spread of rounds or no verdict")
    support = pages.get("support.html", {})
    for table in support.get("tables", []):
        if table["scroll"] > table["client"]:
            found.append(f"support.html: the table of {table['head']!r} scrolls sideways")
        if table["height"] > 1000:
            found.append(f"support.html: the table of {table['head']!r} is {table['height']} px tall")
        if not any(link and link.startswith("tests/") for link in table["links"]):
            found.append(f"support.html: the table of {table['head']!r} links no test")
        if table["head"].startswith(("DDP", "Join")) and re.search(r"CUDA IPC\s+not implemented", table["text"]):
            found.append(f"support.html: {table['head']!r} says CUDA IPC is not implemented")
    for table in support.get("tables", []):
        for link in table["links"]:
            page = link.split("#")[0] if link else ""
            if link and link.startswith("tests/") and page not in pages:
                found.append(f"support.html: a link to {link}, a page that does not exist")
    index = pages.get("index.html", {})
    first = next((b for b in index.get("blocks", []) if "snippet-code" in b["classes"]), None)
    if not first or any(line.startswith(" ") for line in first["text"].splitlines()):
        found.append("index.html: the first block is not whole commands and whole comments")
    coming = pages.get("coming-from.html", {})
    snippets = [b for b in coming.get("blocks", []) if "snippet-code" in b["classes"] and "sd-col" in b["classes"]]
    if len(snippets) != 2 or "torch.distributed" not in snippets[0]["text"] or \
            "distlab" not in snippets[1]["text"] or "Ran on 2 ranks" not in (snippets[1]["note"] or ""):
        found.append("coming-from.html: no torch script and its distlab port side by side, the port run")
    return found


def quote(pages: dict[str, dict], name: str, lines: int = 12) -> str:
    text = [line for line in pages[name]["text"].splitlines() if line.strip()]
    return "\n".join(text[:lines])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", nargs="?", default="docs/_build/html")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--browser", default="chromium")
    parser.add_argument("--quote", action="store_true", help="print the opening lines of the RRef and GPU pages")
    args = parser.parse_args()
    pages = load(Path(args.site), args.width, args.browser)
    problems = [p for name, page in pages.items() for p in page_problems(name, page)] + special_problems(pages)
    for problem in problems:
        print(problem)
    if args.quote:
        for name in ("protocols/rref.html", "gpu.html"):
            print(f"--- {name}, as Chromium shows it at {args.width} px ---\n{quote(pages, name)}")
    print(f"walk_site: {len(problems)} problems in {len(pages)} pages at {args.width} px")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
