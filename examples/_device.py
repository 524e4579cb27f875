"""``--device`` for the examples: ``cpu`` (numpy), ``cuda`` (cupy: one GPU per rank, or ranks sharing GPU 0 when
there are fewer GPUs than ranks) or ``fake`` (``distlab.fakegpu``, the strict host-memory stand-in CI uses to run
the device code paths without a GPU; it refuses implicit host conversions as cupy does, and is no faster)."""
from __future__ import annotations

import contextlib
import os

import numpy as np

DEVICES = ("cpu", "cuda", "fake")


def add_device_argument(parser) -> None:
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="cpu (numpy), cuda (cupy, a GPU per rank or shared), fake (the CI stand-in)")


def select(device: str):
    """The array module of ``device`` (``numpy``, ``cupy`` or the stand-in), with this rank's GPU made current;
    ``Module.to("cuda")`` then means it. Exits with a clear message when ``cuda`` cannot be had."""
    if device == "cpu":
        return np
    if device == "fake":
        from distlab import fakegpu

        fakegpu.use_as_cuda()
        return fakegpu
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - not installed, no driver, no device
        raise SystemExit(f"--device cuda needs cupy and a CUDA device ({type(exc).__name__}: {exc}); install "
                         "cupy (pip install -e '.[cuda]') on a machine with a GPU, or run with --device cpu") from None
    if count < 1:
        raise SystemExit("--device cuda needs a CUDA device, and cupy sees none; run with --device cpu")
    cupy.cuda.Device(int(os.environ.get("RANK", "0")) % count).use()
    return cupy


def this_rank(xp):
    """A context making this rank's GPU current (``with this_rank(xp):``): RPC runs functions on the agent's
    threads, and a thread starts on GPU 0 (as in PyTorch). Nothing for numpy."""
    if xp is np:
        return contextlib.nullcontext()
    return xp.cuda.Device(int(os.environ.get("RANK", "0")) % xp.cuda.runtime.getDeviceCount())
