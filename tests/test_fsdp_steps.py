"""FSDP's per-step pieces on one process, several ranks simulated: a parameter's moves between its shard, its
post-forward piece and its unsharded form, gradient accumulation without synchronisation, a group's unshard and
reshard over a stand-in process group of several ranks, the reduce-scatter's calls, and the order of a step's
group calls (what a joined rank replays). Both twins, numpy and the device stand-in. Real ranks:
tests/test_fsdp_mpi.py."""
from __future__ import annotations

import numpy as np
import pytest

import distlab
from distlab import comm, nn
from distlab._common.fsdp import ShardedState, TrainingState
from distlab._common.fsdp_param import ParamModuleInfo
from distlab.autograd import Tensor, to_numpy
from distlab.fsdp import MixedPrecisionPolicy, fully_shard


@pytest.fixture(autouse=True)
def _single_rank_world():
    assert comm.world().size == 1


class Work:
    """A finished request: what an asynchronous collective of the stand-in group returns."""

    def wait(self):
        pass


class Ranks:
    """A process group of ``size`` simulated ranks, this process being ``rank``: its all-gather gives ``rows`` (what
    every rank contributes), its reduce-scatter this rank's row of the input as if the others sent zeros, its
    all-reduce leaves the array as it is; each call is recorded as ``(op, name, async_op, elements, reduce op)``."""

    def __init__(self, size, rank=0, rows=None):
        self.size, self.rank, self.rows, self.calls = size, rank, rows, []

    def allgather(self, array, out=None, async_op=False, name=None):
        self.calls.append(("allgather", name, async_op, array.size, None))
        self.sent = array
        out[...] = self.rows
        return Work() if async_op else None

    def reduce_scatter(self, output, input, op="sum", async_op=False, name=None):  # noqa: A002 - comm's signature
        self.calls.append(("reduce_scatter", name, async_op, input.size, op))
        output[...] = input.reshape(self.size, -1)[self.rank]
        return Work() if async_op else None

    def allreduce(self, array, op="sum", async_op=False, name=None):
        self.calls.append(("allreduce", name, async_op, array.size, op))
        return Work() if async_op else None


class Holder(nn.Module):
    """A module holding one parameter."""

    def __init__(self, data):
        super().__init__()
        self.weight = nn.Parameter(data)


def _params(fsdp, xp, world, post_forward=0, rows=7, cols=5, policy=MixedPrecisionPolicy()):
    """Every simulated rank's FSDPParam of one ``rows x cols`` parameter (a module's each), and the data."""
    data = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1
    out = []
    for r in range(world):
        layer = Holder(xp.asarray(data))
        out.append(fsdp.FSDPParam(layer.weight, ParamModuleInfo(layer, "weight"), world, r, post_forward, policy,
                                  "weight"))
    return out, data


def _rows(xp, per_rank):
    """What an all-gather of each rank's all-gather input gives: one row per rank."""
    return xp.asarray(np.stack([to_numpy(p.all_gather_input()) for p in per_rank]))


def test_the_post_forward_piece_is_the_ranks_slice_of_the_unsharded_data(fsdp, xp):
    # reshard_after_forward=2 over 4 ranks: rank 1 keeps the second half of the padded unsharded rows, and its
    # next all-gather (over its 2-rank group) sends that piece
    params, data = _params(fsdp, xp, 4, post_forward=2)
    p = params[1]
    padded = np.zeros((8, 5), np.float32)
    padded[:7] = data
    p.set_all_gather_output(xp.asarray(padded.reshape(-1)), 0)
    p.init_unsharded_param()
    p.to_sharded_post_forward()
    assert p.sharded_state == ShardedState.SHARDED_POST_FORWARD and p.module_info.places[0][0].weight is \
        p.sharded_param
    assert p.all_gather_input_numel() == 20
    assert np.array_equal(to_numpy(p.all_gather_input()), padded[4:].reshape(-1))
    p.to_unsharded()
    assert p.module_info.places[0][0].weight is p.unsharded_param
    assert np.array_equal(to_numpy(p.all_gather_input()), to_numpy(p.sharded_param_data))  # the shard again


