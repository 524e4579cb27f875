"""distlab.rpc: latency, async throughput and RRef rates of each twin, beside the MPI floor and PyTorch RPC.

Run: ``python -P benchmarks/bench_rpc.py``. It launches itself on 2 ranks once per twin (the twin is chosen per
process by ``DISTLAB_IMPL``); each job also measures a raw mpi4py ``Send``/``Recv`` ping-pong of the same payloads
on its own communicator (the floor), so every ratio compares numbers from one launch. Rank 0 calls, rank 1 serves.
With ``--torch-python PATH`` (an interpreter with torch installed, e.g. a scratch venv: ``pip install
torch==2.13.0``), or when torch imports here, it also runs the same calls over PyTorch RPC (TensorPipe) on 2
processes of that interpreter. Prints a table, each figure beside its floor and torch's, and writes
``benchmarks/results/bench_rpc.json``.

The calls are written as a user writes them: a plain ``for`` loop of ``rpc.rpc_sync(1, noop)`` with ``noop``
defined in the script (``__main__``), default settings. Timed rows are the median of 10 batches, with the best
batch beside it (on a shared machine other jobs' load moves medians by up to 10x from one minute to the next;
the best batch is what the code costs when it gets the cores). The in-process rows need no MPI and no second
process, so load barely moves them: two agents on a fake communicator, pumped on one thread, measure the agent's
own work per call (both sides), and ``--in-process sync|async --calls N`` runs just that loop, for an
instruction count::

    valgrind --tool=callgrind python -P benchmarks/bench_rpc.py --in-process sync --calls 1000
    valgrind --tool=callgrind python -P benchmarks/bench_rpc.py --in-process sync --calls 3000

(the difference of the two totals, over 2,000, is the instructions per call; the full run does this for the core
twin when valgrind is installed, unless ``--no-callgrind``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW = 1000  # rpc_async: calls in flight


def noop():
    return None


def one():
    return 1


def echo(x):
    return x


def _cheap():
    import distlab.rpc as rpc

    return rpc.cheap(noop), rpc.cheap(echo)


def _median_best(samples) -> tuple:
    return statistics.median(samples), min(samples)


def _raw_floor(raw, rank, results, payloads, scale) -> None:
    """The floor: a raw mpi4py Send/Recv ping-pong of each payload (rank 1 echoes)."""
    import numpy as np

    for label, arr in payloads.items():
        n = max(int((2000 if arr.nbytes < 1 << 16 else 200) * scale) // 10, 1)
        buf = np.empty_like(arr)
        samples = []
        for _ in range(10):
            raw.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    raw.Send(arr, 1, 5)
                    raw.Recv(buf, 1, 5)
                else:
                    raw.Recv(buf, 0, 5)
                    raw.Send(buf, 0, 5)
            samples.append((time.perf_counter() - t0) / n * 1e6)
        results[f"raw MPI round trip, {label}"] = _median_best(samples)


def _keep_freed_memory() -> None:
    """glibc keeps freed memory between steps, as docs/ measured (docs/autograd.md). Only distlab's processes
    import distlab: PyTorch's run this file with an interpreter that need not have it."""
    import distlab

    distlab.keep_freed_memory()


