"""The local autograd engine: one training step of two MLPs, and the engine's own cost per graph node.

Run: ``python -P benchmarks/bench_autograd.py`` (``--quick`` for a smoke run). Measured, interleaved round by round
so the machine's drift hits every method equally:

- ``big``: 100 x Linear(256, 256) (26 MB of fp32 parameters), batch 32; ``small``: 500 x Linear(16, 16)
  (1000 parameter tensors), batch 32. One step = zero_grad + forward + MSE loss + backward + SGD(momentum) step,
  for distlab and for the same maths hand-written in numpy (no graph, no engine). The difference is the
  framework's overhead per step; the forward/backward/step split is timed separately.
- engine overhead per node: a chain of N ``y = y * 1.0`` ops on a 1-element tensor, forward (recording) and
  backward (engine), minus the same numpy multiplications without autograd, divided by N. Later benchmarks (the
  DDP reducer's) can subtract ``nodes x this`` from their per-step figures.

BLAS is pinned to one thread unless OPENBLAS_NUM_THREADS/OMP_NUM_THREADS is set: on a 2-core machine shared with
other processes (or with a second MPI rank) a multi-threaded gemm waits for descheduled workers and takes tens of
milliseconds. Prints a table; writes ``benchmarks/results/bench_autograd.json``.
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import distlab  # noqa: E402
from distlab import nn, optim  # noqa: E402

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"big": (100, 256), "small": (500, 16)}  # name -> (layers, width)
BATCH = 32


def make_mlp(layers: int, width: int) -> nn.Sequential:
    """``layers`` x Linear(width, width), float32, seeded: the models the DDP benchmark uses too."""
    distlab.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class DistlabStep:
    """zero_grad + forward + loss + backward + SGD step through distlab, with a per-phase split."""

    def __init__(self, layers, width):
        self.model = make_mlp(layers, width)
        self.opt = optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        rng = np.random.default_rng(1)
        self.x = distlab.tensor(rng.standard_normal((BATCH, width), dtype=np.float32))
        self.y = rng.standard_normal((BATCH, width), dtype=np.float32)
        self.loss_fn = nn.MSELoss()

    def __call__(self, split=None):
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        if split is not None:
            split["forward"].append(t1 - t0)
            split["backward"].append(t2 - t1)
            split["optimizer"].append(t3 - t2)


class NumpyStep:
    """The same step written directly in numpy: the floor that distlab's overhead is measured against."""

    def __init__(self, layers, width):
        model = make_mlp(layers, width)
        self.ws = [m.weight.data.copy() for m in model]
        self.bs = [m.bias.data.copy() for m in model]
        self.mw = [None] * layers
        self.mb = [None] * layers
        rng = np.random.default_rng(1)
        self.x = rng.standard_normal((BATCH, width), dtype=np.float32)
        self.y = rng.standard_normal((BATCH, width), dtype=np.float32)

    def __call__(self, split=None):
        acts = [self.x]
        for w, b in zip(self.ws, self.bs):
            out = acts[-1] @ w.T
            out += b
            acts.append(out)
        diff = acts[-1] - self.y
        g = diff * (2.0 / diff.size)
        for i in reversed(range(len(self.ws))):
            gw, gb = g.T @ acts[i], g.sum(axis=0)
            if i:  # the input needs no gradient (distlab skips it too)
                g = g @ self.ws[i]
            self._sgd(i, gw, gb)

    def _sgd(self, i, gw, gb, lr=1e-3, momentum=0.9):
        for params, bufs, grad in ((self.ws, self.mw, gw), (self.bs, self.mb, gb)):
            if bufs[i] is None:
                bufs[i] = grad.copy()
            else:
                bufs[i] *= momentum
                bufs[i] += grad
            params[i] -= lr * bufs[i]


