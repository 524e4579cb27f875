"""bucket_cap_mb="auto": the cost model, the choice, and DDP using it on both twins (one process).

Several ranks (every rank choosing the same caps, a mixed world, Join) are covered by tests/test_ddp_mpi.py.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distlab
from distlab import nn
from distlab._common import reducer_autocap
from distlab._common.reducer_autocap import MiB, LinkModel, choose_bucket_caps, predict_end
from distlab.ddp import DistributedDataParallel as DDP


def test_predict_end_overlaps_fully_without_contention_and_not_at_all_with_full_contention():
    # Two 2-byte buckets ready at 1 s and 3 s, 1 byte/s, no latency.
    assert predict_end([2, 2], [1.0, 3.0], LinkModel(0.0, 1.0, 0.0)) == pytest.approx(5.0)  # 1-3 hidden, 3-5
    assert predict_end([2, 2], [1.0, 3.0], LinkModel(0.0, 1.0, 1.0)) == pytest.approx(7.0)  # 3 + 4, in turns
    assert predict_end([4], [3.0], LinkModel(0.5, 1.0, 0.3)) == pytest.approx(7.5)  # the last bucket is never hidden


buckets = st.lists(st.tuples(st.integers(0, 10_000), st.floats(0, 1)), min_size=1, max_size=20)
models = st.tuples(st.floats(0, 1e-3), st.floats(1e3, 1e9), st.floats(0, 1))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(buckets, models)
def test_predicted_end_bounds_and_monotonic_in_contention(spec, model):
    nbytes = [b for b, _ in spec]
    ready = np.maximum.accumulate([r for _, r in spec]).tolist()
    latency, bandwidth, contention = model
    comm = sum(latency + b / bandwidth for b in nbytes)
    end = predict_end(nbytes, ready, LinkModel(latency, bandwidth, contention))
    assert end >= max(ready[-1], comm) - 1e-9
    assert end <= ready[-1] + comm * 2 + 1e-9
    assert predict_end(nbytes, ready, LinkModel(latency, bandwidth, 1.0)) >= ready[-1] + comm - 1e-9
    assert predict_end(nbytes, ready, LinkModel(latency, bandwidth, 0.0)) <= end + 1e-9


def _layers(count=8, mib=1):
    params = [np.zeros(int(mib * MiB) // 4, dtype=np.float32) for _ in range(count)]
    order = list(range(count))[::-1]
    arrivals = np.zeros(count)
    arrivals[order] = np.linspace(0, 70e-3, count)  # one layer's gradient every 10 ms
    return order, params, arrivals


def test_a_slow_link_gets_small_buckets_one_host_gets_one_bucket():
    order, params, arrivals = _layers()
    # 100 MB/s (10 ms per layer, as long as its backward), overlapping freely: keep the wire busy from the start
    slow = choose_bucket_caps(order, params, arrivals, LinkModel(1e-4, 1e8, 0.0))
    assert slow.cap <= 2 * MiB and slow.first_cap == min(MiB, slow.cap)
    assert slow.predicted[slow.cap] < 0.7 * slow.predicted[8 * MiB]
    one_host = choose_bucket_caps(order, params, arrivals, LinkModel(5e-5, 3e9, 1.0))  # a copy by the same core
    assert one_host.cap == 8 * MiB  # overlap gains nothing, every bucket costs latency
    assert set(one_host.predicted) == {2 ** k for k in range(16, 24)}
    # A wire slower than backward on one host still gets the whole model: with full contention nothing overlaps,
    # so there is no idle wire for small buckets to fill, and the choice never depends on the measurements there.
    one_host_slow = choose_bucket_caps(order, params, arrivals, LinkModel(5e-5, 1e8, 1.0))
    assert sum(p.nbytes for p in params) / 1e8 > 70e-3 and one_host_slow.cap == 8 * MiB
    as_dict = one_host.as_dict()
    assert as_dict["cap_bytes"] == 8 * MiB and as_dict["contention"] == 1.0 and len(as_dict["predicted_s"]) == 8


def test_near_ties_go_to_the_larger_cap_unless_the_wire_is_the_bottleneck():
    order, params, arrivals = _layers()
    free = choose_bucket_caps(order, params, arrivals, LinkModel(0.0, 1e15, 0.0))  # communication costs nothing
    assert free.cap == 8 * MiB
    # 1 MB/s: the wire takes 8 s against 70 ms of backward. Every cap starts it with the same 1 MiB first bucket
    # and keeps it busy from then on, so all tie; the smallest of at least 1 MiB wins.
    slow = choose_bucket_caps(order, params, arrivals, LinkModel(0.0, 1e6, 0.0))
    assert max(slow.predicted.values()) <= min(slow.predicted.values()) * (1 + reducer_autocap.TIE)
    assert slow.cap == MiB
    assert reducer_autocap._break_tie([MiB // 4, MiB // 2], wire_bound=True) == MiB // 2
    assert reducer_autocap._break_tie([MiB // 2, 2 * MiB, 4 * MiB], wire_bound=True) == 2 * MiB
    assert reducer_autocap._break_tie([MiB // 2, 2 * MiB, 4 * MiB], wire_bound=False) == 4 * MiB


def test_sparse_parameters_count_as_latency_only():
    order, params, arrivals = _layers(count=4)
    sparse = [False, True, False, False]
    choice = choose_bucket_caps(order, params, arrivals, LinkModel(1e-4, 1e8, 0.0), sparse)
    assert max(choice.predicted) == 3 * MiB  # the dense bytes only


@pytest.fixture
def fixed_link(monkeypatch):
    """measure_link with a slow link's figures and a 5 ms backward per parameter, so that the choice does not
    depend on this machine (the real probes still run, on one rank)."""
    real = reducer_autocap.measure_link

    def measure(group, gradient_bytes, arrivals):
        real(group, gradient_bytes, arrivals)
        n = len(arrivals)
        return LinkModel(1e-4, 1e7, 0.0), 5e-3 * (n - 1 - np.arange(n))  # registered last, arrived first

    monkeypatch.setattr(reducer_autocap, "measure_link", measure)
    monkeypatch.setattr("distlab._common.reducer.measure_link", measure)


def mlp():
    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])  # 6 x 66 KB


def test_ddp_auto_chooses_at_the_rebuild_and_trains_like_the_plain_model(impl, fixed_link):
    model, plain = DDP(mlp(), bucket_cap_mb="auto", impl=impl), mlp()
    data = model.reducer.get_logging_data()
    assert data["bucket_cap_auto"] and data["auto_bucket_cap"] is None and data["bucket_cap_bytes"] == 25 * MiB
    x = distlab.tensor(np.ones((4, 128), dtype=np.float32))
    for _ in range(3):
        model.zero_grad()
        plain.zero_grad()
        model(x).sum().backward()
        plain(x).sum().backward()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            assert np.allclose(p.grad.data, q.grad.data), name
    data = model.reducer.get_logging_data()
    choice = data["auto_bucket_cap"]
    assert data["has_rebuilt_buckets"] and choice["bandwidth_Bps"] == 1e7
    assert data["bucket_cap_bytes"] == choice["cap_bytes"] < 25 * MiB  # 10 MB/s: small buckets
    assert data["first_bucket_cap_bytes"] == choice["first_cap_bytes"]
    assert len(data["bucket_indices"]) > 1 and 0 < choice["backward_s"] < 60


@pytest.mark.parametrize("spelling", [{}, {"bucket_cap_mb": None}, {"bucket_cap_mb": 25}])
def test_auto_is_the_default_and_a_number_fixes_the_caps(impl, fixed_link, monkeypatch, caplog, spelling):
    caplog.set_level("INFO", logger="distlab.ddp")
    probes = []
    measure = reducer_autocap.measure_link  # fixed_link's
    monkeypatch.setattr("distlab._common.reducer.measure_link", lambda *a: probes.append(1) or measure(*a))
    model = DDP(mlp(), impl=impl, **spelling)
    x = distlab.tensor(np.ones((4, 128), dtype=np.float32))
    for _ in range(3):
        model(x).sum().backward()
    data = model.reducer.get_logging_data()
    fixed = spelling.get("bucket_cap_mb") == 25
    assert data["has_rebuilt_buckets"] and data["bucket_cap_auto"] is not fixed and len(probes) == (not fixed)
    said = [r.getMessage() for r in caplog.records if r.name == "distlab.ddp"]
    if fixed:  # torch's layout: the 400 KB model in the 1 MiB first bucket, and nothing measured
        assert data["auto_bucket_cap"] is None and data["bucket_cap_bytes"] == 25 * MiB
        assert len(data["bucket_indices"]) == 1 and not said
    else:
        choice = data["auto_bucket_cap"]
        assert data["bucket_cap_bytes"] == choice["cap_bytes"] < 25 * MiB
        # The choice is logged once, with what it was made from (fixed_link's 10 MB/s, 100 us, no contention).
        assert len(said) == 1 and said[0].startswith(
            f"bucket_cap_mb='auto' chose {choice['cap_bytes'] / MiB:.3g} MiB, first bucket ")
        assert "allreduce 0.01 GB/s + 100 us, contention 0.00" in said[0], said[0]
        assert "(the whole model in one bucket: " in said[0] and "A number for bucket_cap_mb fixes" in said[0]


def test_ddp_auto_rebuilds_also_with_find_unused_parameters(impl, fixed_link):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = mlp(), nn.Linear(128, 128)

        def forward(self, x):
            return self.body(x)

    model = DDP(Branchy(), bucket_cap_mb="auto", find_unused_parameters=True, impl=impl)
    x = distlab.tensor(np.ones((4, 128), dtype=np.float32))
    for _ in range(3):
        model(x).sum().backward()
    data = model.reducer.get_logging_data()
    assert data["has_rebuilt_buckets"] and data["auto_bucket_cap"] is not None
    assert sorted(i for b in data["bucket_indices"] for i in b) == list(range(14))
    assert model.module.spare.weight.grad is None  # unused everywhere: untouched


def test_ddp_auto_with_a_static_graph(impl, fixed_link):
    model, plain = DDP(mlp(), bucket_cap_mb="auto", static_graph=True, impl=impl), mlp()
    x = distlab.tensor(np.ones((4, 128), dtype=np.float32))
    for _ in range(4):  # a static graph records arrivals in iteration 2 and rebuilds before iteration 3
        model.zero_grad()
        plain.zero_grad()
        model(x).sum().backward()
        plain(x).sum().backward()
    data = model.reducer.get_logging_data()
    assert data["has_rebuilt_buckets"] and data["auto_bucket_cap"] is not None and len(data["bucket_indices"]) > 1
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        assert np.allclose(p.grad.data, q.grad.data), name


@pytest.mark.parametrize("value, message", [("big", "bucket_cap_mb must be a number of MiB or 'auto'"),
                                            (0, "bucket_cap_mb must be positive")])
def test_bad_bucket_cap(impl, value, message):
    with pytest.raises(ValueError, match=message):
        DDP(mlp(), bucket_cap_mb=value, impl=impl)


def test_bad_reducer_cap(impl):
    from distlab import _backend, comm

    with pytest.raises(ValueError, match="bucket_bytes_cap must be a number of bytes or 'auto', got 'big'"):
        _backend.load("reducer", impl).Reducer([nn.Parameter(np.ones(2, np.float32))], [[0]], comm.world(),
                                                bucket_bytes_cap="big")


class _FakeClock:
    """The probes' clock, advanced only by the fake work below: the contention probe without timing noise."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Product:
    """Stands for the probe's layer-sized matrix product: 1 ms of this rank's core."""

    def __init__(self, clock):
        self.clock = clock

    def __matmul__(self, other):
        self.clock.now += 1e-3


