"""The reducer and DistributedDataParallel in one process (world size 1): behaviour and every error path.

Several ranks are covered by tests/test_ddp_mpi.py; here the collectives are trivial, so each test isolates the
reducer's own bookkeeping. Every test runs on both twins.
"""
import numpy as np
import pytest

import distlab
from distlab import comm, nn, optim
from distlab.autograd import to_numpy
from distlab.ddp import DistributedDataParallel as DDP
from distlab.ddp_comm_hooks import allreduce_hook, noop_hook
from distlab.futures import Future


class TwoBranch(nn.Module):
    """fc1 always used; fc2 only when asked (an unused parameter otherwise); on ``xp``'s device."""

    def __init__(self, xp=np):
        super().__init__()
        self.fc1 = nn.Linear(4, 3, seed=1)
        self.fc2 = nn.Linear(3, 3, seed=2)
        if xp is not np:
            self.to("cuda")  # the xp fixture made "cuda" mean the stand-in

    def forward(self, x, use_fc2=True, twice=False):
        h = self.fc1(x)
        if use_fc2:
            h = self.fc2(h)
            if twice:
                h = self.fc2(h)
        return h.sum()


def x(xp=np):
    return distlab.tensor(xp.ones((2, 4), dtype=np.float32))


@pytest.fixture
def group():
    return comm.world()


def test_ddp_step_matches_plain_step(impl, xp):
    plain, wrapped = TwoBranch(xp), DDP(TwoBranch(xp), impl=impl)
    plain(x(xp)).backward()
    wrapped(x(xp)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.module.named_parameters()):
        assert np.array_equal(a.grad.data, b.grad.data), name
    data = wrapped.reducer.get_logging_data()
    assert data["num_parameters"] == 4 and data["world_size"] == 1 and data["impl"] == impl


def test_buckets_are_rebuilt_once_in_arrival_order(impl, xp):
    model = DDP(TwoBranch(xp), bucket_cap_mb=8 / 2**20, impl=impl)  # 8 bytes: one parameter per bucket
    before = [b.parameters() for b in model.reducer.get_grad_buckets()]
    assert len(before) == 4
    assert model.reducer.get_logging_data()["bucket_indices"] == [[3], [2], [1], [0]]  # reversed registration
    arrivals = []
    for i, p in enumerate(model.module.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: arrivals.append(i))
    for _ in range(3):
        model(x(xp)).backward()
    assert model.reducer.has_rebuilt_bucket
    after = model.reducer.get_logging_data()["bucket_indices"]
    assert after == [[i] for i in arrivals[:4]]  # arrival order; caps stay at 8 bytes on rebuild
    assert arrivals[:2] in ([2, 3], [3, 2])  # fc2's gradients arrive before fc1's


def test_gradient_as_bucket_view(impl, xp):
    model = DDP(TwoBranch(xp), gradient_as_bucket_view=True, impl=impl)
    plain = TwoBranch(xp)
    for _ in range(2):
        model(x(xp)).backward()
        plain(x(xp)).backward()
    buffers = [b.buffer() for b in model.reducer.get_grad_buckets()]
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        assert any(np.shares_memory(p.grad.data, buf) for buf in buffers), name
        assert np.allclose(p.grad.data, q.grad.data), name


@pytest.mark.parametrize("mode", ["find_unused_parameters", "static_graph"])
def test_gradient_as_bucket_view_leaves_a_globally_unused_parameter_without_grad(impl, mode, xp):
    """As torch: a grad becomes a bucket view when first reduced; an unused parameter keeps None (no zero grad
    that weight decay would then move)."""
    model = DDP(TwoBranch(xp), gradient_as_bucket_view=True, impl=impl, **{mode: True})
    assert all(p.grad is None for p in model.parameters())  # construction gives no parameter a grad
    opt = optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    before = model.module.fc2.weight.data.copy()
    for _ in range(3):
        opt.zero_grad()
        model(x(xp), use_fc2=False).backward()
        assert model.module.fc2.weight.grad is None and model.module.fc2.bias.grad is None
        assert model.module.fc1.weight.grad is not None
        opt.step()
    assert np.array_equal(model.module.fc2.weight.data, before)
    buffers = [b.buffer() for b in model.reducer.get_grad_buckets()]
    assert any(np.shares_memory(model.module.fc1.weight.grad.data, buf) for buf in buffers)


