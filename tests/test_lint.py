"""The linter: ruff, with the short rule set of pyproject.toml's [tool.ruff], over every Python file we write.

A test rather than a Makefile step, so that `make test`, CI and an engineer running the test files of their
change all meet it the same way, and a failure lists the file, line and rule like any other test.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINTED = ("src", "reference", "core", "tests", "benchmarks", "examples", "scripts", "tutorials", "docs", "setup.py")


def test_the_code_meets_the_linter():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           *LINTED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_linter_sees_a_fault(tmp_path):
    # guards the test above against a configuration that selects nothing: an unused import must be reported
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "faulty.py").write_text("import os\n")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "faulty.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout + done.stderr
