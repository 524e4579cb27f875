"""distlab's multi-tensor kernels: what the stand-in runs and counts, and the CUDA source a GPU compiles, run on
the CPU.

The CUDA source of each optimizer's multi-tensor kernel is compiled here by the host C++ compiler, with the
CUDA names it uses (``__global__``, ``blockIdx``...) defined for one host thread, and run over the arrays the
stand-in updated, launch by launch, block by block and thread by thread: it must write the very bits the stand-in
wrote. What that leaves to a GPU: nvcc's own reading of the source, and the launch itself
(``tests/test_autograd_gpu.py``).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

import distlab
from distlab import fakegpu as xp
from distlab import nn, optim
from distlab.autograd._kernels import MultiTensorKernel
from distlab.optim import _functional

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


_OPTIMIZERS = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
    "sgd-dampening": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.3),
    "adam": lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01, maximize=True),
    "adagrad": lambda ps: optim.Adagrad(ps, lr=0.1, weight_decay=0.1),
    "rmsprop": lambda ps: optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True),
    "adadelta": lambda ps: optim.Adadelta(ps, weight_decay=0.1),
    "adamax": lambda ps: optim.Adamax(ps, lr=0.01, maximize=True),
}
_PRELUDE = """#include <cmath>
#include <algorithm>
using std::sqrt; using std::exp; using std::log; using std::fabs; using std::fmax; using std::fmin;
struct Dim3 { unsigned int x, y, z; };
static Dim3 blockIdx, blockDim, threadIdx, gridDim;
#define __global__
extern "C" void set_thread(unsigned bx, unsigned by, unsigned tx, unsigned grid_x, unsigned block_x) {
    blockIdx = {bx, by, 0}; threadIdx = {tx, 0, 0}; gridDim = {grid_x, 1, 1}; blockDim = {block_x, 1, 1};
}
"""


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
def test_the_cuda_source_run_on_the_cpu_writes_the_stand_ins_bits(launches, tmp_path):
    """Each launch's CUDA source, compiled by g++ (no contraction into multiply-adds, as numpy) and run with every
    (block, thread) of a 2 x 3 grid row per tensor: the arrays it writes equal the stand-in's, bit for bit."""
    sources, names = [], []
    for i, (_, kernel, before, _) in enumerate(launches):
        shape = tuple(len(a) if isinstance(a, list) else None for a in before)
        source, name = kernel.cuda_source("float", shape)
        sources.append(f"namespace k{i} {{\n{source.replace(name, f'{name}_{i}')}}}\n")  # one symbol per launch
        names.append(f"{name}_{i}")
    (tmp_path / "kernels.cpp").write_text(_PRELUDE + "".join(sources))
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", str(tmp_path / "k.so"),
                    str(tmp_path / "kernels.cpp")], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    for name, (which, kernel, before, after) in zip(names, launches):
        arrays = [[x.copy() for x in a] if isinstance(a, list) else a for a in before]
        args = [a.ctypes.data_as(ctypes.c_void_p) for a in kernel.kernel_args(arrays, np.dtype(np.float32))
                if isinstance(a, np.ndarray)]
        sizes = [ctypes.c_longlong(a.size) for a in next(a for a in arrays if isinstance(a, list))]
        scalars = [ctypes.c_float(v) for v in arrays if not isinstance(v, list)]
        function = getattr(lib, name)
        for t in range(len(sizes)):
            for block in range(2):
                for thread in range(3):
                    lib.set_thread(block, t, thread, 2, 3)
                    function(*args, *sizes, *scalars)
        for got, want in zip((x for a in arrays if isinstance(a, list) for x in a),
                             (x for a in after if isinstance(a, list) for x in a)):
            assert got.tobytes() == want.tobytes(), (which, name)


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