def test_gradient_as_bucket_view_has_backward_compute_into_the_views(impl, xp):
    """Each gradient is computed in its bucket view (the anchor computes it elsewhere and copies it in): what the
    reducer's hook is handed is the view itself, every iteration, and the values are those of plain training."""
    model, plain = DDP(TwoBranch(xp), gradient_as_bucket_view=True, impl=impl), TwoBranch(xp)
    opt = optim.SGD(model.parameters(), lr=0.1)
    handed = {}
    for p in model.parameters():  # registered after the reducer's hooks: runs once the reducer took the grad
        p.register_post_accumulate_grad_hook(lambda t: handed.__setitem__(id(t), t.grad.data))
    for _ in range(3):
        opt.zero_grad()  # set_to_none: the next gradient is computed into the view
        handed.clear()
        model(x(xp)).backward()
        plain.zero_grad()
        plain(x(xp)).backward()
        views = {id(model.reducer.params[i]): bucket.views_in[position]  # (the buckets are rebuilt once)
                 for bucket in model.reducer.buckets for position, i in enumerate(bucket.variable_indices)}
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            assert handed[id(p)] is views[id(p)] and p.grad.data is views[id(p)], name
            assert np.array_equal(p.grad.data, q.grad.data), name
        opt.step()
        for p, q in zip(model.parameters(), plain.parameters()):
            q.data[...] = p.data
    model.reducer.remove_hooks()  # a discarded DDP no longer has backward write into its buckets
    assert all(p._grad_buffer is None for p in model.parameters())


def test_without_bucket_views_gradients_are_computed_apart(impl, xp):
    model = DDP(TwoBranch(xp), impl=impl)
    model(x(xp)).backward()
    assert all(p._grad_buffer is None for p in model.parameters())
    buffers = [b.buffer() for b in model.reducer.get_grad_buckets()]
    assert not any(np.shares_memory(p.grad.data, buf) for p in model.parameters() for buf in buffers)


def test_no_sync_accumulates_then_syncs(impl, xp):
    model, plain = DDP(TwoBranch(xp), find_unused_parameters=True, impl=impl), TwoBranch(xp)
    with model.no_sync():
        model(x(xp), use_fc2=True).backward()   # fc2 used only in the no_sync micro-batch
    model(x(xp), use_fc2=False).backward()
    plain(x(xp), use_fc2=True).backward()
    plain(x(xp), use_fc2=False).backward()
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        assert np.allclose(p.grad.data, q.grad.data), name


def test_unused_parameter_grad_untouched_with_find_unused(impl, xp):
    model = DDP(TwoBranch(xp), find_unused_parameters=True, impl=impl)
    model(x(xp), use_fc2=False).backward()
    assert model.module.fc2.weight.grad is None and model.module.fc1.weight.grad is not None
    model(x(xp), use_fc2=True).backward()
    assert model.module.fc2.weight.grad is not None


def test_prior_reduction_error_names_the_unused_parameters(impl, xp):
    model = DDP(TwoBranch(xp), impl=impl)
    model(x(xp), use_fc2=False).backward()
    with pytest.raises(RuntimeError) as info:
        model(x(xp), use_fc2=False)
    text = str(info.value)
    assert "'fc2.weight' (index 2)" in text and "'fc2.bias' (index 3)" in text
    assert "find_unused_parameters=True" in text and "on rank 0" in text


def test_marked_twice_names_the_parameter(impl, group):
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float32))]
    reducer = module.Reducer(params, [[1, 0]], group, param_names=["a.w", "b.w"])
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([])
    for p in params:
        p.grad = distlab.tensor(np.ones_like(p.data))
    reducer.mark_variable_ready(1)
    with pytest.raises(RuntimeError, match=r"parameter 'b.w' \(index 1\) was marked ready twice"):
        reducer.mark_variable_ready(1)


def test_grad_dtype_mismatch(impl, group):
    module = distlab._backend.load("reducer", impl)
    p = nn.Parameter(np.ones(3, dtype=np.float32))
    reducer = module.Reducer([p], [[0]], group, param_names=["w"])
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([])
    p.grad = distlab.tensor(np.ones(3, dtype=np.float64))
    with pytest.raises(TypeError, match="'w' .* has dtype float32 but its gradient is float64"):
        reducer.mark_variable_ready(0)


