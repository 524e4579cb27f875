"""Print the requirements of one extra of the installed distlab, one per line: `python extra_requirements.py docs`.

`make docs` uses it to install the `docs` extra without re-installing (and re-compiling) distlab itself: the
metadata of the editable install made by `make` is current, because that install re-runs whenever
pyproject.toml changes.
"""
import re
import sys
from importlib.metadata import requires

extra = sys.argv[1]
for requirement in requires("distlab") or []:
    name, _, marker = requirement.partition(";")
    if re.search(r"""extra\s*==\s*["']%s["']""" % re.escape(extra), marker):
        print(name.strip())
