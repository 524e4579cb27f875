"""What the optimizers share: reading a parameter's gradient the way torch's ``_single_tensor_*`` do, and the
fused updates (one element-wise kernel per parameter, as torch's ``fused=True``).

An unfused update is a handful of array operations per parameter (SGD with momentum: six), each one kernel launch
on a GPU; a fused update is one kernel (:func:`distlab.autograd._kernels.elementwise_kernel`) whose body performs
the same operations in the same order, so numpy runs it to the same bits as the unfused code. Every scalar the
body needs (``1 - beta1``, ``lr / (1 - beta1 ** t)``...) is computed on the host in Python's doubles, as the
unfused code computes it, and handed to the kernel, which casts it to the parameter's type, as numpy does.
"""
from __future__ import annotations

import contextlib
import math
import threading

import numpy as np

from ..autograd._array import array_module, is_cupy
from ..autograd._kernels import MULTI_TENSOR_DTYPES, elementwise_kernel, multi_tensor_kernel
from ..autograd.sparse import SparseGrad

__all__ = ["dense_grad", "check_non_negative", "fusable", "batched", "fused_sgd", "fused_adam", "fused_adagrad",
           "fused_rmsprop", "fused_adadelta", "fused_adamax"]


def dense_grad(optimizer, p, maximize: bool, weight_decay: float = 0.0):
    """``p``'s gradient as a dense array, negated for ``maximize``, plus ``weight_decay * p`` (torch's coupled
    weight decay); a new array whenever either applies, so the gradient itself is never written in place.

    Raises RuntimeError for a sparse gradient, as torch does for every optimizer but SGD, Adagrad and SparseAdam.
    """
    if isinstance(p.grad, SparseGrad):
        raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients (as in torch); use SGD "
                           "or Adagrad for sparse embeddings")
    grad = -p.grad.data if maximize else p.grad.data
    return grad + weight_decay * p.data if weight_decay != 0 else grad


def check_non_negative(**values) -> None:
    """torch's constructor checks: ``ValueError("Invalid <name> value: <v>")`` for a negative hyper-parameter."""
    for name, value in values.items():
        if not 0.0 <= value:
            raise ValueError(f"Invalid {name} value: {value}")


def fusable(fused, p) -> bool:
    """Whether ``p``'s update runs fused: ``fused`` True or False as given; None (the default) on device arrays
    only (numpy keeps the readable operation-by-operation code, which gives the same bits). A gradient of another
    type, dtype or shape than the parameter (or a sparse one) takes the unfused code."""
    data, grad = p.data, p.grad
    if fused is False or isinstance(grad, SparseGrad) or (fused is None and not is_cupy(data)):
        return False
    grad = grad.data
    return type(grad) is type(data) and grad.dtype == data.dtype and grad.shape == data.shape


class _Batch(threading.local):
    calls = None  # the fused updates collected by the innermost batched() of this thread, or None


_batch = _Batch()


@contextlib.contextmanager
def batched():
    """Collect the fused updates of device parameters made inside, then run them as multi-tensor launches: each
    set of updates with the same body, dtype and scalars is one launch per 32 parameters (torch's
    ``multi_tensor_apply``) instead of one per parameter. What ``step`` runs its updates in. The updates are
    independent of each other, so running them together changes no result."""
    if _batch.calls is not None:
        yield
        return
    _batch.calls = calls = []
    try:
        yield
    finally:
        _batch.calls = None
        groups = {}
        for xp, signature, inputs, outputs in calls:
            scalars = tuple(v for _, v in inputs if not isinstance(v, xp.ndarray))
            key = (xp.__name__, signature, outputs[0][1].dtype, scalars)
            groups.setdefault(key, (xp, signature, []))[2].append((inputs, outputs))
        for xp, signature, members in groups.values():
            first_inputs, first_outputs = members[0]
            args = [[m[0][i][1] for m in members] if isinstance(v, xp.ndarray) else v
                    for i, (_, v) in enumerate(first_inputs)]
            args += [[m[1][i][1] for m in members] for i in range(len(first_outputs))]
            multi_tensor_kernel(xp, *signature)(*args)


def _run(data, name: str, inputs: list, outputs: list, body: list) -> None:
    """Run the kernel ``body`` over ``inputs`` ``[(param, value)]`` into ``outputs`` ``[(param, array)]``, now, or
    with the rest of a :func:`batched` step."""
    xp = array_module(data)
    signature = (", ".join(f"T {n}" for n, _ in inputs), ", ".join(f"T {n}" for n, _ in outputs),
                 "; ".join(body) + ";", name)
    if _batch.calls is not None and xp is not np and data.dtype in MULTI_TENSOR_DTYPES and all(
            a.flags.c_contiguous for _, a in inputs + outputs if isinstance(a, xp.ndarray)):
        _batch.calls.append((xp, signature, inputs, outputs))
        return
    elementwise_kernel(xp, *signature)(*(v for _, v in inputs), *(a for _, a in outputs))


def _start(p, maximize: bool, weight_decay: float = 0.0):
    """The kernel's first statements, :func:`dense_grad`'s operations: ``d``, the gradient (negated for
    ``maximize``) plus ``weight_decay * p``; with its inputs and the parameter as the first output."""
    inputs, body = [("g", p.grad.data)], ["T d = -g" if maximize else "T d = g"]
    if weight_decay != 0:
        inputs.append(("wd", weight_decay))
        body.append("d = d + wd * p")
    return inputs, [("p", p.data)], body