@pytest.mark.parametrize("buckets, expect_sparse, message", [
    ([[0, 1], []], None, "bucket 1 is empty"),
    ([[0, 1]], [True, False], "'a' expects a sparse gradient and must be alone"),
    ([[0]], None, r"every parameter index 0..1 exactly once"),
])
def test_bad_bucket_layouts(impl, group, buckets, expect_sparse, message):
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float32))]
    with pytest.raises(ValueError, match=message):
        module.Reducer(params, buckets, group, expect_sparse, param_names=["a", "b"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(expect_sparse_gradients=[False]), "expect_sparse_gradients has 1 entries for 2 parameters"),
    (dict(param_names=["a"]), "param_names has 1 names for 2 parameters"),
])
def test_per_parameter_lists_must_match_the_parameters(impl, group, kwargs, message):
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float32))]
    with pytest.raises(ValueError, match=message):
        module.Reducer(params, [[1, 0]], group, **kwargs)


def test_the_ddp_module_is_the_one_public_home():
    import distlab.ddp as ddp

    assert ddp.Reducer is distlab._backend.load("reducer").Reducer
    assert {"DistributedDataParallel", "Reducer", "GradBucket", "compute_bucket_assignment_by_size"} <= set(ddp.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        ddp.Nothing  # noqa: B018


def test_mixed_dtypes_in_a_bucket(impl, group):
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float64))]
    with pytest.raises(TypeError, match="bucket 0 mixes .* 'a' is cpu float32, 'b' is cpu float64"):
        module.Reducer(params, [[0, 1]], group, param_names=["a", "b"])


def test_host_and_device_parameters_in_one_bucket_are_refused(impl, group):
    from distlab import fakegpu

    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(fakegpu.ones(2, dtype=np.float32))]
    with pytest.raises(TypeError, match="bucket 0 mixes .* 'a' is cpu float32, 'b' is cuda float32; all parameters"):
        module.Reducer(params, [[0, 1]], group, param_names=["a", "b"])


def test_static_graph(impl, xp):
    model, plain = DDP(TwoBranch(xp), static_graph=True, impl=impl), TwoBranch(xp)
    for _ in range(3):
        model.module.zero_grad()
        plain.zero_grad()
        model(x(xp), use_fc2=False).backward()
        plain(x(xp), use_fc2=False).backward()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert np.allclose(p.grad.data, q.grad.data), name
    with pytest.raises(RuntimeError, match="must be called before the first iteration"):
        model.reducer.set_static_graph()


def test_an_unused_parameter_contributes_zeros_to_its_bucket(impl, xp):
    """With find_unused_parameters, a parameter without a gradient is marked ready with zeros in its bucket (what a
    comm hook sees, and what every rank sends), and keeps no gradient when no rank used it."""
    model = DDP(TwoBranch(xp), find_unused_parameters=True, bucket_cap_mb=1e-5, impl=impl)  # a bucket each
    seen = {}

    def recording_hook(state, bucket):
        for param, view in zip(bucket.parameters(), bucket.gradients()):
            seen[id(param)] = to_numpy(view).copy()
        return noop_hook(state, bucket)

    model.register_comm_hook(None, recording_hook)
    for _ in range(2):
        seen.clear()
        model.zero_grad()
        model(x(xp), use_fc2=False).backward()
        for name, p in model.module.named_parameters():
            assert id(p) in seen, name
            if name.startswith("fc2"):
                assert p.grad is None and not seen[id(p)].any(), (name, seen[id(p)])
            else:
                assert np.array_equal(seen[id(p)], to_numpy(p.grad.data)), name


def test_static_graph_change_is_an_error(impl, xp):
    model = DDP(TwoBranch(xp), static_graph=True, impl=impl)
    model(x(xp)).backward()
    model(x(xp)).backward()
    model(x(xp), use_fc2=False).backward()  # fc2 unused: its bucket never completes
    with pytest.raises(RuntimeError, match=r"graph changed.*static_graph=True(.|\n)*'fc2.weight' \(index 2\)"):
        model(x(xp))


