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
  arithmetic, as numpy's booleans are) and ``sqrt exp log fabs max min``; no float literals (a C ``1.0`` is a
  double, where numpy keeps a Python float in the array's type: pass such constants as ``T`` parameters,
  computed on the host), no ``?:``, no ``&&``/``||``, no casts;
- a scalar argument takes its parameter's type (``T lr`` with ``T`` float32 casts ``lr`` to float32, as numpy
  does to a Python float in ``lr * g``); an output parameter may be read (it is the element of the output array).

A GPU rounds some of these operations differently from numpy (the CUDA compiler contracts ``a - b * c`` into
one fused multiply-add), as it does for unfused cupy code: only the host twins are bit-equal to numpy.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["HostElementwiseKernel", "elementwise_kernel"]

#: the C types a body or a parameter may name, as numpy dtypes
_C_TYPES = {"float": "float32", "double": "float64", "int": "int32", "bool": "bool", "float16": "float16",
            "float32": "float32", "float64": "float64", "int32": "int32", "int64": "int64", "bool_": "bool"}
#: the functions a body may call, and numpy's function for each
_FUNCTIONS = {"sqrt": np.sqrt, "exp": np.exp, "log": np.log, "fabs": np.absolute, "max": np.maximum,
              "min": np.minimum}
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
        self.name = name
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
