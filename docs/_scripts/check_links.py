"""Check every internal link of the built site: the target page exists and so does its anchor.

``make linkcheck`` runs it after Sphinx's own linkcheck (which checks the external URLs, and cannot reach them
on a machine without a network). Usage: ``python docs/_scripts/check_links.py [docs/_build/html]``; prints each
broken link and exits 1 if there is one. The highlighted-source pages (``_modules/``, from sphinx.ext.viewcode)
are left out: viewcode links each function back to the API page of the module that defines it, which for a
name documented under another module (a re-export) has no anchor; those are counted, not failed.
"""
from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ("href", "src"):
            value = attrs.get(key)
            if value and not urlsplit(value).scheme and not value.startswith(("//", "mailto:", "data:")):
                self.links.append(value)


def check(site: Path) -> list[str]:
    pages: dict[Path, _Page] = {}
    for path in site.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(errors="replace"))
        pages[path.resolve()] = page
    broken, viewcode = [], 0
    for path, page in sorted(pages.items()):
        source_page = "_modules" in path.relative_to(site.resolve()).parts
        for link in page.links:
            parts = urlsplit(link)
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            problem = None
            if not target.exists():
                problem = f"{path.relative_to(site.resolve())}: {link} (no such file)"
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in pages[target].ids:
                problem = f"{path.relative_to(site.resolve())}: {link} (no anchor #{parts.fragment})"
            if problem and source_page:
                viewcode += 1
            elif problem:
                broken.append(problem)
    if viewcode:
        print(f"check_links: {viewcode} links of the highlighted-source pages (_modules/) lead nowhere (not checked)")
    return broken


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
    problems = check(site)
    for problem in problems:
        print(problem)
    print(f"check_links: {len(problems)} broken internal links in {site}")
    sys.exit(1 if problems else 0)