def test_static_graph_extra_hook_is_an_error(impl, xp):
    model = DDP(TwoBranch(xp), static_graph=True, bucket_cap_mb=8 / 2**20, impl=impl)
    model(x(xp)).backward()
    model(x(xp))  # iteration 2 forward; now a reentrant backward would call fc1.bias's hook twice
    for p in model.module.parameters():
        p.grad = distlab.tensor(np.ones_like(p.data))
    model.reducer.autograd_hook(1)
    with pytest.raises(RuntimeError, match=r"graph changed in this iteration: parameter 'fc1.bias' \(index 1\)"):
        model.reducer.autograd_hook(1)


def test_comm_hooks(impl, xp):
    model, plain = DDP(TwoBranch(xp), impl=impl), TwoBranch(xp)
    model.register_comm_hook(None, allreduce_hook)
    model(x(xp)).backward()
    plain(x(xp)).backward()
    assert all(np.allclose(p.grad.data, q.grad.data) for p, q in zip(model.parameters(), plain.parameters()))
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(None, noop_hook)
    fresh = DDP(TwoBranch(xp), impl=impl)
    with pytest.raises(TypeError, match="must be callable"):
        fresh.register_comm_hook(None, 42)
    with pytest.raises(TypeError, match=r"takes \(state, bucket\)"):
        fresh.register_comm_hook(None, lambda bucket: bucket)


def tripling_hook(_state, bucket) -> Future:
    """No communication; the reduced bucket is a new array, three times the gradients (so it is not the view)."""
    future = Future(description="tripling hook")
    future.set_result(bucket.buffer() * 3)
    return future


@pytest.mark.parametrize("as_view", [False, True], ids=["copied", "bucket-view"])
def test_grad_stays_the_same_array_from_step_to_step(impl, as_view, xp):
    """Gradients zeroed in place (``set_to_none=False``) are written back in place: the same ``.grad`` tensor and
    array every step (torch's copy_bucket_to_grad; with bucket views, the view itself), with the new values."""
    model, plain = DDP(TwoBranch(xp), gradient_as_bucket_view=as_view, impl=impl), TwoBranch(xp)
    for _ in range(2):   # the buckets are rebuilt once, after the first iteration (bucket views move with them)
        model.zero_grad(set_to_none=False)
        model(x(xp)).backward()
    first = {name: (p.grad, p.grad.data) for name, p in model.module.named_parameters()}
    for step in range(3):
        model.zero_grad(set_to_none=False)
        plain.zero_grad(set_to_none=False)
        model(x(xp), twice=step % 2 == 1).backward()
        plain(x(xp), twice=step % 2 == 1).backward()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            grad, data = first[name]
            assert p.grad is grad and p.grad.data is data, (name, step)
            assert np.array_equal(p.grad.data, q.grad.data), (name, step)


@pytest.mark.parametrize("grads", ["none", "zeros", "own"])
def test_bucket_view_grads_hold_what_a_hook_returned_as_a_new_array(impl, grads, xp):
    """``gradient_as_bucket_view`` with a hook whose result is a new array (not the bucket): the result is copied
    into the bucket, and every ``.grad`` is its bucket view holding it, whether the gradients were None, zeroed
    in place, or arrays of the user's own (replaced by the views)."""
    model, plain = DDP(TwoBranch(xp), gradient_as_bucket_view=True, impl=impl), TwoBranch(xp)
    model.register_comm_hook(None, tripling_hook)
    for step in range(3):
        if grads == "none" or step == 0:
            model.zero_grad()
        elif grads == "zeros":
            model.zero_grad(set_to_none=False)
        else:
            for p in model.parameters():
                p.grad = distlab.tensor(xp.zeros_like(p.data))
        plain.zero_grad()
        model(x(xp)).backward()
        plain(x(xp)).backward()
        buffers = [b.buffer() for b in model.reducer.get_grad_buckets()]
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            assert np.allclose(p.grad.data, 3 * q.grad.data), (name, step)
            assert any(np.shares_memory(p.grad.data, buf) for buf in buffers), (name, step)


def _train(impl, fused, xp, steps=3, **hyper):
    """TwoBranch with fc2 used twice (a weight shared by two graph nodes), one bucket per parameter."""
    model = DDP(TwoBranch(xp), bucket_cap_mb=1e-5, impl=impl)
    if fused:
        opt = model._register_fused_optim(optim.SGD, **hyper)
    else:
        opt = optim.SGD(model.parameters(), **hyper)
    for _ in range(steps):
        model.zero_grad()
        model(x(xp), twice=True).backward()
        if not fused:
            opt.step()
    return model, opt


