"""Fused element-wise kernels: one launch on a GPU for what would be several array operations.

At a small model's size a GPU training step is bound by kernel launches, not by arithmetic: every separate array
operation (each ``+``, ``*``, ``astype``) starts a kernel, and cupy takes about 8 us to start one. So the hot
element-wise updates (an optimizer's per-parameter update, ReLU's backward) are written once as a
``cupy.ElementwiseKernel``: parameters (``"T g, T lr"``, ``"T p"``) and a body of statements (``"p -= lr * g"``).

:func:`elementwise_kernel` returns that kernel for an array module: cupy's own ``ElementwiseKernel`` (compiled,
one launch), the device stand-in's (``distlab.fakegpu``: the same body run on the host, counted as one launch),
or, for numpy, :class:`HostElementwiseKernel`, which runs the body with numpy. The body is written in the subset
of C whose meaning numpy shares statement for statement, so the host twin gives the bits the same operations
written with numpy arrays give:

- statements ``T name = expr;``, ``name = expr;`` and ``name op= expr;`` (``+ - * /``), separated by ``;``;
- expressions of parameters, locals, integer literals, ``+ - * /``, comparisons (``y > 0`` is 1 or 0 in
  arithmetic, as numpy's booleans are) and ``sqrt exp log fabs fmax fmin``; no float literals (a C ``1.0`` is a
  double, where numpy keeps a Python float in the array's type: pass such constants as ``T`` parameters,
  computed on the host), no ``?:``, no ``&&``/``||``, no casts;
- a scalar argument takes its parameter's type (``T lr`` with ``T`` float32 casts ``lr`` to float32, as numpy
  does to a Python float in ``lr * g``); an output parameter may be read (it is the element of the output array).

A GPU rounds some of these operations differently from numpy (the CUDA compiler contracts ``a - b * c`` into
one fused multiply-add; its ``fmax`` skips a NaN that numpy's ``maximum`` keeps), as it does for unfused cupy
code: only the host twins are bit-equal to numpy.

:func:`multi_tensor_kernel` gives a kernel's multi-tensor form, which runs the body over many arrays in one launch
(torch's ``multi_tensor_apply``, what an optimizer step needs): on cupy a ``RawKernel`` whose source
(:meth:`MultiTensorKernel.cuda_source`) wraps the same body in a loop over a chunk of up to 32 arrays.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["HostElementwiseKernel", "elementwise_kernel", "MultiTensorKernel", "CupyMultiTensorKernel",
           "multi_tensor_kernel", "MULTI_TENSOR_DTYPES"]

#: the C types a body or a parameter may name, as numpy dtypes
_C_TYPES = {"float": "float32", "double": "float64", "int": "int32", "bool": "bool", "float16": "float16",
            "float32": "float32", "float64": "float64", "int32": "int32", "int64": "int64", "bool_": "bool"}
#: the functions a body may call, and numpy's function for each
# fmax/fmin, not max/min: CUDA's math library declares them for float and double in every compiler (NVRTC for
# raw kernels included), where max/min overloads depend on the headers a kernel gets.
_FUNCTIONS = {"sqrt": np.sqrt, "exp": np.exp, "log": np.log, "fabs": np.absolute, "fmax": np.maximum,
              "fmin": np.minimum}
_STATEMENT = re.compile(r"\s*(?:const\s+)?(?:(?P<type>[A-Za-z_]\w*)\s+)?(?P<name>[A-Za-z_]\w*)\s*"
                        r"(?P<op>[-+*/]?)=(?!=)(?P<expr>.+)", re.S)
_TOKEN = re.compile(r"\s*(?:(?P<number>\d+)(?![\w.])|(?P<name>[A-Za-z_]\w*)|(?P<op>[<>!=]=|[-+*/(),<>]))")


def _parse_params(text: str, what: str) -> list:
    """``"T a, float32 b"`` -> ``[("a", "T"), ("b", "float32")]``."""
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        if len(words) != 2 or words[0] == "raw":
            raise ValueError(f"{what}: {part!r} is not a parameter the kernels support (\"TYPE name\"; no raw)")
        params.append((words[1], words[0]))
    return params


def _check_expression(expr: str, known: set, where: str) -> None:
    pos = 0
    while pos < len(expr.rstrip()):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"{where}: cannot read {expr[pos:].strip()!r} (the kernels take +, -, *, /, "
                             f"comparisons, integer literals and {', '.join(_FUNCTIONS)}; no float literals)")
        name = match.group("name")
        if name is not None and name not in known and name not in _FUNCTIONS:
            raise ValueError(f"{where}: unknown name {name!r}")
        pos = match.end()


class HostElementwiseKernel:
    """A ``cupy.ElementwiseKernel`` run by numpy: same parameters, same body, same calling convention.

    Called with the inputs, then optionally every output (written in place); without outputs, they are allocated
    with the inputs' broadcast shape. Returns the output, or a tuple of them.
    """

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel"):
        self.name, self.operation = name, operation
        self.in_params = _parse_params(in_params, name)
        self.out_params = _parse_params(out_params, name)
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        inputs = {n for n, _ in self.in_params}
        outputs = {n for n, _ in self.out_params}
        self._types = dict(self.in_params + self.out_params)
        self._statements = []
        locals_ = {}
        for text in filter(str.strip, operation.split(";")):
            match = _STATEMENT.fullmatch(text)
            if match is None:
                raise ValueError(f"{name}: cannot read the statement {text.strip()!r}")
            var, ctype, op, expr = match.group("name"), match.group("type"), match.group("op"), match.group("expr")
            where = f"{name}: {text.strip()!r}"
            if var in inputs:
                raise ValueError(f"{where}: {var!r} is an input parameter, which a kernel cannot assign")
            if ctype is not None:
                locals_[var] = ctype
            elif var not in outputs and var not in locals_:
                raise ValueError(f"{where}: {var!r} is assigned before it is declared")
            _check_expression(expr, inputs | outputs | set(locals_), where)
            source = f"{var} {op} ({expr})" if op else expr
            self._statements.append((var, locals_.get(var), compile(source.strip(), where, "eval")))
        self._local_types = locals_

    def _dtype(self, ctype: str, bound: dict):
        if ctype in _C_TYPES:
            return np.dtype(_C_TYPES[ctype])
        if ctype not in bound:
            raise TypeError(f"{self.name}: cannot determine the type {ctype} from the arguments")
        return bound[ctype]

    def __call__(self, *args):
        if len(args) not in (self.nin, self.nin + self.nout):
            raise TypeError(f"Wrong number of arguments for {self.name}: {len(args)} (takes {self.nin} inputs, "
                            f"then optionally {self.nout} outputs)")
        params = self.in_params + self.out_params[:len(args) - self.nin]
        bound = {}
        for (pname, ctype), value in zip(params, args):
            if isinstance(value, np.ndarray) and ctype not in _C_TYPES:
                if bound.setdefault(ctype, value.dtype) != value.dtype:
                    raise TypeError(f"{self.name}: type is mismatched: {pname} is {value.dtype}, {ctype} is "
                                    f"{bound[ctype]}")
        ns = dict(_FUNCTIONS)
        shapes = []
        for (pname, ctype), value in zip(params, args):
            dtype = self._dtype(ctype, bound)
            if isinstance(value, np.ndarray):
                shapes.append(value.shape)
                ns[pname] = value
            else:
                ns[pname] = dtype.type(value)  # a scalar takes its parameter's type, as in C
        shape = np.broadcast_shapes(*shapes)
        outputs = args[self.nin:]
        if not outputs:
            outputs = tuple(np.empty(shape, self._dtype(ctype, bound)) for _, ctype in self.out_params)
        elif any(o.shape != shape for o in outputs):
            raise ValueError(f"{self.name}: the outputs' shapes {[o.shape for o in outputs]} are not the "
                             f"broadcast shape {shape}")
        ns.update((pname, out) for (pname, _), out in zip(self.out_params, outputs))
        out_names = {pname: out for (pname, _), out in zip(self.out_params, outputs)}
        for var, ctype, code in self._statements:
            value = eval(code, {"__builtins__": {}}, ns)  # noqa: S307 - a body checked by _check_expression
            if var in out_names:
                np.copyto(out_names[var], value, casting="unsafe")  # C's conversion on assignment
            else:
                ns[var] = np.asarray(value).astype(self._dtype(self._local_types[var], bound), copy=False)
        return outputs[0] if self.nout == 1 else tuple(outputs)


_CACHE: dict = {}


def elementwise_kernel(xp, in_params: str, out_params: str, operation: str, name: str):
    """The kernel for array module ``xp``: its own ``ElementwiseKernel`` (cupy, the device stand-in), else (numpy)
    a :class:`HostElementwiseKernel`. Made once per module and kernel, and kept (cupy compiles one per dtype)."""
    key = (xp.__name__, in_params, out_params, operation, name)
    kernel = _CACHE.get(key)
    if kernel is None:
        make = getattr(xp, "ElementwiseKernel", None) if xp is not np else None
        kernel = _CACHE[key] = (make or HostElementwiseKernel)(in_params, out_params, operation, name)
    return kernel


class MultiTensorKernel:
    """A kernel's multi-tensor form: one launch runs its body over up to :attr:`CHUNK` tensors (torch's
    ``multi_tensor_apply``), so an optimizer step is a few launches instead of one per parameter.

    Called with one argument per parameter: a list (one array per tensor, every list as long) or a scalar that
    all tensors share. Only ``T`` parameters; every array C-contiguous. This class runs each chunk on the host,
    tensor by tensor, with :class:`HostElementwiseKernel`; a device module's form launches each chunk once.
    """

    CHUNK = 32

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel"):
        self.elementwise = HostElementwiseKernel(in_params, out_params, operation, name)
        self.name, self.operation = name, operation
        self.signature = (in_params, out_params, operation, name)  # what made it, to make its other forms
        if any(ctype != "T" for _, ctype in self.elementwise.in_params + self.elementwise.out_params):
            raise ValueError(f"{name}: a multi-tensor kernel takes T parameters only")
        taken = {"t", "n", "i", "sizes"} & ({p for p, _ in self.elementwise.in_params + self.elementwise.out_params}
                                           | set(self.elementwise._local_types))
        if taken:
            raise ValueError(f"{name}: {sorted(taken)} are names the multi-tensor kernel's own code uses")

    def __call__(self, *args) -> None:
        lists = [a for a in args if isinstance(a, list)]
        count = len(lists[0]) if lists else 0
        if any(len(a) != count for a in lists) or len(args) != self.elementwise.nin + self.elementwise.nout:
            raise TypeError(f"{self.name}: give every parameter, each a list of one array per tensor (all as long) "
                            f"or a scalar")
        if any(not a.flags.c_contiguous for arrays in lists for a in arrays):
            raise ValueError(f"{self.name}: a multi-tensor kernel indexes its arrays flat: each must be C-contiguous")
        for start in range(0, count, self.CHUNK):
            self._launch([a[start:start + self.CHUNK] if isinstance(a, list) else a for a in args])

    def _launch(self, args: list) -> None:
        """Run one chunk (each list argument holds its arrays)."""
        for i in range(len(next(a for a in args if isinstance(a, list)))):
            self.elementwise(*(a[i] if isinstance(a, list) else a for a in args))

    def cuda_source(self, ctype: str, shape: tuple) -> tuple:
        """The CUDA source and kernel name of one launch: ``shape`` says, per parameter, how many tensors its list
        holds, or None for a scalar; ``ctype`` is ``T``'s C type."""
        k = next(n for n in shape if n is not None)
        params = self.elementwise.in_params + self.elementwise.out_params
        nin = self.elementwise.nin
        kernel = f"{self.name}_x{k}_" + "".join("a" if n else "s" for n in shape)
        args, tables, elements = [], [], []
        for index, ((pname, _), n) in enumerate(zip(params, shape)):
            const = "const " if index < nin else ""
            if n is None:
                continue
            args += [f"{const}T* {pname}_{t}" for t in range(k)]
            tables.append(f"    {const}T* const {pname}_all[{k}] = {{{', '.join(f'{pname}_{t}' for t in range(k))}}};")
            elements.append(f"        {const}T{'' if const else '&'} {pname} = {pname}_all[t][i];")
        args += [f"long long n_{t}" for t in range(k)]
        args += [f"T {pname}" for (pname, _), n in zip(params, shape) if n is None]
        body = "\n".join(f"        {s.strip()};" for s in self.operation.split(";") if s.strip())
        source = "\n".join([
            f"typedef {ctype} T;",
            f"extern \"C\" __global__ void {kernel}({', '.join(args)}) {{",
            "    const int t = blockIdx.y;",
            *tables,
            f"    const long long sizes[{k}] = {{{', '.join(f'n_{t}' for t in range(k))}}};",
            "    const long long n = sizes[t];",
            "    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;",
            "         i += (long long)gridDim.x * blockDim.x) {",
            *elements, body, "    }", "}", ""])
        return source, kernel

    def kernel_args(self, args: list, dtype) -> list:
        """One launch's arguments, in :meth:`cuda_source`'s order: the arrays, the sizes, the scalars (as ``T``)."""
        arrays = [a for arg in args if isinstance(arg, list) for a in arg]
        sizes = [np.int64(a.size) for a in next(arg for arg in args if isinstance(arg, list))]
        return arrays + sizes + [dtype.type(a) for a in args if not isinstance(a, list)]


