"""Join in one process: the configuration it hands to joinables, notify_join_context, and class checks."""
import warnings

import numpy as np
import pytest

from distlab import comm
from distlab._common.join import COUNT_NAME, TERMINATION_CHECK_NAME, WARN_THRESHOLD, JoinConfig, skew_message
from distlab.testing import RecordingGroup


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


def test_a_non_joinable_is_refused_with_what_a_joinable_needs(join):
    """Join([object()]) used to fail with "AttributeError: 'object' object has no attribute 'join_hook'"."""
    with pytest.raises(TypeError) as info:
        join.Join([object()])
    message = str(info.value)
    assert "joinables[0] is a object object" in message
    for need in ("join_hook, join_device, join_process_group", "subclasses distlab.join.Joinable",
                 "super().__init__()"):
        assert need in message, message

    group = comm.world()

    class HalfDone:  # duck-typed, but missing a property: named, with its module
        def join_hook(self, **kwargs):
            return join.JoinHook()

        join_device = "cpu"

    with pytest.raises(TypeError, match=r"joinables\[1\] is a test_join\..*HalfDone object, which has no "
                                        r"join_process_group\."):
        join.Join([make_joinable(join, group), HalfDone()])


def test_a_joinable_that_skipped_its_constructor_is_refused_at_join(join):
    group = comm.world()

    class Skipper(join.Joinable):
        def __init__(self):
            pass  # forgot super().__init__()

        def join_hook(self, **kwargs):
            return join.JoinHook()

        join_device = "cpu"
        join_process_group = group

    joinable = Skipper()
    with pytest.raises(TypeError, match=r"has no join configuration: its constructor must call super\(\).__init__"):
        join.Join([joinable])
    with pytest.raises(AttributeError, match="must call Joinable.__init__"):
        join.Join.notify_join_context(joinable)


def test_errors_leave_the_joinables_untouched(join):
    group = comm.world()
    a = make_joinable(join, group)
    with pytest.raises(TypeError):
        join.Join([a, object()])
    assert a._join_config == JoinConfig.disabled()
    with pytest.raises(ValueError, match="at least one joinable"):
        join.Join([])


def test_one_joinable_class_for_both_twins_and_the_facade(join):
    from distlab import join as facade
    from distlab.ddp import DistributedDataParallel
    from distlab.metrics import DistributedMean

    assert join.Joinable is facade.Joinable and join.JoinHook is facade.JoinHook
    assert issubclass(DistributedDataParallel, join.Joinable)
    assert issubclass(DistributedMean, join.Joinable)


class Recorder:
    """A hook that records the order in which Join calls it."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def pre_hook(self):
        self.log.append((self.name, "pre"))

    def main_hook(self):
        self.log.append((self.name, "main"))

    def post_hook(self, is_last_joiner):
        self.log.append((self.name, "post", is_last_joiner))


def recording_joinable(join, group, log, name, hook_cls=Recorder):
    joinable = make_joinable(join, group)
    joinable.join_hook = lambda **kwargs: hook_cls(log, name)
    return joinable


class NoPreHook:
    """A torch-style hook (main_hook and post_hook only): Join must not need a pre_hook."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def main_hook(self):
        self.log.append((self.name, "main"))

    def post_hook(self, is_last_joiner):
        self.log.append((self.name, "post", is_last_joiner))


@pytest.mark.parametrize("throw", [False, True])
def test_pre_hooks_run_before_the_final_count_except_in_throw_mode(join, throw):
    """J4 on one rank: nobody else trains, so the loop counts once; pre hooks run before that count."""
    group = comm.world()
    log = []
    joinables = [recording_joinable(join, group, log, "a"), recording_joinable(join, group, log, "b", NoPreHook),
                 recording_joinable(join, group, log, "c")]
    with join.Join(joinables, throw_on_early_termination=throw):
        pass
    expected_pre = [] if throw else [("a", "pre"), ("c", "pre")]
    assert log == expected_pre + [("a", "post", True), ("b", "post", True), ("c", "post", True)]


