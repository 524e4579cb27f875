"""Join in one process: the configuration it hands to joinables, notify_join_context, and class checks."""
import pytest

from distlab import comm
from distlab._join_support import JoinConfig

from conftest import twin

join = twin("join")


def make_joinable(join, group):
    class Toy(join.Joinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            return join.JoinHook()

        @property
        def join_device(self):
            return "cpu"

        @property
        def join_process_group(self):
            return group

    return Toy()


def test_configs_and_notify(join):
    group = comm.world()
    a, b = make_joinable(join, group), make_joinable(join, group)
    assert a._join_config == JoinConfig.disabled()
    assert join.Join.notify_join_context(a) is None  # outside a Join: nothing to notify
    join.Join([a, b], throw_on_early_termination=True)
    assert a._join_config == JoinConfig(True, True, True) and b._join_config == JoinConfig(True, True, False)
    assert join.Join.notify_join_context(b) is None  # only the first joinable communicates
    work = join.Join.notify_join_context(a)
    assert work.result()[0] == 1  # one rank: the allreduce of 1 counts itself


def test_joinable_is_abstract_and_needs_its_constructor(join):
    with pytest.raises(TypeError):
        join.Joinable()

    class Forgetful:
        pass

    with pytest.raises(AttributeError, match="must call Joinable.__init__"):
        join.Join.notify_join_context(Forgetful())


def test_facade_registers_shared_joinables():
    from distlab import join as facade
    from distlab.ddp import DistributedDataParallel
    from distlab.metrics import DistributedMean

    assert issubclass(DistributedDataParallel, facade.Joinable)
    assert issubclass(DistributedMean, facade.Joinable)
