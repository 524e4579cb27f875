"""FSDP on one rank and piece by piece: the chunk rule, the sharded parameter, copy-in, copy-out and the
reduce-scatter's packing for several simulated ranks (both twins, numpy and the device stand-in, the memcpy path
and the casting path), torch's divide factors, mixed precision's clamping, the releasable storage, and
``fully_shard``'s API and errors. Several ranks: tests/test_fsdp_mpi.py."""
from __future__ import annotations

import copy
import tracemalloc

import numpy as np
import pytest

import distlab
from distlab import _backend, comm, nn, optim
from distlab._common.fsdp import BufferPool, chunk_rows, gradient_divide_factors, shard_rows
from distlab._common.fsdp_param import PARAM_STATE, ParamModuleInfo, sharded_array
from distlab._common.fsdp_param_group import GROUP_STATE
from distlab._common.fsdp_storage import UnshardedStorage
from distlab.fsdp import DeviceMesh, FSDPModule, MixedPrecisionPolicy, fully_shard


@pytest.fixture(autouse=True)
def _single_rank_world():
    assert comm.world().size == 1


@pytest.mark.parametrize("rows, world, expected", [
    (6, 4, [(0, 2), (2, 2), (4, 2), (6, 0)]),  # torch.chunk: 2, 2, 2 and an empty shard
    (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),
    (10, 4, [(0, 3), (3, 3), (6, 3), (9, 1)]),
    (3, 2, [(0, 2), (2, 1)]),
])
def test_torch_chunk_rule(rows, world, expected):
    assert [shard_rows(rows, world, r) for r in range(world)] == expected
    assert chunk_rows(rows, world) == max(n for _, n in expected)


def _param_on(xp, rows=7, cols=5, dtype=np.float32, seed=0):
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(dtype)
    layer = nn.Linear(cols, rows)
    layer.weight = nn.Parameter(xp.asarray(data))
    return layer, data


def _sharded(fsdp, xp, world, rows=7, cols=5, dtype=np.float32, policy=MixedPrecisionPolicy()):
    """Rank r's FSDPParam of one parameter, for every simulated rank r (a module each)."""
    out = []
    for r in range(world):
        layer, data = _param_on(xp, rows, cols, dtype, seed=rows)
        out.append(fsdp.FSDPParam(layer.weight, ParamModuleInfo(layer, "weight"), world, r, 0, policy, "weight"))
    return out, data


def test_the_sharded_parameter_is_a_view_of_the_padded_shard(fsdp, xp):
    params, data = _sharded(fsdp, xp, 4)
    for r, p in enumerate(params):
        first, length = shard_rows(7, 4, r)
        layer = p.module_info.places[0][0]
        assert layer.weight is p.sharded_param and layer._parameters["weight"] is p.sharded_param
        assert p.sharded_param.global_shape == (7, 5) and p.sharded_param.offsets == (first, 0)
        assert p.sharded_param_data.size == 2 * 5  # every rank holds ceil(7 / 4) rows
        padded = distlab.autograd.to_numpy(p.sharded_param_data).reshape(2, 5)
        assert np.array_equal(padded[:length], data[first:first + length]) and not padded[length:].any()
        block = sharded_array(p)
        assert block.global_shape == (7, 5) and block.offsets == (first, 0) and block.sizes == (length, 5)
        assert block.local is p.sharded_param.data


def test_both_twins_keep_the_shared_state_by_name(fsdp, xp):
    # the shared functions of distlab._common read a parameter and a group by these names only
    params, _ = _sharded(fsdp, xp, 2)
    p = params[1]
    missing = [name for name in PARAM_STATE if not hasattr(p, name)]
    assert missing == [] and (p.shard_rank, p.shard_offset, p.sharded_size, p.fqn) == (1, 4, (3, 5), "weight")
    group = fsdp.FSDPParamGroup([p], (p.module_info.places[0][0],), fsdp.MeshInfo(comm.world()), None,
                                MixedPrecisionPolicy(), "block")
    missing = [name for name in GROUP_STATE if not hasattr(group, name)]
    assert missing == [] and group.module_fqn == "block" and group.reduce_grads and group.storage is None


