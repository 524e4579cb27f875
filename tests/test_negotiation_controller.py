"""The controller's cycle on an in-process world (threads + fake transport): fast and slow paths, requeue,
invalidation, validation errors, join, fusion, stall reports, and twin equivalence including mixed worlds."""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from _negotiation_sim import make_world, run_cycle
from distlab import _backend
from distlab._common.negotiation import dtype_code
from distlab._wire import JOIN_TENSOR_NAME, RequestType, ResponseType
from distlab.errors import StallWarning

F32 = dtype_code("float32")
F64 = dtype_code("float64")


def submit(mod, controller, name, shape=(4,), dtype=F32, op=1, kind=RequestType.ALLREDUCE, root=0, device=-1,
           pre=1.0, post=1.0):
    controller.enqueue(mod.Request(name, kind, dtype, shape, request_rank=controller.rank, root_rank=root,
                                   device=device, reduce_op=op, prescale_factor=pre, postscale_factor=post))


def names_of(response_list):
    return [r.tensor_names for r in response_list.responses]


@pytest.mark.parametrize("size", [2, 4])
def test_any_order_then_fast_path_when_repeated(negotiation, size):
    m = negotiation
    world, cs, ts = make_world([m] * size, fusion_threshold=10 * 16)
    for step in range(3):
        for c in cs:
            order = [f"t{i}" for i in range(20)]
            if c.rank % 2:
                order.reverse()
            for name in order:
                submit(m, c, name)
        out = run_cycle(cs, ts)
        assert all(o == out[0] for o in out)
        got = [n for r in out[0].responses for n in r.tensor_names]
        assert sorted(got) == sorted(f"t{i}" for i in range(20))
        assert all(len(r.tensor_names) <= 10 for r in out[0].responses)   # fusion threshold: 10 x 16 bytes
    for c in cs:
        assert c.counters["slow_path"] == 1 and c.counters["fast_path"] == 2
        assert c.counters["hits"] == 40 and c.counters["misses"] == 20
    # fast-path cycles send only bit vectors
    kinds = {kind for _r, kind, _d in world.trace}
    assert kinds == {"bits-band", "gather", "broadcast"}


def test_hit_on_some_ranks_only_is_requeued(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    for c in cs:
        submit(m, c, "a")
    run_cycle(cs, ts)
    submit(m, cs[0], "a")
    out = run_cycle(cs, ts)
    assert out[0].responses == [] and cs[0].queue_length() == 1
    assert cs[0].counters["requeued"] == 1 and cs[0].counters["idle"] == 1
    submit(m, cs[1], "a")
    out = run_cycle(cs, ts)
    assert names_of(out[0]) == [["a"]] and names_of(out[1]) == [["a"]]
    assert cs[0].queue_length() == 0 and cs[0].counters["fast_path"] == 1


def test_changed_params_invalidate_everywhere_then_error_names_ranks(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m, m])
    for c in cs:
        submit(m, c, "a")
    run_cycle(cs, ts)
    for c in cs:
        submit(m, c, "a", shape=(5,) if c.rank == 1 else (4,))
    out = run_cycle(cs, ts)
    assert any(kind == "bits-bor" for _r, kind, _d in world.trace)
    assert all(len(c.cache) == 0 for c in cs)
    (error,) = out[0].responses
    assert error.response_type == ResponseType.ERROR
    assert error.error_message == ("Mismatched shapes for tensor 'a' (allreduce): ranks 0, 2 sent [4]; "
                                   "rank 1 sent [5].")
    assert all(o == out[0] for o in out)


@pytest.mark.parametrize("case,expected", [
    ({"dtype": F64}, "Mismatched data types for tensor 'x' (allreduce): rank 0 sent float32; rank 1 sent float64."),
    ({"kind": RequestType.BROADCAST}, "Mismatched operations for tensor 'x' (allreduce): rank 0 sent allreduce; "
                                      "rank 1 sent broadcast."),
    ({"op": 3}, "Mismatched reduce ops for tensor 'x' (allreduce): rank 0 sent sum; rank 1 sent min."),
    ({"pre": 2.0}, "Mismatched prescale/postscale factors for tensor 'x' (allreduce): rank 0 sent (1, 1); "
                   "rank 1 sent (2, 1)."),
    ({"device": 0}, "Mismatched devices for tensor 'x' (allreduce): rank 0 sent CPU; rank 1 sent GPU 0."),
])
def test_validation_errors(negotiation, case, expected):
    m = negotiation
    world, cs, ts = make_world([m, m])
    submit(m, cs[0], "x")
    submit(m, cs[1], "x", **case)
    out = run_cycle(cs, ts)
    (error,) = out[1].responses
    assert error.response_type == ResponseType.ERROR and error.error_message == expected


