"""The CUDA sources distlab hands to cupy, compiled and run on the CPU.

:class:`HostCuda` stands in for the one part of cupy a multi-tensor kernel uses, ``cupy.RawKernel(source, name)``
called as ``kernel(grid, block, args)``: the source is compiled by the host C++ compiler with the CUDA names it
uses (``__global__``, ``blockIdx``...) defined for one host thread, and a launch runs every (block, thread) of the
grid in turn. Each argument is checked the way the GPU would read it: a pointer parameter takes an array of ``T``,
a value parameter the numpy scalar of exactly its C type (cupy passes a numpy scalar's bytes as they are, so a
``float64`` handed to a ``float`` parameter is garbage on a GPU, not a conversion).

:func:`elementwise_source` writes what ``cupy.ElementwiseKernel`` compiles for a body (one element per loop trip,
inputs read-only, outputs by reference), with plain pointers where cupy has its ``CArray`` indexer, so ``nvcc`` can
read every body where cupy's headers are absent.
"""
from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np

__all__ = ["HostCuda", "elementwise_source", "PRELUDE"]

PRELUDE = """#include <cmath>
#include <algorithm>
using std::sqrt; using std::exp; using std::log; using std::fabs; using std::fmax; using std::fmin;
struct Dim3 { unsigned int x, y, z; };
static Dim3 blockIdx, blockDim, threadIdx, gridDim;
#define __global__
"""
_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')
_TYPEDEF = re.compile(r"typedef ([\w ]+?) T;")
_C_TYPES = {"float": (ctypes.c_float, np.float32), "double": (ctypes.c_double, np.float64),
            "long long": (ctypes.c_longlong, np.int64), "int": (ctypes.c_int, np.int32)}


def _parameters(source: str, name: str) -> list:
    """``[(C type, is a pointer, parameter name)]`` of kernel ``name`` in ``source``, ``T`` resolved."""
    typedef = _TYPEDEF.search(source)
    signature = next(m for m in _KERNEL.finditer(source) if m.group(1) == name)
    params = []
    for text in signature.group(2).split(","):
        words = text.replace("*", " * ").split()
        ctype = " ".join(w for w in words[:-1] if w not in ("const", "*"))
        params.append((typedef.group(1) if ctype == "T" and typedef else ctype, "*" in words, words[-1]))
    return params


def _launcher(name: str, params: list) -> str:
    """A host function running kernel ``name`` over a whole grid, its arguments as CUDA takes them: an array of
    pointers to each value (``cuLaunchKernel``'s ``kernelParams``)."""
    args = ", ".join(f"*({c}{'*' if p else ''}*)argv[{i}]" for i, (c, p, _) in enumerate(params))
    return (f'extern "C" void launch_{name}(unsigned gx, unsigned gy, unsigned bx, void** argv) {{\n'
            f"    gridDim = {{gx, gy, 1}}; blockDim = {{bx, 1, 1}};\n"
            f"    for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) for (unsigned t = 0; t < bx; ++t) {{\n"
            f"        blockIdx = {{x, y, 0}}; threadIdx = {{t, 0, 0}}; {name}({args});\n    }}\n}}\n")


class HostCuda:
    """``cupy.RawKernel`` on the host (see the module docstring). ``sources`` ``[(source, name)]`` are compiled
    together at once (one compiler run); a kernel made from any other source is compiled alone when made."""

    def __init__(self, workdir, sources=()):
        self._workdir, self._libraries, self._count = workdir, {}, 0
        if sources:
            self._compile(list(sources))

    def _compile(self, sources: list) -> None:
        units, symbols = [], []
        for i, (source, name) in enumerate(sources):  # one symbol each: cupy makes a module of each source
            symbols.append(f"{name}_{self._count}_{i}")
            source = source.replace(name, symbols[-1])
            units.append(f"namespace unit{self._count}_{i} {{\n{source}\n{_launcher(symbols[-1], _parameters(source, symbols[-1]))}}}\n")
        path = self._workdir / f"kernels{self._count}.cpp"
        path.write_text(PRELUDE + "".join(units))
        library = path.with_suffix(".so")
        # no contraction into fused multiply-adds, as numpy computes: the bits must be the host twin's
        done = subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", str(library), str(path)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"g++ refused {path}:\n{done.stderr[-3000:]}")
        lib = ctypes.CDLL(str(library))
        for (source, name), symbol in zip(sources, symbols):
            self._libraries[(source, name)] = getattr(lib, f"launch_{symbol}")
        self._count += 1

    def RawKernel(self, source: str, name: str):  # noqa: N802 - cupy's name
        if (source, name) not in self._libraries:
            self._compile([(source, name)])
        return _HostRawKernel(self._libraries[(source, name)], name, _parameters(source, name))


class _HostRawKernel:
    def __init__(self, launch, name: str, params: list):
        self.name, self.params, self.launches = name, params, 0
        self._launch = launch

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        values = [self._value(arg, param) for arg, param in zip(args, self.params)]
        addresses = [ctypes.addressof(v) for v in values]  # ``values`` keeps each one alive through the launch
        argv = (ctypes.c_void_p * len(values))(*addresses)
        gx, gy = (tuple(grid) + (1, 1))[:2]
        self._launch(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(block[0]), argv)
        self.launches += 1

    def _value(self, arg, param):
        ctype, pointer, pname = param
        c_type, dtype = _C_TYPES[ctype]
        if pointer:
            if not (isinstance(arg, np.ndarray) and arg.dtype == dtype and arg.flags.c_contiguous):
                raise TypeError(f"{self.name}: {pname} takes a C-contiguous {dtype.__name__} array, not {arg!r:.60}")
            return ctypes.c_void_p(arg.ctypes.data)
        if type(arg) is not dtype:
            raise TypeError(f"{self.name}: {pname} is a {ctype}: a GPU would read the bytes of "
                            f"{type(arg).__name__} {arg!r} as one")
        return c_type(arg)


def elementwise_source(kernel, ctype: str, arrays: set, name: str) -> str:
    """What ``cupy.ElementwiseKernel`` compiles for :class:`~distlab.autograd._kernels.HostElementwiseKernel`
    ``kernel`` with ``T`` = ``ctype``: parameters in ``arrays`` are arrays, other inputs scalars."""
    params, reads = [], []
    for pname, ptype in kernel.in_params:
        if pname in arrays:
            params.append(f"const {ptype}* _raw_{pname}")
            reads.append(f"const {ptype} {pname} = _raw_{pname}[i];")
        else:
            params.append(f"const {ptype} {pname}")
    for pname, ptype in kernel.out_params:
        params.append(f"{ptype}* _raw_{pname}")
        reads.append(f"{ptype} &{pname} = _raw_{pname}[i];")
    body = " ".join(f"{s.strip()};" for s in kernel.operation.split(";") if s.strip())
    return (f"typedef {ctype} T;\nextern \"C\" __global__ void {name}({', '.join(params)}, long long _n) {{\n"
            f"    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < _n;\n"
            f"         i += (long long)gridDim.x * blockDim.x) {{\n        {' '.join(reads)}\n        {body}\n    }}\n}}\n")

