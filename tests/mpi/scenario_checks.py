"""Checks the scenario scripts share (imported from the script's own directory).

A scenario's groups are made before its device half first uses the stand-in, so they move device arrays without a
device transport. With ``DISTLAB_TEST_DEVICE_WORLD=1`` importing this module registers the stand-in's arrays
first: the groups then take the transport ``auto`` picks for it (``ipc``: its ranks share one "device" on one
node), for every collective, the host half's too, as groups do on a GPU.
"""
import os

if os.environ.get("DISTLAB_TEST_DEVICE_WORLD") == "1":
    import distlab.fakegpu  # noqa: F401 - registered before the scenario makes its groups (see above)
    from distlab import comm as _comm

    assert _comm.world().device_comm == "ipc", _comm.world()


def expect(exc_type, call, *texts):
    """Call ``call()``; it must raise ``exc_type`` whose message contains every one of ``texts``. Returns it."""
    try:
        call()
    except exc_type as exc:
        for text in texts:
            assert text in str(exc), (text, str(exc))
        return exc
    raise AssertionError(f"{exc_type.__name__} not raised: {texts}")


def twin_of(rank: int, impl_arg: str) -> str:
    """The twin a rank runs: ``impl_arg``, or for "mixed" the reference on even ranks and the core on odd ones."""
    return impl_arg if impl_arg != "mixed" else ("reference" if rank % 2 == 0 else "core")


def seeded_mlp(width: int, layers: int = 6):
    """``layers`` x Linear(width, width) with the same weights on every rank."""
    import distlab
    from distlab import nn

    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def sharded_batch(step: int, rows, total: int, width: int):
    """Step ``step``'s (x, y) tensors: ``total`` random rows, the same on every rank, of which ``rows``."""
    import numpy as np

    import distlab

    rng = np.random.default_rng(step)
    x = rng.standard_normal((total, width)).astype(np.float32)
    y = rng.standard_normal((total, width)).astype(np.float32)
    return distlab.tensor(x[rows]), distlab.tensor(y[rows])


# -- devices: every scenario runs on numpy ("cpu") and on the strict device stand-in ("cuda") in one launch ------
#: the devices a scenario loops over; "cuda" is distlab.fakegpu, which refuses any implicit host conversion
DEVICES = ("cpu", "cuda")


def _stand_in():
    from distlab import fakegpu

    fakegpu.use_as_cuda()
    return fakegpu


def on(device: str, value):
    """A host array (or a Tensor of one) on ``device``: as it is for "cpu", copied onto the stand-in for "cuda"."""
    from distlab.autograd import Tensor

    if device == "cpu":
        return value
    xp = _stand_in()
    if isinstance(value, Tensor):
        return Tensor(xp.asarray(value.data), requires_grad=value.requires_grad)
    return xp.asarray(value)


def to_device(model, device: str):
    """``model.to(device)`` with "cuda" meaning the stand-in."""
    if device == "cuda":
        _stand_in()
    return model.to(device)


def host(array):
    """A host copy of ``array`` (explicit ``.get()`` for device arrays) for comparing and pickling."""
    from distlab.autograd import to_numpy

    return to_numpy(array).copy()


def replay_uneven_inputs(local, local_opt, loss_fn, batch, counts, device, divisor=None) -> None:
    """Train ``local`` as DDP under Join trains on uneven inputs: at step i the ranks r with ``counts[r] > i``
    contribute ``batch(r, i)``, their gradients summed and divided by ``divisor`` (None: the ranks contributing)."""
    import distlab

    for i in range(max(counts)):
        active = [r for r, count in enumerate(counts) if count > i]
        grads = None
        for r in active:
            local.zero_grad()
            x, y = batch(r, i)
            loss_fn(local(distlab.tensor(on(device, x))), distlab.tensor(on(device, y))).backward()
            g = [p.grad.data / (divisor or len(active)) for p in local.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(local.parameters(), grads):
            p.grad = distlab.tensor(g)
        local_opt.step()


def assert_parameters_equal(model, local, *context) -> None:
    """The DDP ``model``'s parameters equal ``local``'s within 1e-5 (``context`` goes into the failure)."""
    import numpy as np

    for (name, a), b in zip(model.module.named_parameters(), local.parameters()):
        a, b = host(a.data), host(b.data)
        assert np.allclose(a, b, atol=1e-5), (*context, name, np.abs(a - b).max())


def start_counting(device: str) -> None:
    """Forget the stand-in's transfer counts (a device run starts)."""
    if device == "cuda":
        _stand_in().reset()


#: The scalar reads distlab makes on purpose, each one number per call: a training batch norm's element count over
#: every rank (its "more than 1 value per channel" check and the divisor), and DistributedMean, a host metric that
#: takes a number (as ``loss.item()``).
EXPECTED_SCALAR_READS = {("item", "distlab.nn._batchnorm_function"), ("item", "distlab.metrics")}


def staged_outside_comm(device: str) -> dict:
    """The host transfers distlab made outside its comm layer since :func:`start_counting`: none is expected,
    since only the comm layer stages device memory through the host (MPI is not CUDA-aware). Placing a model on
    the device (``Module.to("cuda")``, a copy in) is the user's explicit move, not counted."""
    if device == "cpu":
        return {}
    return {key: n for key, n in _stand_in().transfers().items()
            if key[1].startswith("distlab.") and not key[1].startswith("distlab.comm.") and key[0] != "synchronize"
            and key != ("from_host", "distlab.nn.module") and key not in EXPECTED_SCALAR_READS}
