"""Draw the protocol pages' message-flow figures from recorded runs: docs/_generated/flows/<name>.svg.

Each scenario below runs on 2 or 3 ranks with ``distlab.run`` and ``DISTLAB_TIMELINE`` set, between two marks
("scenario begin" / "scenario end"); :func:`distlab.viz.plot_sequence` draws what the run recorded: the RPC
agent's messages, the comm layer's collectives, and notes from the lanes a scenario names. Nothing is drawn
by hand, so a figure changes when the code does. The merged trace is kept beside each figure (``<name>.json``,
for Perfetto).

``make docs`` runs this script through docs/conf.py; it does the work only when its inputs changed (this file
or distlab's Python sources: a hash in docs/_generated/flows/.stamp). By hand::

    .venv/bin/python -P docs/_scripts/make_flow_figures.py [--force] [name ...]

The scenarios run the reference twin, as the docs build does.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "_generated" / "flows"
os.environ["DISTLAB_IMPL"] = "reference"
os.environ.setdefault("DISTLAB_TIMEOUT", "60")
os.environ["MPLBACKEND"] = "Agg"
BEGIN, END = "scenario begin", "scenario end"


def mark(name: str) -> None:
    """Record a mark on every rank's ``scenario`` lane: the figure shows what happens between two of them."""
    from distlab.timeline import get_timeline

    get_timeline().instant(name, lane="scenario")


# -- reducer (docs/protocols/reducer.md) ---------------------------------------------------------------------

def _three_layers(bucket_bytes: float, **ddp_options):
    import distlab
    from distlab import nn
    from distlab.ddp import DistributedDataParallel

    distlab.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    return DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2 ** 20, **ddp_options)


def _aligned():
    """A barrier, then the begin mark: the ranks start the scenario together."""
    from distlab import comm

    comm.world().barrier()
    mark(BEGIN)


def reducer_buckets():
    """One backward: each bucket's allreduce starts when its last gradient arrives, in bucket order."""
    import numpy as np

    import distlab

    model = _three_layers(70)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    for _ in range(2):                 # the second forward rebuilds the buckets in arrival order
        model(x).sum().backward()
    _aligned()
    model(x).sum().backward()
    mark(END)


def reducer_order():
    """The ranks' gradients arrive in different orders: a full bucket waits for the buckets before it."""
    import numpy as np

    import distlab
    from distlab import comm, nn
    from distlab.ddp import DistributedDataParallel

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x, a_first):
            return (self.a(x).sum() + self.b(x).sum()) if a_first else (self.b(x).sum() + self.a(x).sum())

    distlab.manual_seed(0)
    model = DistributedDataParallel(TwoHeads(), bucket_cap_mb=70 / 2 ** 20)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    _aligned()
    model(x, a_first=comm.world().rank == 0).backward()   # the first iteration: buckets in registration order
    mark(END)


def reducer_unused():
    """find_unused_parameters: rank 1 skips a layer; it marks that layer's gradient ready with zeros."""
    import numpy as np

    import distlab
    from distlab import comm, nn
    from distlab.ddp import DistributedDataParallel

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)
            self.skip = nn.Linear(4, 1)

        def forward(self, x, use_head):
            h = self.body(x).tanh()
            return (self.head(h) + self.skip(h)).sum() if use_head else self.skip(h).sum()

    distlab.manual_seed(0)
    model = DistributedDataParallel(TwoHeads(), find_unused_parameters=True, bucket_cap_mb=1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    _aligned()
    model(x, use_head=comm.world().rank == 0).backward()
    mark(END)
    comm.world().barrier()
    comm.progress()                    # finds the used-map allreduce complete: every rank records it


# -- join (docs/protocols/join.md) ---------------------------------------------------------------------------------

def join_ddp():
    """Rank 0 has 3 batches, rank 1 has 2: rank 1 shadows rank 0's third iteration, then both take rank 0's model."""
    import numpy as np

    import distlab
    from distlab import comm

    model = _three_layers(1 << 20)     # one bucket
    batches = 3 - comm.world().rank
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    _aligned()
    with model.join():
        for _ in range(batches):
            model(x).sum().backward()
    mark(END)


def join_zero():
    """DDP and ZeroRedundancyOptimizer under one Join: the joined rank still steps and broadcasts its shard."""
    import numpy as np

    import distlab
    from distlab import comm, optim
    from distlab.join import Join
    from distlab.optim import ZeroRedundancyOptimizer

    model = _three_layers(1 << 20)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=0.1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    _aligned()
    with Join([model, opt]):
        for _ in range(2 - comm.world().rank):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    mark(END)


def join_syncbn():
    """DDP, SyncBatchNorm and ZeroRedundancyOptimizer in one Join: the batch-norm layer's own communicator."""
    import numpy as np

    import distlab
    from distlab import comm, nn, optim
    from distlab.ddp import DistributedDataParallel
    from distlab.join import Join
    from distlab.optim import ZeroRedundancyOptimizer

    distlab.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    model = DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(net))
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.SGD, lr=0.1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    for _ in range(2):                 # past DDP's bucket rebuild
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    with Join([model, *nn.SyncBatchNorm.layers_in(model), opt]):
        _aligned()
        for _ in range(2 - comm.world().rank):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    mark(END)


