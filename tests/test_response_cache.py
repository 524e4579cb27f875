"""ResponseCache and CacheCoordinator alone (no MPI), on both twins, and their equivalence."""
from __future__ import annotations

import sys
import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import _backend
from distlab._common.negotiation import dtype_code
from distlab._wire import RequestType, ResponseType
from distlab.errors import CacheEvictionWarning, CacheStateError

F32 = dtype_code("float32")
F64 = dtype_code("float64")


def req(mod, name, shape=(4,), dtype=F32, op=1, kind=RequestType.ALLREDUCE, device=-1, pre=1.0, post=1.0, rank=0):
    return mod.Request(name, kind, dtype, shape, request_rank=rank, device=device, reduce_op=op,
                       prescale_factor=pre, postscale_factor=post)


def resp(mod, names, kind=ResponseType.ALLREDUCE, sizes=None, size=2):
    return mod.Response(kind, names, F32, devices=[-1] * size,
                        tensor_sizes=sizes if sizes is not None else [4] * len(names), reduce_op=1)


def put(mod, cache, *names, **params):
    for name in names:
        cache.put(resp(mod, [name]), {name: req(mod, name, **params)})


def test_miss_hit_and_invalid_on_changed_params(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    assert cache.cached(req(m, "a")) == m.MISS
    put(m, cache, "a")
    assert cache.cached(req(m, "a")) == m.HIT
    for changed in ({"shape": (5,)}, {"dtype": F64}, {"op": 2}, {"device": 0}, {"pre": 2.0}, {"post": 0.5},
                    {"kind": RequestType.ALLGATHER}):
        assert cache.cached(req(m, "a", **changed)) == m.INVALID, changed
    assert cache.cached(req(m, "b")) == m.MISS
    assert m.request_params(req(m, "a")) == (0, F32, (4,), -1, 1, 1.0, 1.0, -1, 0)


def test_lru_order_get_moves_peek_does_not(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a", "b", "c")
    assert cache.lru_names() == ["a", "b", "c"]
    assert [cache.peek_cache_bit(n) for n in "abc"] == [0, 1, 2]
    assert cache.peek_response(0).tensor_names == ["a"]
    assert cache.lru_names() == ["a", "b", "c"]
    assert cache.get_response(0).tensor_names == ["a"]
    assert cache.lru_names() == ["b", "c", "a"]
    # bits keep their numbers until update_cache_bits renumbers them in LRU order (least recent = 0)
    assert cache.peek_cache_bit("a") == 0
    cache.update_cache_bits()
    assert [cache.peek_cache_bit(n) for n in "bca"] == [0, 1, 2]
    # a HIT put moves the entry to most recent and keeps its bit
    put(m, cache, "b")
    assert cache.lru_names() == ["c", "a", "b"]
    assert cache.peek_cache_bit("b") == 0


def test_eviction_reuses_the_bit_and_warns_once_clearly(negotiation):
    m = negotiation
    cache = m.ResponseCache(2)
    put(m, cache, "a", "b")
    with pytest.warns(CacheEvictionWarning) as record:
        put(m, cache, "c")
    text = str(record[0].message)
    assert "'a'" in text and "'c'" in text and "DISTLAB_CACHE_CAPACITY" in text and "capacity 2" in text
    assert "slow path" in text
    assert cache.peek_cache_bit("c") == 0          # took the evicted entry's bit
    assert cache.cached(req(m, "a")) == m.MISS
    assert cache.lru_names() == ["b", "c"]
    assert cache.num_active_bits() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        put(m, cache, "d")                          # second eviction: no second warning
    assert cache.evictions == 2
    assert cache.peek_cache_bit("d") == 1


def test_the_eviction_warning_points_at_the_code_that_put_the_entry(negotiation):
    """The warning is attributed to the caller of ``put`` (where the capacity is exceeded), not to the cache's
    own code or to an interpreter frame further up."""
    m = negotiation
    cache = m.ResponseCache(1)
    cache.put(resp(m, ["a"]), {"a": req(m, "a")})
    line = sys._getframe().f_lineno + 2   # the put below
    with pytest.warns(CacheEvictionWarning) as record:
        cache.put(resp(m, ["b"]), {"b": req(m, "b")})
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_erase_leaves_a_hole_then_update_compacts(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a", "b", "c")
    cache.update_cache_bits()
    cache.erase_response(1)
    assert cache.num_active_bits() == 3
    assert cache.list_all_bits() == [0, 2]
    assert cache.cached(req(m, "b")) == m.MISS
    with pytest.raises(CacheStateError, match="bit 1 holds no entry"):
        cache.peek_response(1)
    with pytest.raises(CacheStateError):
        cache.get_response(7)
    cache.update_cache_bits()
    assert cache.num_active_bits() == 2
    assert cache.list_all_bits() == [0, 1]
    assert [cache.peek_cache_bit(n) for n in "ac"] == [0, 1]
    # after erase, the freed slot is reused by a new entry at a new bit
    put(m, cache, "d")
    assert cache.peek_cache_bit("d") == 2
    assert len(cache) == 3


def test_refuses_to_overwrite_an_invalid_name(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a")
    with pytest.raises(CacheStateError, match=r"the entry is INVALID \(same name, different parameters\)"):
        cache.put(resp(m, ["a"]), {"a": req(m, "a", shape=(5,))})
    cache.erase_response(cache.peek_cache_bit("a"))
    cache.put(resp(m, ["a"]), {"a": req(m, "a", shape=(5,))})
    assert cache.cached(req(m, "a", shape=(5,))) == m.HIT


def test_capacity_change_clears_and_zero_disables(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a")
    cache.set_capacity(8)
    assert len(cache) == 1
    cache.set_capacity(4)
    assert len(cache) == 0 and cache.capacity == 4 and cache.num_active_bits() == 0
    cache.set_capacity(0)
    put(m, cache, "a")
    assert cache.cached(req(m, "a")) == m.MISS
    with pytest.raises(ValueError):
        cache.set_capacity(-1)


def test_only_cacheable_types(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    for kind in (ResponseType.BROADCAST, ResponseType.ERROR, ResponseType.JOIN, ResponseType.BARRIER):
        with pytest.raises(CacheStateError, match="not cacheable"):
            cache.put(resp(m, ["a"], kind=kind), {"a": req(m, "a")})
    for kind in (ResponseType.ALLGATHER, ResponseType.ADASUM, ResponseType.ALLTOALL):
        cache.put(resp(m, [f"k{kind}"], kind=kind), {f"k{kind}": req(m, f"k{kind}")})
    assert len(cache) == 3
    with pytest.raises(CacheStateError, match="no request"):
        cache.put(resp(m, ["zz"]), {})


def test_fused_response_is_split_with_own_sizes_and_joined_matches_anything(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    cache.put(resp(m, ["a", "b"], sizes=[4, 9]), {"a": req(m, "a"), "b": req(m, "b", shape=(9,))})
    assert cache.peek_response(1).tensor_names == ["b"] and cache.peek_response(1).tensor_sizes == [9]
    cache.put(resp(m, ["j"]), {}, joined=True)
    assert cache.cached(req(m, "j", shape=(100, 3), dtype=F64)) == m.HIT


# -- coordinator --------------------------------------------------------------------------------------------
def test_bitvector_status_bits_are_inverted(negotiation):
    m = negotiation
    c = m.CacheCoordinator(200)
    assert c.num_words == 4
    words = c.bitvector()
    assert words.dtype == np.uint64 and int(words[0]) == 0b111
    c.set_should_shut_down(True)
    assert int(c.bitvector()[0]) == 0b110
    c.set_uncached_in_queue(True)
    assert int(c.bitvector()[0]) == 0b100
    for bit in (0, 60, 61, 64, 199):
        c.record_hit(bit)
    words = c.bitvector()
    assert int(words[0]) == 0b100 | (1 << 3) | (1 << 63)
    assert int(words[1]) == 1 | (1 << 3)   # 61 -> 64, 64 -> 67
    assert int(words[3]) == 1 << (202 - 192)
    c.record_invalid_bit(60)
    assert int(c.bitvector()[0]) == 1 << 3  # invalid pending: its status bit cleared, and 60 is not a hit
    assert c.cache_hits == [0, 60, 61, 64, 199]
    c.erase_hit(61)
    assert c.cache_hits == [0, 60, 64, 199]
    with pytest.raises(CacheStateError, match="out of range"):
        c.record_hit(200)


def _sync_all(coordinators):
    """Sync coordinators as ranks of one world (threads), returning the trace of (rank, op)."""
    size = len(coordinators)
    barrier = threading.Barrier(size)
    slots = [None] * size
    trace = []

    def allreduce_for(rank):
        def allreduce(words, op):
            trace.append((rank, op))
            slots[rank] = words.copy()
            barrier.wait(10)
            result = slots[0].copy()
            for other in slots[1:]:
                result = result & other if op == "band" else result | other
            barrier.wait(10)
            words[:] = result
        return allreduce

    threads = [threading.Thread(target=c.sync, args=(allreduce_for(r),)) for r, c in enumerate(coordinators)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return trace


@pytest.mark.parametrize("size", [2, 4])
def test_sync_common_hits_status_and_invalid_bits(negotiation, size):
    m = negotiation
    cs = [m.CacheCoordinator(130) for _ in range(size)]
    for r, c in enumerate(cs):
        for bit in (1, 64, 129):
            c.record_hit(bit)
        c.record_hit(10 + r)          # rank-specific: not common
    trace = _sync_all(cs)
    assert sorted(op for _, op in trace) == ["band"] * size
    for c in cs:
        assert c.synced and c.cache_hits == [1, 64, 129]
        assert not (c.should_shut_down or c.uncached_in_queue or c.invalid_in_queue)
    with pytest.raises(CacheStateError, match="already synced"):
        cs[0].record_hit(1)

    cs = [m.CacheCoordinator(130) for _ in range(size)]
    for c in cs:
        c.record_hit(5)
        c.record_hit(6)
    cs[-1].record_invalid_bit(6)
    cs[-1].set_should_shut_down(True)
    cs[0].set_uncached_in_queue(True)
    trace = _sync_all(cs)
    assert sorted(op for _, op in trace) == ["band"] * size + ["bor"] * size
    for c in cs:
        assert c.cache_hits == [5] and c.invalid_bits == [6]
        assert c.should_shut_down and c.uncached_in_queue and c.invalid_in_queue


def test_sync_with_allreduce_returning_a_new_array(negotiation):
    c = negotiation.CacheCoordinator(3)
    c.record_hit(2)
    c.sync(lambda words, op: words & np.uint64(0b111))
    assert c.cache_hits == [] and not c.uncached_in_queue


def _fuse_hits(mod, cache, hit, threshold):
    """The fast path's responses as (names, sizes) for the entries whose bit ``hit`` accepts (None: none hit)."""
    coordinator = mod.CacheCoordinator(cache.num_active_bits())
    for bit in cache.list_all_bits():
        if hit(bit):
            coordinator.record_hit(bit)
    coordinator.sync(lambda words, op: words)
    fused = cache.fused_hits(coordinator, threshold)
    return None if fused is None else [(r.tensor_names, r.tensor_sizes) for r in fused]


def test_fused_hits_touch_the_common_hits_in_bit_order_and_fuse_them(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a", "b", "c", "d")
    assert _fuse_hits(m, cache, lambda bit: False, 1 << 20) is None
    assert cache.lru_names() == ["a", "b", "c", "d"]                # nothing hit: nothing touched
    assert _fuse_hits(m, cache, lambda bit: bit in (0, 2), 1 << 20) == [(["a", "c"], [4, 4])]
    assert cache.lru_names() == ["b", "d", "a", "c"]                # touched in bit order, as get_response does
    assert [cache.peek_cache_bit(n) for n in "bdac"] == [0, 1, 2, 3]  # and renumbered
    assert _fuse_hits(m, cache, lambda bit: bit in (0, 2), 16) == [(["b"], [4]), (["a"], [4])]  # 16 bytes each
    # the same hits in an unchanged cache give the same fusion, and a caller's changes to it stay its own
    cache.update_cache_bits()
    hits = m.CacheCoordinator(cache.num_active_bits())
    for bit in cache.list_all_bits():
        hits.record_hit(bit)
    hits.sync(lambda words, op: words)
    first = cache.fused_hits(hits, 1 << 20)
    first[0].tensor_names.append("x")
    again = m.CacheCoordinator(cache.num_active_bits())
    for bit in cache.list_all_bits():
        again.record_hit(bit)
    again.sync(lambda words, op: words)
    assert [r.tensor_names for r in cache.fused_hits(again, 1 << 20)] == [["d", "c", "b", "a"]]


# -- equivalence ----------------------------------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["put", "put_other", "get", "peek", "erase", "update", "cap", "fuse"]),
                         st.integers(0, 9)), max_size=60)


@settings(max_examples=80, deadline=None)
@given(sequence=ops)
def test_twins_make_identical_decisions(sequence):
    if not _backend.core_available():
        pytest.skip("core not built")
    twins = _backend.load_twins("negotiation")
    caches = {impl: mod.ResponseCache(4) for impl, mod in twins.items()}
    other = {impl: mod.ResponseCache(4) for impl, mod in twins.items()}
    # Request objects kept across operations (the core caches lookups in them; this checks the hints expire)
    kept = {impl: [req(mod, f"t{i}") for i in range(10)] for impl, mod in twins.items()}
    for impl, mod in twins.items():
        put(mod, other[impl], "t1")
    coordinators = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheEvictionWarning)
        for op, k in sequence:
            observed = {}
            for impl, mod in twins.items():
                cache = caches[impl]
                name = f"t{k}"
                fused = None
                try:
                    if op == "put":
                        put(mod, cache, name)
                    elif op == "put_other":
                        put(mod, cache, name, shape=(k + 7,))
                    elif op == "get":
                        cache.get_response(k)
                    elif op == "peek":
                        cache.peek_response(k)
                    elif op == "erase":
                        cache.erase_response(k)
                    elif op == "update":
                        cache.update_cache_bits()
                    elif op == "fuse":   # the fast path: a third of the entries hit everywhere, fused up to 16k bytes
                        fused = _fuse_hits(mod, cache, lambda bit: (bit + k) % 3 == 0, 16 * k)
                    else:
                        cache.set_capacity(4 + k % 2)
                    outcome = "ok"
                except CacheStateError as exc:
                    outcome = f"error {str(exc)[:40]}"
                states = [cache.cached(req(mod, f"t{i}")) for i in range(10)]
                assert [cache.cached(r) for r in kept[impl]] == states
                assert [other[impl].cached(r) for r in kept[impl]] == [mod.HIT if i == 1 else mod.MISS
                                                                       for i in range(10)]
                assert [cache.cached(r) for r in kept[impl]] == states
                coordinator = mod.CacheCoordinator(cache.num_active_bits())
                for bit in cache.list_all_bits():
                    coordinator.record_hit(bit)
                coordinators[impl] = coordinator
                observed[impl] = (outcome, fused, cache.lru_names(), cache.list_all_bits(), cache.num_active_bits(),
                                  states, coordinator.bitvector().tobytes(), cache.evictions)
            assert observed["reference"] == observed["core"], (op, k)


def test_many_dimensions_and_mutated_requests(negotiation):
    m = negotiation
    cache = m.ResponseCache(8)
    shape = tuple(range(1, 11))
    put(m, cache, "deep", shape=shape)
    assert cache.cached(req(m, "deep", shape=shape)) == m.HIT
    assert cache.cached(req(m, "deep", shape=shape[:-1] + (99,))) == m.INVALID
    assert cache.cached(req(m, "deep", shape=shape[:-1])) == m.INVALID
    kept = req(m, "deep", shape=shape)
    assert cache.cached(kept) == m.HIT
    kept.tensor_shape = (3,)                 # a request changed after a lookup is looked at afresh
    assert cache.cached(kept) == m.INVALID
    kept.tensor_name = "other"
    assert cache.cached(kept) == m.MISS


@pytest.mark.parametrize("field, changed", [("request_type", RequestType.ALLGATHER), ("tensor_type", F64),
                                            ("device", 0), ("reduce_op", 2), ("prescale_factor", 0.5),
                                            ("postscale_factor", 2.0), ("group_id", 7), ("group_size", 3)])
def test_a_changed_field_is_looked_at_afresh(negotiation, field, changed):
    """A request remembers what a lookup found only while neither it nor the cache changes: every field a HIT
    compares, written after a lookup, gives the state of the changed request (and back)."""
    m = negotiation
    cache = m.ResponseCache(8)
    put(m, cache, "a")
    kept = req(m, "a")
    assert cache.cached(kept) == m.HIT
    before = getattr(kept, field)
    setattr(kept, field, changed)
    assert getattr(kept, field) == changed
    assert cache.cached(kept) == m.INVALID
    setattr(kept, field, before)
    assert cache.cached(kept) == m.HIT
    with pytest.raises(AttributeError):
        kept.no_such_field = 1