def test_unsynchronised_gradients_accumulate_in_the_reduce_dtype(fsdp, xp):
    # set_requires_gradient_sync(False) under mixed precision: float16 gradients are summed in float32 over the
    # microbatches, and the sum is what the next reduction takes
    policy = MixedPrecisionPolicy(param_dtype=np.float16, reduce_dtype=np.float32)
    (p,), _ = _params(fsdp, xp, 1, policy=policy)
    p.set_all_gather_output(xp.zeros(p.unsharded_numel, dtype=np.float16), 0)
    p.init_unsharded_param()
    assert p.unsharded_grad_data() is None and p.take_unsharded_grad() is None
    p.to_accumulated_grad_if_needed()  # no gradient yet: nothing to move
    assert p.unsharded_accumulated_grad is None
    first = xp.full((7, 5), 0.5, dtype=np.float16)
    p.unsharded_param.grad = Tensor(first)
    assert p.unsharded_grad_data() is first
    p.to_accumulated_grad_if_needed()
    held = p.unsharded_accumulated_grad
    assert held.dtype == np.float32 and p.unsharded_param.grad is None
    p.accumulate_unsharded_grad_if_needed()  # no new gradient: nothing added
    p.unsharded_param.grad = Tensor(xp.full((7, 5), 0.25, dtype=np.float16))
    p.accumulate_unsharded_grad_if_needed()
    assert p.unsharded_param.grad is None and np.array_equal(to_numpy(held), np.full((7, 5), 0.75, np.float32))
    assert p.take_unsharded_grad() is held and p.unsharded_accumulated_grad is None
    assert p.take_unsharded_grad() is None


def test_without_a_reduce_dtype_the_gradient_stays_where_it_is(fsdp, xp):
    (p,), _ = _params(fsdp, xp, 1)
    p.set_all_gather_output(xp.zeros(p.unsharded_numel, dtype=np.float32), 0)
    p.init_unsharded_param()
    grad = xp.ones((7, 5), dtype=np.float32)
    p.unsharded_param.grad = Tensor(grad)
    p.to_accumulated_grad_if_needed()
    assert p.unsharded_accumulated_grad is None and p.unsharded_grad_data() is grad
    assert p.take_unsharded_grad() is grad and p.unsharded_param.grad is None


def test_a_group_unshards_once_over_its_ranks_and_reshards(fsdp, xp):
    # one parameter on rank 1 of 4: one all-gather (named after the group) gives the whole parameter, registered on
    # the module; asking again while unsharded gathers nothing; after forward it is resharded (ZeRO-3)
    params, data = _params(fsdp, xp, 4)
    ranks = Ranks(4, 1, _rows(xp, params))
    p = params[1]
    module = p.module_info.places[0][0]
    group = fsdp.FSDPParamGroup([p], (module,), fsdp.MeshInfo(ranks), ranks, MixedPrecisionPolicy(), "block")
    group.unshard()
    group.wait_for_unshard()
    assert ranks.calls == [("allgather", "fsdp all-gather block", False, 10, None)]
    assert module.weight is p.unsharded_param and np.array_equal(to_numpy(module.weight.data), data)
    assert group.sharded_state == ShardedState.UNSHARDED
    group.unshard()
    group.wait_for_unshard()
    assert len(ranks.calls) == 1
    group.training_state = TrainingState.FORWARD
    group.reshard()
    assert group.sharded_state == ShardedState.SHARDED and module.weight is p.sharded_param
    group.prefetch_unshard("forward")  # asynchronous, and the group's state is left as it was
    assert ranks.calls[1] == ("allgather", "fsdp all-gather block", True, 10, None)
    assert group.training_state == TrainingState.FORWARD
    group.wait_for_unshard()
    assert module.weight is p.unsharded_param


