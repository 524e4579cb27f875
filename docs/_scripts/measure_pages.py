"""Measure, in a real browser, what scrolls sideways on the built site: the calibration of check_pages.py.

``make docs`` does not need a browser: check_pages.py estimates a block's rendered width from its characters
(see its docstring for the figures). This script measures the truth in headless Chromium (a Debian package:
``apt-get install chromium``), for re-calibrating the estimate after a theme or CSS change, and to check a
built site by hand::

    python docs/_scripts/measure_pages.py [docs/_build/html] [--width 1280] [--json out.json]

It copies the site to a temporary folder, adds a small script to each page that measures every ``<pre>`` block
and every table once the page has laid out (its ``scrollWidth`` against its ``clientWidth``: more means a
scroll bar), loads each page with ``chromium --headless --dump-dom`` at the given window width, and prints per
page the blocks and tables that overflow, then the font figures the estimate uses: the code font's family,
size and advance width of one character, and the content column's width.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: Pages Sphinx generates (the general and module indices, search), left out of the counts.
GENERATED = {"genindex.html", "py-modindex.html", "search.html"}

_PROBE = r"""
<script>
window.addEventListener("load", () => {
  const out = {blocks: [], tables: [], font: null, column: null};
  const article = document.querySelector("article") || document.body;
  out.column = article.clientWidth;
  document.querySelectorAll("pre").forEach((pre) => {
    const lang = ([...(pre.closest("div[class*=highlight-]") || {classList: []}).classList]
                  .find((c) => c.startsWith("highlight-")) || "highlight-none").slice(10);
    const widest = Math.max(0, ...pre.textContent.split("\n").map((l) => l.length));
    out.blocks.push({lang, widest, scroll: pre.scrollWidth, client: pre.clientWidth,
                     output: !!pre.closest(".cell_output"), text: pre.textContent.slice(0, 60)});
  });
  document.querySelectorAll("table").forEach((table) => {
    const box = table.parentElement;
    out.tables.push({width: table.scrollWidth, client: box.clientWidth, scroll: box.scrollWidth,
                     head: (table.querySelector("tr") || table).textContent.trim().slice(0, 60)});
  });
  const pre = document.querySelector("div:not(.quoted) > div.highlight pre");
  if (pre) {
    const style = getComputedStyle(pre);
    const probe = document.createElement("span");
    probe.textContent = "x".repeat(1000);
    probe.style.cssText = "position: absolute; white-space: nowrap; display: inline";
    pre.appendChild(probe);
    out.font = {family: style.fontFamily, size: style.fontSize, char: probe.getBoundingClientRect().width / 1000,
                padding: parseFloat(style.paddingLeft) + parseFloat(style.paddingRight)};
    probe.remove();
  }
  const para = document.querySelector("article p");
  if (para) {
    const sample = document.createElement("span");
    sample.textContent = "The reducer packs gradients into buckets and starts each bucket's allreduce as soon as "
                         + "the bucket is full, while backward is still computing the earlier layers.";
    sample.style.cssText = "position: absolute; white-space: nowrap";
    para.appendChild(sample);
    out.text = {family: getComputedStyle(para).fontFamily, size: getComputedStyle(para).fontSize,
                char: sample.getBoundingClientRect().width / sample.textContent.length};
    sample.remove();
  }
  const code = document.querySelector("td code.literal") || document.querySelector("p code.literal");
  if (code) {
    const probe = document.createElement("span");
    probe.textContent = "x".repeat(100);
    probe.style.cssText = "position: absolute; white-space: nowrap";
    code.appendChild(probe);
    out.inline_code = {in_table: !!code.closest("td"), size: getComputedStyle(code).fontSize,
                       char: probe.getBoundingClientRect().width / 100};
    probe.remove();
  }
  const result = document.createElement("pre");
  result.id = "measured";
  result.textContent = JSON.stringify(out);
  document.body.appendChild(result);
});
</script>
"""


#: How Chromium runs: headless, no sandbox (root), nothing fetched or synced, a fresh profile each page.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def probe_pages(site: Path, probe: str, marker: str, width: int = 1280, browser: str = "chromium",
                skip=()) -> dict[str, dict]:
    """Load every page of a copy of ``site`` in headless Chromium with ``probe`` (a ``<script>`` that writes JSON
    into ``<pre id="marker">`` once the page has laid out) added to it; each page's JSON, by the page's path."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="distlab-probe-") as tmp:
        copy = Path(tmp) / "html"
        shutil.copytree(site, copy)
        pages = sorted(p for p in copy.rglob("*.html")
                       if not p.relative_to(copy).parts[0].startswith("_") and p.name not in skip)
        for page in pages:
            text = page.read_text(errors="replace")
            page.write_text(text.replace("</body>", probe + "</body>", 1))
            profile = Path(tmp) / "profile"
            shutil.rmtree(profile, ignore_errors=True)
            done = subprocess.run(
                [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000",
                 f"--window-size={width},1000", "--dump-dom", page.as_uri()],
                capture_output=True, text=True, timeout=120)
            found = re.search(rf'<pre id="{marker}">(.*?)</pre>', done.stdout, flags=re.S)
            if not found:
                raise RuntimeError(f"{page.name}: nothing measured in Chromium's output:\n{done.stderr[-2000:]}")
            raw = found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
            results[str(page.relative_to(copy))] = json.loads(raw.replace("&amp;", "&"))
    return results


def measure(site: Path, width: int = 1280, browser: str = "chromium") -> dict[str, dict]:
    """Every page's measured blocks, tables, code font and column width, keyed by the page's path."""
    return probe_pages(site, _PROBE, "measured", width, browser)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", nargs="?", default="docs/_build/html")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument("--browser", default="chromium")
    args = parser.parse_args()
    results = measure(Path(args.site), args.width, args.browser)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    total_blocks = total_tables = 0
    for name, page in results.items():
        if name in GENERATED:  # Sphinx's indices: not pages a learner reads
            continue
        blocks = [b for b in page["blocks"] if b["scroll"] > b["client"] and not b["output"]]
        tables = [t for t in page["tables"] if t["scroll"] > t["client"]]
        total_blocks += len(blocks)
        total_tables += len(tables)
        if blocks or tables:
            print(f"{name}: {len(blocks)} blocks and {len(tables)} tables scroll (column {page['column']} px)")
            for b in blocks:
                print(f"    {b['lang']:9s} {b['widest']:4d} chars {b['scroll']:5d} > {b['client']} px  "
                      f"{b['text'][:40]!r}")
            for t in tables:
                print(f"    table {t['width']:5d} > {t['client']} px  {t['head'][:50]!r}")
    fonts = {json.dumps(p.get(key), sort_keys=True) for p in results.values()
             for key in ("font", "text", "inline_code") if p.get(key)}
    for font in fonts:
        print("code font:", font)
    columns = sorted({p["column"] for p in results.values()})
    print(f"content column widths: {columns} px at a {args.width} px window")
    print(f"measure_pages: {total_blocks} code blocks and {total_tables} tables scroll sideways "
          f"at {args.width} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