def test_broadcast_root_and_allgather_shape_errors(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    submit(m, cs[0], "b", kind=RequestType.BROADCAST, root=0)
    submit(m, cs[1], "b", kind=RequestType.BROADCAST, root=1)
    submit(m, cs[0], "g", kind=RequestType.ALLGATHER, shape=(2, 3))
    submit(m, cs[1], "g", kind=RequestType.ALLGATHER, shape=(5, 4))
    submit(m, cs[0], "ok", kind=RequestType.ALLGATHER, shape=(2, 3))
    submit(m, cs[1], "ok", kind=RequestType.ALLGATHER, shape=(5, 3))
    out = run_cycle(cs, ts)
    by_name = {r.tensor_names[0]: r for r in out[0].responses}
    assert by_name["b"].error_message.endswith("rank 0 sent root 0; rank 1 sent root 1.")
    assert "shapes beyond the first dimension" in by_name["g"].error_message
    assert by_name["ok"].response_type == ResponseType.ALLGATHER and by_name["ok"].tensor_sizes == [2, 5]


def test_join_zero_contribution_and_last_joined_rank(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m, m])
    for c in cs:
        submit(m, c, "w")
    run_cycle(cs, ts)
    # rank 2 joins; ranks 0 and 1 keep going with the cached tensor and a new one
    submit(m, cs[2], JOIN_TENSOR_NAME, kind=RequestType.JOIN)
    out = run_cycle(cs, ts)
    assert out[0].responses == []
    for c in cs[:2]:
        submit(m, c, "w")
    out = run_cycle(cs, ts)
    assert names_of(out[2]) == [["w"]]                 # the joined rank takes part (with zeros)
    assert cs[0].counters["fast_path"] == 1
    for c in cs[:2]:
        submit(m, c, "new")
    submit(m, cs[0], "g", kind=RequestType.ALLGATHER, shape=(1,))
    submit(m, cs[1], "g", kind=RequestType.ALLGATHER, shape=(1,))
    submit(m, cs[0], "b", kind=RequestType.BROADCAST)
    submit(m, cs[1], "b", kind=RequestType.BROADCAST)
    out = run_cycle(cs, ts)
    by_name = {r.tensor_names[0]: r for r in out[2].responses}
    assert by_name["new"].response_type == ResponseType.ALLREDUCE and by_name["new"].devices == [-1, -1]
    assert "not supported once a rank has joined" in by_name["g"].error_message
    assert by_name["b"].error_message == "broadcast of 'b' is not supported once a rank has joined (rank 2 has joined)"
    assert all(c.cache.cached(m.Request("new", tensor_type=F32, tensor_shape=(4,), reduce_op=1)) == m.MISS
               for c in cs)                            # not every rank took part: not cached
    submit(m, cs[0], JOIN_TENSOR_NAME, kind=RequestType.JOIN)
    run_cycle(cs, ts)
    submit(m, cs[1], JOIN_TENSOR_NAME, kind=RequestType.JOIN)
    out = run_cycle(cs, ts)
    (join,) = out[0].responses
    assert join.response_type == ResponseType.JOIN and join.last_joined_rank == 1
    assert all(o == out[0] for o in out) and not any(c.joined for c in cs)