# -- fully sharded data parallel (docs/protocols/fsdp.md) -------------------------------------------------------

def _fsdp_model():
    """Two blocks, each one FSDP group, and the root (its head Linear)."""
    import distlab
    from distlab import nn
    from distlab.fsdp import fully_shard

    distlab.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                        nn.Linear(4, 1))
    for block in (net[0], net[1]):
        fully_shard(block)
    return fully_shard(net)


def _fsdp_step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def fsdp_step():
    """One ZeRO-3 step: each group's all-gather before its forward and its backward, its reduce-scatter after."""
    import numpy as np

    import distlab
    from distlab import optim

    model = _fsdp_model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    _fsdp_step(model, opt, x)          # the first step checks the model across ranks
    _aligned()
    _fsdp_step(model, opt, x)
    mark(END)


def fsdp_join():
    """Rank 0 has 2 batches, rank 1 has 1: rank 1 replays its own iteration with zero gradients, then steps."""
    import numpy as np

    import distlab
    from distlab import comm, optim

    model = _fsdp_model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = distlab.tensor(np.ones((2, 4), dtype=np.float32))
    rank = comm.world().rank
    with model.join(optimizer=opt):
        for i in range(2 - rank):
            if i == 1:
                mark(BEGIN)            # rank 0's second iteration ...
            _fsdp_step(model, opt, x)
        if rank == 1:
            mark(BEGIN)                # ... which rank 1, out of batches, shadows
    mark(END)


# -- RRefs (docs/protocols/rref.md) and distributed autograd (docs/protocols/dist_autograd.md) ---------------------

def _value(x):
    return x


def _use(rref):
    """Run on the child: touch the RRef it was given (its fork is confirmed before this runs)."""
    return rref.owner().name


def rref_remote_and_fork():
    """worker0 creates an RRef owned by worker1, forks it to worker2, then every reference is dropped."""
    import gc
    import os

    import distlab.rpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}")
    rpc.get_agent().barrier(30)
    mark(BEGIN)
    if rank == 0:
        rref = rpc.remote("worker1", _value, (42,))
        rref.to_here()
        mark("fork begin")
        rpc.rpc_sync("worker2", _use, (rref,))
        del rref
        gc.collect()
    rpc.get_agent().barrier(30)
    mark(END)
    rpc.shutdown()


class _Stage:
    """One pipeline stage: tanh(x @ W) on its worker, then the next stage's RRef, if any."""

    def __init__(self, weight, next_stage=None):
        from distlab.autograd import Tensor

        self.w = Tensor(weight, requires_grad=True)
        self.next = next_stage

    def forward(self, x):
        y = (x @ self.w).tanh()
        return y if self.next is None else self.next.rpc_sync().forward(y)


def dist_autograd_chain():
    """Forward through worker1 and worker2 by RPC inside a context, then a distributed backward."""
    import os

    import numpy as np

    import distlab.rpc as rpc
    from distlab import distributed_autograd as dist_autograd
    from distlab.autograd import Tensor

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        rng = np.random.default_rng(0)
        second = rpc.remote("worker2", _Stage, (rng.standard_normal((4, 4)),))
        first = rpc.remote("worker1", _Stage, (rng.standard_normal((4, 4)), second))
        x = Tensor(rng.standard_normal((2, 4)), requires_grad=True)
        first.to_here(), second.to_here()
    rpc.get_agent().barrier(30)
    mark(BEGIN)
    if rank == 0:
        with dist_autograd.context() as context_id:
            loss = (first.rpc_sync().forward(x) ** 2).sum()
            mark("backward")
            dist_autograd.backward(context_id, [loss])
        del first, second
    rpc.get_agent().barrier(30)
    mark(END)
    rpc.shutdown()