def test_fused_optimizer_updates_as_buckets_are_reduced_exactly_like_step_after_backward(impl, xp):
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    fused, fused_opt = _train(impl, True, xp, **hyper)
    plain, _ = _train(impl, False, xp, **hyper)
    assert len(fused.reducer.get_grad_buckets()) == 4
    for (name, p), q in zip(fused.module.named_parameters(), plain.parameters()):
        np.testing.assert_array_equal(to_numpy(p.data), to_numpy(q.data), err_msg=name)
        # .grad still holds the average
        np.testing.assert_array_equal(to_numpy(p.grad.data), to_numpy(q.grad.data), err_msg=name)
    assert len(fused_opt.state) == 4  # momentum buffers, one per parameter


def test_fused_optimizer_on_some_parameters_and_its_errors(impl, xp):
    model = DDP(TwoBranch(xp), impl=impl)
    before = [p.data.copy() for p in model.parameters()]
    model._register_fused_optim(optim.SGD, lr=0.1, optim_params=list(model.module.fc1.parameters()))
    model(x(xp)).backward()
    changed = [not np.array_equal(b, p.data) for b, p in zip(before, model.parameters())]
    assert changed == [True, True, False, False]  # fc1 updated, fc2 left to another optimizer
    with pytest.raises(RuntimeError, match="_register_fused_optim can only be called once"):
        model._register_fused_optim(optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="register_comm_hook can only be called once"):
        model.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="no_sync.. cannot be used with an optimizer registered by"):
        with model.no_sync():
            pass
    hooked = DDP(TwoBranch(xp), impl=impl)
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="does not compose with register_comm_hook"):
        hooked._register_fused_optim(optim.SGD, lr=0.1)
    later = TwoBranch(xp)
    grown = optim.SGD(later.fc1.parameters(), lr=0.1)
    grown.step_param(later.fc1.weight, xp.zeros((3, 4), np.float32))
    grown.add_param_group({"params": list(later.fc2.parameters()), "lr": 0.5})  # found after the map was built
    kept = later.fc2.bias.data.copy()
    grown.step_param(later.fc2.bias, xp.ones(3, np.float32))
    np.testing.assert_allclose(to_numpy(later.fc2.bias.data), to_numpy(kept - 0.5))
    other = optim.SGD(TwoBranch(xp).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"step_param: the parameter \(shape \(3, 4\)\) is not in any of this SGD"):
        other.step_param(model.module.fc1.weight, xp.zeros((3, 4), np.float32))


def test_step_param_equals_step_for_every_optimizer(xp):
    for cls, hyper in [(optim.Adam, dict(lr=0.01, weight_decay=0.1)), (optim.RMSprop, dict(lr=0.01, momentum=0.5)),
                       (optim.Adagrad, dict(lr=0.1)), (optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1))]:
        a, b = TwoBranch(xp), TwoBranch(xp)
        opt_a, opt_b = cls(a.parameters(), **hyper), cls(b.parameters(), **hyper)
        for _ in range(2):
            a.zero_grad()
            b.zero_grad()
            a(x(xp)).backward()
            b(x(xp)).backward()
            opt_a.step()
            for p in b.parameters():
                kept = p.grad
                opt_b.step_param(p, p.grad.data.copy())
                assert p.grad is kept  # the gradient given is used, .grad left as it was
        for p, q in zip(a.parameters(), b.parameters()):
            np.testing.assert_array_equal(to_numpy(p.data), to_numpy(q.data), err_msg=cls.__name__)


def not_a_future_hook(state, bucket):
    return 1


def a_future_of_nothing_hook(state, bucket):
    from distlab.futures import Future

    future = Future()
    future.set_result(None)
    return future