def _gather(fsdp, xp, per_rank, dtype, pool):
    """What W ranks' all-gather leaves every rank (the stacked flat inputs of ``per_rank``, each rank's list of
    parameters), then rank 0's copy-out into its parameters."""
    rows = []
    for params in per_rank:
        flat = pool.take(xp, dtype, sum(p.all_gather_input_numel() for p in params))
        fsdp.all_gather_copy_in(params, flat)
        rows.append(distlab.autograd.to_numpy(flat).copy())
        pool.give_back(flat)
    gathered = xp.asarray(np.stack(rows))
    targets = per_rank[0]
    for p in targets:
        p.set_all_gather_output(xp.empty(p.unsharded_numel, dtype=dtype), 0)
    result = distlab._common.fsdp.AllGatherResult(gathered, gathered.reshape(-1), xp.empty(0, dtype=dtype), None,
                                                  [p.all_gather_input_numel() for p in targets], len(per_rank))
    fsdp.foreach_all_gather_copy_out(result, targets, pool)
    for p in targets:
        p.init_unsharded_param()
    return targets


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("dtype, param_dtype", [(np.float32, None), (np.float32, np.float16), (np.float64, None)])
def test_copy_in_all_gather_copy_out_rebuild_the_parameters(fsdp, xp, world, dtype, param_dtype):
    # two parameters per group (the second at an offset), the same-dtype path (memcpy in the core on numpy) and the
    # casting path (mixed precision) alike
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    first, data = _sharded(fsdp, xp, world, dtype=dtype, policy=policy)
    second, other = _sharded(fsdp, xp, world, rows=3, cols=4, dtype=dtype, policy=policy)
    targets = _gather(fsdp, xp, [[a, b] for a, b in zip(first, second)], param_dtype or dtype, BufferPool())
    for target, expected in zip(targets, (data, other)):
        whole = distlab.autograd.to_numpy(target.unsharded_param.data)
        assert whole.dtype == (param_dtype or dtype) and np.array_equal(whole, expected.astype(param_dtype or dtype))


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("grad_dtype, reduce_dtype", [(np.float32, np.float32), (np.float16, np.float32)])
def test_reduce_scatter_copy_in_chunks_gradients_into_rank_rows(fsdp, xp, world, grad_dtype, reduce_dtype):
    first, _ = _sharded(fsdp, xp, world, rows=7, cols=5)
    second, _ = _sharded(fsdp, xp, world, rows=3, cols=2)
    params = [first[0], second[0]]
    grads = [np.arange(35, dtype=grad_dtype).reshape(7, 5) + 1, np.arange(6, dtype=grad_dtype).reshape(3, 2) + 1]
    total = sum(p.padded_sharded_numel for p in params)
    packed = xp.full((world, total), np.nan, dtype=reduce_dtype)  # the padding must be written, not found
    fsdp.foreach_reduce_scatter_copy_in(params, [xp.asarray(g) for g in grads], packed)
    packed = distlab.autograd.to_numpy(packed)
    for r in range(world):
        expected = []
        for p, g in zip(params, grads):
            padded = np.zeros((p.chunk * world,) + g.shape[1:], dtype=reduce_dtype)
            padded[:g.shape[0]] = g
            expected.append(padded[r * p.chunk:(r + 1) * p.chunk].reshape(-1))
        assert np.array_equal(packed[r], np.concatenate(expected)), r


