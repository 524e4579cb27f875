"""Checks the scenario scripts share (imported from the script's own directory)."""


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
