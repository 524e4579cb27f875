"""Distributed autograd over MPI (tests/mpi/dist_autograd.py): ids, context errors, known workers, cleanup on
every rank, backward across 2 and 4 workers equal to the local graph, remote engine errors, DistributedOptimizer;
each twin of the containers, and a mixed world (even ranks reference, odd ranks core)."""
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 4])
def test_dist_autograd(mpirun, impl, np_):
    result = mpirun("dist_autograd.py", np=np_, timeout=120, env={"DISTLAB_IMPL": impl})
    assert result.stdout.count(f"container distlab.{'reference.' if impl == 'reference' else 'core._'}") == np_
    assert f"dist autograd OK on {np_} workers" in result.stdout


@pytest.mark.parametrize("np_", [2, 4])
def test_dist_autograd_mixed_world(mpirun, np_):
    result = mpirun("dist_autograd.py", np=np_, args=["mixed"], timeout=120)
    assert result.stdout.count("container distlab.reference.") == (np_ + 1) // 2
    assert result.stdout.count("container distlab.core.") == np_ // 2
    assert f"dist autograd OK on {np_} workers" in result.stdout


def test_pipeline_example(mpirun):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "dist_autograd_pipeline.py"
    result = mpirun(str(example), np=2, timeout=180)
    assert "distributed vs local training: max parameter difference" in result.stdout


def test_failures_are_bounded_and_named(mpirun, impl):
    """tests/mpi/dist_autograd_failures.py: a failed pass reports first and releases in the background; a stalled
    worker's backward, rpc_async and optimizer step time out within the RPC timeout naming worker and context;
    release retries share the timeout."""
    result = mpirun("dist_autograd_failures.py", np=2, timeout=120, env={"DISTLAB_IMPL": impl})
    assert "dist autograd failures OK" in result.stdout