def test_one_rank_reduction_delivers_the_gradient(fsdp, xp):
    params, _ = _sharded(fsdp, xp, 1)
    grad = xp.asarray(np.full((7, 5), 2.0, dtype=np.float32))
    state = fsdp.foreach_reduce(params, [grad], comm.world(), np.dtype(np.float32), None, xp, None, None, True, "w")
    fsdp.finish_reduce(state)
    assert np.array_equal(distlab.autograd.to_numpy(params[0].sharded_param.grad.data), np.full((7, 5), 2.0))
    state = fsdp.foreach_reduce(params, [grad], comm.world(), np.dtype(np.float32), None, xp, None, None, True, "w")
    fsdp.finish_reduce(state)  # a second gradient adds to the first
    assert np.array_equal(distlab.autograd.to_numpy(params[0].sharded_param.grad.data), np.full((7, 5), 4.0))


@pytest.mark.parametrize("dtype, shard, replicate, factor, expected", [
    (np.float32, 4, 1, None, (None, None, "avg", "avg")),
    (np.float32, 1, 1, None, (None, None, "sum", "sum")),
    (np.float32, 4, 1, 4, (None, None, "avg", "sum")),
    (np.float32, 4, 1, 3, (("premul", 1 / 3), None, "sum", "sum")),
    ("bfloat16", 2, 2, None, (None, None, "avg", "avg")),
    (np.float16, 2, 1, None, (2.0, 1.0, "sum", "sum")),  # pre- and post-divide, about sqrt(N) each
    (np.float16, 4, 1, None, (2.0, 2.0, "sum", "sum")),
    (np.float16, 4, 2, None, (4.0, 2.0, "sum", "sum")),
    (np.float64, 3, 1, None, (None, 3.0, "sum", "sum")),
])
def test_torch_gradient_divide_factors(dtype, shard, replicate, factor, expected):
    dtype = distlab._common.fsdp.resolve_dtype(dtype)
    assert gradient_divide_factors(dtype, shard, replicate, factor) == expected


def test_mixed_precision_is_clamped_as_torch_clamps_it():
    policy = MixedPrecisionPolicy(param_dtype=np.float16, reduce_dtype=np.float16)
    assert policy.clamped(np.float32) == (np.float16, None)  # reduce_dtype == param_dtype: no cast
    assert policy.clamped(np.float16) == (None, None)  # param_dtype == the parameter's
    assert policy.clamped(np.int64) == (None, None)  # not floating point
    assert MixedPrecisionPolicy(param_dtype="bfloat16").param_dtype.name == "bfloat16"
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs=1)


@pytest.mark.parametrize("release", ["lazy", "eager"])
def test_host_storage_is_released_and_taken_back_at_the_same_address(release):
    storage = UnshardedStorage(np, np.float32, 1 << 20, release)
    view = storage.flat[10:20]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert storage.alloc() is False  # the same array: views stay
        held = tracemalloc.get_traced_memory()[0]
        view[...] = 7.0
        storage.free()
        released = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held - before >= 4 << 20 and released - before < 4096  # tracemalloc sees it as numpy memory
    if release == "eager":
        assert not view.any()  # the pages went back to the kernel at once: zeros
    storage.alloc()
    view[...] = 3.0
    assert (storage.flat[10:20] == 3.0).all()


def test_device_storage_is_a_new_array_after_each_release():
    from distlab import fakegpu

    storage = UnshardedStorage(fakegpu, np.float32, 100)
    assert storage.alloc() is True and storage.generation == 1
    storage.free()
    assert storage.flat is None
    assert storage.alloc() is True and storage.generation == 2


# -- fully_shard on one rank ------------------------------------------------------------------------------------------
def _net(device="cpu"):
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    return net.to(device)


