"""The Horovod-style front on N ranks: grouped allreduce, alltoall with splits, reducescatter, objects, parameters and
optimizer state, process sets (disjoint and overlapping, each with its own cache), scaling precision, Adasum.

Argument: ``mixed`` makes even ranks use the reference twin and odd ranks the core twin.
"""
import os
import sys

import numpy as np

if "mixed" in sys.argv[1:]:
    os.environ["DISTLAB_IMPL"] = "reference" if int(os.environ["RANK"]) % 2 == 0 else "core"

import ml_dtypes  # noqa: E402

from distlab import _backend, collectives as hvd, optim  # noqa: E402
from distlab.autograd.tensor import Tensor  # noqa: E402
from distlab import fakegpu  # noqa: E402
from scenario_checks import expect, staged_outside_comm, start_counting  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()

for device, xp in (("cpu", np), ("cuda", fakegpu)):  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # -- grouped allreduce: one response for the group, repeated (the cache), then a member missing on one rank --
    for step in range(3):
        before = hvd.stats()
        out = hvd.grouped_allreduce([xp.full(3, r + i + step, np.float32) for i in range(5)], name="grp", op=hvd.Sum)
        assert [o.tolist() for o in out] == [[sum(k + i + step for k in range(n))] * 3 for i in range(5)], out
        after = hvd.stats()
        assert after["responses"] - before["responses"] == 1, (before, after)      # one response for five tensors
        assert after["fused_tensors"] - before["fused_tensors"] == 5
    assert hvd.stats()["fast_path"] >= 1
    group = hvd.grouped_allreduce([xp.ones(4, np.float64) * r for _ in range(3)], name="avg.group")
    assert all(np.allclose(g.tolist(), (n - 1) / 2) for g in group)
    members = 2 if r == 0 else 3
    exc = expect(hvd.CollectiveError, lambda: hvd.grouped_allreduce([xp.ones(2)] * members, name="bad.group"),
                 "grouped allreduce 'bad.group'", "disagree on the group's members", "rank 0 submitted 2 tensors",
                 "raised on every rank")
    exc = expect(hvd.CollectiveError,
                 lambda: hvd.grouped_allreduce([xp.ones(2), xp.ones(3 if r == 1 else 2)], name="bad.member"),
                 "grouped allreduce 'bad.member' failed as a whole", "Mismatched shapes")
    expect(TypeError, lambda: hvd.grouped_allreduce([xp.ones(2), xp.ones(2, np.int32)], name="mixed"), "same dtype")

    # -- alltoall with splits ----------------------------------------------------------------------------------------
    rows = xp.arange(sum(range(1, n + 1)), dtype=np.float64) + 100 * r       # rank r sends j+1 rows to rank j
    splits = list(range(1, n + 1))
    received, received_splits = hvd.alltoall(rows.reshape(-1, 1), splits=splits, name="a2a")
    assert received_splits.tolist() == [r + 1] * n, received_splits
    start = sum(range(1, r + 1))
    assert received[:, 0].tolist() == [100 * k + start + i for k in range(n) for i in range(r + 1)], received
    even, even_splits = hvd.alltoall(xp.arange(2 * n, dtype=np.int32) + 10 * r, name="a2a.even")
    assert even_splits.tolist() == [2] * n and even.tolist() == [10 * k + 2 * r + i for k in range(n) for i in range(2)]
    expect(ValueError, lambda: hvd.alltoall(xp.ones(3), splits=[5] * n), "must be")

    # -- reducescatter (Horovod's split of the first dimension) -------------------------------------------------------
    total = 2 * n + 1
    x = xp.arange(total * 2, dtype=np.float64).reshape(total, 2) * (r + 1)
    mine = hvd.reducescatter(x, name="rs", op=hvd.Sum)
    counts = [total // n + (1 if k < total % n else 0) for k in range(n)]
    first = sum(counts[:r])
    expected = xp.arange(total * 2, dtype=np.float64).reshape(total, 2)[first:first + counts[r]] * (n * (n + 1) / 2)
    assert mine.shape == (counts[r], 2) and np.allclose(mine, expected), (mine, expected)
    avg = hvd.reducescatter(xp.ones((n, 3)) * r, name="rs.avg")
    assert np.allclose(avg, (n - 1) / 2) and avg.shape == (1, 3)

    # -- objects, parameters, optimizer state -----------------------------------------------------------------------
    assert hvd.broadcast_object({"rank": r, "text": "x" * r}, root_rank=n - 1) == {"rank": n - 1, "text": "x" * (n - 1)}
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]
    params = {"w": Tensor(xp.full((2, 2), float(r)), requires_grad=True), "b": xp.full(3, r, np.int64)}
    hvd.broadcast_parameters(params, root_rank=1)
    assert (params["w"].data == 1.0).all() and (params["b"] == 1).all()
    w = Tensor(xp.ones(3) * r, requires_grad=True)
    adam = optim.Adam([w], lr=0.1 * (r + 1), betas=(0.5 + 0.1 * r, 0.99))
    w.grad = Tensor(xp.ones(3) * (r + 1))
    adam.step()
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state[w]
    assert adam.param_groups[0]["lr"] == 0.1 and adam.param_groups[0]["betas"] == (0.5, 0.99), adam.param_groups
    assert type(state["step"]) is int and state["step"] == 1 and np.allclose(state["exp_avg"], 0.5), state
    fresh = optim.SGD([Tensor(xp.ones(2), requires_grad=True)], lr=0.5 + r, momentum=0.9)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)      # no state yet: initialised, then broadcast
    assert fresh.param_groups[0]["lr"] == 0.5 and len(fresh.state) == 1

    # -- scaling precision: half precision in float32, as Horovod ------------------------------------------------------
    # 5 * (1/3) rounds differently when the factor is first rounded to the array's own half precision
    half32 = float(np.float16(np.float32(5.0) * np.float32(1 / 3)))
    assert half32 != float(np.float16(5.0) * np.float16(1 / 3))  # so the check below can tell the two apart
    h = hvd.allreduce(xp.full(4, 5.0, np.float16), name="half", op=hvd.Sum, prescale_factor=1 / 3)
    assert h.dtype == np.float16 and h.tolist() == [half32 * n] * 4, (h, half32 * n)  # * 2 and * 4 are exact
    bf32 = float(ml_dtypes.bfloat16(np.float32(5 * n) / 3))
    assert bf32 != float(ml_dtypes.bfloat16(5 * n) * ml_dtypes.bfloat16(1 / 3))
    b = hvd.allreduce(xp.full(4, 5.0, ml_dtypes.bfloat16), name="bf16", op=hvd.Sum, postscale_factor=1 / 3)
    assert b.dtype == ml_dtypes.bfloat16 and float(b[0]) == bf32, (b, bf32)
    # Horovod's test_horovod_allreduce_prescale, threshold 0 up to 3 ranks: the input scaled as ScaleBuffer does
    # (float32 in float32 with the factor cast to float32, float16 in float32, integers in float64), times size.
    # Values from -100 to 100 as upstream, and near 30, where scaling float32 in float64 used to be one ulp off
    rng = np.random.default_rng(1234)
    for dtype, dim, spread in [(d, k, s) for d in ("int32", "int64", "float16", "float32", "float64")
                               for k in (1, 2, 3) for s in ("upstream", "near30")]:
        factor = float(rng.uniform())
        base = rng.integers(-100, 100, (17,) * dim) if spread == "upstream" else 30 + rng.uniform(-1, 1, (17,) * dim)
        tensor = base.astype(dtype)
        summed = hvd.allreduce(xp.asarray(tensor), name=f"prescale.{dtype}.{dim}.{spread}", op=hvd.Sum,
                               prescale_factor=factor)
        summed = summed if xp is np else summed.get()
        compute = {"int32": np.float64, "int64": np.float64, "float16": np.float32}.get(dtype, np.dtype(dtype).type)
        expected = (compute(factor) * tensor.astype(compute)).astype(dtype).astype(np.float64) * n
        gap = np.abs(summed.astype(np.float64) - expected).max()
        assert summed.dtype == tensor.dtype and gap <= (0 if n <= 3 else 1e-4 * np.abs(expected).max()), (dtype, gap)
    expect(NotImplementedError, lambda: hvd.allreduce(xp.ones(2), op=hvd.Adasum), "Adasum")
    # an op the dtype cannot take, on one rank: refused at once there; it used to reach the cycle thread and stop the
    # collectives of every rank
    if r == n - 1:
        expect(TypeError, lambda: hvd.allreduce(xp.ones(2, np.complex64), name="cmax", op=hvd.Max),
               "allreduce of 'cmax': op 'max' is undefined for complex numbers")
        expect(TypeError, lambda: hvd.grouped_allreduce([xp.ones(2, np.complex128)], name="gmin", op=hvd.Min),
               "allreduce of 'gmin.0': op 'min' is undefined for complex numbers")
        expect(TypeError, lambda: hvd.reducescatter(xp.ones((n, 2), np.complex64), name="rsmax", op=hvd.Max),
               "reducescatter of 'rsmax': op 'max'")
    assert hvd.allreduce(xp.ones(2, np.complex64), name="csum", op=hvd.Sum).tolist() == [n, n]

    # -- process sets: disjoint, overlapping, each with its own coordinator and cache --------------------------------
    evens = hvd.add_process_set(range(0, n, 2))
    odds = hvd.add_process_set(range(1, n, 2))
    low = hvd.add_process_set([0, 1])                    # overlaps both when n == 4
    assert evens.process_set_id != odds.process_set_id and evens.ranks == list(range(0, n, 2))
    mine_set, other_set = (evens, odds) if r % 2 == 0 else (odds, evens)
    assert mine_set.included() and not other_set.included() and mine_set.rank() == r // 2
    for step in range(3):
        out = hvd.allreduce(xp.ones(2) * r, name="ps.grad", op=hvd.Sum, process_set=mine_set)
        assert out.tolist() == [float(sum(k for k in mine_set.ranks))] * 2
        if r in low.ranks:
            lo = hvd.allreduce(xp.ones(1) * r, name="ps.grad", op=hvd.Sum, process_set=low)   # same name, other set
            assert lo.tolist() == [1.0]
    stats = hvd.stats(mine_set)
    assert stats["fast_path"] >= 2 and stats["cache_entries"] == 1, stats            # its own cache
    g = hvd.allgather(xp.array([r]), name="ps.gather", process_set=mine_set)
    assert g.tolist() == mine_set.ranks
    bc = hvd.broadcast(xp.array([r]), root_rank=mine_set.ranks[-1], name="ps.bcast", process_set=mine_set)
    assert bc.tolist() == [mine_set.ranks[-1]]
    grouped = hvd.grouped_allreduce([xp.ones(1) * r, xp.ones(2)], name="ps.group", op=hvd.Sum, process_set=mine_set)
    assert grouped[0].tolist() == [float(sum(mine_set.ranks))] and grouped[1].tolist() == [len(mine_set.ranks)] * 2
    expect(ValueError, lambda: hvd.allreduce(xp.ones(1), name="x", process_set=other_set), "not in process set")
    expect(ValueError, lambda: hvd.broadcast(xp.ones(1), root_rank=other_set.ranks[0], process_set=mine_set),
           "is not a rank of")
    hvd.remove_process_set(low)
    expect(ValueError, lambda: hvd.allreduce(xp.ones(1), process_set=low), "not registered")
    assert hvd.allreduce(xp.ones(1), name="world.after", op=hvd.Sum).tolist() == [n]
    hvd.remove_process_set(evens)  # the device run registers the same ranks again
    hvd.remove_process_set(odds)
    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {r}: alltoall, reducescatter, objects, parameters, precision, process sets on {device} OK",
          flush=True)

print(f"rank {r}: front OK impl={_backend.active_impl()}", flush=True)
hvd.shutdown()