_WORKERS = {0: "worker0", 1: "worker1", 2: "worker2"}


# -- negotiation (docs/protocols/response-cache.md) ---------------------------------------------------------------

def negotiation_first_and_cached():
    """Two tensors submitted in different orders: the first cycle negotiates them (slow path), the second hits."""
    import numpy as np

    from distlab import collectives as hvd
    from distlab import comm

    hvd.init()
    rank = comm.world().rank
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    for step in range(2):
        if step == 1:
            hvd.synchronize(hvd.allreduce_async(np.zeros(1), name="warm-up"))
        mark(BEGIN if step == 0 else "cached begin")
        handles = [hvd.allreduce_async(np.full(4, rank + 1.0), name=n) for n in names]
        for handle in handles:
            hvd.synchronize(handle)
        mark("first end" if step == 0 else END)
    comm.world().barrier()  # both ranks marked the end before rank 0's shutdown starts a (slow-path) cycle
    hvd.shutdown()


def negotiation_grouped():
    """grouped_allreduce of two arrays under one name, twice: negotiated once as a group, then from the cache."""
    import numpy as np

    from distlab import collectives as hvd

    hvd.init()
    mark(BEGIN)
    for _ in range(2):
        hvd.grouped_allreduce([np.ones(4), np.ones(2)], name="g")
    mark(END)
    hvd.shutdown()


def negotiation_process_sets():
    """4 ranks, process sets {0, 2} and {1, 2, 3}: each set negotiates on its own communicator."""
    import numpy as np

    from distlab import collectives as hvd
    from distlab import comm

    hvd.init()
    rank = comm.world().rank
    mark(BEGIN)
    first = hvd.add_process_set([0, 2])
    second = hvd.add_process_set([1, 2, 3])
    mine = [ps for ps in (first, second) if ps.included()]
    for ps in mine:
        hvd.allreduce(np.ones(2) * rank, name="grad", op=hvd.Sum, process_set=ps)
    mark(END)
    comm.world().barrier()             # every set's work done before rank 0's shutdown stops them all
    hvd.shutdown()


def negotiation_optimizer():
    """hvd.DistributedOptimizer on 2 ranks, two steps: gradient hooks submit allreduces during backward."""
    import numpy as np

    import distlab
    from distlab import collectives as hvd
    from distlab import comm, nn, optim

    hvd.init()
    distlab.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    x = distlab.tensor(np.full((2, 4), comm.world().rank + 1.0, dtype=np.float32))
    comm.world().barrier()
    for step in range(2):
        mark(BEGIN if step == 0 else "second step")
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    mark(END)
    hvd.shutdown()


def negotiation_stop():
    """Rank 1 shuts its collectives down while rank 0 waits for an allreduce: rank 0's handle fails, naming rank 1."""
    import numpy as np

    from distlab import collectives as hvd
    from distlab import comm

    hvd.init()
    rank = comm.world().rank
    hvd.allreduce(np.ones(1), name="warm-up")
    mark(BEGIN)
    if rank == 1:
        hvd.shutdown()
    else:
        try:
            hvd.allreduce(np.ones(1), name="x")
        except Exception as exc:  # noqa: BLE001 - the error this scenario shows
            from distlab.timeline import get_timeline

            get_timeline().instant(f"{type(exc).__name__}: {exc}", lane="negotiation")
        hvd.shutdown()
    mark(END)


def _with_group(item) -> str:
    """Label a collective with its process group (the comm lane without "comm "; Horovod's process sets as
    "global set" and "set N"), other items by name."""
    group = getattr(item, "group", None)
    if not group:
        return item.name
    group = group.removeprefix("comm ")
    group = "global set" if group == "collectives" else group.removeprefix("collectives ")
    return f"{item.name}  [{group}]"


def _negotiation_collectives(call) -> bool:
    """Negotiation figures: every collective (see drop_idle_cycles for the idle cycles' bit vectors)."""
    return True


