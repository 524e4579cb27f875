"""The stand-in's array: host memory that refuses every implicit conversion to numpy, as ``cupy.ndarray`` does.

What it keeps from cupy, because that is what device code gets wrong:

- ``np.asarray(a)``, ``np.array(a)``, ``np.ascontiguousarray(a)`` raise the TypeError cupy's ``__array__`` raises;
  the buffer protocol and ``__array_interface__`` are absent, so numpy has no other way in;
- ufuncs and numpy functions given stand-in arrays stay on the "device" (``__array_ufunc__`` /
  ``__array_function__``, as cupy dispatches them), and refuse host arrays mixed in, as cupy's kernels do;
- reductions give 0-d arrays, not numpy scalars, and indexing one element gives a 0-d view (a later write
  through the array shows in it, as in cupy); ``float()``, ``int()``, ``bool()``,
  ``.item()``, ``.tolist()`` and ``.get()`` are the explicit ways out, and each is counted (:mod:`._transfers`);
- ``.set(host)`` takes only a numpy array of the same shape and dtype;
- ``__cuda_array_interface__`` points at the memory, so a "CUDA-aware" MPI can be handed the array directly;
  ``data.ptr`` and the interface register the memory they expose, so code that passes raw pointers (the stand-in
  NCCL's collectives) gets them resolved back to that memory, and a pointer to nothing known is refused;
- every operation that would start a kernel on a GPU (a ufunc, a reduction, a matmul, a copy, a fill, an
  allocation) counts one launch, and a view none (:func:`launched`, :mod:`._transfers`).

The maths runs in numpy on the wrapped host array, so a seeded run on the stand-in is bit-equal to the same run on
numpy: the stand-in proves where the data goes, not how a GPU rounds.
"""
from __future__ import annotations

import inspect
import weakref

import numpy as np

from . import _transfers
from ._memory import MemoryPointer, UnownedMemory, host_bytes, over_pointer

__all__ = ["ndarray", "MemoryPointer", "unwrap", "unwrap_index", "wrap", "resolve_pointer", "launched", "launch_kind"]

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")


#: Device memory whose address was handed out (``data.ptr``, ``__cuda_array_interface__``): start address ->
#: (byte length, weak reference to the host array behind it); an entry goes when its array is collected.
_exposed: dict[int, tuple[int, weakref.ref]] = {}


def _expose(host: np.ndarray) -> int:
    """Register ``host``'s memory (C-contiguous arrays only: a raw pointer names a flat range) and return its
    address."""
    ptr = host.__array_interface__["data"][0]
    if host.flags.c_contiguous and host.nbytes:
        known = _exposed.get(ptr)
        if known is None or known[0] < host.nbytes or known[1]() is None:
            _exposed[ptr] = (host.nbytes, weakref.ref(host, lambda ref, ptr=ptr: _forget(ptr, ref)))
    return ptr


def _forget(ptr: int, ref) -> None:
    known = _exposed.get(ptr)
    if known is not None and known[1] is ref:
        del _exposed[ptr]


def resolve_pointer(ptr: int, nbytes: int, what: str = "pointer") -> np.ndarray:
    """The ``nbytes`` bytes at device address ``ptr``, as a writable uint8 view of the memory behind it.

    ``ptr`` must lie, with its ``nbytes``, inside memory some stand-in array exposed (``data.ptr``) and still
    holds; anything else is refused with a ValueError (on a GPU it would be an illegal address).
    """
    ptr, nbytes = int(ptr), int(nbytes)
    for start, (length, ref) in list(_exposed.items()):
        host = ref()
        if host is not None and start <= ptr and ptr + nbytes <= start + length:
            return host.reshape(-1).view(np.uint8)[ptr - start:ptr - start + nbytes]
    mapped = host_bytes(ptr, nbytes)
    if mapped is not None:
        return mapped
    raise ValueError(f"{what} {ptr:#x} ({nbytes} bytes) is not inside any live device array whose address was "
                     "taken (data.ptr), nor inside a live cuda.Memory or opened IPC handle: an illegal address")