def test_a_comm_hook_breaking_the_contract_is_named_at_the_first_backward(impl, xp):
    from distlab.errors import CommHookError

    model = DDP(TwoBranch(xp), impl=impl)
    model.register_comm_hook(None, not_a_future_hook)
    # torch raises RuntimeError ("callback must return a torch.futures.Future"): code written for it catches ours
    with pytest.raises(RuntimeError, match=r"callback must return a distlab.futures.Future whose value is the "
                                           r"reduced bucket buffer, but comm hook 'not_a_future_hook' returned "
                                           r"int") as raised:
        model(x(xp)).backward()
    assert isinstance(raised.value, TypeError) and type(raised.value) is CommHookError
    with pytest.raises(TypeError, match="comm hook 'not_a_future_hook' returned int"):  # Join's shadow path too
        model.reducer._run_comm_hook(model.reducer._get_zeros_like_grad_buckets()[0])
    model = DDP(TwoBranch(xp), impl=impl)
    model.register_comm_hook(None, a_future_of_nothing_hook)
    with pytest.raises(CommHookError, match=r"comm hook 'a_future_of_nothing_hook' completed with NoneType, "
                                            r"expected an array of 27 float32 elements \(the bucket's size\)"):
        model(x(xp)).backward()


def _hook_annotated(bucket, returns):
    """A hook ``(state, bucket: <bucket>) -> <returns>``; None leaves an annotation out."""
    def hook(state, bucket):
        return allreduce_hook(state, bucket)

    if bucket is not None:
        hook.__annotations__["bucket"] = bucket
    if returns is not None:
        hook.__annotations__["return"] = returns
    return hook


def test_comm_hook_annotations_are_checked_at_registration(impl):
    """torch's _check_comm_hook: ValueError at registration for a bucket annotated other than GradBucket or a
    return annotated other than a Future; no annotation passes. String annotations (``from __future__ import
    annotations``) are resolved, or read by name."""
    from distlab.ddp import GradBucket
    from distlab.ddp_comm_hooks import fp16_compress_hook
    from distlab.futures import Future

    accepted = [(None, None), (GradBucket, Future), (GradBucket, Future[np.ndarray]), ("GradBucket", "Future"),
                ("distlab.ddp.GradBucket", "Future[np.ndarray]"), ("ddp.GradBucket", None), (None, "fut.Future")]
    for bucket, returns in accepted:
        model = DDP(TwoBranch(), impl=impl)
        model.register_comm_hook(None, _hook_annotated(bucket, returns))
        model(x()).backward()
    DDP(TwoBranch(), impl=impl).register_comm_hook(None, fp16_compress_hook)   # ours: string annotations
    refused = [((int, None), r"bucket annotation should be distlab.ddp.GradBucket; hook 'hook' annotates 'bucket' "
                             r"with int"),
               (("np.ndarray", None), r"annotates 'bucket' with ndarray"),            # resolved
               (("GradBuckets", None), r"annotates 'bucket' with 'GradBuckets'"),     # read by name
               ((None, int), r"return annotation should be distlab.futures.Future; hook 'hook' is annotated to "
                             r"return int"),
               ((GradBucket, np.ndarray), r"to return ndarray"),
               ((None, "torch.futures.Futures"), r"to return 'torch.futures.Futures'")]
    for (bucket, returns), message in refused:
        model = DDP(TwoBranch(), impl=impl)
        with pytest.raises(ValueError, match=message):
            model.register_comm_hook(None, _hook_annotated(bucket, returns))
        assert model.reducer.comm_hook is None                                   # nothing was registered


def test_module_without_trainable_parameters(impl):
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        DDP(frozen, impl=impl)


def test_bucket_view_and_reduce_dtype_conflict(impl, group):
    module = distlab._backend.load("reducer", impl)
    with pytest.raises(ValueError, match="gradient_as_bucket_view cannot be used with a reduce_dtype"):
        module.Reducer([nn.Parameter(np.ones(2, np.float32))], [[0]], group, gradient_as_bucket_view=True,
                       reduce_dtype=np.float16)


def test_reduce_dtype_mixed_precision(impl, xp):
    model, plain = DDP(TwoBranch(xp), reduce_dtype=np.float16, impl=impl), TwoBranch(xp)
    assert all(b.buffer().dtype == np.float16 for b in model.reducer.get_grad_buckets())
    model(x(xp)).backward()
    plain(x(xp)).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad.data.dtype == np.float32 and np.allclose(p.grad.data, q.grad.data, rtol=1e-3, atol=1e-3)


def test_training_converges(impl):
    model = DDP(nn.Sequential(nn.Linear(4, 8, seed=0), nn.Tanh(), nn.Linear(8, 1, seed=1)), impl=impl)
    opt = optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((64, 4)).astype(np.float32)
    target = data @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype=np.float32)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = nn.MSELoss()(model(distlab.tensor(data)), distlab.tensor(target))
        loss.backward()
        opt.step()
        losses.append(float(loss.data))
    assert losses[-1] < 0.1 * losses[0]


