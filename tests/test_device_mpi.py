"""Every public component on the strict device stand-in (distlab.fakegpu), on 2 and 4 ranks, both twins and the
mixed world: tests/mpi/device_components.py runs each component on numpy and on the stand-in in one launch and
checks there that the device results equal numpy's bit for bit, with the same collectives, and that no module
outside the comm layer moved data through the host (beyond the scalar reads listed in scenario_checks). Here the
twins' results and traces are compared across launches."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi
IMPLS = ("reference", "core", "mixed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _mpi import run_worlds

    return run_worlds("device_components.py", tmp_path_factory.mktemp("device"),
                      [(np_, impl) for np_ in (2, 4) for impl in IMPLS],
                      "component checks equal on numpy and the device stand-in")


@pytest.mark.parametrize("np_", [2, 4])
def test_twins_and_the_mixed_world_agree_on_the_device_bit_for_bit(runs, np_):
    first = runs[np_, IMPLS[0]]
    for impl in IMPLS[1:]:
        for rank in range(np_):
            np.testing.assert_equal(runs[np_, impl][rank], first[rank], err_msg=f"{impl} rank {rank}")


@pytest.mark.parametrize("np_", [2, 4])
def test_every_component_section_ran_on_the_device(runs, np_):
    checks = runs[np_, "core"][0]["cuda"]
    for prefix in ("comm allreduce", "comm broadcast", "comm allgather", "comm reduce_scatter", "comm alltoall",
                   "comm allgather_object", "hvd allreduce", "hvd grouped", "hvd allgather", "hvd broadcast",
                   "hvd alltoall", "hvd reducescatter", "hvd process set", "hvd DistributedOptimizer",
                   "hvd optimizer state", "join view=False", "join view=True", "optim SGD", "optim Rprop",
                   "nn sparse Embedding"):
        assert any(key.startswith(prefix) for key in checks), prefix
    assert "comm send/recv" in runs[np_, "core"][1]["cuda"]