class _ProbeGroup:
    """One rank whose allreduce of the probe takes 20 ms: CPU work done while polled (``cpu``: MPI through shared
    memory on one host, or the shared-memory arena), or moved meanwhile by someone else (a NIC)."""

    size, rank = 1, 0

    def __init__(self, clock, cpu: bool):
        self.clock, self.cpu = clock, cpu

    def barrier(self, name=None):
        pass

    def allreduce(self, array, op="sum", async_op=False, name=None):
        cost = 20e-3 if array.nbytes > 64 * 1024 else 1e-5
        if not async_op:
            self.clock.now += cost
            return array
        return _ProbeWork(self.clock, cost, self.cpu)


class _ProbeWork:
    def __init__(self, clock, cost, cpu):
        self.clock, self.left, self.cpu, self.end = clock, cost, cpu, clock.now + cost

    def is_completed(self):
        if self.cpu:  # each poll does a slice of the work on this core
            step = min(self.left, 1e-3)
            self.clock.now += step
            self.left -= step
            return self.left <= 0
        return self.clock.now >= self.end

    def wait(self):
        if self.cpu:
            self.clock.now += self.left
            self.left = 0.0
        else:
            self.clock.now = max(self.clock.now, self.end)


@pytest.mark.parametrize("cpu, expected", [(True, 1.0), (False, 0.0)])
def test_the_contention_probe_sees_an_allreduce_that_takes_the_core(monkeypatch, cpu, expected):
    # The probe computes a fixed number of products beside the allreduce: computing until a deadline would end
    # on time however much of the core the allreduce took, and measured 0.12 on one host where it is 1.
    clock = _FakeClock()
    monkeypatch.setattr(reducer_autocap, "time", clock)
    monkeypatch.setattr(reducer_autocap, "_A", _Product(clock))
    model, _ = reducer_autocap.measure_link(_ProbeGroup(clock, cpu), 8 * MiB, np.zeros(3))
    assert model.contention == pytest.approx(expected, abs=0.1)


class _ArenaProbeGroup(_ProbeGroup):
    """The same rank on one node: its probes live in a shared-memory arena (``shared_arrays``), whose reduction
    is this rank's own work in its polls."""

    def __init__(self, clock):
        super().__init__(clock, cpu=True)
        self.names = []

    def shared_arrays(self, specs):
        return object(), [np.zeros(count, dtype) for count, dtype in specs]

    def allreduce(self, array, op="sum", async_op=False, name=None):
        self.names.append(name)
        return super().allreduce(array, op, async_op, name)


def test_in_a_shared_memory_arena_the_contention_is_one_without_a_probe(monkeypatch):
    # Probed there, it read 0.2 to 0.95 on one host, and auto chose 4 MB where the whole model does best.
    clock = _FakeClock()
    monkeypatch.setattr(reducer_autocap, "time", clock)
    group = _ArenaProbeGroup(clock)
    model, _ = reducer_autocap.measure_link(group, 8 * MiB, np.zeros(3))
    assert model.contention == 1.0 and model.bandwidth > 0
    assert "auto bucket cap: contention" not in group.names
    assert group.names[-1] == "auto bucket cap: measurements"