def fused_sgd(p, state, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """SGD's update of ``p`` (its dense gradient) and, with momentum, of the momentum buffer in ``state`` (made
    there on the first step, as the unfused ``grad.copy()``; ``state`` None without momentum), in one kernel."""
    inputs, outputs, body = _start(p, maximize, weight_decay)
    inputs.append(("lr", lr))
    if momentum != 0:
        inputs.append(("momentum", momentum))
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = array_module(p.data).empty_like(p.data)
            body.append("buf = d")
        elif dampening:
            inputs.append(("damp", 1 - dampening))
            body.append("buf = buf * momentum + damp * d")
        else:
            body.append("buf = buf * momentum + d")
        outputs.append(("buf", buf))
        body.append("d = d + momentum * buf" if nesterov else "d = buf")
    body.append("p = p - lr * d")
    _run(p.data, "distlab_sgd", inputs, outputs, body)


def fused_adam(p, state, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, step):
    """Adam's (AdamW's with ``decoupled``) update of ``p`` and its moments in ``state`` at step ``step``, in one
    kernel."""
    inputs, outputs, body = _start(p, maximize, 0.0 if decoupled else weight_decay)
    inputs += [("b1c", 1 - beta1), ("beta2", beta2), ("b2c", 1 - beta2), ("step_size", lr / (1 - beta1 ** step)),
               ("bc2", math.sqrt(1 - beta2 ** step)), ("eps", eps)]
    outputs += [("m", state["exp_avg"]), ("v", state["exp_avg_sq"])]
    if weight_decay != 0 and decoupled:
        inputs.append(("decay", 1 - lr * weight_decay))
        body.append("p = p * decay")
    body += ["m = m + b1c * (d - m)", "v = v * beta2 + b2c * d * d"]
    second = "v"
    if amsgrad:
        outputs.append(("vmax", state["max_exp_avg_sq"]))
        body.append("vmax = fmax(vmax, v)")
        second = "vmax"
    body.append(f"p = p - step_size * (m / (sqrt({second}) / bc2 + eps))")
    _run(p.data, "distlab_adam", inputs, outputs, body)


def fused_adagrad(p, state_sum, clr, eps, weight_decay, maximize):
    """Adagrad's dense update of ``p`` and its sum of squares, with this step's learning rate ``clr``."""
    inputs, outputs, body = _start(p, maximize, weight_decay)
    inputs += [("clr", clr), ("eps", eps)]
    outputs.append(("sum", state_sum))
    body += ["sum = sum + d * d", "p = p - clr * (d / (sqrt(sum) + eps))"]
    _run(p.data, "distlab_adagrad", inputs, outputs, body)


def fused_rmsprop(p, state, lr, alpha, eps, weight_decay, momentum, centered, maximize):
    """RMSprop's update of ``p`` and its averages (and momentum buffer) in ``state``."""
    inputs, outputs, body = _start(p, maximize, weight_decay)
    inputs += [("lr", lr), ("alpha", alpha), ("a1", 1 - alpha), ("eps", eps)]
    outputs.append(("sq", state["square_avg"]))
    body.append("sq = sq * alpha + a1 * d * d")
    if centered:
        outputs.append(("ga", state["grad_avg"]))
        body += ["ga = ga + a1 * (d - ga)", "T avg = sqrt(sq - ga * ga) + eps"]
    else:
        body.append("T avg = sqrt(sq) + eps")
    if momentum > 0:
        inputs.append(("momentum", momentum))
        outputs.append(("buf", state["momentum_buffer"]))
        body += ["buf = buf * momentum + d / avg", "p = p - lr * buf"]
    else:
        body.append("p = p - lr * (d / avg)")
    _run(p.data, "distlab_rmsprop", inputs, outputs, body)


def fused_adadelta(p, state, lr, rho, eps, weight_decay, maximize):
    """Adadelta's update of ``p`` and its two running averages in ``state``."""
    inputs, outputs, body = _start(p, maximize, weight_decay)
    inputs += [("lr", lr), ("rho", rho), ("r1", 1 - rho), ("eps", eps)]
    outputs += [("sq", state["square_avg"]), ("acc", state["acc_delta"])]
    body += ["sq = sq * rho + r1 * d * d", "T delta = sqrt(acc + eps) / sqrt(sq + eps) * d",
             "acc = acc * rho + r1 * delta * delta", "p = p - lr * delta"]
    _run(p.data, "distlab_adadelta", inputs, outputs, body)


def fused_adamax(p, state, clr, beta1, beta2, eps, weight_decay, maximize):
    """Adamax's update of ``p`` and its moments in ``state``, with this step's ``clr = lr / (1 - beta1^t)``."""
    inputs, outputs, body = _start(p, maximize, weight_decay)
    inputs += [("clr", clr), ("b1c", 1 - beta1), ("beta2", beta2), ("eps", eps)]
    outputs += [("m", state["exp_avg"]), ("u", state["exp_inf"])]
    body += ["m = m + b1c * (d - m)", "u = fmax(u * beta2, fabs(d) + eps)", "p = p - clr * (m / u)"]
    _run(p.data, "distlab_adamax", inputs, outputs, body)