def test_one_rank_training_equals_the_local_model_bit_for_bit(impl, xp):
    device = "cpu" if xp is np else "cuda"
    local, model = _net(device), _net(device)
    fully_shard(model[0], impl=impl)
    fully_shard(model[2], impl=impl, reshard_after_forward=False)
    fully_shard(model, impl=impl)
    assert type(model).__name__ == "FSDPSequential" and isinstance(model, nn.Sequential)
    assert isinstance(model, FSDPModule) and isinstance(model, distlab.join.Joinable)
    opts = optim.Adam(local.parameters(), lr=0.01), optim.Adam(model.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = distlab.tensor(xp.asarray(rng.standard_normal((3, 4)).astype(np.float32)))
        for net, opt in zip((local, model), opts):
            opt.zero_grad()
            (net(x) ** 2).mean().backward()
            opt.step()
    for a, b in zip(local.parameters(), model.parameters()):
        assert np.array_equal(distlab.autograd.to_numpy(a.data), distlab.autograd.to_numpy(b.data))


def test_unshard_reshard_and_the_options(impl):
    model = _net()
    fully_shard(model[2], impl=impl)
    fully_shard(model, impl=impl)
    assert model.unshard() is None
    assert model[4].weight.shape == (2, 5) and "_fsdp_param" in model[4].weight.__dict__
    handle = model[2].unshard(async_op=True)
    handle.wait()
    model.reshard()
    model[2].reshard()
    assert model[4].weight is model[4].weight.__dict__["_fsdp_param"].sharded_param
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False, recurse=False)
    model.set_gradient_divide_factor(3.0)
    groups = {m: m._get_fsdp_state().param_group for m in (model, model[2])}
    assert all(not g.reduce_grads and g.gradient_divide_factor == 3.0 for g in groups.values())
    assert not groups[model].reshard_after_backward and groups[model[2]].reshard_after_backward
    model.set_reshard_after_forward(False)
    assert all(g.post_forward_group is None for g in groups.values())
    with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
        model.set_reshard_after_forward(1)
    model.set_modules_to_backward_prefetch([model[2]])
    with pytest.raises(ValueError, match="Expects FSDPModule"):
        model.set_modules_to_forward_prefetch([model[0]])


def test_state_dict_gives_shards_and_loads_both_forms(impl):
    model, plain = _net(), _net()
    fully_shard(model, impl=impl)
    state = model.state_dict()
    assert set(state) == set(plain.state_dict())
    assert all(isinstance(v, distlab.ShardedArray) and v.offsets[0] == 0 for v in state.values())
    other = _net()
    for p in other.parameters():
        p.data[...] = 1.5
    model.load_state_dict(other.state_dict())  # whole arrays (as DDP saves them)
    assert all((p.data == 1.5).all() for p in model.parameters())
    model.load_state_dict(state)  # shards (the same arrays: no change)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict({**other.state_dict(), "0.weight": np.zeros((2, 2), np.float32)})
    moved = distlab.ShardedArray(np.zeros((1, 4), np.float32), (6, 4), (1, 0))
    with pytest.raises(RuntimeError, match="not this rank's block"):
        model.load_state_dict({**other.state_dict(), "0.weight": moved})


# -- errors, in torch's words ----------------------------------------------------------------------------------------
def test_applied_twice_container_scalar_and_noncontiguous_parameters(impl):
    model = _net()
    fully_shard(model, impl=impl)
    with pytest.raises(RuntimeError, match="can only be applied to a module once"):
        fully_shard(model, impl=impl)
    with pytest.raises(ValueError, match="containers that do not implement forward"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), impl=impl)
    with pytest.raises(ValueError, match="expects a distlab.nn.Module"):
        fully_shard(object(), impl=impl)
    layer = nn.Linear(2, 2)
    layer.scale = nn.Parameter(np.float32(2.0))
    with pytest.raises(ValueError, match="scalar"):
        fully_shard(layer, impl=impl)
    layer = nn.Linear(3, 2)
    layer.weight = nn.Parameter(np.ones((3, 2), np.float32).T)
    with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
        fully_shard(layer, impl=impl)
    with pytest.raises(AssertionError, match="does not support deepcopy. Please use state dict"):
        copy.deepcopy(model)