def idle_cycles(trace) -> set:
    """The bit-vector allreduces of cycles that negotiated nothing (the next collective of the group is the next
    cycle's bit vector): a background thread runs a cycle every millisecond, busy or not."""
    by_group: dict = {}
    for call in trace.collectives():
        by_group.setdefault(call.group, []).append(call)
    idle = set()
    for calls in by_group.values():
        calls.sort(key=lambda c: c.seq)
        for call, following in zip(calls, calls[1:] + [None]):
            if call.name.endswith("negotiation bits") and (following is None
                                                            or following.name.endswith("negotiation bits")):
                idle.add((call.group, call.seq))
    return idle


SCENARIOS = {
    "reducer_buckets": dict(
        fn=reducer_buckets, np=2, notes=("reducer grads", "reducer buckets"),
        title="DDP backward: gradients fill buckets; a full bucket's allreduce starts at once"),
    "reducer_order": dict(
        fn=reducer_order, np=2, notes=("reducer grads", "reducer buckets"),
        title="Gradients in different orders: buckets still launch in bucket order"),
    "reducer_unused": dict(
        fn=reducer_unused, np=2, notes=("reducer grads", "reducer buckets"),
        title="find_unused_parameters: rank 1 never uses head; its bucket still completes"),
    "join_ddp": dict(
        fn=join_ddp, np=2, notes=("join",), names={0: "rank 0 (3 batches)", 1: "rank 1 (2 batches)"},
        title="DDP under Join: rank 1 runs out and shadows rank 0's third iteration"),
    "join_zero": dict(
        fn=join_zero, np=2, notes=("join",), names={0: "rank 0 (2 batches)", 1: "rank 1 (1 batch)"},
        title="DDP and ZeroRedundancyOptimizer under one Join"),
    "join_syncbn": dict(
        fn=join_syncbn, np=2, notes=("join",), names={0: "rank 0 (2 batches)", 1: "rank 1 (1 batch)"},
        label=_with_group,
        title="SyncBatchNorm in the Join: its allreduces run on the layer's own communicator"),
    "fsdp_step": dict(
        fn=fsdp_step, np=2, title="One ZeRO-3 step of two blocks and a root: three groups, each gathered "
                                  "twice and reduced once"),
    "fsdp_join": dict(
        fn=fsdp_join, np=2, notes=("join",), names={0: "rank 0 (2 batches)", 1: "rank 1 (1 batch)"},
        title="FSDP under Join: rank 1 runs out and replays its own iteration"),
    "rref_remote": dict(
        fn=rref_remote_and_fork, np=3, window=(BEGIN, "fork begin"), ranks=[0, 1],
        names={0: "worker0 (user)", 1: "worker1 (owner)"},
        title="remote(): the owner creates the OwnerRRef and answers; to_here() fetches the value"),
    "rref_fork": dict(
        fn=rref_remote_and_fork, np=3, window=("fork begin", END),
        names={0: "worker0 (parent)", 1: "worker1 (owner)", 2: "worker2 (child)"},
        title="A user forks its RRef to another user, then every reference is dropped"),
    "dist_autograd": dict(
        fn=dist_autograd_chain, np=3, names=_WORKERS,
        title="Distributed autograd: forward by RPC through two workers, then backward across them"),
    "negotiation": dict(
        fn=negotiation_first_and_cached, np=2, notes=("negotiation",), window=(BEGIN, "first end"),
        collectives=_negotiation_collectives,
        title="First cycle: a miss on every rank, negotiated through rank 0 (slow path)"),
    "negotiation_grouped": dict(
        fn=negotiation_grouped, np=2, notes=("negotiation",),
        title="grouped_allreduce twice: one response for the group, then one fused allreduce from the cache"),
    "negotiation_process_sets": dict(
        fn=negotiation_process_sets, np=4, notes=("negotiation",), label=_with_group, drop_idle_cycles=True,
        title="Process sets {0, 2} and {1, 2, 3}: agreed on the global set, then negotiated on their own"),
    "negotiation_optimizer": dict(
        fn=negotiation_optimizer, np=2, notes=("negotiation",), drop_idle_cycles=True,
        title="DistributedOptimizer, two steps: hooks submit each gradient; step() synchronizes"),
    "negotiation_stop": dict(
        fn=negotiation_stop, np=2, notes=("negotiation",), drop_idle_cycles=True,
        title="Stopping: rank 1 shuts its collectives down while rank 0 waits"),
    "negotiation_cached": dict(
        fn=negotiation_first_and_cached, np=2, notes=("negotiation",), window=("cached begin", END),
        drop_idle_cycles=True,
        title="Later cycles: every rank hits the cache; one bit-vector allreduce decides"),
}

