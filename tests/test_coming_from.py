"""docs/coming-from.md: every distlab name in its tables is a real attribute, every setting is read by distlab."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "coming-from.md"


def _distlab_column() -> list[str]:
    """The second cell of every table row (header and separator rows excluded)."""
    cells = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            row = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if row[1] != "distlab":
                cells.append(row[1])
    return cells


def _names(pattern: str) -> list[str]:
    return sorted({name for cell in _distlab_column() for name in re.findall(pattern, cell)})


NAMES = _names(r"`(distlab(?:\.\w+)+)`")
SETTINGS = _names(r"`(DISTLAB_[A-Z_]+)`")


def resolve(dotted: str):
    """Import the longest module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_page_has_its_tables():
    # torch.distributed, DDP, FSDP2, rpc, dist autograd, horovod.torch, Horovod's settings
    assert sum(line.startswith("|---") for line in PAGE.read_text().splitlines()) == 7
    assert len(NAMES) > 100 and len(SETTINGS) >= 6


@pytest.mark.parametrize("name", NAMES)
def test_every_distlab_name_resolves(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_is_read_by_distlab(name):
    sources = (path.read_text() for path in (ROOT / "src" / "distlab").rglob("*.py"))
    assert any(name in text for text in sources), f"{name} appears nowhere in src/distlab"


def test_a_wrong_name_would_fail():
    with pytest.raises(AttributeError):
        resolve("distlab.collectives.local_rank_that_does_not_exist")
    with pytest.raises(ModuleNotFoundError):
        resolve("nodistlab.x")


def test_the_page_is_in_the_docs_and_linked_from_the_readme():
    assert "coming-from" in (ROOT / "docs" / "index.md").read_text()
    assert "docs/coming-from.md" in (ROOT / "README.md").read_text()