def in_backward(fn):
    """Run ``fn`` inside a backward pass (the reducer queues finalize_backward as an engine callback)."""
    from distlab.autograd import Node, run_backward

    class Driver(Node):
        def __init__(self):
            super().__init__(())

        def apply(self, grad):
            fn()
            return ()

    run_backward([Driver()], [np.ones(1)])


class GradProperty(nn.Parameter):
    """A parameter whose ``grad`` is a property: the core may not read Tensor's slot directly for it."""

    def __init__(self, data):
        super().__init__(data)
        self.reads = 0

    @property
    def grad(self):
        self.reads += 1
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad = value


class TensorSubclass(distlab.Tensor):
    """A gradient of a Tensor subclass whose ``data`` is a property (counted)."""

    __slots__ = ()
    reads = 0

    @property
    def data(self):
        TensorSubclass.reads += 1
        return distlab.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        distlab.Tensor.data.__set__(self, value)


@pytest.mark.parametrize("kind", ["contiguous", "transposed", "strided", "float64", "tensor subclass"])
@pytest.mark.parametrize("hook", [None, noop_hook])
def test_gradients_of_every_layout_reach_the_bucket(impl, group, kind, hook, xp):
    """The core's C copies take only plain C-contiguous host arrays; anything else (other layouts, device arrays)
    must give the same result through the array module."""
    module = distlab._backend.load("reducer", impl)
    dtype = np.float64 if kind == "float64" else np.float32
    plain = nn.Parameter(xp.zeros((3, 4), dtype=dtype))
    special = GradProperty(xp.zeros((4, 3), dtype=dtype))
    reducer = module.Reducer([plain, special], [[1, 0]], group, param_names=["plain", "special"])
    if hook is not None:
        reducer.register_comm_hook(None, hook)
    source = xp.arange(12, dtype=dtype).reshape(3, 4)
    grads = {"contiguous": (source, source.reshape(4, 3)), "transposed": (source, source.T),
             "strided": (xp.arange(24, dtype=dtype).reshape(3, 8)[:, ::2], source.reshape(4, 3)),
             "float64": (source, source.reshape(4, 3)), "tensor subclass": (source, source.reshape(4, 3))}[kind]
    wrap = TensorSubclass if kind == "tensor subclass" else distlab.tensor
    expected = [to_numpy(g).copy() for g in grads]
    for _ in range(2):  # twice: the second iteration runs with rebuilt buckets
        reducer.prepare_for_forward()
        reducer.prepare_for_backward([])
        plain.grad, special.grad = wrap(grads[0].copy(order="K")), wrap(grads[1].copy(order="K"))
        reads, data_reads = special.reads, TensorSubclass.reads
        in_backward(lambda: (reducer.autograd_hook(1), reducer.autograd_hook(0)))
        assert special.reads > reads  # the properties were honoured, not bypassed
        assert (TensorSubclass.reads > data_reads) == (kind == "tensor subclass")
        for p, want in zip((plain, special), expected):
            assert np.array_equal(to_numpy(distlab.Tensor.data.__get__(p.grad)), want)
        reducer.rebuild_buckets()


def test_reducer_grad_bucket_lists_its_parameters(impl, group):
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float32))]
    seen = []

    def recording_hook(state, bucket):
        seen.append((bucket.index(), bucket.parameters(), bucket.offsets(), bucket.lengths(), bucket.sizes(),
                     repr(bucket)))
        bucket.offsets().append(99)  # the accessors hand out copies
        return noop_hook(state, bucket)

    reducer = module.Reducer(params, [[1, 0]], group)
    reducer.register_comm_hook(None, recording_hook)
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([])
    for p in params:
        p.grad = distlab.tensor(np.ones_like(p.data))
    in_backward(lambda: (reducer.autograd_hook(1), reducer.autograd_hook(0)))
    (index, parameters, offsets, lengths, sizes, text), = seen
    assert index == 0 and parameters[0] is params[1] and parameters[1] is params[0]
    assert (offsets, lengths, sizes) == ([0, 2], [2, 3], [(2,), (3,)])
    assert text == "<GradBucket 0/1 2 params>"
    assert reducer.rebuilt_param_indices == [1, 0]


