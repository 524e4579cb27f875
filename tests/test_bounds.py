"""Every test is bounded: pytest-timeout's settings (pyproject.toml) and the MPI tests' bound (conftest.py)."""
import subprocess
import sys
import time

import pytest
from conftest import MPI_TEST_TIMEOUT, REPO


def test_a_hanging_test_fails_at_its_bound_showing_where_it_hung(tmp_path):
    """With the project's settings (the thread method), a test that never returns ends the run at its bound and
    prints the stack of every thread, the hung line included (here the bound is lowered to 3 s)."""
    (tmp_path / "test_hang.py").write_text("import time\n\n\ndef test_hang():\n    while True:\n"
                                           "        time.sleep(0.01)  # the hung line\n")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-c",
                          str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "--timeout", "3",
                          str(tmp_path / "test_hang.py")], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    output = run.stdout + run.stderr
    assert run.returncode != 0 and took < 60
    assert "Timeout" in output and "timeout method: thread" in output, output
    assert 'test_hang.py", line 6, in test_hang' in output and "the hung line" in output, output


def test_the_default_bound_and_method_come_from_the_project(request):
    assert float(request.config.getini("timeout")) == 120
    assert request.config.getini("timeout_method") == "thread"


@pytest.mark.mpi
def test_a_test_marked_mpi_gets_the_mpi_bound(request):
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (MPI_TEST_TIMEOUT,)