def time_steps(methods: dict, rounds: int, warmup: int, split_of=None) -> tuple[dict, dict]:
    """Median seconds per call of each method, interleaved round by round; plus the per-phase split."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in methods}
    split = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(rounds):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn(split if name == split_of else None)
            samples[name].append(time.perf_counter() - t0)
    return ({k: statistics.median(v) for k, v in samples.items()},
            {k: statistics.median(v) for k, v in split.items() if v})


def node_overhead(n_nodes: int, rounds: int) -> dict:
    """Per-node cost of recording (forward) and of the engine (backward) on a chain of trivial ops."""
    x = distlab.tensor(np.ones(1, dtype=np.float32), requires_grad=True)
    raw = np.ones(1, dtype=np.float32)
    fwd, bwd, np_fwd, np_bwd = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = x
        for _ in range(n_nodes):
            y = y * 1.0
        t1 = time.perf_counter()
        y.backward(np.ones(1, dtype=np.float32))
        t2 = time.perf_counter()
        a = raw
        for _ in range(n_nodes):
            a = a * 1.0
        t3 = time.perf_counter()
        g = raw
        for _ in range(n_nodes):
            g = g * 1.0  # MulBackward's own arithmetic: grad * other
        t4 = time.perf_counter()
        fwd.append(t1 - t0), bwd.append(t2 - t1), np_fwd.append(t3 - t2), np_bwd.append(t4 - t3)
    med = statistics.median
    return {"nodes": n_nodes,
            "forward_record_us_per_node": (med(fwd) - med(np_fwd)) / n_nodes * 1e6,
            "backward_engine_us_per_node": (med(bwd) - med(np_bwd)) / n_nodes * 1e6,
            "numpy_op_us": med(np_fwd) / n_nodes * 1e6}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per method and model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few rounds only (smoke test)")
    args = parser.parse_args(argv)
    rounds, warmup = (3, 1) if args.quick else (args.rounds, args.warmup)

    report = {"batch": BATCH, "rounds": rounds, "numpy": np.__version__, "python": platform.python_version(),
              "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "models": {}}
    for name, (layers, width) in MODELS.items():
        methods = {"distlab": DistlabStep(layers, width), "numpy": NumpyStep(layers, width)}
        params = sum(p.numel() for p in methods["distlab"].model.parameters())
        med, split = time_steps(methods, rounds, warmup, split_of="distlab")
        report["models"][name] = {
            "layers": layers, "width": width, "param_tensors": 2 * layers, "param_mb": params * 4 / 1e6,
            "graph_nodes": layers + 2 * layers + 3,  # Linear nodes + AccumulateGrad + (sub, mul, mean) loss
            "distlab_step_ms": med["distlab"] * 1e3, "numpy_step_ms": med["numpy"] * 1e3,
            "overhead_ms": (med["distlab"] - med["numpy"]) * 1e3,
            **{f"{k}_ms": v * 1e3 for k, v in split.items()}}
    report["node_overhead"] = node_overhead(1000, max(rounds, 5))
    print_table(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_autograd.json").write_text(json.dumps(report, indent=2))
    return report


def print_table(report: dict) -> None:
    print(f"autograd step, batch {report['batch']}, median of {report['rounds']} (BLAS threads: "
          f"{report['blas_threads']})")
    print(f"{'model':<7}{'layers':>7}{'params MB':>10}{'distlab ms':>11}{'numpy ms':>10}{'overhead':>10}"
          f"{'fwd':>8}{'bwd':>8}{'optim':>8}")
    for name, m in report["models"].items():
        print(f"{name:<7}{m['layers']:>7}{m['param_mb']:>10.2f}{m['distlab_step_ms']:>11.2f}{m['numpy_step_ms']:>10.2f}"
              f"{m['overhead_ms']:>10.2f}{m['forward_ms']:>8.2f}{m['backward_ms']:>8.2f}{m['optimizer_ms']:>8.2f}")
    o = report["node_overhead"]
    print(f"engine overhead per node (chain of {o['nodes']} mul-by-1.0 on 1 element, numpy op itself "
          f"{o['numpy_op_us']:.2f} us): record {o['forward_record_us_per_node']:.2f} us, "
          f"backward {o['backward_engine_us_per_node']:.2f} us")


if __name__ == "__main__":
    main()