def test_bad_options(impl):
    with pytest.raises(ValueError, match="should be a factor of 1, not 2"):
        fully_shard(_net(), reshard_after_forward=2, impl=impl)
    with pytest.raises(ValueError, match="should be a bool or an int"):
        fully_shard(_net(), reshard_after_forward="yes", impl=impl)
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        fully_shard(_net(), mp_policy=np.float16, impl=impl)
    with pytest.raises(TypeError, match="ProcessGroup or a DeviceMesh"):
        fully_shard(_net(), group="world", impl=impl)
    with pytest.raises(ValueError, match="expects a 1D or 2D DeviceMesh"):
        fully_shard(_net(), group=DeviceMesh((1, 1, 1)), impl=impl)
    with pytest.raises(ValueError, match="needs 2 ranks"):
        DeviceMesh((2, 1))
    mixed = _net()
    mixed[0].weight = nn.Parameter(np.zeros((6, 4), np.float64))
    with pytest.raises(AssertionError, match="uniform original parameter dtype"):
        fully_shard(mixed[0], impl=impl)


def test_a_parameter_shared_by_two_groups(impl):
    block, other = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    other.extra = block[0]  # one Linear reachable from two groups
    fully_shard(block, impl=impl)
    with pytest.raises(ValueError, match="is shared with a parameter already managed by another FSDP group"):
        fully_shard(other, impl=impl)
    model = _net()
    model[0].extra = model[4]  # a sharded module inside another group's subtree stays its own group (torch's)
    fully_shard(model[4], impl=impl)
    fully_shard(model[0], impl=impl)
    shared = nn.Parameter(np.zeros((6, 4), np.float32))
    first, second = nn.Linear(4, 6), nn.Linear(4, 6)
    first.weight = second.weight = shared  # the original object in two modules
    fully_shard(first, impl=impl)
    with pytest.raises(ValueError, match="Parameter 'weight' is shared with a parameter already managed"):
        fully_shard(second, impl=impl)
    both = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    both[1].weight = nn.Parameter(np.zeros((4, 6), np.float32))
    both[0].weight = nn.Parameter(np.zeros((6, 4), np.float32))
    fully_shard([both[0], both[1]], impl=impl)  # one group holding both is fine


def test_forward_hooks_can_be_prepended():
    layer, calls = nn.Linear(2, 2), []
    handle = layer.register_forward_pre_hook(lambda m, args: calls.append("late"))
    layer.register_forward_pre_hook(lambda m, args: calls.append("first"), prepend=True)
    layer.register_forward_hook(lambda m, args, out: calls.append("after"))
    layer.register_forward_hook(lambda m, args, out: calls.append("before"), prepend=True)
    layer(distlab.tensor(np.ones((1, 2), np.float32)))
    assert calls == ["first", "late", "before", "after"]
    handle.remove()  # a handle made before the prepend still removes its hook
    calls.clear()
    layer(distlab.tensor(np.ones((1, 2), np.float32)))
    assert calls == ["first", "before", "after"]


def test_the_twin_registry_and_facade(fsdp):
    assert _backend.load("fsdp").__name__.endswith(("reference.fsdp_param_group", "core._fsdp_param_group"))
    assert set(fsdp.__all__) >= {"FSDPParam", "FSDPParamGroup", "foreach_all_gather", "foreach_reduce"}
    assert distlab.fully_shard is fully_shard


def test_one_device_per_group_and_a_single_root(impl):
    from distlab import fakegpu

    layer = nn.Linear(3, 2)
    layer.bias = nn.Parameter(fakegpu.asarray(np.zeros(2, np.float32)))  # the weight on the host, the bias not
    with pytest.raises(AssertionError, match="one device"):
        fully_shard(layer, impl=impl)
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    fully_shard([first, second], impl=impl)
    with pytest.raises(RuntimeError, match="requires a single root module"):
        first(distlab.tensor(np.ones((1, 2), np.float32)))
    model = _net()
    fully_shard(model[0], impl=impl)
    fully_shard(model, impl=impl)
    model[0](distlab.tensor(np.ones((1, 4), np.float32)))  # the block ran forward on its own first
    with pytest.raises(RuntimeError, match="requires running forward through the root module first"):
        model(distlab.tensor(np.ones((1, 4), np.float32)))
