"""Every error message of the DDP reducer, defined once so that both twins raise them word for word.

The messages name parameters by default (the anchor, reducer.cpp, names them only under
``TORCH_DISTRIBUTED_DEBUG``), since a list of indices sends users hunting through ``named_parameters()``.
"""
from __future__ import annotations

import inspect
import re
import typing

from ..errors import CommHookError
from ..futures import Future
from .reducer_buckets import GradBucket

__all__ = ["marked_twice", "prior_reduction_unfinished", "static_graph_changed", "grad_mismatch", "hook_name",
           "check_hook_annotations", "check_hook_result", "check_hook_value"]


def _named(names, indices) -> str:
    return ", ".join(f"{names[i]!r} (index {i})" for i in indices)


def marked_twice(names, index, static_graph: bool, find_unused: bool) -> str:
    """``mark_variable_ready`` saw ``index`` twice in one iteration (``checkAndRaiseMarkedTwiceError``)."""
    causes = [
        "it is used in several reentrant backward passes (for example activation checkpointing); DDP supports "
        "that only with static_graph=True",
        "it is shared by several modules and used more than once, while the graph changes between iterations; "
        "try static_graph=True",
        "two DDP wrappers (or a DDP wrapper and a manual allreduce hook) reduce the same parameter",
    ]
    if find_unused:
        causes.append("find_unused_parameters=True marked it unused, yet a gradient reached it later in the same "
                      "backward pass (its use is hidden from the graph walk)")
    listed = "".join(f"\n  {n}) {c}" for n, c in enumerate(causes, 1))
    return (f"parameter {names[index]!r} (index {index}) was marked ready twice in one backward pass; the DDP "
            f"reducer expects one gradient per parameter per iteration. Likely causes:{listed}")


def prior_reduction_unfinished(rank, names, unmarked, static_graph: bool, find_unused: bool) -> str:
    """A new iteration started before the last one's gradients were all reduced (``ensure_prior_reduction...``)."""
    head = ("expected the reduction of the previous iteration to finish before a new one starts. ")
    if static_graph:
        why = ("The training graph changed: with static_graph=True every iteration must use the same parameters "
               "as the first one.")
    elif not find_unused:
        why = ("This happens when the module has parameters that were not used in producing the loss. Pass "
               "find_unused_parameters=True to DistributedDataParallel, and make sure every output of forward "
               "takes part in the loss.")
    else:
        why = ("find_unused_parameters=True is set, so some outputs of forward likely did not take part in the "
               "loss; make sure they all do.")
    return (head + why + f"\nParameters that received no gradient on rank {rank}: {_named(names, unmarked)}")


def static_graph_changed(names, index) -> str:
    """A static graph produced more gradient hooks for a parameter than in its first iteration."""
    return (f"the training graph changed in this iteration: parameter {names[index]!r} (index {index}) received "
            "more gradients than in the first iteration, which static_graph=True does not allow (the set of used "
            "parameters and how often each is used must stay the same)")


def grad_mismatch(names, index, param_dtype, grad) -> str:
    """A gradient of the wrong dtype or layout reached the reducer."""
    kind = "sparse" if getattr(grad, "is_sparse", False) else f"{grad.dtype}"
    return (f"parameter {names[index]!r} (index {index}) has dtype {param_dtype} but its gradient is {kind}; the "
            "reducer needs a dense gradient of the parameter's dtype (a sparse gradient only for parameters "
            "declared sparse, such as Embedding(sparse=True))")


def grad_shape_mismatch(names, index, param_shape, grad_shape) -> str:
    """A gradient of the wrong shape reached the reducer (torch asserts the element counts match)."""
    return (f"parameter {names[index]!r} (index {index}) has shape {tuple(param_shape)} but its gradient has shape "
            f"{tuple(grad_shape)}; the reducer needs a gradient of the parameter's shape")


def hook_name(hook) -> str:
    return getattr(hook, "__name__", None) or repr(hook)


def _annotates(annotation, cls) -> bool:
    """Whether ``annotation`` is ``cls`` or ``cls[...]``; a string (``from __future__ import annotations``, which
    ``eval_str`` could not resolve) is read by name: ``GradBucket``, ``ddp.GradBucket``, ``Future[np.ndarray]``."""
    if isinstance(annotation, str):
        return re.fullmatch(rf"\s*(?:[\w.]+\.)?{cls.__name__}\s*(?:\[.*\])?\s*", annotation, re.S) is not None
    return annotation is cls or typing.get_origin(annotation) is cls


def check_hook_annotations(hook) -> None:
    """Refuse a hook annotated against the contract, at registration (mirrors torch's ``_check_comm_hook``).

    Torch raises ValueError when the bucket parameter is annotated with something other than GradBucket, or the
    return annotation is not a Future; an absent annotation passes. Torch compares the annotation objects, so it
    refuses string annotations; distlab resolves them first (``inspect.signature(eval_str=True)``), or, when the
    names are not importable where the hook lives, reads them by name.
    """
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        sig = inspect.signature(hook)
    params = list(sig.parameters.values())
    bucket = params[1].annotation if len(params) > 1 else inspect.Parameter.empty
    if bucket is not inspect.Parameter.empty and not _annotates(bucket, GradBucket):
        raise ValueError(f"Communication hook: bucket annotation should be distlab.ddp.GradBucket; hook "
                         f"{hook_name(hook)!r} annotates {params[1].name!r} with {_annotation_text(bucket)}")
    returns = sig.return_annotation
    if returns is not inspect.Signature.empty and not _annotates(returns, Future):
        raise ValueError(f"Communication hook: return annotation should be distlab.futures.Future; hook "
                         f"{hook_name(hook)!r} is annotated to return {_annotation_text(returns)}")


def _annotation_text(annotation) -> str:
    return repr(annotation) if isinstance(annotation, str) else getattr(annotation, "__qualname__", repr(annotation))


def check_hook_result(hook, result):
    """A communication hook must return a Future; anything else is refused here, naming the hook."""
    if not isinstance(result, Future):
        raise CommHookError(f"callback must return a distlab.futures.Future whose value is the reduced bucket "
                            f"buffer, but comm hook {hook_name(hook)!r} returned {type(result).__name__}")
    return result


def check_hook_value(hook, bucket, value):
    """The value a hook's Future completed with must be an array of the bucket's size (any array type)."""
    expected = bucket.gradients
    if getattr(value, "size", None) != expected.size or getattr(value, "ndim", None) != 1:
        raise CommHookError(f"callback must return a distlab.futures.Future whose value is the reduced bucket "
                            f"buffer, but comm hook {hook_name(hook)!r} completed with {type(value).__name__}, "
                            f"expected an array of {expected.size} {expected.dtype} elements (the bucket's size)")
    return value