def wrap(value):
    """Host results back onto the "device": numpy arrays and scalars become :class:`ndarray`, containers recurse."""
    if isinstance(value, np.ndarray):
        return _over(value)
    if isinstance(value, np.generic):
        return _over(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(wrap(v) for v in value)
    if isinstance(value, list):
        return [wrap(v) for v in value]
    return value


def unwrap(value, what: str = "argument"):
    """Stand-in arrays to their host arrays for the numpy call underneath; a host array is refused, as cupy does."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type {type(value)} ({what}): a numpy array cannot be mixed with device "
                        "arrays; move it to the device first (xp.asarray)")
    if isinstance(value, (tuple, list)):
        return type(value)(unwrap(v, what) for v in value)
    if isinstance(value, dict):
        return {k: unwrap(v, what) for k, v in value.items()}
    return value


def unwrap_index(key):
    """An index may hold device arrays (unwrapped) or host arrays and lists (copied in, as cupy allows)."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, tuple):
        return tuple(unwrap_index(k) for k in key)
    return key


#: what a launch of each (numpy) function or method is counted as; the rest are "elementwise"
_KINDS = {**dict.fromkeys(("sum", "mean", "max", "min", "prod", "var", "std", "argmax", "argmin", "any", "all",
                           "cumsum", "cumprod", "ptp", "amax", "amin", "nonzero", "count_nonzero", "average",
                           "linalg.norm", "norm", "sort", "argsort", "partition", "argpartition"), "reduction"),
          **dict.fromkeys(("matmul", "dot", "tensordot", "einsum", "inner", "outer", "vdot"), "matmul"),
          **dict.fromkeys(("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
                           "arange", "eye", "identity", "linspace"), "alloc"),
          **dict.fromkeys(("copy", "astype", "concatenate", "stack", "take", "copyto", "repeat", "tile", "flatten",
                           "ascontiguousarray", "compress", "choose", "put", "diagonal", "trace"), "copy"),
          "fill": "fill"}


def launch_kind(name: str) -> str:
    """The kind a launch of numpy's ``name`` is counted as ("reduction", "matmul", "alloc", "copy", ...)."""
    return _KINDS.get(name, "elementwise")


def _host_arrays(values, scalars=False):
    for v in values:
        if isinstance(v, np.ndarray) or (scalars and isinstance(v, np.generic)):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _host_arrays(v, scalars)


def launched(name: str, result, sources, out=None) -> None:
    """Count the launch of ``name`` that made ``result`` from the host arrays among ``sources``, unless ``result``
    is a view of one of them (reshape, transpose, broadcast, basic indexing: no kernel on cupy either)."""
    if out is None and result is not None:
        results = list(_host_arrays((result,), scalars=True))  # a numpy scalar is new memory
        if not results or all(any(np.may_share_memory(r, s) for s in _host_arrays(sources)) for r in results):
            return
    _transfers.count_launch(launch_kind(name))


def _binary(ufunc, reflected=False):
    def op(self, other):
        if getattr(other, "__array_priority__", 0) > self.__array_priority__ and not isinstance(other, ndarray):
            return NotImplemented  # a Tensor (or anything of higher priority) takes the operator, as with cupy
        if not isinstance(other, (ndarray, np.ndarray, np.generic, int, float, complex, bool)):
            return NotImplemented
        return ufunc(other, self) if reflected else ufunc(self, other)
    return op


def _inplace(ufunc):
    def op(self, other):
        ufunc(self, other, out=(self,))
        return self
    return op



def _read_back(convert):
    """A scalar conversion of a device array (``float(a)``...): one counted read back to the host."""
    def method(self):
        _transfers.count("item")
        return convert(self._a)

    method.__name__ = f"__{convert.__name__}__"
    return method

class ndarray:  # noqa: N801 - the name cupy's array type has
    """A "device" array over host memory (see the module docstring). Build one with the facade (``xp.asarray``)."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100.0  # as cupy.ndarray's

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        """``ndarray(shape, dtype=float, memptr=None, strides=None, order='C')``, as cupy's: new memory, or a view
        of the memory at ``memptr`` (a :class:`MemoryPointer`, kept alive by the array)."""
        shape = tuple(int(n) for n in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        dtype = np.dtype(dtype)
        if order not in ("C", "F"):
            raise ValueError(f"order not understood: {order!r}")
        if memptr is None:
            if strides is not None:
                raise ValueError("strides are given without memptr")
            _transfers.count_launch("alloc")
            self._a = np.empty(shape, dtype, order=order)
            return
        if not isinstance(memptr, MemoryPointer):
            raise TypeError(f"memptr must be a MemoryPointer, got {type(memptr).__name__}")
        count = int(np.prod(shape))
        if strides is None:
            nbytes = count * dtype.itemsize
        else:
            nbytes = 0 if count == 0 else dtype.itemsize + sum((n - 1) * abs(int(s)) for n, s in zip(shape, strides))
        if nbytes == 0:
            self._a = np.empty(shape, dtype, order=order)
            return
        if host_bytes(memptr.ptr, nbytes) is None:  # a cuda.Memory or an opened handle, else an exposed array
            resolve_pointer(memptr.ptr, nbytes, "memptr")  # memory that exists, or an illegal address
        span = over_pointer(memptr.ptr, nbytes, memptr)  # the array holds memptr, its memory and its owner
        self._a = np.ndarray(shape, dtype, buffer=span, strides=strides, order=order)

    # -- the walls: no implicit conversion to the host ---------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for x in inputs:
            if not isinstance(x, (ndarray, np.ndarray, np.generic, int, float, complex, bool)) and x is not None:
                return NotImplemented
        args = unwrap(inputs, f"{ufunc.__name__} operand")
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = unwrap(out, f"{ufunc.__name__} out")
        result = getattr(ufunc, method)(*args, **kwargs)
        _transfers.count_launch("matmul" if ufunc is np.matmul else "elementwise" if method in ("__call__", "at")
                                else "reduction")  # a ufunc always runs a kernel, in place or not
        if out is not None:
            return out[0] if len(out) == 1 else out
        return wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        if not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        out = kwargs.get("out")
        args = unwrap(args, func.__name__)
        result = func(*args, **unwrap(kwargs, func.__name__))
        launched(func.__name__, result, args, out)
        return out if out is not None else wrap(result)

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr,
                "strides": None if a.flags.c_contiguous else a.strides,
                "data": (_expose(a), False), "version": 3}

    # -- explicit transfers (counted) ------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        """Copy to a new numpy array (or into ``out``): the explicit device-to-host transfer."""
        _transfers.count("to_host")
        if out is not None:  # cupy's checks, in its order and words
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if out.dtype != self._a.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self._a.dtype} array")
            if out.shape != self._a.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self._a.shape}, actual shape: {out.shape}")
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to non-contiguous ndarray")
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        """Copy a numpy array of the same shape and dtype in: the explicit host-to-device transfer."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self._a.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self._a.dtype} array")
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        _transfers.count("from_host")
        self._a[...] = arr

    def item(self):
        _transfers.count("item")
        return self._a.item()

    def tolist(self):
        _transfers.count("to_host")
        return self._a.tolist()

    # float(a), int(a), bool(a), complex(a): each reads the value back to the host, as cupy's do
    __float__ = _read_back(float)
    __int__ = _read_back(int)
    __bool__ = _read_back(bool)
    __complex__ = _read_back(complex)

    def __reduce__(self):  # pickling copies to the host, as cupy's does
        _transfers.count("to_host")
        return _rebuild, (self._a.copy(),)

    def __repr__(self):
        return repr(self._a)  # shown, not used: a diagnostic, as cupy's repr

    def __str__(self):
        return str(self._a)

    # -- metadata ---------------------------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: MemoryPointer(UnownedMemory(_expose(self._a), self._a.nbytes, self._a, 0), 0))
    T = property(lambda self: _over(self._a.T))
    real = property(lambda self: _over(self._a.real))
    imag = property(lambda self: _over(self._a.imag))

    @property
    def base(self):
        return None if self._a.base is None else _over(self._a.base) if isinstance(self._a.base, np.ndarray) \
            else self._a.base

    @property
    def device(self):
        from .cuda import Device

        return Device(0)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (wrap(x) for x in self._a)

    def __getitem__(self, key):
        key = unwrap_index(key)
        result = self._a[key]
        if isinstance(result, np.generic):  # one element: cupy gives a 0-d view of it, not numpy's scalar copy
            result = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        launched("take", result, (self._a,))  # advanced indexing gathers (a kernel); basic indexing is a view
        return wrap(result)

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray):
            _transfers.count("from_host")  # host to device in an assignment is allowed, as in cupy
        else:
            _transfers.count_launch("fill" if not isinstance(value, ndarray) else "copy")
        self._a[unwrap_index(key)] = value._a if isinstance(value, ndarray) else value

    def __copy__(self):
        _transfers.count_launch("copy")
        return _over(self._a.copy())

    def __deepcopy__(self, memo):
        _transfers.count_launch("copy")
        return _over(self._a.copy())

    def __matmul__(self, other):
        if getattr(other, "__array_priority__", 0) > self.__array_priority__ and not isinstance(other, ndarray):
            return NotImplemented
        return np.matmul(self, other)

    def __rmatmul__(self, other):
        return np.matmul(other, self)

    def __abs__(self):
        return np.absolute(self)

    def __neg__(self):
        return np.negative(self)

    def __pos__(self):
        return np.positive(self)

    def __invert__(self):
        return np.invert(self)

    __hash__ = None


