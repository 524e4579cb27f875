"""Shared fixtures: the twin fixtures, the import-hygiene check, and the MPI scenario runner.

Tests never name a twin: they take ``impl`` (ids ``reference`` and ``core``) or a fixture derived from it, such
as ``fingerprint``, which yields that twin's module of a component (one such fixture per component of
``distlab._twins.TWINS``, named after it).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from distlab import _backend
from distlab._twins import TWINS

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The time bound of a test marked ``mpi`` (others get pyproject's ``timeout``, 120 s): each of its jobs is bounded by
#: the launcher already, so this catches only what hangs outside them (the test's own waits, a stuck launcher).
MPI_TEST_TIMEOUT = 900


def pytest_collection_modifyitems(config, items):
    """Give every test marked ``mpi`` (and no timeout of its own) the MPI bound (pytest-timeout's marker)."""
    for item in items:
        if item.get_closest_marker("mpi") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(MPI_TEST_TIMEOUT))


@pytest.fixture(scope="session", autouse=True)
def _interrupts_reach_the_launchers():
    """Ctrl-C must reach the launchers the interrupt tests start: a shell starts a background job (``make test &``,
    ``nohup``) with SIGINT ignored, and children inherit that; a handled SIGINT is reset to the default in them."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def _no_top_level_twin_packages():
    """The repository root must not be importable: ``core``/``reference`` exist only as distlab.core/reference."""
    yield
    assert str(REPO) not in [os.path.abspath(p or os.getcwd()) for p in sys.path], (
        "the repository root is on sys.path; run tests with `python -P -m pytest` (make test does)")
    for name in ("core", "reference"):
        assert name not in sys.modules, f"a top-level {name!r} module was imported; use distlab.{name}"


@pytest.fixture(params=_backend.IMPLS)
def impl(request) -> str:
    """The twin under test: ``"reference"`` or ``"core"``. A missing core fails in CI and skips elsewhere."""
    if request.param == "core" and not _backend.core_available():
        message = f"the distlab core twin is not compiled; {_backend.BUILD_HINT}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return request.param


def twin(component: str):
    """Make a fixture that yields ``component``'s module from the twin under test."""

    @pytest.fixture
    def _fixture(impl):
        return _backend.load(component, impl)

    _fixture.__doc__ = f"The {component} module of the twin under test."
    return _fixture


# One fixture per registered component (``reducer``, ``negotiation``, ...), named after it, read from the registry.
for _component in TWINS:
    globals()[_component] = twin(_component)


@pytest.fixture(params=["numpy", "fakegpu"])
def xp(request):
    """The array module under test: numpy, or distlab.fakegpu, the strict device stand-in (cupy's refusals: any
    implicit conversion of its arrays to numpy raises), so a host conversion anywhere fails the test. While a
    test runs on the stand-in, ``"cuda"`` (``Module.to("cuda")``) means it."""
    if request.param == "numpy":
        import numpy

        yield numpy
        return
    from distlab import fakegpu

    fakegpu.use_as_cuda()
    try:
        yield fakegpu
    finally:
        fakegpu.use_as_cuda(False)


@pytest.fixture(scope="session")
def mpirun():
    """Run a scenario script under ``mpiexec -n N``; see :func:`tests._mpi.run_scenario`."""
    from _mpi import run_scenario

    return run_scenario


# -- the virtual cluster (distlab.cluster) ----------------------------------------------------------------------
def cluster_privileges_or_skip() -> None:
    """Skip (with the reason) unless this process may build network namespaces; as root under CI, fail instead."""
    from distlab.cluster import require_privileges
    from distlab.errors import ClusterPermissionError

    try:
        require_privileges("up")
    except ClusterPermissionError as exc:
        if IN_CI and os.geteuid() == 0:
            pytest.fail(f"the cluster tests must run under CI as root: {exc}")
        pytest.skip(f"the virtual cluster needs root: {exc}")


def sweep_dead_test_clusters() -> None:
    """Take down test clusters (``dlt...``) left by a test session that died without its teardown."""
    from distlab.cluster import down
    from distlab.cluster.state import list_states, read_state

    for name in list_states():
        owner = (read_state(name) or {}).get("owner_pid")
        if name.startswith("dlt") and owner and not Path(f"/proc/{owner}").exists():
            down(name)


@pytest.fixture(scope="session")
def virtual_cluster():
    """A 2-host virtual cluster of this test session's own (``dlt<pid>``), unshaped; its name is yielded.

    Always torn down: at the end of the session, when a test fails, on Ctrl-C, and on SIGTERM (turned into an
    exception so the teardown runs); a session killed outright leaves a state file that the next session's
    sweep removes.
    """
    import signal

    from distlab.cluster import down, up

    cluster_privileges_or_skip()
    sweep_dead_test_clusters()
    name = f"dlt{os.getpid():x}"
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    try:
        up(hosts=2, name=name)
        yield name
    finally:
        down(name)
        signal.signal(signal.SIGTERM, previous)
