"""Groups, shutdown reasons and process sets in the controller's cycle, on an in-process world, both twins and mixed.

A group (grouped_allreduce) is one response whatever the fusion threshold, on the slow path and from the cache;
a member missing on a rank makes the group wait as one, and ranks that disagree on the members get one error
naming the group; a rank that asks to stop says why, and every rank reads who stopped.
"""
from __future__ import annotations

import pytest

from _negotiation_sim import make_world, run_cycle
from distlab import _backend
from distlab._common.negotiation import dtype_code, group_id_of
from distlab._wire import RequestType, ResponseType
from distlab.errors import MessageFormatError

F32 = dtype_code("float32")


def submit_group(mod, controller, group, sizes, dtype=F32, shapes=None):
    gid = group_id_of(group)
    shapes = shapes or [(s,) for s in sizes]
    controller.enqueue_group([mod.Request(f"{group}.{i}", RequestType.ALLREDUCE, dtype, shape,
                                          request_rank=controller.rank, reduce_op=1, group_id=gid,
                                          group_size=len(shapes))
                              for i, shape in enumerate(shapes)])


def submit(mod, controller, name, size=4):
    controller.enqueue(mod.Request(name, RequestType.ALLREDUCE, F32, (size,), request_rank=controller.rank,
                                   reduce_op=1))


def groups_and_names(response_list):
    return [(r.group_id, sorted(r.tensor_names)) for r in response_list.responses]


@pytest.mark.parametrize("caching", [1024, 0], ids=["cache", "no-cache"])
def test_group_is_one_response_beyond_the_threshold_slow_and_fast(negotiation, caching):
    m = negotiation
    world, cs, ts = make_world([m, m, m], fusion_threshold=16, cache_capacity=caching)
    gid = group_id_of("g")
    for step in range(3):
        for c in cs:
            submit_group(m, c, "g", [8, 8, 8])         # 3 x 32 bytes: far beyond a 16-byte threshold
            submit(m, c, f"alone.{step}")
            submit(m, c, "also")
        out = run_cycle(cs, ts)
        assert all(o == out[0] for o in out)
        assert (gid, ["g.0", "g.1", "g.2"]) in groups_and_names(out[0]), groups_and_names(out[0])
        assert sum(1 for r in out[0].responses if set(r.tensor_names) & {"g.0", "g.1", "g.2"}) == 1
    if caching:
        c0 = cs[0]
        for c in cs:
            submit_group(m, c, "g", [8, 8, 8])
            submit(m, c, "also")
        out = run_cycle(cs, ts)                         # every tensor cached: the fast path keeps the group whole
        assert c0.counters["fast_path"] == 1 and (gid, ["g.0", "g.1", "g.2"]) in groups_and_names(out[0])


def test_group_waits_as_one_until_every_rank_submitted_it(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    submit_group(m, cs[0], "g", [2, 2])
    assert run_cycle(cs, ts)[0].responses == []
    submit_group(m, cs[1], "g", [2, 2])
    out = run_cycle(cs, ts)
    assert groups_and_names(out[1]) == [(group_id_of("g"), ["g.0", "g.1"])]


def test_members_missing_on_a_rank_is_one_error_naming_the_group_on_every_rank(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m, m], cache_capacity=0)
    submit_group(m, cs[0], "grads", [2, 2, 2])
    submit_group(m, cs[1], "grads", [2, 2])
    submit_group(m, cs[2], "grads", [2, 2, 2])
    out = run_cycle(cs, ts)
    assert all(o == out[0] for o in out)
    (error,) = out[0].responses
    assert error.response_type == ResponseType.ERROR and sorted(error.tensor_names) == ["grads.0", "grads.1",
                                                                                         "grads.2"]
    assert error.error_message == ("grouped allreduce 'grads': the ranks disagree on the group's members: ranks 0, "
                                   "2 submitted 3 tensors; rank 1 submitted 2 tensors. Every rank must submit the "
                                   "same tensors in a group.")


def test_a_bad_member_fails_the_whole_group(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    submit_group(m, cs[0], "g", None, shapes=[(2,), (3,)])
    submit_group(m, cs[1], "g", None, shapes=[(2,), (4,)])
    (error,) = run_cycle(cs, ts)[0].responses
    assert error.response_type == ResponseType.ERROR and sorted(error.tensor_names) == ["g.0", "g.1"]
    assert error.error_message.startswith("grouped allreduce 'g' failed as a whole: Mismatched shapes for tensor "
                                          "'g.1'")


def test_a_changed_member_renegotiates_the_whole_group(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    for c in cs:
        submit_group(m, c, "g", [2, 2])
    run_cycle(cs, ts)
    for c in cs:
        submit_group(m, c, "g", None, shapes=[(2,), (5,)])     # member 1 changed shape everywhere
    out = run_cycle(cs, ts)
    assert groups_and_names(out[0]) == [(group_id_of("g"), ["g.0", "g.1"])]
    assert cs[0].counters["slow_path"] == 2 and out[0].responses[0].tensor_sizes == [2, 5]


@pytest.mark.parametrize("size", [2, 3])
def test_shutdown_reason_reaches_every_rank_naming_the_rank(negotiation, size):
    m = negotiation
    world, cs, ts = make_world([m] * size)
    for c in cs:
        submit(m, c, "w")
    run_cycle(cs, ts)
    for c in cs:
        submit(m, c, "w")                          # a cached tensor: the stop still travels on the slow path
    futures = [c.compute_response_list for c in cs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(size) as pool:
        results = [pool.submit(f, t, c.rank == size - 1, "called shutdown()")
                   for f, t, c in zip(futures, ts, cs)]
        out = [r.result(timeout=30) for r in results]
    for o in out:
        assert o.shutdown and o.shutdown_reason == f"rank {size - 1} called shutdown()"
        assert [r.tensor_names for r in o.responses] == [["w"]]


def test_controllers_of_different_process_sets_refuse_each_other(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m], cache_capacity=0)
    cs[1] = m.Controller(1, 2, cache_capacity=0, process_set_id=5)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(c.compute_response_list, t) for c, t in zip(cs, ts)]
        out0 = futures[0].result(timeout=30)
        with pytest.raises(MessageFormatError, match="response list is for process set 0, but this controller "
                                                     "negotiates for process set 5"):
            futures[1].result(timeout=30)
    assert out0.shutdown and "is for process set 5, but this controller negotiates for process set 0" in \
        out0.shutdown_reason


def test_twins_and_mixed_world_agree_on_groups_and_reasons():
    if not _backend.core_available():
        pytest.skip("core not built")
    twins = _backend.load_twins("negotiation")
    ref, core = twins["reference"], twins["core"]
    results = {}
    for label, modules in (("reference", [ref] * 3), ("core", [core] * 3), ("mixed", [ref, core, ref])):
        world, cs, ts = make_world(modules, fusion_threshold=40)
        outs = []
        for step in range(3):
            for c, mod in zip(cs, modules):
                submit_group(mod, c, "g", [4, 4, 4])
                submit(mod, c, f"t{step}")
                submit(mod, c, "u", size=3)
            outs.append([o.to_bytes() for o in run_cycle(cs, ts)])
        for c, mod in zip(cs, modules):
            submit_group(mod, c, "h", [2] * (2 if c.rank == 1 else 3))
        outs.append([o.to_bytes() for o in run_cycle(cs, ts)])
        results[label] = (outs, sorted(world.trace), [c.counters for c in cs], [c.cache.lru_names() for c in cs])
    assert results["reference"] == results["core"] == results["mixed"]
