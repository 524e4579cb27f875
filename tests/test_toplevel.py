"""The top level: every public name reachable as an attribute, loaded on first use, and no MPI at import."""
from __future__ import annotations

import subprocess
import sys

import pytest

import distlab


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_distlab_loads_no_mpi_and_no_component():
    done = _python("import sys, distlab; print(sorted(m for m in sys.modules "
                   "if m.startswith(('mpi4py', 'numpy', 'distlab.'))))")
    assert done.returncode == 0, done.stderr
    # distlab.core is the (empty) package of the compiled modules, imported to look them up, not to load them;
    # distlab._malloc sets glibc's thresholds (ctypes only), reading its setting through distlab._env; the registry
    # of twins (distlab._twins) is a table; distlab._mpi looks for the MPI library's file (no MPI is loaded)
    allowed = {"distlab._backend", "distlab._env", "distlab._malloc", "distlab._twins", "distlab.errors",
               "distlab.core", "distlab._mpi"}
    assert set(eval(done.stdout)) <= allowed, done.stdout


def test_the_components_are_attributes():
    done = _python("import sys, distlab; distlab.DistributedDataParallel; distlab.Join; distlab.rpc.rpc_sync; "
                   "distlab.collectives.allreduce; distlab.distributed_autograd.context; "
                   "print('mpi4py.MPI' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_dir_and_all_show_the_public_names_only():
    assert dir(distlab) == sorted(distlab.__all__)
    assert not [name for name in distlab.__all__ if name.startswith("_") and name != "__version__"]
    assert "annotations" not in dir(distlab)


@pytest.mark.parametrize("name", sorted(distlab.__all__))
def test_every_public_name_resolves(name):
    assert getattr(distlab, name) is not None


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'distlab' has no attribute 'nope'"):
        distlab.nope  # noqa: B018


def test_top_level_names_are_the_defining_modules_objects():
    from distlab.join import Join
    from distlab.autograd import Tensor

    assert distlab.Join is Join and distlab.Tensor is Tensor