def test_with_a_rank_joined_tensors_are_ready_in_the_order_their_last_request_came(negotiation):
    """Once a rank has joined, a tensor is ready when every other rank sent it, at the request that completes it
    (IncrementTensorCount), not later in the order the tensors were first seen."""
    m = negotiation
    world, cs, ts = make_world([m, m, m])
    submit(m, cs[2], JOIN_TENSOR_NAME, kind=RequestType.JOIN)
    run_cycle(cs, ts)
    submit(m, cs[0], "a")
    submit(m, cs[0], "b")
    assert run_cycle(cs, ts)[0].responses == []       # rank 1 has sent neither yet
    submit(m, cs[1], "b")
    submit(m, cs[1], "a")
    out = run_cycle(cs, ts)
    assert names_of(out[0]) == [["b", "a"]] and all(o == out[0] for o in out)


def test_cached_allgather_under_join_is_refused_not_held(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m])
    for c in cs:
        submit(m, c, "g", kind=RequestType.ALLGATHER, shape=(2,))
        submit(m, c, "w")
    run_cycle(cs, ts)
    assert len(cs[0].cache) == 2
    submit(m, cs[1], JOIN_TENSOR_NAME, kind=RequestType.JOIN)
    submit(m, cs[0], "g", kind=RequestType.ALLGATHER, shape=(2,))
    submit(m, cs[0], "w")
    out = run_cycle(cs, ts)
    by_name = {r.tensor_names[0]: r for o in [out[0]] for r in o.responses}
    assert "not supported once a rank has joined" in by_name["g"].error_message
    assert by_name["w"].response_type == ResponseType.ALLREDUCE
    assert out[0] == out[1]


def test_cache_disabled_always_takes_the_slow_path(negotiation):
    m = negotiation
    world, cs, ts = make_world([m, m], cache_capacity=0)
    for _ in range(3):
        for c in cs:
            submit(m, c, "a")
        out = run_cycle(cs, ts)
        assert names_of(out[0]) == [["a"]]
    assert cs[0].counters["slow_path"] == 3 and cs[0].counters["fast_path"] == 0
    assert not any(kind.startswith("bits") for _r, kind, _d in world.trace)


def test_fuse_responses_threshold_lookahead_and_compatibility(negotiation):
    m = negotiation

    def r(name, count, dtype=F32, op=1, kind=ResponseType.ALLREDUCE):
        return m.Response(kind, [name], dtype, devices=[-1, -1], tensor_sizes=[count], reduce_op=op)

    responses = [r("a", 4), r("b", 4, dtype=F64), r("c", 4), r("d", 100), r("e", 2), r("f", 4, op=2),
                 r("g", 1, kind=ResponseType.BROADCAST)]
    fused = m.fuse_responses(responses, 64)
    assert [x.tensor_names for x in fused] == [["a", "c"], ["b"], ["d"], ["e"], ["f"], ["g"]]
    assert fused[0].tensor_sizes == [4, 4]
    # look-ahead skips a non-fusable response while the skipped bytes fit
    fused = m.fuse_responses([r("a", 4), r("b", 2, dtype=F64), r("c", 4), r("e", 2)], 64)
    assert [x.tensor_names for x in fused] == [["a", "c", "e"], ["b"]]
    # ... up to the threshold itself: 16 bytes taken, 48 skipped is exactly 64; one byte more stops the look-ahead
    fused = m.fuse_responses([r("a", 4), r("b", 6, dtype=F64), r("c", 4)], 64)
    assert [x.tensor_names for x in fused] == [["a", "c"], ["b"]]
    fused = m.fuse_responses([r("a", 4), r("b", 6, dtype=F64), r("c", 4)], 63)
    assert [x.tensor_names for x in fused] == [["a"], ["b"], ["c"]]
    assert responses[0].tensor_names == ["a"]          # inputs are not modified


def test_a_cycle_called_without_arguments_keeps_the_job_running(negotiation):
    """``compute_response_list(transport)``: shutting down is asked for, never the default."""
    m = negotiation
    world, cs, ts = make_world([m, m])
    for c in cs:
        submit(m, c, "w")
    with ThreadPoolExecutor(2) as pool:
        out = [f.result(timeout=30) for f in [pool.submit(c.compute_response_list, t) for c, t in zip(cs, ts)]]
    assert names_of(out[0]) == [["w"]] and not any(o.shutdown or o.shutdown_reason for o in out)