# -- what the captions say, checked on what each run recorded ---------------------------------------------------
# Per figure, (a phrase its caption on the docs page says, a check of the drawn rows that makes it true). Rows
# are dicts: kind ("collective", "note", "send", "receive"), label, ranks (the ranks drawn in the row).


def _labels(rows, kind, rank=None):
    return [r["label"] for r in rows if r["kind"] == kind and (rank is None or rank in r["ranks"])]


def _before(labels, first, then):
    """Every label starting with ``first`` comes before every label starting with ``then``."""
    firsts = [i for i, label in enumerate(labels) if label.startswith(first)]
    thens = [i for i, label in enumerate(labels) if label.startswith(then)]
    return bool(firsts) and bool(thens) and max(firsts) < min(thens)


def _one_bit_vector_per_cycle(rows):
    """Each cycle that reduces something starts with one bit-vector allreduce, then the data's allreduces (idle
    cycles, a bit vector and nothing else, are left out of the figure)."""
    calls = _labels(rows, "collective")
    bits = [c.startswith("allreduce negotiation bits") for c in calls]
    return (bool(calls) and bits[0] and not bits[-1] and all(not (a and b) for a, b in zip(bits, bits[1:])))


CLAIMS = {
    "reducer_buckets": [
        ("bucket launches", lambda rows: all(n.endswith("launched") for n in _labels(rows, "note")
                                             if n.startswith("bucket "))),
    ],
    "reducer_order": [
        ("rank 1 `a` before `b`", lambda rows: _before(_labels(rows, "note", 1), "grad a.", "grad b.")),
        ("on rank 1 bucket 1 (layer `a`) is full first, but it is launched only after bucket 0",
         lambda rows: all(_before(_labels(rows, "note", rank), "bucket 0 launched", "bucket 1 launched")
                          for rank in (0, 1))
         and _before(_labels(rows, "note", 1), "grad b.", "bucket 1 launched")),
        ("allreduce `bucket0` and allreduce `bucket1` pair up across the ranks",
         lambda rows: _labels(rows, "collective") == ["allreduce bucket0", "allreduce bucket1"]),
    ],
    "negotiation_cached": [
        ("the bit-vector allreduce (AND) finds the common hits", _one_bit_vector_per_cycle),
        ("without any gather or broadcast",
         lambda rows: not any(c.startswith(("allgather", "broadcast")) for c in _labels(rows, "collective"))),
    ],
    "negotiation_process_sets": [
        ("each is an allgather of membership masks negotiated on the global set",
         lambda rows: sum(c.startswith("allgather process_set.add") and c.endswith("[global set]")
                          for c in _labels(rows, "collective")) == 2),
        ("set 1 (ranks 0, 2) and set 2 (ranks 1, 2, 3) negotiate on their own communicators",
         lambda rows: {tuple(r["ranks"]) for r in rows if r["label"].startswith("allreduce grad")}
         == {(0, 2), (1, 2, 3)}),
    ],
    "negotiation_stop": [
        ('`NotInitializedError("distlab.collectives stopped: rank 1 called shutdown()")`',
         lambda rows: any(n.startswith("NotInitializedError: distlab.collectives stopped")
                          and n.endswith("rank 1 called shutdown()") for n in _labels(rows, "note", 0))),
    ],
}


_FIGURE = re.compile(r"^```\{figure\} \.\./_generated/flows/(\w+)\.svg\n(?::[^\n]*\n)*\n(.*?)\n```", flags=re.M | re.S)


def captions() -> dict[str, str]:
    """Every flow figure's captions on the docs pages, by figure name (a figure shown twice, in a page's summary
    and in its scenarios, has both captions, one after the other)."""
    found: dict[str, str] = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" not in page.parts:
            for name, caption in _FIGURE.findall(page.read_text()):
                found[name] = f"{found[name]}\n{caption}" if name in found else caption
    return found


