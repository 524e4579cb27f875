"""distlab's multi-tensor kernels: what the stand-in runs and counts, and the CUDA source a GPU compiles, run on
the CPU.

The CUDA source of each optimizer's multi-tensor kernel is compiled here by the host C++ compiler, with the
CUDA names it uses (``__global__``, ``blockIdx``...) defined for one host thread, and launched the way cupy's form
of the kernel launches it over the arrays the stand-in updated, block by block and thread by thread: it must
write the very bits the stand-in wrote. Where nvcc is installed (no GPU needed), every kernel source a GPU would
compile is compiled by it too. What that leaves to a GPU: the launch itself (``tests/test_autograd_gpu.py``).
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import distlab
from distlab import fakegpu as xp
from distlab import nn, optim
from distlab.autograd._kernels import CupyMultiTensorKernel, HostElementwiseKernel, MultiTensorKernel
from distlab.optim import _functional

from _cuda_host import HostCuda, elementwise_source

SGD_BODY = ("T g, T lr, T momentum", "T p, T buf",
            "T d = g; buf = buf * momentum + d; d = buf; p = p - lr * d;", "sgd")


def _tensors(module, shapes, seed):
    rng = np.random.default_rng(seed)
    return [module.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def test_the_stand_in_counts_one_launch_per_chunk_of_32_tensors_and_computes_each_tensors_update():
    shapes = [(3, 4), (5,), ()] * 23 + [(2,)]  # 70 tensors: chunks of 32, 32 and 6
    g, p, buf = (_tensors(xp, shapes, seed) for seed in (0, 1, 2))
    host = [[a.get() for a in arrays] for arrays in (g, p, buf)]
    xp.reset()
    xp.MultiTensorKernel(*SGD_BODY)(g, 0.1, 0.9, p, buf)
    assert xp.launches() == {("elementwise", __name__): 3}
    one = xp.ElementwiseKernel(*SGD_BODY)
    for i, (hg, hp, hb) in enumerate(zip(*host)):
        want_p, want_buf = xp.asarray(hp), xp.asarray(hb)
        one(xp.asarray(hg), 0.1, 0.9, want_p, want_buf)
        assert p[i].get().tobytes() == want_p.get().tobytes() and buf[i].get().tobytes() == want_buf.get().tobytes()


@pytest.mark.parametrize("call, error, words", [
    (lambda k, a: k(a, 0.1, 0.9, a[:1], a), TypeError, "all as long"),
    (lambda k, a: k(a, 0.1, 0.9, a), TypeError, "give every parameter"),
    (lambda k, a: k([x.T for x in a], 0.1, 0.9, a, a), ValueError, "C-contiguous"),
    (lambda k, a: k([np.ones((3, 2), np.float32)] * 2, 0.1, 0.9, a, a), TypeError, "numpy array cannot be mixed"),
])
def test_a_multi_tensor_kernel_refuses_what_it_cannot_index(call, error, words):
    with pytest.raises(error, match=words):
        call(xp.MultiTensorKernel(*SGD_BODY), _tensors(xp, [(2, 3), (2, 3)], 0))
    with pytest.raises(ValueError, match="T parameters only"):
        MultiTensorKernel("float32 g", "T p", "p = g;", "k")
    with pytest.raises(ValueError, match=r"\['n'\] are names"):
        MultiTensorKernel("T g", "T p", "T n = g; p = n;", "k")


_OPTIMIZERS = {  # every branch of the fused bodies (optim/_functional.py) at least once
    "sgd-plain": lambda ps: optim.SGD(ps, lr=0.1),
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
    "sgd-dampening": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.3),
    "adam": lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adam-plain": lambda ps: optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01, maximize=True),
    "adagrad": lambda ps: optim.Adagrad(ps, lr=0.1, weight_decay=0.1),
    "rmsprop": lambda ps: optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True),
    "rmsprop-plain": lambda ps: optim.RMSprop(ps, lr=0.01, weight_decay=0.1),
    "adadelta": lambda ps: optim.Adadelta(ps, weight_decay=0.1),
    "adamax": lambda ps: optim.Adamax(ps, lr=0.01, maximize=True),
}
@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every multi-tensor launch of two steps of each optimizer on the stand-in (35 parameters, so two chunks):
    its kernel, and the chunk's arguments on the host before and after it ran."""
    records = []
    real = _functional.multi_tensor_kernel

    class Spy:
        def __init__(self, kernel, which):
            self.kernel, self.which = kernel, which

        def __call__(self, *args):
            for start in range(0, len(next(a for a in args if isinstance(a, list))), MultiTensorKernel.CHUNK):
                chunk = [a[start:start + MultiTensorKernel.CHUNK] if isinstance(a, list) else a for a in args]
                before = [[x.get() for x in a] if isinstance(a, list) else a for a in chunk]
                self.kernel._launch(chunk)
                after = [[x.get() for x in a] if isinstance(a, list) else a for a in chunk]
                records.append((self.which, self.kernel, before, after))

    for which, make in _OPTIMIZERS.items():
        _functional.multi_tensor_kernel = lambda *a, which=which: Spy(real(*a), which)
        try:
            params = [nn.Parameter(x) for x in _tensors(xp, [(4, 3), (3,)] * 17 + [()], 3)]
            opt = make(params)
            for step in range(2):
                for p, g in zip(params, _tensors(xp, [p.shape for p in params], 10 + step)):
                    p.grad = distlab.Tensor(g)
                opt.step()
        finally:
            _functional.multi_tensor_kernel = real
    return records