def test_stall_report_names_tensors_missing_ranks_and_waits(negotiation):
    m = negotiation
    now = [0.0]
    world, cs, ts = make_world([m, m, m], stall_check_time=5.0, stall_shutdown_time=30.0, clock=lambda: now[0])
    submit(m, cs[0], "late")
    submit(m, cs[2], "late")
    run_cycle(cs, ts)
    now[0] = 6.0
    with pytest.warns(StallWarning) as record:
        out = run_cycle(cs, ts)
    report = str(record[0].message)
    assert "'late' (allreduce): waiting 6.0 s; ready on ranks 0, 2; missing rank 1" in report
    assert "join()" in report and "DISTLAB_STALL_SHUTDOWN_TIME" in report
    assert cs[0].stall.last_stalled == {"late": [1]} and not out[0].shutdown
    now[0] = 40.0
    with pytest.warns(StallWarning, match="Shutting down"):
        out = run_cycle(cs, ts)
    assert all(o.shutdown for o in out)
    assert all(o.shutdown_reason == out[0].shutdown_reason for o in out)   # the stall is why, on every rank
    assert "its stall inspector saw 'late' wait 40.0 s" in out[0].shutdown_reason


def test_stalled_cached_tensor_goes_to_the_coordinator(negotiation):
    m = negotiation
    now = [0.0]
    world, cs, ts = make_world([m, m], stall_check_time=5.0, clock=lambda: now[0])
    for c in cs:
        submit(m, c, "a")
    run_cycle(cs, ts)
    submit(m, cs[0], "a")
    run_cycle(cs, ts)                                   # requeued on rank 0
    now[0] = 6.0
    run_cycle(cs, ts)                                   # invalidated: erased, sent to the coordinator
    assert len(cs[0].cache) == 0
    now[0] = 12.0
    with pytest.warns(StallWarning, match="'a' .*missing rank 1"):
        run_cycle(cs, ts)


def _scenario(modules):
    world, cs, ts = make_world(modules, fusion_threshold=40, cache_capacity=6)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):
            for c, mod in zip(cs, modules):
                order = [f"t{(i * 3 + step) % 9}" for i in range(9)]
                if c.rank % 2:
                    order.reverse()
                for name in order[: 6 + (step + c.rank) % 3]:
                    submit(mod, c, name, shape=(2 + (name == "t4" and step == 3 and c.rank == 0),))
            for _ in range(3):
                outs.append([o.to_bytes() for o in run_cycle(cs, ts)])
        for step in range(3):                           # a steady pattern: the fast path
            for c, mod in zip(cs, modules):
                for name in (["s0", "s1", "s2", "s3"] if c.rank % 2 else ["s3", "s2", "s1", "s0"]):
                    submit(mod, c, name)
            outs.append([o.to_bytes() for o in run_cycle(cs, ts)])
    trace = sorted(world.trace)
    return outs, trace, [c.counters for c in cs], [c.cache.lru_names() for c in cs]


@pytest.mark.parametrize("size", [2, 4])
def test_twins_and_mixed_world_are_equivalent(size):
    if not _backend.core_available():
        pytest.skip("core not built")
    ref = _backend.load("negotiation", "reference")
    core = _backend.load("negotiation", "core")
    a = _scenario([ref] * size)
    b = _scenario([core] * size)
    mixed = _scenario([ref if r % 2 == 0 else core for r in range(size)])
    assert a == b
    assert a == mixed
    assert a[2][0]["fast_path"] > 0 and a[2][0]["slow_path"] > 0 and a[2][0]["invalid"] >= 0


