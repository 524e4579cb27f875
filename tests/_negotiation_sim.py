"""An in-process world for the negotiation engine: N controllers in threads, a fake transport, a trace.

Lets tests drive whole cycles of either twin (or a mix) without MPI, and record every message the transport
carries (bit vectors, request lists, response lists) for equivalence checks.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class FakeWorld:
    """Shared state of N fake ranks; ``trace`` lists (rank, kind, bytes) for every transport call."""

    def __init__(self, size: int, timeout: float = 20.0):
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size)
        self._slots = [None] * size
        self.trace: list[tuple[int, str, bytes]] = []
        self._lock = threading.Lock()

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)

    def _exchange(self, rank, value):
        self._slots[rank] = value
        self._barrier.wait(self.timeout)
        values = list(self._slots)
        self._barrier.wait(self.timeout)
        return values

    def _record(self, rank, kind, data):
        with self._lock:
            self.trace.append((rank, kind, bytes(data)))


class FakeTransport:
    """The three calls a Controller needs, over threads."""

    def __init__(self, world: FakeWorld, rank: int):
        self.world = world
        self.rank = rank

    def allreduce_bits(self, words, op):
        self.world._record(self.rank, "bits-" + op, np.asarray(words, dtype=np.uint64).tobytes())
        values = self.world._exchange(self.rank, np.array(words, dtype=np.uint64))
        result = values[0].copy()
        for other in values[1:]:
            result = (result & other) if op == "band" else (result | other)
        words[:] = result

    def gather(self, payload):
        self.world._record(self.rank, "gather", payload)
        values = self.world._exchange(self.rank, bytes(payload))
        return values if self.rank == 0 else None

    def broadcast(self, payload):
        if self.rank == 0:
            self.world._record(self.rank, "broadcast", payload)
        values = self.world._exchange(self.rank, payload)
        return values[0]


def run_cycle(controllers, transports, shut_down=False):
    """One cycle on every rank at once; returns the per-rank ResponseLists."""
    with ThreadPoolExecutor(len(controllers)) as pool:
        futures = [pool.submit(c.compute_response_list, t, shut_down) for c, t in zip(controllers, transports)]
        return [f.result(timeout=30) for f in futures]


def make_world(modules, **controller_kwargs):
    """Controllers for ranks 0..len(modules)-1, rank r from ``modules[r]`` (a negotiation twin module)."""
    size = len(modules)
    world = FakeWorld(size)
    controllers = [m.Controller(r, size, **controller_kwargs) for r, m in enumerate(modules)]
    transports = [world.transport(r) for r in range(size)]
    return world, controllers, transports
