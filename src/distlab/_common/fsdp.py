"""What both FSDP twins share, defined once: the states, the mixed precision policy, torch's chunk rule, the
gradient divide factors, the reused flat buffers, and every error message.

Mirrors the small shared pieces of torch/distributed/fsdp/_fully_shard/: ``_fsdp_api.py``
(``MixedPrecisionPolicy``), ``_fsdp_common.py`` (``TrainingState``, ``_chunk_with_empty``,
``_get_dim0_padded_size``) and ``_fsdp_collectives.py``'s ``_get_gradient_divide_factors``. What runs per
parameter and per step (copy-in, copy-out, padding, views, the reduce-scatter's packing) is twinned:
``reference/fsdp_param.py``, ``reference/fsdp_collectives.py``, ``reference/fsdp_param_group.py``.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import numpy as np

__all__ = ["ShardedState", "TrainingState", "MixedPrecisionPolicy", "AllGatherResult", "resolve_dtype", "chunk_rows", "shard_rows",
           "gradient_divide_factors", "BufferPool", "collective_name", "FSDP_LANE", "TWIN_NAMES"]

#: What both twins export (``distlab.reference.fsdp_param_group`` and ``distlab.core._fsdp_param_group``).
TWIN_NAMES = ("FSDPParam", "ParamModuleInfo", "FSDPParamGroup", "FSDPCommContext", "MeshInfo", "AllGatherResult",
              "ReduceScatterState", "foreach_all_gather", "all_gather_copy_in", "foreach_all_gather_copy_out",
              "foreach_reduce", "foreach_reduce_scatter_copy_in", "free_reduce_input", "wait_reduce_scatter",
              "finish_reduce",
              "PostBackwardNode")

#: The timeline lane of FSDP's own spans (copy-in, copy-out, each group's compute); the collectives themselves
#: are recorded by the comm layer on its lanes.
FSDP_LANE = "fsdp"


class ShardedState(enum.IntEnum):
    """Where a parameter group's data is (``_fsdp_param.py ShardedState``).

    ``SHARDED``: only the shards exist, registered on the modules. ``SHARDED_POST_FORWARD``: after a forward with
    ``reshard_after_forward=k``, each rank also keeps a 1/k piece of the unsharded data, so that backward gathers
    over k ranks only. ``UNSHARDED``: the all-gathered parameters are registered on the modules.
    """

    SHARDED = 0
    SHARDED_POST_FORWARD = 1
    UNSHARDED = 2


class TrainingState(enum.IntEnum):
    """What a group or a module's FSDP state is doing (``_fsdp_common.py TrainingState``)."""

    IDLE = 0
    FORWARD = 1
    PRE_BACKWARD = 2
    POST_BACKWARD = 3


class AllGatherResult(NamedTuple):
    """An all-gather issued and not yet copied out (``_fsdp_collectives.py AllGatherResult``)."""

    all_gather_output: object  # the (W, n) buffer
    flat_output: object  # the same, flat, as the pool gave it
    all_gather_input: object  # this rank's n elements
    all_gather_work: object  # the Work of an asynchronous all-gather, else None
    input_numels: list  # elements each parameter put in
    world_size: int


def resolve_dtype(dtype):
    """``dtype`` as a numpy dtype (``np.float16``, ``"bfloat16"``, ``ml_dtypes.bfloat16``), or None."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision of one ``fully_shard`` call (torch's ``MixedPrecisionPolicy``, ``_fsdp_api.py``).

    Parameters
    ----------
    param_dtype : dtype, optional
        All-gather the parameters in this dtype and compute forward and backward in it (float16, bfloat16).
        The optimizer keeps stepping the sharded parameters in their own dtype.
    reduce_dtype : dtype, optional
        Reduce-scatter (and, hybrid, all-reduce) the gradients in this dtype; default: ``param_dtype``.
    output_dtype : dtype, optional
        Cast the module's floating-point outputs to this dtype.
    cast_forward_inputs : bool
        Cast the module's floating-point inputs to ``param_dtype`` (default True).

    A dtype equal to the one it replaces becomes None, as torch clamps it: ``param_dtype`` equal to a
    parameter's own dtype, ``reduce_dtype`` equal to ``param_dtype``.
    """

    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, field, resolve_dtype(getattr(self, field)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy: cast_forward_inputs must be a bool, got "
                            f"{self.cast_forward_inputs!r}")

    def clamped(self, orig_dtype) -> tuple:
        """``(param_dtype, reduce_dtype)`` for a parameter of ``orig_dtype`` (``FSDPParam.init_dtype_attrs``)."""
        param_dtype, reduce_dtype = self.param_dtype, self.reduce_dtype
        if reduce_dtype is not None and reduce_dtype == param_dtype:
            reduce_dtype = None  # gradients are computed in param_dtype: no cast needed
        if param_dtype is not None and (param_dtype == orig_dtype or np.dtype(orig_dtype).kind != "f"):
            param_dtype = None  # nothing to cast (or not a floating-point parameter)
        return param_dtype, reduce_dtype