def test_every_optimizer_ran_multi_tensor_launches_of_32(launches):
    assert {which for which, *_ in launches} == set(_OPTIMIZERS)
    assert all(len(next(a for a in chunk if isinstance(a, list))) in (32, 3) for *_, chunk in launches)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")
def test_cupys_multi_tensor_kernel_runs_its_cuda_source_to_the_stand_ins_bits(launches, tmp_path):
    """Each launch made again by the form cupy runs (:class:`CupyMultiTensorKernel`: its source, its grid, its
    arguments handed to ``RawKernel``), the source compiled by g++ (no contraction into multiply-adds, as numpy)
    and run block by block and thread by thread over the whole grid: the arrays it writes equal the stand-in's,
    bit for bit, and every argument has the C type of its parameter."""
    shapes = [tuple(len(a) if isinstance(a, list) else None for a in before) for _, _, before, _ in launches]
    cuda = HostCuda(tmp_path, {kernel.cuda_source("float", shape) for (_, kernel, *_), shape in zip(launches, shapes)})
    for which, kernel, before, after in launches:
        arrays = [[x.copy() for x in a] if isinstance(a, list) else a for a in before]
        CupyMultiTensorKernel(cuda, *kernel.signature)._launch(arrays)
        for got, want in zip((x for a in arrays if isinstance(a, list) for x in a),
                             (x for a in after if isinstance(a, list) for x in a)):
            assert got.tobytes() == want.tobytes(), which


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")
def test_a_tensor_longer_than_the_grid_is_strided_over_and_scalars_take_their_c_type(tmp_path):
    """1024 blocks of 256 threads at most: a tensor of 600,000 elements takes each thread round the grid three
    times, beside a 5-element one in the same launch; a scalar that is not ``T`` is what a GPU would misread."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        g, p, buf = ([rng.standard_normal(n).astype(dtype) for n in (600_000, 5)] for _ in range(3))
        want_p, want_buf = [a.copy() for a in p], [a.copy() for a in buf]
        MultiTensorKernel(*SGD_BODY)(g, 0.1, 0.9, want_p, want_buf)
        (tmp_path / dtype.__name__).mkdir()
        kernel = CupyMultiTensorKernel(HostCuda(tmp_path / dtype.__name__), *SGD_BODY)
        kernel(g, 0.1, 0.9, p, buf)
        assert [a.tobytes() for a in p + buf] == [a.tobytes() for a in want_p + want_buf]
        raw = next(iter(kernel._compiled.values()))
        with pytest.raises(TypeError, match="lr is a (float|double): a GPU would read the bytes of float"):
            raw((1, 2), (256,), tuple(kernel.kernel_args([g, 0.1, 0.9, p, buf], np.dtype(dtype)))[:-2] + (0.1, 0.9))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA compiler (nvcc)")
@pytest.mark.timeout(600)  # nvcc compiles every kernel source: 41 s on a loaded 2-core machine, the slowest test here
def test_every_kernel_source_compiles_for_a_gpu(launches, tmp_path):
    """What nvcc makes of every kernel a GPU would compile (for an H100, to PTX, no device needed): each
    multi-tensor launch's raw source, and each body as ``cupy.ElementwiseKernel`` wraps it (the per-parameter
    updates, ReLU's backward), in float and double."""
    units = {}
    for _, kernel, before, _ in launches:
        shape = tuple(len(a) if isinstance(a, list) else None for a in before)
        arrays = {n for (n, _), k in zip(kernel.elementwise.in_params, shape) if k is not None}
        for ctype in ("float", "double"):
            units.setdefault(kernel.cuda_source(ctype, shape), None)
            units.setdefault((elementwise_source(kernel.elementwise, ctype, arrays, "elementwise"), "elementwise"))
    relu = HostElementwiseKernel("T g, T out", "T gx", "gx = g * (out > 0);", "distlab_relu_backward")
    units.update(((elementwise_source(relu, c, {"g", "out"}, "elementwise"), "elementwise"), None)
                 for c in ("float", "double"))
    text = "".join(f"namespace unit{i} {{\n{source.replace(name, f'{name}_{i}')}}}\n"
                   for i, (source, name) in enumerate(units))
    (tmp_path / "kernels.cu").write_text(text)
    done = subprocess.run(["nvcc", "-arch=compute_90", "--ptx", "-o", str(tmp_path / "kernels.ptx"),
                           str(tmp_path / "kernels.cu")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "kernels.ptx").read_text().count(".entry") == len(units) > 40


@pytest.mark.parametrize("make", [lambda ps: optim.SGD(ps, lr=np.float64(0.1), momentum=0.9),
                                  lambda ps: optim.Adam(ps, lr=np.float64(0.01), weight_decay=np.float64(0.1))],
                         ids=["sgd", "adam"])
def test_a_numpy_scalar_hyper_parameter_is_a_scalar_of_the_multi_tensor_kernel(make, monkeypatch):
    """A hyper-parameter given (or computed) as a numpy scalar is one ``T`` the kernel takes by value, not a list
    of one per tensor: on cupy the latter compiles to a pointer where the float goes."""
    calls = []
    real = _functional.multi_tensor_kernel

    def spy(*signature):
        kernel = real(*signature)
        return lambda *args: (calls.append((kernel, args)), kernel(*args))

    monkeypatch.setattr(_functional, "multi_tensor_kernel", spy)
    params = [nn.Parameter(x) for x in _tensors(xp, [(4, 3), (3,)], 3)]
    opt = make(params)
    for p, g in zip(params, _tensors(xp, [p.shape for p in params], 10)):
        p.grad = distlab.Tensor(g)
    opt.step()
    assert calls
    for kernel, args in calls:
        shape = tuple(len(a) if isinstance(a, list) else None for a in args)
        names = [n for n, _ in kernel.elementwise.in_params]
        assert names[0] == "g" and shape[0] == 2 and shape[1:len(names)] == (None,) * (len(names) - 1), names
        source, _ = kernel.cuda_source("float", shape)
        assert "const T* g_0" in source and not any(f"T* {n}_0" in source for n in names[1:])
