"""Distributed autograd: the cost of a send/recv pair against an RPC round trip, and a model split across workers
against the same model run locally; reference vs core containers side by side in one job.

Run: ``python -P benchmarks/bench_dist_autograd.py`` (launches itself on 2 ranks; ``--np 3`` for more). Rank 0
drives, the other ranks serve. For each container twin (switched on every rank between rounds, interleaved so
the machine's drift hits both equally) it measures:

- ``rtt``: ``k`` plain ``rpc_sync`` calls of ``f(x) = x * 1`` on a small tensor, outside any context, per call.
- ``pair``: inside a context, ``k`` chained calls of the same function, ``backward`` and leaving the context
  (release on the other worker), minus the ``k`` plain calls, divided by the ``2k`` send/recv pairs (each call
  makes two: the request's tensor and the reply's): what distributed autograd adds per pair (metadata,
  send/recv functions, one gradient message in backward, and the pass's fixed costs spread over the pairs).
- ``step``: one training step of a 3-stage MLP split over the workers (forward through RRef proxies,
  distributed backward, ``DistributedOptimizer.step``) vs the same step of the same model in one process.
- ``bookkeeping`` (in the launching process, no MPI): the container calls one RPC inside a context makes on its
  two sides (a message id, the current context, a send function and a known worker on the caller; the context
  found or created, a recv function, the current context set and restored on the callee; in backward the context
  and the send function found again), per RPC, for each twin: what the core twin compiles.

Medians over every timed run, and the "best" (fastest) run of each, which the machine's stalls disturb least.
Prints a table and writes ``benchmarks/results/bench_dist_autograd.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import distlab

distlab.keep_freed_memory()  # glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md)

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("reference", "core")
KS = (1, 8, 32)
SIZES = [64, 256, 256, 10]
BATCH = 32


def _identity(x):
    return x * 1.0


def _use_impl(impl):
    """Switch this worker's container twin (no context may be alive)."""
    from distlab.distributed_autograd import _state

    _state.use_twin(impl)


class _Stage:
    def __init__(self, index):
        from distlab import nn

        self.lin = nn.Linear(SIZES[index], SIZES[index + 1], seed=10 + index)
        self.act = index < len(SIZES) - 2

    def forward(self, x):
        y = self.lin(x)
        return y.tanh() if self.act else y

    def parameter_rrefs(self):
        from distlab import rpc

        return [rpc.RRef(p) for p in self.lin.parameters()]


def _times(fn, repeat):
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _median_time(fn, repeat):
    return statistics.median(_times(fn, repeat))


