"""DDP's and Join's scenarios with the device stand-in registered before their groups are made, so that every
collective of theirs, the host half's too, goes through the transport ``auto`` picks for the stand-in (``ipc``), as
it will on a GPU: device buckets in memory every rank maps, joined ranks shadowing through the slots, asynchronous
bucket reductions moved on while a rank waits on another collective of the group."""
import pytest

pytestmark = pytest.mark.mpi

DEVICE_WORLD = {"DISTLAB_TEST_DEVICE_WORLD": "1"}


@pytest.mark.parametrize("np_", [2, 3])
def test_ddp_trains_as_locally_with_device_buckets_every_rank_maps(mpirun, tmp_path, np_):
    job = mpirun("ddp_train.py", np=np_, args=["core", str(tmp_path / "ddp")], timeout=300, env=DEVICE_WORLD)
    assert job.stdout.count("devices match local training") == np_


def test_fused_optimizer_under_join_through_the_slots(mpirun):
    # the joined rank's count allreduce waits for an asynchronous reduction the training rank issued before a
    # broadcast it then waits on: the reduction must move on inside that wait, or both ranks wait for ever
    job = mpirun("ddp_fused_optim.py", np=2, args=["core"], timeout=120, env={**DEVICE_WORLD, "DISTLAB_TIMEOUT": "60"})
    assert job.stdout.count("fused optimizer under Join OK") == 4


@pytest.mark.parametrize("script, done", [("join_uneven.py", "join scenarios OK"), ("join_zero.py", "zero scenarios OK"),
                                          ("join_syncbn.py", "syncbn scenarios OK")])
def test_joinables_through_the_slots(mpirun, tmp_path, script, done):
    job = mpirun(script, np=2, args=["core", str(tmp_path / "join")], timeout=300, env=DEVICE_WORLD)
    assert done in job.stdout