@pytest.mark.parametrize("param_dtype", [None, np.float16])
def test_the_all_gather_sends_the_groups_packed_shards_as_they_are(fsdp, xp, param_dtype):
    # the group keeps its parameters' padded shards one after the other in one buffer, of which the sharded
    # parameters (what the optimizer steps) are views: the all-gather sends that buffer, with no copy-in; under
    # mixed precision the shards are cast into a buffer of param_dtype first
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    first, data = _params(fsdp, xp, 2, policy=policy)
    second, other = _params(fsdp, xp, 2, rows=3, cols=2, policy=policy)
    dtype = param_dtype or np.float32
    rows = xp.asarray(np.stack([np.concatenate([to_numpy(a.sharded_param_data), to_numpy(b.sharded_param_data)])
                                for a, b in zip(first, second)]).astype(dtype))
    ranks = Ranks(2, 0, rows)
    params = [first[0], second[0]]
    modules = tuple(p.module_info.places[0][0] for p in params)
    group = fsdp.FSDPParamGroup(params, modules, fsdp.MeshInfo(ranks), ranks, policy, "g")
    if param_dtype is not None:
        assert group.sharded_flat is None
    else:
        packed = to_numpy(group.sharded_flat)
        assert np.array_equal(packed, to_numpy(rows[0]))
        params[1].sharded_param.data[...] = 9  # stepped in place: the buffer is what the parameter holds
        flat = to_numpy(group.sharded_flat)
        assert np.all(flat[20:24] == 9) and np.array_equal(flat[:20], packed[:20])
        params[1].sharded_param.data[...] = xp.asarray(other[:2])
    group.unshard()
    assert (ranks.sent is group.sharded_flat) == (param_dtype is None) and ranks.sent.dtype == dtype
    group.wait_for_unshard()
    for p, expected in zip(params, (data, other)):
        assert np.array_equal(to_numpy(p.unsharded_param.data), expected.astype(dtype))


def test_reshard_after_forward_k_keeps_a_piece_and_gathers_it_over_k_ranks(fsdp, xp):
    params, data = _params(fsdp, xp, 4, post_forward=2)
    shard_ranks = Ranks(4, 1, _rows(xp, params))
    pair = Ranks(2, 1)
    p = params[1]
    module = p.module_info.places[0][0]
    group = fsdp.FSDPParamGroup([p], (module,), fsdp.MeshInfo(shard_ranks), pair, MixedPrecisionPolicy(), "block")
    group.training_state = TrainingState.FORWARD
    group.unshard()
    group.wait_for_unshard()
    group.reshard()
    assert group.sharded_state == ShardedState.SHARDED_POST_FORWARD and module.weight is p.sharded_param
    padded = np.zeros((8, 5), np.float32)
    padded[:7] = data
    pair.rows = xp.asarray(padded.reshape(2, 20))  # what the pair's pieces are
    group.training_state = TrainingState.PRE_BACKWARD
    group.unshard()
    group.wait_for_unshard()
    assert pair.calls == [("allgather", "fsdp all-gather block", False, 20, None)]
    assert np.array_equal(to_numpy(module.weight.data), data) and len(shard_ranks.calls) == 1
    group.reshard()  # in backward: all the way back to the shard
    assert group.sharded_state == ShardedState.SHARDED


@pytest.mark.parametrize("world", [1, 2])
def test_the_reduce_scatter_is_issued_over_more_than_one_rank_only(fsdp, xp, world):
    params, _ = _params(fsdp, xp, world)
    ranks = Ranks(world, 0)
    grad = xp.asarray(np.full((7, 5), 2.0, np.float32))
    state = fsdp.foreach_reduce(params[:1], [grad], ranks, np.dtype(np.float32), None, xp, None, None, True, "w")
    fsdp.finish_reduce(state)
    expected = [] if world == 1 else [("reduce_scatter", "fsdp reduce-scatter w", True, 8 * 5, "avg")]
    assert ranks.calls == expected
    rows = params[0].shard_length
    assert np.array_equal(to_numpy(params[0].sharded_param.grad.data), np.full((rows, 5), 2.0))


def test_hybrid_sharding_all_reduces_the_shard_among_replicas_when_asked(fsdp, xp):
    params, _ = _params(fsdp, xp, 2)
    for all_reduce_grads, expected in ((True, 1), (False, 0)):
        shard, replicas = Ranks(2, 0), Ranks(2, 0)
        grad = xp.asarray(np.ones((7, 5), np.float32))
        state = fsdp.foreach_reduce(params[:1], [grad], shard, np.dtype(np.float32), None, xp, None, replicas,
                                    all_reduce_grads, "w")
        fsdp.wait_reduce_scatter(state)
        fsdp.wait_reduce_scatter(state)  # once issued, not again
        fsdp.finish_reduce(state)
        assert replicas.calls == [("allreduce", "fsdp all-reduce w", True, 4 * 5, "avg")] * expected
        params[0].sharded_param.grad = None