class ScriptedGroup:
    """This rank's view of a group whose other ranks still train for ``iterations`` iterations: Join's count
    allreduce answers 1 that many times, then 0 (every rank joined). Records every count it answered."""

    rank = 0

    def __init__(self, iterations):
        self.left = iterations
        self.counts = []
        self.answers = []   # what this rank sent to the early-termination check (throw mode)

    def allreduce(self, array, op="sum", async_op=False, name=None):
        # one int64 element, as the training ranks' notification and check (a different size would not pair)
        assert array.shape == (1,) and array.dtype == np.int64 and not async_op, (array, async_op)
        if name == TERMINATION_CHECK_NAME:
            self.answers.append(int(array[0]))
            return
        assert name == COUNT_NAME, name
        array[...] = 1 if self.left else 0
        self.left = max(self.left - 1, 0)
        self.counts.append(int(array[0]))


@pytest.mark.parametrize("shadowed,warned", [(0, 0), (3, 0), (WARN_THRESHOLD, 0), (WARN_THRESHOLD + 1, 1),
                                             (WARN_THRESHOLD + 4, 1)])
def test_the_skew_warning_comes_once_past_the_threshold_and_the_loop_starts_clean(join, shadowed, warned):
    """A rank that shadows ``shadowed`` iterations: one count per iteration plus the final one, each preceded by
    the pre hooks and (but the last) followed by the main hooks; the post hooks say whether this rank joined last
    (only when it shadowed nothing); more than WARN_THRESHOLD shadowed iterations warn once, at the user's
    ``with`` (torch warns about the skew once too)."""
    group = ScriptedGroup(shadowed)
    log = []
    joinables = [recording_joinable(join, group, log, "a"), recording_joinable(join, group, log, "b", NoPreHook)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with join.Join(joinables):
            pass
    assert group.counts == [1] * shadowed + [0]
    iteration = [("a", "pre"), ("a", "main"), ("b", "main")]
    assert log == iteration * shadowed + [("a", "pre"), ("a", "post", shadowed == 0), ("b", "post", shadowed == 0)]
    skew = [w for w in caught if issubclass(w.category, UserWarning) and "shadowed more than" in str(w.message)]
    assert len(skew) == warned, [str(w.message) for w in skew]
    for w in skew:
        assert str(w.message) == skew_message(0, WARN_THRESHOLD)
        assert w.filename == __file__, w.filename      # attributed to the ``with`` statement that joined


def test_in_throw_mode_a_joined_rank_answers_the_check_with_1_and_raises(join):
    """J3 on the joined rank: while others train, it answers their early-termination check with 1 (one int64) and
    raises, shadowing nothing (no pre or main hook runs)."""
    group = ScriptedGroup(2)
    log = []
    with pytest.raises(RuntimeError, match=r"rank 0 exhausted its inputs.*every rank raises now"):
        with join.Join([recording_joinable(join, group, log, "a")], throw_on_early_termination=True):
            pass
    assert group.counts == [1] and group.answers == [1] and log == []


@pytest.mark.parametrize("throw", [False, True])
def test_a_training_rank_sends_one_int64_count_and_in_throw_mode_one_int64_check(join, throw):
    """J1 and J3 on a training rank: each iteration's notification is an allreduce of one int64 (1), and in throw
    mode the check another (0 here: nobody ran out), the sizes a joined rank's count and answer pair with."""
    group = RecordingGroup(comm.world())
    joinable = make_joinable(join, group)
    join.Join([joinable], throw_on_early_termination=throw)
    work = join.Join.notify_join_context(joinable)
    assert work.result()[0] == 1
    expected = [("allreduce", COUNT_NAME, (1,), "int64", "sum")]
    if throw:
        expected.append(("allreduce", TERMINATION_CHECK_NAME, (1,), "int64", "sum"))
    assert group.trace == expected