_C_NAMES = {np.dtype("float32"): "float", np.dtype("float64"): "double"}
#: the dtypes a multi-tensor kernel takes (``T``'s C type without extra headers); others take one kernel an array
MULTI_TENSOR_DTYPES = frozenset(_C_NAMES)


class CupyMultiTensorKernel(MultiTensorKernel):
    """The multi-tensor kernel on cupy: each chunk is one ``cupy.RawKernel`` launch (compiled once per dtype and
    argument shape); the grid's rows are the chunk's tensors, its columns stride over their elements."""

    BLOCK = 256

    def __init__(self, cupy, in_params: str, out_params: str, operation: str, name: str = "kernel"):
        super().__init__(in_params, out_params, operation, name)
        self.cupy, self._compiled = cupy, {}

    def _launch(self, args: list) -> None:
        first = next(a for a in args if isinstance(a, list))
        dtype = first[0].dtype
        shape = tuple(len(a) if isinstance(a, list) else None for a in args)
        kernel = self._compiled.get((dtype, shape))
        if kernel is None:
            source, name = self.cuda_source(_C_NAMES[dtype], shape)
            kernel = self._compiled[(dtype, shape)] = self.cupy.RawKernel(source, name)
        largest = max(a.size for a in first)
        blocks = max(1, min(-(-largest // self.BLOCK), 1024))
        kernel((blocks, len(first)), (self.BLOCK,), tuple(self.kernel_args(args, dtype)))


def multi_tensor_kernel(xp, in_params: str, out_params: str, operation: str, name: str):
    """The multi-tensor form of a kernel for array module ``xp``: cupy's (raw kernels), the device stand-in's
    (``xp.MultiTensorKernel``: one counted launch a chunk), else numpy's (:class:`MultiTensorKernel`)."""
    key = ("multi", xp.__name__, in_params, out_params, operation, name)
    kernel = _CACHE.get(key)
    if kernel is None:
        if xp.__name__ == "cupy":
            kernel = CupyMultiTensorKernel(xp, in_params, out_params, operation, name)
        else:
            kernel = getattr(xp, "MultiTensorKernel", MultiTensorKernel)(in_params, out_params, operation, name)
        _CACHE[key] = kernel
    return kernel