def test_a_parameter_replaced_after_construction_is_read_safely(impl, group):
    """The core reads Tensor's slots only for objects of the class it checked; a swapped-in object of another
    class must be read through its own attributes (and must not crash the process)."""
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.zeros(3, dtype=np.float32)), nn.Parameter(np.zeros(2, dtype=np.float32))]
    reducer = module.Reducer(params, [[1, 0]], group)
    swapped = GradProperty(np.zeros(3, dtype=np.float32))
    reducer.params[0] = swapped
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([])
    swapped.grad = distlab.tensor(np.full(3, 2.0, dtype=np.float32))
    params[1].grad = distlab.tensor(np.ones(2, dtype=np.float32))
    in_backward(lambda: (reducer.autograd_hook(1), reducer.autograd_hook(0)))
    assert swapped.reads >= 2
    assert np.array_equal(swapped.grad.data, np.full(3, 2.0, dtype=np.float32))


def test_logging_data_says_whether_iterations_ran_under_join(impl):
    """torch's _get_ddp_logging_data() reports join_uneven_inputs once a Join has used the module."""
    model = DDP(TwoBranch(), impl=impl)
    model(x()).backward()
    assert model._get_ddp_logging_data()["join_uneven_inputs"] is False
    with model.join():
        for _ in range(2):
            model(x()).backward()
    data = model._get_ddp_logging_data()
    assert data["join_uneven_inputs"] is True and data["num_parameters"] == 4
    model(x()).backward()                      # as torch's logger: it stays set
    assert model._get_ddp_logging_data()["join_uneven_inputs"] is True


def test_static_graph_marks_a_parameter_ready_at_its_last_hook_of_the_iteration(impl, group):
    """A parameter whose hook fires twice per iteration (torch: a reentrant backward, activation checkpointing):
    the first static iteration counts each parameter's hooks and reduces once backward ended; every later iteration
    marks it ready only at its last hook (numGradHooksTriggeredMapPerIteration_), so the bucket carries the whole
    gradient, once."""
    module = distlab._backend.load("reducer", impl)
    params = [nn.Parameter(np.ones(3, dtype=np.float32)), nn.Parameter(np.ones(2, dtype=np.float32))]
    reduced = []

    def recording_hook(state, bucket):
        reduced.append([to_numpy(g).copy() for g in bucket.gradients()])
        return noop_hook(state, bucket)

    reducer = module.Reducer(params, [[0, 1]], group)
    reducer.set_static_graph()
    reducer.register_comm_hook(None, recording_hook)

    def backward():
        reducer.autograd_hook(0)
        params[0].grad.data[...] = 2.0  # its second accumulation
        reducer.autograd_hook(1)
        reducer.autograd_hook(0)

    for iteration in range(3):
        reducer.prepare_for_forward()
        reducer.prepare_for_backward([])
        for p in params:
            p.grad = distlab.tensor(np.ones_like(p.data))
        in_backward(backward)
        assert len(reduced) == iteration + 1, (iteration, reduced)
        assert reduced[-1][0].tolist() == [2.0] * 3 and reduced[-1][1].tolist() == [1.0] * 2, (iteration, reduced)


def test_a_ddp_rebuilt_on_a_new_group_keeps_a_hook_over_its_group_and_drops_one_with_a_state_of_its_own(impl, xp):
    # What the survivors of a failure get (DistributedDataParallel.rebuilt_on, distlab.collectives.elastic): a hook
    # whose state is None or the old group is registered again, the new group its state; any other state (a
    # PowerSGDState, say) belongs to the old world, so the program registers that hook again itself.
    for make_state, kept in ((lambda m: m.process_group, "group"), (lambda m: None, None), (lambda m: {}, "drop")):
        model = DDP(TwoBranch(xp), impl=impl)
        model.register_comm_hook(make_state(model), allreduce_hook)
        new = comm.world().new_group([0])
        rebuilt = model.rebuilt_on(new)
        assert rebuilt.process_group is new
        if kept == "drop":
            assert rebuilt.reducer.comm_hook is None
        else:
            assert rebuilt.reducer.comm_hook is allreduce_hook
            assert rebuilt.reducer.comm_hook_state is (new if kept == "group" else None)
        rebuilt(x(xp)).backward()  # reduces over the new group, through the hook where kept