def driver(world, rounds):
    import numpy as np

    from distlab import distributed_autograd as dist_autograd
    from distlab import optim, rpc
    from distlab.autograd import Tensor
    from distlab.distributed_autograd import DistributedOptimizer

    peer = 1
    x_small = Tensor(np.ones(16), requires_grad=True)

    def plain(k):
        def run():
            for _ in range(k):
                rpc.rpc_sync(peer, _identity, (x_small,))
        return run

    def pairs(k):
        def run():
            with dist_autograd.context() as cid:
                h = x_small
                for _ in range(k):
                    h = rpc.rpc_sync(peer, _identity, (h,))
                dist_autograd.backward(cid, [h.sum()])
        return run

    owners = [(1 + i) % world for i in range(len(SIZES) - 1)]
    x_big = Tensor(np.random.default_rng(0).standard_normal((BATCH, SIZES[0])).astype(np.float32))

    def split_model():
        stages = [rpc.remote(o, _Stage, (i,)) for i, o in enumerate(owners)]
        opt = DistributedOptimizer(optim.SGD, [p for s in stages for p in s.rpc_sync().parameter_rrefs()], lr=0.01)

        def step():
            with dist_autograd.context() as cid:
                h = x_big
                for s in stages:
                    h = s.rpc_sync().forward(h)
                dist_autograd.backward(cid, [(h * h).mean()])
                opt.step(cid)
        return step, stages, opt

    local_stages = [_Stage(i) for i in range(len(SIZES) - 1)]
    local_opt = optim.SGD([p for s in local_stages for p in s.lin.parameters()], lr=0.01)

    def local_step():
        local_opt.zero_grad()
        h = x_big
        for s in local_stages:
            h = s.forward(h)
        (h * h).mean().backward()
        local_opt.step()

    samples = {impl: {"step": [], "local_step": [], **{f"{c}{k}": [] for k in KS for c in "kpd"}}
               for impl in IMPLS}
    for _ in range(rounds):
        for impl in IMPLS:
            for dst in range(world):
                rpc.rpc_sync(dst, _use_impl, (impl,))
            s = samples[impl]
            for k in KS:  # k plain calls and k calls in a context, alternately (machine stalls hit both alike)
                for _ in range(max(10, 200 // k)):
                    s[f"p{k}"] += _times(plain(k), 1)
                    s[f"k{k}"] += _times(pairs(k), 1)
                    s[f"d{k}"].append(s[f"k{k}"][-1] - s[f"p{k}"][-1])
            step, stages, opt = split_model()
            step()
            s["step"].append(_median_time(step, 30))
            s["local_step"].append(_median_time(local_step, 30))
            del step, stages, opt
    rows = []
    for impl in IMPLS:
        med = {name: statistics.median(v) * 1e6 for name, v in samples[impl].items()}
        best = {name: min(v) * 1e6 for name, v in samples[impl].items()}  # the least disturbed run
        for k in KS:
            rtt = med[f"p{k}"] / k
            per_pair = med[f"d{k}"] / (2 * k)  # median of the paired differences
            best_rtt = best[f"p{k}"] / k
            best_pair = (best[f"k{k}"] - best[f"p{k}"]) / (2 * k)
            rows.append({"impl": impl, "np": world, "calls": k, "pairs": 2 * k, "rtt_us": rtt,
                         "plain_us": med[f"p{k}"], "context_us": med[f"k{k}"],
                         "best_rtt_us": best_rtt, "best_overhead_per_pair_us": best_pair,
                         "best_pair_in_rtts": best_pair / best_rtt,
                         "overhead_per_pair_us": per_pair, "pair_in_rtts": per_pair / rtt,
                         "split_step_us": med["step"], "local_step_us": med["local_step"]})
    return rows


def worker(out_path, rounds):
    import threading

    from distlab import distributed_autograd as dist_autograd  # noqa: F401 - the handlers of its calls
    from distlab import rpc

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_timeout=120)
    done = threading.Event()
    globals()["_done"] = done
    if rank == 0:
        rows = driver(world, rounds)
        Path(out_path).write_text(json.dumps(rows))
        for dst in range(1, world):
            rpc.rpc_sync(dst, _finish)
    else:
        done.wait(1800)
    rpc.shutdown()


def _finish():
    globals()["_done"].set()


def table(rows):
    head = (f"{'impl':>9} {'np':>3} {'calls':>5} {'pairs':>5} {'rtt us':>8} {'ctx+bwd us':>11} {'per pair us':>12} "
            f"{'in rtts':>8} {'best rtt':>9} {'best pair':>10} {'in rtts':>8} {'split step us':>14} "
            f"{'local step us':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['impl']:>9} {r['np']:>3} {r['calls']:>5} {r['pairs']:>5} {r['rtt_us']:>8.1f} "
                     f"{r['context_us']:>11.1f} {r['overhead_per_pair_us']:>12.1f} {r['pair_in_rtts']:>8.2f} "
                     f"{r['best_rtt_us']:>9.1f} {r['best_overhead_per_pair_us']:>10.1f} "
                     f"{r['best_pair_in_rtts']:>8.2f} {r['split_step_us']:>14.1f} {r['local_step_us']:>14.1f}")
    return "\n".join(lines)


def bookkeeping(repeat=20, calls=2000):
    """Per-RPC container bookkeeping of each twin, in microseconds (median over ``repeat`` runs of ``calls``)."""
    from distlab import _backend

    out = {}
    for _ in range(repeat):  # interleaved, so that drift hits both twins alike
        for impl in IMPLS:
            twin = _backend.load("autograd_container", impl)
            caller, callee = twin.DistAutogradContainer(0), twin.DistAutogradContainer(1)
            ctx = caller.new_context()
            fn = object()
            start = time.perf_counter()
            for _ in range(calls):
                if caller.has_valid_context():
                    context = caller.current_context()
                    mid = caller.new_autograd_message_id()
                    context.add_send_function(fn, mid)
                    context.add_known_worker_id(1)
                    remote = callee.get_or_create_context(ctx.context_id)
                    remote.add_recv_function(fn, mid)
                    previous = callee.force_current_context_id(ctx.context_id)
                    callee.force_current_context_id(previous)
                    caller.retrieve_context(ctx.context_id).retrieve_send_function(mid)
            out.setdefault(impl, []).append((time.perf_counter() - start) / calls * 1e6)
            caller.clear_current_context_id()
    return {impl: statistics.median(v) for impl, v in out.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2], help="rank counts (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per twin (default 3)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.rounds)
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for np_ in options.np:
        part = RESULTS / f"bench_dist_autograd.np{np_}.json"
        job = launch_script(__file__, np=np_, args=["--worker", str(part), "--rounds", str(options.rounds)],
                            timeout=1800)
        if job.returncode != 0:
            sys.exit(f"bench_dist_autograd on {np_} ranks failed (exit {job.returncode})")
        rows += json.loads(part.read_text())
        part.unlink()
    books = bookkeeping()
    report = {"benchmark": "bench_dist_autograd", "command": " ".join(sys.argv), "host_cores": os.cpu_count(),
              "rows": rows, "bookkeeping_us_per_rpc": books}
    (RESULTS / "bench_dist_autograd.json").write_text(json.dumps(report, indent=1))
    print(table(rows))
    print("\ncontainer bookkeeping per RPC inside a context (both sides, no messaging): "
          + ", ".join(f"{impl} {us:.2f} us" for impl, us in books.items()))
    print(f"\nwritten to {RESULTS / 'bench_dist_autograd.json'}")


if __name__ == "__main__":
    main()