_OPERATORS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
              "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power, "and": np.bitwise_and,
              "or": np.bitwise_or, "xor": np.bitwise_xor, "lshift": np.left_shift, "rshift": np.right_shift}
for _name, _ufunc in _OPERATORS.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(_ufunc))
for _name, _ufunc in {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                      "gt": np.greater, "ge": np.greater_equal}.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))


def _method(name, params: str):
    """The method ``name`` with cupy's ``params``: an argument cupy's method does not take is refused with
    Python's TypeError, as cupy's refuses it; the rest go to numpy's method on the host array."""
    signature = inspect.signature(eval(f"lambda self, {params}: None"))  # noqa: S307 - METHODS' constant text
    host_defaults = _HOST_DEFAULTS.get(name, {})

    def method(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        out = kwargs.get("out")
        kwargs.update((k, v) for k, v in host_defaults.items() if k not in given)
        result = getattr(self._a, name)(*unwrap(args, name), **unwrap(kwargs, name))
        launched(name, result, (self._a,), out)
        return out if out is not None else wrap(result)
    method.__name__ = name
    method.__signature__ = signature
    return method


#: The array methods cupy has (and device code uses), with cupy 14's parameters (the snapshot test compares them
#: with cupy's): run on the host array with their results kept on the device.
METHODS = {
    "reshape": "*shape, order='C', copy=None", "view": "dtype=None, type=None",
    "astype": "dtype, order='K', casting=None, subok=None, copy=True", "copy": "order='C'", "ravel": "order='C'",
    "flatten": "order='C'", "transpose": "*axes", "swapaxes": "axis1, axis2", "squeeze": "axis=None",
    "sum": "axis=None, dtype=None, out=None, keepdims=False", "mean": "axis=None, dtype=None, out=None, keepdims=False",
    "max": "axis=None, out=None, keepdims=False", "min": "axis=None, out=None, keepdims=False",
    "prod": "axis=None, dtype=None, out=None, keepdims=None",
    "var": "axis=None, dtype=None, out=None, ddof=0, keepdims=False",
    "std": "axis=None, dtype=None, out=None, ddof=0, keepdims=False",
    "argmax": "axis=None, out=None, dtype=None, keepdims=False", "argmin": "axis=None, out=None, dtype=None, "
    "keepdims=False", "any": "axis=None, out=None, keepdims=False", "all": "axis=None, out=None, keepdims=False",
    "cumsum": "axis=None, dtype=None, out=None", "clip": "min=None, max=None, out=None", "dot": "b, out=None",
    "nonzero": "", "fill": "value", "repeat": "repeats, axis=None", "take": "indices, axis=None, out=None",
    "round": "decimals=0, out=None", "conj": "", "sort": "axis=-1, kind=None", "argsort": "axis=-1, kind=None",
    "diagonal": "offset=0, axis1=0, axis2=1", "trace": "offset=0, axis1=0, axis2=1, dtype=None, out=None",
    "cumprod": "axis=None, dtype=None, out=None", "ptp": "axis=None, out=None, keepdims=False",
    "put": "indices, values, mode='wrap'", "choose": "choices, out=None, mode='raise'",
    "compress": "condition, axis=None, out=None", "partition": "kth, axis=-1", "argpartition": "kth, axis=-1"}
#: where cupy's default differs from numpy's, the stand-in hands numpy cupy's (``put`` wraps out-of-range indices)
_HOST_DEFAULTS = {"put": {"mode": "wrap"}}
for _name, _params in METHODS.items():
    setattr(ndarray, _name, _method(_name, _params))


def _over(host: np.ndarray) -> ndarray:
    """The device array over ``host`` (how the stand-in wraps its numpy results: no copy, no launch)."""
    out = ndarray.__new__(ndarray)
    out._a = host
    return out


def _rebuild(host):
    return _over(host)