def chunk_rows(rows: int, world_size: int) -> int:
    """Rows per rank under ``torch.chunk`` on dimension 0: ``ceil(rows / world_size)`` (every rank allocates as
    many, zero-padded)."""
    return -(-int(rows) // int(world_size))


def shard_rows(rows: int, world_size: int, rank: int) -> tuple:
    """``(first row, number of rows)`` of ``rank``'s shard (``_chunk_with_empty``): ranks past the end hold none
    (6 rows over 4 ranks: 2, 2, 2, 0)."""
    chunk = chunk_rows(rows, world_size)
    first = min(rank * chunk, rows)
    return first, max(0, min(chunk, rows - first))


def gradient_divide_factors(reduce_dtype, shard_size: int, replicate_size: int, factor=None) -> tuple:
    """``(pre-divide, post-divide, reduce-scatter op, all-reduce op)`` (``_get_gradient_divide_factors``).

    float32 and bfloat16 reduce with the collective's average (``"avg"``), or, for a custom ``factor``, a sum of
    inputs pre-multiplied by ``1 / factor`` (NCCL's PREMUL_SUM; the first element of the tuple is then
    ``("premul", 1 / factor)``). Other dtypes, whose range overflows (float16), sum: divided by about
    ``sqrt(N)`` before the reduction and by the rest after it. ``N`` is the shard group's size times the
    replicate group's (hybrid sharding).
    """
    size = shard_size * replicate_size
    overflow_risk = np.dtype(reduce_dtype) not in (np.dtype(np.float32), resolve_dtype("bfloat16"))
    if not overflow_risk:
        if factor is None:
            return (None, None, "sum", "sum") if size == 1 else (None, None, "avg", "avg")
        if factor == shard_size:
            return None, None, "avg", "sum"
        return ("premul", 1.0 / factor), None, "sum", "sum"
    factor = float(size) if factor is None else float(factor)
    if np.dtype(reduce_dtype).kind == "f" and np.dtype(reduce_dtype).itemsize < 4:
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre, "sum", "sum"
    return None, factor, "sum", "sum"


def collective_name(kind: str, fqn: str) -> str:
    """The name a group's collective carries in traces, timelines and timeouts: ``"fsdp all-gather layers.0"``."""
    return f"fsdp {kind} {fqn or '<root>'}"


class BufferPool:
    """Flat buffers reused from one group to the next (torch's caching allocator plays this part).

    ``take(xp, dtype, numel)`` returns a 1-D view of ``numel`` elements of a free buffer of ``dtype`` large
    enough (the largest is grown when none is), and ``give_back(view)`` makes its buffer free again. One
    all-gather in flight needs one buffer: a group's all-gather output is given back after its copy-out, before
    the next group's all-gather is issued. When no all-gather follows (the first group's backward), ``clear()``
    hands the idle buffers back to the allocator (which keeps freed memory for the next step: distlab._malloc).
    """

    def __init__(self):
        self._free: dict = {}  # (array module, dtype) -> buffers not in use
        self._used: dict = {}  # id(view) -> (key, buffer, view)

    def take(self, xp, dtype, numel: int):
        key = (xp, np.dtype(dtype))
        free = self._free.setdefault(key, [])
        fits = [i for i, buf in enumerate(free) if buf.size >= numel]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].size))
        else:
            if free:  # too small for this group: a larger one replaces it
                free.pop(max(range(len(free)), key=lambda i: free[i].size))
            buf = xp.empty(max(int(numel), 1), dtype=key[1])
        view = buf[:numel]
        self._used[id(view)] = (key, buf, view)
        return view

    def give_back(self, view) -> None:
        entry = self._used.pop(id(view), None)
        if entry is not None:
            self._free[entry[0]].append(entry[1])

    def clear(self) -> None:
        """Drop every buffer not in use (their memory returns to the allocator)."""
        self._free.clear()

    def nbytes(self) -> int:
        """Bytes held by the pool's buffers, in use or not."""
        return (sum(b.nbytes for bufs in self._free.values() for b in bufs)
                + sum(buf.nbytes for _, buf, _ in self._used.values()))