def claim_problems(name: str, drawn: dict, caption: str | None = None) -> list[str]:
    """What is wrong with a drawn figure: a label shortened, no legend, or a claim of its caption that the
    recorded run does not bear out (and, given the caption, a claim phrase the caption no longer says)."""
    problems = [f"{name}: label shortened to {label['shown']!r} ({label['text']!r} does not fit)"
                for label in drawn["labels"] if label["shortened"]]
    if not drawn["legend"]:
        problems.append(f"{name}: no legend")
    for phrase, holds in CLAIMS.get(name, []):
        if caption is not None and phrase not in " ".join(caption.split()):
            problems.append(f"{name}: the caption no longer says {phrase!r}")
        if not holds(drawn["rows"]):
            problems.append(f"{name}: the caption says {phrase!r}, which the recorded run does not show")
    return problems


# -- running and drawing ---------------------------------------------------------------------------------------

def inputs_hash() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for folder in ("src", "reference"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def record(name: str, spec: dict) -> Path:
    import distlab
    from distlab.timeline import merge

    work = Path(tempfile.mkdtemp(prefix=f"distlab-flow-{name}-"))
    trace = work / f"{name}.json"
    distlab.run(spec["fn"], np=spec["np"], env={"DISTLAB_TIMELINE": str(trace)})
    merge(str(trace))
    return trace


def draw(name: str, spec: dict, trace: Path) -> tuple[Path, list[str]]:
    """Draw one figure; write beside it what it shows (``<name>.drawn.json``: its rows, labels and legend);
    return it and its problems (:func:`claim_problems`)."""
    import matplotlib.pyplot as plt

    from distlab import viz

    collectives = spec.get("collectives", True)
    if spec.get("drop_idle_cycles"):
        idle = idle_cycles(viz.load_trace(trace))
        collectives = lambda call: (call.group, call.seq) not in idle  # noqa: E731
    what = dict(window=spec.get("window", (BEGIN, END)), notes=spec.get("notes", ()), ranks=spec.get("ranks"),
                messages=spec.get("messages", True), collectives=collectives)
    fig = viz.plot_sequence(trace, **what, names=spec.get("names"), label=spec.get("label"),
                            title=spec.get("title"))
    target = OUT / f"{name}.svg"
    fig.savefig(target, format="svg", metadata={"Date": None})
    label = spec.get("label") or (lambda item: item.name)
    rows = [{"kind": row.kind, "label": label(row.item), "ranks": _row_ranks(row)}
            for row in viz.sequence_rows(trace, **what)]
    drawn = {"rows": rows, "labels": fig.sequence_labels, "legend": fig.sequence_legend}
    (OUT / f"{name}.drawn.json").write_text(json.dumps(drawn, indent=1))
    plt.close(fig)
    shutil.copy(trace, OUT / f"{name}.json")
    return target, claim_problems(name, drawn)


def _row_ranks(row) -> list[int]:
    item = row.item
    if row.kind == "collective":
        return sorted(item.ranks)
    if row.kind in ("send", "receive"):
        return [item.src, item.dst]
    return [item.rank]


def main(argv: list[str]) -> int:
    force = "--force" in argv
    wanted = [a for a in argv if not a.startswith("--")] or list(SCENARIOS)
    unknown = sorted(set(wanted) - set(SCENARIOS))
    if unknown:
        print(f"make_flow_figures: no scenario {unknown}; the scenarios are {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = OUT / ".stamp"
    digest = inputs_hash()
    complete = all((OUT / f"{name}.svg").exists() for name in SCENARIOS)
    if not force and complete and stamp.exists() and stamp.read_text() == digest:
        return 0
    import matplotlib

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small files, crisp at any zoom
    traces = {}  # one run per scenario function (two figures may show two windows of one run)
    problems = []
    for name in wanted:
        start = time.monotonic()
        spec = SCENARIOS[name]
        if spec["fn"] not in traces:
            traces[spec["fn"]] = record(name, spec)
        target, found = draw(name, spec, traces[spec["fn"]])
        problems += [p for p in claim_problems(name, json.loads((OUT / f"{name}.drawn.json").read_text()),
                                               captions().get(name)) if p not in found] + found
        print(f"make_flow_figures: {target.relative_to(ROOT)} ({time.monotonic() - start:.1f} s)")
    for problem in problems:
        print(f"make_flow_figures: {problem}", file=sys.stderr)
    if problems:
        return 1
    if wanted == list(SCENARIOS):
        stamp.write_text(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