def worker(out_path: str, quick: bool) -> None:
    import numpy as np
    from mpi4py import MPI

    import distlab
    import distlab.rpc as rpc

    _keep_freed_memory()

    raw = MPI.COMM_WORLD.Dup()
    rank = raw.Get_rank()
    scale = 0.3 if quick else 1.0
    payloads = {"8 B": np.zeros(1), "100 f64": np.zeros(100), "1 MiB": np.zeros(1 << 17)}
    results = {}
    _raw_floor(raw, rank, results, payloads, scale)
    rpc.init_rpc(f"w{rank}")
    cheap_noop, cheap_echo = _cheap()

    def batches(label, n, body):
        body(max(n // 20, 1))  # warm-up
        samples = []
        per_batch = max(n // 10, 1)
        for _ in range(10):
            t0 = time.perf_counter()
            body(per_batch)
            samples.append((time.perf_counter() - t0) / per_batch * 1e6)
        results[label] = _median_best(samples)

    def plain_loop(n):  # as a user writes it
        for _ in range(n):
            rpc.rpc_sync(1, noop)

    def cheap_loop(n):
        for _ in range(n):
            rpc.rpc_sync(1, cheap_noop)

    def burst(total, fn):
        futs = []
        for _ in range(total):
            futs.append(rpc.rpc_async(1, fn))
            if len(futs) >= WINDOW:
                for f in futs[: WINDOW // 2]:
                    f.wait(60)
                del futs[: WINDOW // 2]
        for f in futs:
            f.wait(60)

    def remote_to_here(n):
        for _ in range(n):
            r = rpc.remote(1, one)
            r.to_here()
            del r

    def create_delete(n):
        for _ in range(n):
            r = rpc.remote(1, cheap_noop)
            del r
        deadline = time.monotonic() + 60
        while rpc.rpc_sync(1, rpc.rref_debug_info)["num_owner_rrefs"] or rpc.rref_debug_info()["num_pending_users"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"RRefs were not deleted: {rpc.rref_debug_info()}")
            time.sleep(0.0005)

    if rank == 0:
        n = int(2000 * scale)
        batches("rpc_sync no-op, plain loop (thread pool)", n, plain_loop)
        batches("rpc_sync no-op, cheap (inline on the listener)", n, cheap_loop)
        small, big = payloads["100 f64"], payloads["1 MiB"]
        batches("rpc_sync echo 100 f64 (cheap)", n, lambda k: [rpc.rpc_sync(1, cheap_echo, (small,)) for _ in range(k)])
        batches("rpc_sync echo 1 MiB (cheap)", int(200 * scale),
                lambda k: [rpc.rpc_sync(1, cheap_echo, (big,)) for _ in range(k)])
        for label, fn in (("rpc_async calls/s, 1000 in flight (thread pool)", noop),
                          ("rpc_async calls/s, 1000 in flight (cheap)", cheap_noop)):
            burst(2000, fn)
            rates = []
            total = int(10000 * scale)
            for _ in range(5):
                t0 = time.perf_counter()
                burst(total, fn)
                rates.append(total / (time.perf_counter() - t0))
            results[label] = (statistics.median(rates), max(rates))
        batches("remote + to_here + delete, 2000 RRefs (us each)", 2000, remote_to_here)
        create_delete(500)
        pers = []
        for _ in range(5):
            k = int(5000 * scale)
            t0 = time.perf_counter()
            create_delete(k)
            pers.append((time.perf_counter() - t0) / k * 1e6)
        results["remote RRef create + delete, pipelined (us each)"] = _median_best(pers)
    # CPU burnt by an idle worker (its threads waiting for messages), per second of wall time
    raw.Barrier()
    time.sleep(0.3)
    c0 = time.process_time()
    time.sleep(1.0)
    idle = raw.gather(time.process_time() - c0, root=0)
    if rank == 0:
        results["idle worker CPU (s per s, the busier rank)"] = (max(idle), max(idle))
        results["wait path"] = rpc.get_agent().wait_path
    rpc.shutdown()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"impl": distlab.IMPL, "results": results}))


# -- PyTorch RPC (TensorPipe), run by an interpreter that has torch -----------------------------------------------
def torch_worker(rank: int, port: int, out_path: str, quick: bool) -> None:
    import torch.distributed.rpc as trpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    results = {}
    scale = 0.3 if quick else 1.0
    if rank == 0:
        def batches(label, n, body):
            body(max(n // 20, 1))
            samples = []
            for _ in range(10):
                t0 = time.perf_counter()
                body(max(n // 10, 1))
                samples.append((time.perf_counter() - t0) / max(n // 10, 1) * 1e6)
            results[label] = _median_best(samples)

        def plain_loop(k):
            for _ in range(k):
                trpc.rpc_sync("w1", noop)

        def remote_to_here(k):
            for _ in range(k):
                r = trpc.remote("w1", one)
                r.to_here()
                del r

        def burst(total):
            futs = []
            for _ in range(total):
                futs.append(trpc.rpc_async("w1", noop))
                if len(futs) >= WINDOW:
                    for f in futs[: WINDOW // 2]:
                        f.wait()
                    del futs[: WINDOW // 2]
            for f in futs:
                f.wait()

        batches("rpc_sync no-op, plain loop (thread pool)", int(1000 * scale), plain_loop)
        burst(1000)
        rates = []
        for _ in range(3):
            total = int(4000 * scale)
            t0 = time.perf_counter()
            burst(total)
            rates.append(total / (time.perf_counter() - t0))
        results["rpc_async calls/s, 1000 in flight (thread pool)"] = (statistics.median(rates), max(rates))
        batches("remote + to_here + delete, 2000 RRefs (us each)", 1000, remote_to_here)
        pers = []
        for _ in range(3):
            k = int(2000 * scale)
            t0 = time.perf_counter()
            for _ in range(k):
                r = trpc.remote("w1", noop)
                del r
            pers.append((time.perf_counter() - t0) / k * 1e6)
        results["remote RRef create + delete, pipelined (us each)"] = _median_best(pers)
    trpc.shutdown()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def run_torch(python: str, quick: bool) -> dict | None:
    """PyTorch RPC's figures, from 2 processes of ``python``; None when it fails (said on stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = RESULTS / "bench_rpc.torch.json"
    args = [python, __file__, "--torch-worker", "RANK", "--port", str(port), "--out", str(out)] + (
        ["--quick"] if quick else [])
    procs = [subprocess.Popen([a if a != "RANK" else str(r) for a in args]) for r in (1, 0)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        codes = [-1]
    if any(codes) or not out.exists():
        print(f"bench_rpc: the PyTorch RPC run failed (exit codes {codes}); no torch column", file=sys.stderr)
        return None
    data = json.loads(out.read_text())
    out.unlink()
    return data


# -- in process: the agent's own work per call (no MPI, no second process) ------------------------------------
class _FakeMessage:
    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data

    def Recv(self, spec):
        spec[0][:] = self.data


class _FakeWorld:
    """Two agents joined by a fake communicator: a message for a listener waits in its inbox until ``pump`` hands
    it over (on this thread); a reply to a slot waits until its caller probes, which pumps first."""

    def __init__(self, impl: str):
        os.environ["DISTLAB_IMPL"] = impl
        os.environ["DISTLAB_RPC_WAIT"] = "mpi4py"   # the fake communicator has no C handle to probe
        from distlab.rpc import api, calls
        from distlab.rpc.agent import RpcAgent

        self.inbox = {0: collections.deque(), 1: collections.deque()}
        self.tagged = collections.defaultdict(collections.deque)
        self.agents = {}
        for r in (0, 1):
            agent = self.agents[r] = RpcAgent(f"w{r}", _FakeComm(self, r), names=["w0", "w1"], num_threads=1)
            agent.register_handler(calls.K_CALL, api._handle_call, _internal=True)
            agent._dispatch.pool.standby = True   # a standby watches: the listener runs requests itself
            assert agent._seat.take()
        self.agents[0]._seat.leave()   # this thread calls from worker 0 (not from its listener)
        calls.set_agent(self.agents[0])

    def pump(self) -> None:
        seat0 = self.agents[0]._seat
        seat0.come_back()   # this thread is worker 0's listener while it pumps
        try:
            progress = True
            while progress:
                progress = False
                for r in (1, 0):
                    messenger, box = self.agents[r]._messenger, self.inbox[r]
                    while box:
                        src, data = box.popleft()
                        messenger._handle(src, data, None, True)
                        progress = True
                    if messenger._outbox or messenger._corked:
                        messenger._flush_outbox()
                        progress = True
        finally:
            seat0.leave()


class _FakeComm:
    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 2

    def Send(self, spec, dst, tag):
        world = self.world
        (world.inbox[dst] if tag == 17 else world.tagged[(dst, tag)]).append((self.rank, bytearray(spec[0])))

    def Improbe(self, source, tag, status):
        from mpi4py import MPI

        queue = self.world.tagged[(self.rank, tag)]
        if not queue:
            self.world.pump()
            if not queue:
                return None
        src, data = queue.popleft()
        status.source, status.tag = src, tag
        status.Set_elements(MPI.BYTE, len(data))
        return _FakeMessage(data)

    def Free(self):
        pass


def in_process_calls(world, what: str, n: int) -> None:
    import distlab.rpc as rpc

    if what == "sync":
        for _ in range(n):
            rpc.rpc_sync(1, noop)
        return
    futs = []
    for _ in range(n):
        futs.append(rpc.rpc_async(1, noop))
        if len(futs) >= WINDOW:
            world.pump()
            for f in futs:
                f.wait(10)
            futs = []
    world.pump()
    for f in futs:
        f.wait(10)


def in_process_cpu(quick: bool) -> dict:
    """CPU microseconds of the agents' own work per no-op call, both sides (best of 5 runs), in this process."""
    world = _FakeWorld(os.environ.get("DISTLAB_IMPL", "core"))
    out = {}
    for what, n in (("sync", int(20000 * (0.3 if quick else 1))), ("async", int(40000 * (0.3 if quick else 1)))):
        in_process_calls(world, what, 200)
        best = []
        for _ in range(5):
            t0 = time.process_time()
            in_process_calls(world, what, n // 5)
            best.append((time.process_time() - t0) / (n // 5) * 1e6)
        out[what] = min(best)
    out["frames"] = python_frames(world)
    return out


def python_frames(world, n: int = 100) -> float:
    """distlab's Python frames per ``rpc_sync`` no-op, both sides (the fake communicator's and the benchmark's own
    functions not counted): what the interpreter runs per call."""
    frames = [0]
    here = os.path.abspath(__file__)

    def count(frame, event, _arg):
        if event == "call" and "distlab" in frame.f_code.co_filename and frame.f_code.co_filename != here:
            frames[0] += 1

    sys.setprofile(count)
    try:
        in_process_calls(world, "sync", n)
    finally:
        sys.setprofile(None)
    return frames[0] / n


def instructions(impl: str) -> float | None:
    """Instructions per in-process ``rpc_sync`` no-op of the ``impl`` twin, both sides, counted by callgrind: the
    totals of ``--in-process sync`` runs of 3,000 and 1,000 calls, their difference over 2,000 (so start-up and
    imports cancel). None when valgrind is not installed (said on stderr)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("bench_rpc: valgrind is not installed: no instruction count", file=sys.stderr)
        return None
    totals = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1000, 3000):
            command = [valgrind, "--tool=callgrind", f"--callgrind-out-file={tmp}/callgrind.out", sys.executable,
                       "-P", __file__, "--in-process", "sync", "--calls", str(n)]
            # a fixed hash seed and no BLAS threads (they spin while idle, and callgrind counts them): the same
            # count from one run to the next
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                                  env=dict(os.environ, DISTLAB_IMPL=impl, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1"))
            found = re.search(r"Collected : (\d+)", done.stderr)
            if done.returncode or found is None:
                raise RuntimeError(f"callgrind of the {impl} twin failed:\n{done.stderr[-2000:]}")
            totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / 2000


def in_process(impl: str, quick: bool) -> dict:
    """:func:`in_process_cpu` of the ``impl`` twin, in a process of its own (as a user's script: ``__main__``)."""
    command = [sys.executable, "-P", __file__, "--in-process-cpu"] + (["--quick"] if quick else [])
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, DISTLAB_IMPL=impl),
                          timeout=600)
    if done.returncode:
        raise RuntimeError(f"the in-process run of the {impl} twin failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def protocol_cpu(impl: str, n: int = 20000) -> float:
    """CPU microseconds of the RRef protocol's own bookkeeping per remote RRef lifecycle (create, owner
    registration, confirmation, release, deletion), in process with a no-op transport: robust to machine load."""
    from distlab import _backend
    from distlab.futures import Future

    mod = _backend.load("rref", impl)
    acked = Future()
    acked.set_result(None)
    owner = mod.RRefContext(0, lambda dst, kind, payload: acked)
    user = mod.RRefContext(1, lambda dst, kind, payload: acked)
    t0 = time.process_time()
    for _ in range(n):
        u, rid, fid = user.create_remote(0)
        owner.handle_remote_call(rid, fid)
        user.finish_remote(u)
        user.release_user(u)
        owner.handle(1, 4, rid.key() + fid.key())
    per = (time.process_time() - t0) / n * 1e6
    assert owner.idle() and user.idle()
    return per


def where_cpu(impl: str, n: int = 20000) -> dict:
    """Where the agents' CPU per ``rpc_sync`` no-op goes (both sides, in process, microseconds): the pieces a call
    makes, each timed alone (best of 5), for the ``impl`` twin of the codec. What the in-process total has beyond
    their sum is the agent's own Python: its frames per message (sending, listening, dispatching, replying,
    waiting for the reply) and their bookkeeping."""
    from mpi4py import MPI

    from distlab import _backend
    from distlab.rpc import framing

    codec = _backend.load("rpc_framing", impl)
    payload = framing.call_payload(noop, (), None)
    body = framing.dumps(payload)[0]
    header = codec.pack_header(1, 0, 7, (), (), b"", body, (), 1)
    limit = framing.MAX_MESSAGE_BYTES
    comm, status = MPI.COMM_SELF, MPI.Status()

    def message():  # what a message costs in mpi4py calls: send, match, size, receive
        request = comm.Isend([header, MPI.BYTE], 0, 5)
        matched = comm.Improbe(0, 5, status)
        data = bytearray(status.Get_count(MPI.BYTE))
        matched.Recv([data, MPI.BYTE])
        request.Wait()

    pieces = {
        "pickling: the call's payload, and the reply": lambda: (framing.dumps(payload), framing.dumps(None)),
        "unpickling: the call's payload, and the reply": lambda: (framing.loads(body, [], None, checked=True),
                                                                  framing.loads(framing.NONE_BODY, checked=True)),
        "wire codec: two headers packed and checked": lambda: (codec.pack_header(1, 0, 7, (), (), b"", body, (), 1),
                                                              codec.unpack_header(header, limit),
                                                              codec.pack_header(0, 0, 7, (), (), b"", b"", (), 0),
                                                              codec.unpack_header(header, limit)),
        "mpi4py calls of two messages (on COMM_SELF)": lambda: (message(), message()),
    }
    out = {}
    for label, piece in pieces.items():
        best = []
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(n // 5):
                piece()
            best.append((time.process_time() - t0) / (n // 5) * 1e6)
        out[label] = min(best)
    return out


# -- the table ----------------------------------------------------------------------------------------------------
#: What each figure aims at (the physical limit, not the anchors): printed beside it.
TARGETS = {"rpc_sync no-op, plain loop (thread pool)": "<= 15 us",
           "rpc_sync no-op, cheap (inline on the listener)": "<= pool's",
           "rpc_async calls/s, 1000 in flight (thread pool)": ">= 150,000",
           "rpc_async calls/s, 1000 in flight (cheap)": ">= 150,000",
           "remote RRef create + delete, pipelined (us each)": "<= 10 us",
           "remote + to_here + delete, above an rpc_sync (us each)": "<= 10 us",
           "idle worker CPU (s per s, the busier rank)": "<= 0.05"}
FLOORS = {"rpc_sync no-op": "raw MPI round trip, 8 B", "rpc_sync echo 100 f64": "raw MPI round trip, 100 f64",
          "rpc_sync echo 1 MiB": "raw MPI round trip, 1 MiB"}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    median, best = value if isinstance(value, (list, tuple)) else (value, None)
    text = f"{median:,.0f}" if abs(median) >= 1000 else (f"{median:.1f}" if abs(median) >= 10 else f"{median:.3g}")
    if best is not None and best != median:
        text += f" ({best:,.0f})" if abs(best) >= 1000 else (f" ({best:.1f})" if abs(best) >= 10 else f" ({best:.3g})")
    return text


ABOVE = "remote + to_here + delete, above an rpc_sync (us each)"
def _above(run: dict) -> float:
    """What a remote + to_here + delete costs above an rpc_sync: best batch against best batch (a difference of
    medians taken minutes apart on a loaded machine can even come out negative)."""
    return run["remote + to_here + delete, 2000 RRefs (us each)"][1] - run["rpc_sync no-op, plain loop (thread pool)"][1]


FRAMES = "distlab's Python functions run per rpc_sync no-op, both sides (count)"
INSTRUCTIONS = "instructions per rpc_sync no-op, both sides, in process (callgrind)"
WHERE = "  of which "   # the rows of where_cpu, under the in-process total they split


def rows(runs: dict, torch: dict | None) -> list:
    """The table's rows: ``[metric, target, floor, one cell per twin..., torch]``, as printed."""
    impls = list(runs)
    core = runs.get("core") or next(iter(runs.values()))
    metrics = [m for m in core if not m.startswith("raw MPI") and m != "wait path"]
    out = []
    for m in metrics:
        floor = next((core.get(f) for prefix, f in FLOORS.items() if m.startswith(prefix)), None)
        out.append([m, TARGETS.get(m, ""), _cell(floor)] + [_cell(runs[i].get(m)) for i in impls]
                   + [_cell((torch or {}).get(m))])
    return out


def table(runs: dict, torch: dict | None) -> str:
    impls = list(runs)
    head = (f"{'metric':<62}{'target':>11}{'floor (raw MPI)':>17}" + "".join(f"{i:>18}" for i in impls)
            + f"{'torch':>18}")
    lines = [head, "-" * len(head)]
    for metric, target, floor, *cells in rows(runs, torch):
        lines.append(f"{metric:<62}{target:>11}{floor:>17}" + "".join(f"{c:>18}" for c in cells))
    lines.append("")
    lines.append("floor: the same job's raw mpi4py Send/Recv round trip of the same payload; figures are medians of "
                 "10 batches (best batch in brackets); calls/s rows: median of 5 bursts (best); 'above an rpc_sync': "
                 "best batches; 'of which' rows: the pieces of the in-process CPU per rpc_sync, each timed alone")
    lines.append("wait path: " + ", ".join(f"{i}: {runs[i].get('wait path')}" for i in impls))
    return "\n".join(lines)


def record(report: dict, path: Path) -> None:
    """Write the run as the docs' record (``docs/_data/bench/rpc.json``: table ``t1``, figures, the source), keeping
    the record's ``before`` table (the figures before the change the page describes)."""
    runs, torch = report["runs"], report["torch_tensorpipe"]
    old = json.loads(path.read_text()) if path.exists() else {}
    unit = {"us": " us", "s/s": " s/s"}

    def with_unit(metric, cell):
        if cell in ("", "-") or "calls/s" in metric or metric in (FRAMES, INSTRUCTIONS):
            return cell
        return cell + (unit["s/s"] if "CPU (s per s" in metric else unit["us"])

    table_rows = [[m.strip(), t, with_unit(m, f)] + [with_unit(m, c) for c in cells]
                  for m, t, f, *cells in rows(runs, torch)]
    core = runs.get("core", {})
    data = {
        "what": "RPC and RRef figures on 2 ranks of one host, each beside its target, the same job's raw mpi4py "
                "ping-pong (the floor) and PyTorch RPC over TensorPipe in the same sitting; medians of 10 batches "
                "(best batch in parentheses); the in-process rows are CPU time of the agents' own work per call",
        "tables": {"t1": {"columns": ["metric", "target", "floor (raw MPI)"] + list(runs) + ["torch"],
                          "rows": table_rows}},
        "figures": {"wait_path": core.get("wait path", ""),
                    "load_average": f"{report['load_average'][0]:.1f}"},
        "command": report["command"],
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{report['host_cores']}-core development machine shared with other jobs, load average "
                   f"{report['load_average'][0]:.1f} at the end of the run",
    }
    if "before" in old.get("tables", {}):
        data["tables"]["before"] = old["tables"]["before"]
        data["figures"]["before_source"] = old.get("figures", {}).get("before_source", "")
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", nargs="+", default=["reference", "core"])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--torch-python", help="an interpreter with torch: adds PyTorch RPC's column")
    parser.add_argument("--in-process", choices=["sync", "async"], help="run only N in-process calls (for callgrind)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--no-callgrind", action="store_true",
                        help="skip the instruction count (callgrind runs the in-process loop twice, a few minutes)")
    parser.add_argument("--record", help="also write the run as the docs' record (docs/_data/bench/rpc.json)")
    parser.add_argument("--in-process-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.quick)
        return
    if options.torch_worker is not None:
        torch_worker(options.torch_worker, options.port, options.out, options.quick)
        return
    _keep_freed_memory()
    if options.in_process:
        in_process_calls(_FakeWorld(os.environ.get("DISTLAB_IMPL", "core")), options.in_process, options.calls)
        return
    if options.in_process_cpu:
        print(json.dumps(in_process_cpu(options.quick)))
        return
    from distlab.launch import launch_script

    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = {}
    for impl in options.impl:
        part = RESULTS / f"bench_rpc.{impl}.json"
        args = ["--worker", str(part)] + (["--quick"] if options.quick else [])
        job = launch_script(__file__, np=2, args=args, timeout=900, env={"DISTLAB_IMPL": impl})
        if job.returncode != 0:
            sys.exit(f"bench_rpc with the {impl} twin failed (exit {job.returncode})")
        runs[impl] = json.loads(part.read_text())["results"]
        part.unlink()
        cpu = in_process(impl, options.quick)
        sync = runs[impl]["agent CPU per rpc_sync no-op, both sides, in process (us)"] = cpu["sync"]
        where = where_cpu(impl)
        for label, value in where.items():
            runs[impl][WHERE + label] = value
        runs[impl][WHERE + "the agent's own Python frames (the rest)"] = sync - sum(where.values())
        runs[impl][FRAMES] = cpu["frames"]
        if impl == "core" and not options.no_callgrind:
            runs[impl][INSTRUCTIONS] = instructions(impl)
        runs[impl]["agent CPU per rpc_async no-op, both sides, in process (us)"] = cpu["async"]
        runs[impl]["RRef protocol bookkeeping, CPU per lifecycle, in process (us)"] = protocol_cpu(impl)
        if "remote + to_here + delete, 2000 RRefs (us each)" in runs[impl]:
            runs[impl][ABOVE] = _above(runs[impl])
    torch_python = options.torch_python
    if torch_python is None:
        try:
            import torch.distributed.rpc  # noqa: F401
            torch_python = sys.executable
        except ImportError:
            pass
    torch = run_torch(torch_python, options.quick) if torch_python else None
    if torch and "remote + to_here + delete, 2000 RRefs (us each)" in torch:
        torch[ABOVE] = _above(torch)
    # the command as a reader reruns it (a scratch interpreter's path is this machine's, not the project's)
    argv = [a if a != options.torch_python else "PYTHON_WITH_TORCH" for a in sys.argv[1:]]
    command = " ".join(["python -P benchmarks/bench_rpc.py"] + argv)
    report = {"benchmark": "bench_rpc", "command": command, "host_cores": os.cpu_count(), "ranks": 2,
              "load_average": os.getloadavg(), "runs": runs, "torch_tensorpipe": torch}
    (RESULTS / "bench_rpc.json").write_text(json.dumps(report, indent=1))
    print(table(runs, torch))
    if options.record:
        record(report, Path(options.record))
        print(f"docs record written to {options.record}")
    print(f"\nwritten to {RESULTS / 'bench_rpc.json'}")


if __name__ == "__main__":
    main()