def _random_world(modules, plan, capacity, threshold):
    world, cs, ts = make_world(modules, cache_capacity=capacity, fusion_threshold=threshold)
    outs = []
    in_flight = [set() for _ in cs]      # as the facade does: a name in flight on a rank is not resubmitted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cycle in plan:
            for c, mod, submissions in zip(cs, modules, cycle):
                for name, size, op in submissions:
                    if name not in in_flight[c.rank]:
                        in_flight[c.rank].add(name)
                        submit(mod, c, name, shape=(size,), op=op)
            results = run_cycle(cs, ts)
            for r, result in enumerate(results):
                for response in result.responses:
                    in_flight[r].difference_update(response.tensor_names)
            outs.append([o.to_bytes() for o in results])
        # drain: whatever is still pending completes once every rank has submitted it
        for _ in range(2):
            outs.append([o.to_bytes() for o in run_cycle(cs, ts)])
    return outs, sorted(world.trace), [c.counters for c in cs], [c.cache.lru_names() for c in cs]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_patterns_identical_across_twins_and_mixed(data):
    if not _backend.core_available():
        pytest.skip("core not built")
    size = data.draw(st.sampled_from([2, 3]), label="ranks")
    names = [f"t{i}" for i in range(6)]
    submission = st.tuples(st.sampled_from(names), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]))
    plan = data.draw(st.lists(st.lists(st.lists(submission, max_size=4, unique_by=lambda s: s[0]),
                                       min_size=size, max_size=size), min_size=1, max_size=8), label="plan")
    capacity = data.draw(st.sampled_from([0, 3, 1024]), label="capacity")
    threshold = data.draw(st.sampled_from([0, 16, 1 << 20]), label="threshold")
    ref = _backend.load("negotiation", "reference")
    core = _backend.load("negotiation", "core")
    a = _random_world([ref] * size, plan, capacity, threshold)
    b = _random_world([core] * size, plan, capacity, threshold)
    mixed = _random_world([ref if r % 2 else core for r in range(size)], plan, capacity, threshold)
    assert a == b
    assert a == mixed
    event(f"fast path taken: {a[2][0]['fast_path'] > 0}")
    event(f"requeued: {a[2][0]['requeued'] > 0}; invalid: {a[2][0]['invalid'] > 0}")


def test_repeated_hit_cycles_follow_threshold_and_cache_changes(negotiation):
    """A fast-path cycle that repeats the last one's hits must still see a new fusion threshold, a changed entry,
    and never hand out a response that a caller's change to an earlier result could have altered."""
    m = negotiation
    world, cs, ts = make_world([m, m], fusion_threshold=1 << 20)

    def cycle(shape=(4,)):
        for c in cs:
            for name in ("a", "b", "c"):
                submit(m, c, name, shape=shape)
        return run_cycle(cs, ts)

    cycle()
    first = cycle()
    assert names_of(first[0]) == [["a", "b", "c"]]
    first[0].responses[0].tensor_names.append("tampered")   # a caller editing its result ...
    assert names_of(cycle()[0]) == [["a", "b", "c"]]          # ... does not reach the next cycle
    for c in cs:
        c.fusion_threshold = 16                              # one 4-float tensor per fused response
    assert names_of(cycle()[0]) == [["a"], ["b"], ["c"]]
    for c in cs:
        c.fusion_threshold = 1 << 20
    assert names_of(cycle()[0]) == [["a", "b", "c"]]
    cycle(shape=(8,))                                         # changed shape: invalidated, renegotiated
    again = cycle(shape=(8,))
    assert names_of(again[0]) == [["a", "b", "c"]] and again[0].responses[0].tensor_sizes == [8, 8, 8]
    assert all(c.counters["fast_path"] >= 5 for c in cs)


def test_a_request_changed_after_enqueue_is_negotiated_as_changed(negotiation):
    """A request is looked up in the cache when it is queued; changing it before the cycle, or a cycle changing
    the cache meanwhile, must give the cycle the state of the request as it is then (invalid, renegotiated)."""
    m = negotiation
    world, cs, ts = make_world([m, m])
    for c in cs:
        submit(m, c, "a")
    run_cycle(cs, ts)
    kept = []
    for c in cs:
        request = m.Request("a", RequestType.ALLREDUCE, F32, (4,), request_rank=c.rank, reduce_op=1)
        c.enqueue(request)                                    # a HIT when queued ...
        kept.append(request)
    for request in kept:
        request.reduce_op = 2                                 # ... changed before the cycle: invalid everywhere
    out = run_cycle(cs, ts)
    assert all(c.counters["invalid"] == 1 and c.counters["slow_path"] == 2 for c in cs)
    assert names_of(out[0]) == [["a"]] and out[0].responses[0].reduce_op == 2
    for c in cs:
        submit(m, c, "a", op=2)
    assert names_of(run_cycle(cs, ts)[0]) == [["a"]] and all(c.counters["fast_path"] == 1 for c in cs)