def _blocks(impl, frozen_bias=False):
    distlab.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    if frozen_bias:
        net[0][0].bias.requires_grad_(False)
    for block in net:
        fully_shard(block, impl=impl)
    return fully_shard(net, impl=impl)


def _program(net):
    state = net._get_fsdp_state()
    names = {id(g): g.module_fqn for g in state.groups()}
    return [(names[id(g)], event, argument) for g, event, argument in state.comm_ctx.program]


def test_a_steps_group_calls_come_in_torchs_order(impl):
    # what a joined rank replays: each block's post-backward as soon as its input's gradient arrives (before the
    # previous block's pre-backward), the previous block prefetched in backward, and from the second iteration on
    # the next block prefetched in forward; the mask says which parameters had a gradient
    net = _blocks(impl, frozen_bias=True)
    x = distlab.tensor(np.ones((2, 4), np.float32), requires_grad=True)
    for _ in range(2):
        net(x).sum().backward()
    assert _program(net) == [
        ("0", "pre_forward", None), ("1", "prefetch", "forward"), ("0", "post_forward", None),
        ("1", "pre_forward", None), ("1", "post_forward", None),
        ("1", "pre_backward", True), ("0", "prefetch", "backward"), ("1", "post_backward", (True, True)),
        ("0", "pre_backward", True), ("0", "post_backward", (True, False)),
        ("0", "finalize", None), ("1", "finalize", None)]


@pytest.mark.parametrize("shape", [(5, 3), (3, 0)])
def test_the_reduce_scatter_packs_a_partial_chunk_then_zero_rows(fsdp, xp, shape):
    # 5 rows over 4 ranks: chunks of 2, 2, 1 (and a padding row) and an empty one; a parameter with no elements
    # packs nothing; a second parameter after it lands at its own offset
    (first, *_), _ = _params(fsdp, xp, 4, rows=shape[0], cols=shape[1])
    (second, *_), _ = _params(fsdp, xp, 4, rows=2, cols=1)
    params = [first, second]
    grads = [np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1, np.array([[7.0], [8.0]], np.float32)]
    total = sum(p.padded_sharded_numel for p in params)
    packed = xp.full((4, total), np.nan, dtype=np.float32)
    fsdp.foreach_reduce_scatter_copy_in(params, [xp.asarray(g) for g in grads], packed)
    expected = []
    for p, g in zip(params, grads):
        padded = np.zeros((p.chunk * 4,) + g.shape[1:], np.float32)
        padded[:g.shape[0]] = g
        expected.append(padded.reshape(4, -1))
    assert np.array_equal(to_numpy(packed), np.concatenate(expected, axis=1))


def test_float16_gradients_are_divided_before_and_after_the_sum_as_torch_does(fsdp, xp):
    # 2 ranks without replicas: torch's factors for float16 are a pre-divide by 2 and a post-divide by 1 (the sum
    # in float16 must not overflow); the stand-in's other rank sends zeros, so a gradient of ones arrives halved
    params, _ = _params(fsdp, xp, 2)
    ranks = Ranks(2, 0)
    grad = xp.asarray(np.ones((7, 5), np.float32))
    state = fsdp.foreach_reduce(params[:1], [grad], ranks, np.dtype(np.float32), np.dtype(np.float16), xp, None,
                                None, True, "w")
    fsdp.finish_reduce(state)
    assert ranks.calls == [("reduce_scatter", "fsdp reduce-scatter w", True, 8 * 5, "sum")]
    got = params[0].sharded_param.grad.data
    assert got.dtype == np.float32 and np.array_equal(to_numpy(got), np.full((4, 5), 0.5, np.float32))


def test_a_prefetch_that_backward_never_used_gives_its_buffer_back(fsdp, xp):
    params, _ = _params(fsdp, xp, 2)
    ranks = Ranks(2, 0, _rows(xp, params))
    p = params[0]
    group = fsdp.FSDPParamGroup([p], (p.module_info.places[0][0],), fsdp.MeshInfo(ranks), ranks,
                                MixedPrecisionPolicy(), "g")
    group.prefetch_unshard("backward")
    group.finalize_backward()  # the all-gather completes, and the pool has its buffer free again
    pool = group.comm_ctx.all_gather_pool
    held = pool.nbytes()
    pool.take(xp, np.float32, 2 * p.padded_sharded_numel)
    assert held > 0 and pool.nbytes() == held and group.sharded_state == ShardedState.SHARDED
