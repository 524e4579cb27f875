"""Horovod's response cache and cache coordinator (mirrors horovod/common/response_cache.h and .cc).

Twinned with ``core/_response_cache.pxi`` (included by ``core/_negotiation.pyx``).

Once a tensor has been negotiated, every rank stores the coordinator's ``Response`` for it in an LRU cache, and
all ranks perform the same cache operations in the same order, so the cache (and its *bit* numbering) is
identical everywhere. From then on a rank that submits the same tensor with the same parameters only has to say
"bit 17 is ready here": the :class:`CacheCoordinator` packs those bits into a vector of 64-bit words and one
bitwise-AND allreduce gives the bits ready on every rank. No gather, no broadcast, no coordinator.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np

from distlab._common.negotiation import (
    CACHEABLE_RESPONSE_TYPES,
    HIT,
    INVALID,
    MISS,
    cache_error,
    check_capacity,
    eviction_warning_text,
)
from distlab._wire import INVALID_IN_QUEUE, NUM_STATUS_BITS, SHOULD_SHUT_DOWN, UNCACHED_IN_QUEUE
from distlab.errors import CacheEvictionWarning
from distlab.reference.coordinator import fuse_responses
from distlab.reference.messages import Response

__all__ = ["ResponseCache", "CacheCoordinator", "request_params", "MISS", "HIT", "INVALID"]

#: The parameters a cache entry remembers; a joined rank stores ``JOINED`` (it matches anything).
JOINED = ("joined",)


def request_params(request) -> tuple:
    """The parameters that must match for a cache HIT: type, dtype, shape, device, reduce op, scale factors, group.

    Mirrors response_cache.h ``TensorParams`` (Horovod compares device, dtype and shape; we also compare the
    op and the scale factors, so a changed ``op`` cannot silently reuse a stale response, and the group, so a
    tensor that moves in or out of a group, or a group that changes size, is negotiated again).
    """
    return (request.request_type, request.tensor_type, tuple(request.tensor_shape), request.device,
            request.reduce_op, request.prescale_factor, request.postscale_factor, request.group_id,
            request.group_size)


class ResponseCache:
    """LRU cache of single-tensor responses; a cache bit is an entry's slot index.

    Parameters
    ----------
    capacity : int
        Maximum number of entries; 0 disables caching (``put`` does nothing).
    """

    def __init__(self, capacity: int = 1024):
        self._capacity = 0
        self._print_warning = True
        self.evictions = 0
        self.clear()
        self.set_capacity(capacity)

    # -- size and configuration ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every entry (mirrors ResponseCache::clear)."""
        # name -> [response, params], ordered from least to most recently used.
        self._entries: OrderedDict[str, list] = OrderedDict()
        self._bits: list[str | None] = []          # bit -> name (None: a hole left by erase_response)
        self._name_to_bit: dict[str, int] = {}
        self._bits_outdated = False

    def set_capacity(self, capacity: int) -> None:
        """Set the capacity; a different capacity clears the cache (mirrors ResponseCache::set_capacity)."""
        capacity = check_capacity(capacity)
        if capacity != self._capacity:
            self.clear()
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        """Maximum number of entries (0 = caching disabled)."""
        return self._capacity

    def num_active_bits(self) -> int:
        """Number of bit positions in use, holes included (sizes the coordinator's bit vector)."""
        return len(self._bits)

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups ---------------------------------------------------------------------------------------------
    def cached(self, request) -> int:
        """MISS, HIT or INVALID for ``request`` (mirrors ResponseCache::cached(const Request&)).

        HIT: an entry of that name exists with the same parameters (or was stored by a joined rank).
        INVALID: an entry of that name exists with different parameters. MISS: no entry of that name.
        """
        bit = self._name_to_bit.get(request.tensor_name)
        if bit is None:
            return MISS
        params = self._entries[request.tensor_name][1]
        return HIT if params is JOINED or params == request_params(request) else INVALID

    def peek_cache_bit(self, request_or_name) -> int:
        """The bit of a cached name (a Request or a str); CacheStateError when not cached."""
        name = request_or_name if isinstance(request_or_name, str) else request_or_name.tensor_name
        bit = self._name_to_bit.get(name)
        if bit is None:
            raise cache_error("not_cached", name=name)
        return bit

    def _name_at(self, bit: int) -> str:
        if not 0 <= bit < len(self._bits) or self._bits[bit] is None:
            raise cache_error("no_entry", bit=bit, active=len(self._bits))
        return self._bits[bit]

    def peek_response(self, bit: int) -> Response:
        """The response at ``bit``, without touching the LRU order (mirrors peek_response)."""
        return self._entries[self._name_at(bit)][0]

    def get_response(self, bit: int) -> Response:
        """The response at ``bit``, marked most recently used (mirrors get_response)."""
        name = self._name_at(bit)
        self._entries.move_to_end(name)
        self._bits_outdated = True
        return self._entries[name][0]

    def list_all_bits(self) -> list[int]:
        """Every bit that holds an entry, ascending (Horovod's order is the hash map's; ours is stable)."""
        return sorted(self._name_to_bit.values())

    def lru_names(self) -> list[str]:
        """Cached names from least to most recently used (for tests and the docs)."""
        return list(self._entries)

    # -- mutation --------------------------------------------------------------------------------------------
    def put(self, response: Response, requests, joined: bool = False) -> None:
        """Cache ``response``, split per tensor if fused (mirrors ResponseCache::put).

        Parameters
        ----------
        response : Response
            A cacheable response (allreduce, allgather, adasum, alltoall); other types raise CacheStateError.
        requests : mapping
            This rank's requests by tensor name (their parameters are what a later request must match).
        joined : bool
            This rank has joined and has no requests: the entries match any parameters.
        """
        if self._capacity == 0:
            return
        if response.response_type not in CACHEABLE_RESPONSE_TYPES:
            raise cache_error("uncacheable", response_type=response.response_type)
        fused = len(response.tensor_names) > 1
        for i, name in enumerate(response.tensor_names):
            # Horovod copies every fused size into each part; we keep the part's own size.
            sizes = [response.tensor_sizes[i]] if fused else response.tensor_sizes
            single = Response(response.response_type, [name], response.tensor_type, response.error_message,
                              response.devices, sizes, response.prescale_factor, response.postscale_factor,
                              response.reduce_op, response.last_joined_rank, response.group_id)
            if joined:
                params = JOINED
            else:
                request = requests.get(name)
                # No request here for a name already cached: it was a common hit, already checked (HIT).
                params = None if request is None else request_params(request)
                if params is None and name not in self._name_to_bit:
                    raise cache_error("no_request", name=name)
            self._put_one(name, single, params)

    def _put_one(self, name: str, response: Response, params) -> None:
        # mirrors response_cache.cc ResponseCache::put_
        bit = self._name_to_bit.get(name)
        if bit is not None:
            old = self._entries[name][1]
            if not (params is None or params is JOINED or old is JOINED or old == params):
                raise cache_error("overwrite_invalid", name=name)
            # HIT: keep the stored response and its bit, mark it most recently used.
            self._entries.move_to_end(name)
        elif len(self._entries) >= self._capacity:
            evicted = next(iter(self._entries))          # least recently used
            if self._print_warning:
                warnings.warn(eviction_warning_text(self._capacity, evicted, name), CacheEvictionWarning,
                              stacklevel=3)
                self._print_warning = False
            self.evictions += 1
            bit = self._name_to_bit.pop(evicted)
            del self._entries[evicted]
            self._entries[name] = [response, params]     # the new entry inherits the evicted bit
            self._bits[bit] = name
            self._name_to_bit[name] = bit
        else:
            bit = len(self._bits)
            self._bits.append(name)
            self._entries[name] = [response, params]
            self._name_to_bit[name] = bit
        self._bits_outdated = True

    def erase_response(self, bit: int) -> None:
        """Remove the entry at ``bit``, leaving a hole until update_cache_bits (mirrors erase_response)."""
        name = self._name_at(bit)
        del self._entries[name]
        del self._name_to_bit[name]
        self._bits[bit] = None
        self._bits_outdated = True

    def update_cache_bits(self) -> None:
        """Renumber bits in LRU order (least recent = 0) and drop holes (mirrors update_cache_bits).

        Every rank calls this at the end of every cycle after the same operations, so bits agree everywhere.
        """
        if not self._bits_outdated:
            return
        self._bits = list(self._entries)
        self._name_to_bit = {name: bit for bit, name in enumerate(self._bits)}
        self._bits_outdated = False

    def fused_hits(self, coordinator, threshold: int) -> list | None:
        """The fast path's responses: :meth:`get_response` of every bit that hit on every rank, in bit order (each
        rank touches the same entries in the same order, so the LRU order stays identical everywhere), fused up
        to ``threshold`` bytes (:func:`~distlab.reference.coordinator.fuse_responses`), the bits then renumbered
        (:meth:`update_cache_bits`); None, touching nothing, when none hit (mirrors the cache branch of
        ``ComputeResponseList``)."""
        bits = coordinator.cache_hits
        if not bits:
            return None
        fused = fuse_responses([self.get_response(bit) for bit in bits], threshold)
        self.update_cache_bits()
        return fused


class CacheCoordinator:
    """One cycle's cache hits and status flags, and their sync across ranks (mirrors CacheCoordinator).

    The bit vector has ``num_active_bits + 3`` bits in 64-bit words. Bits 0-2 are status bits stored inverted
    (1 means "not shutting down", "nothing uncached queued", "nothing invalid queued"), so one AND gives
    "no rank wants to shut down" etc.; bit ``3 + b`` is cache bit ``b``. After the AND, a set bit is a hit on every
    rank. If any rank saw an INVALID entry, a second, OR allreduce spreads the invalid bits to every rank.

    Parameters
    ----------
    num_active_bits : int
        ``ResponseCache.num_active_bits()`` (identical on every rank).
    """

    def __init__(self, num_active_bits: int):
        self.num_active_bits = int(num_active_bits)
        self._cache_hits: set[int] = set()
        self._invalid_bits: set[int] = set()
        self._should_shut_down = False
        self._uncached_in_queue = False
        self._invalid_in_queue = False
        self._synced = False
        self.num_words = (self.num_active_bits + NUM_STATUS_BITS + 63) // 64
        #: The bit vector as it went into the AND allreduce (after sync; for traces).
        self.sent_words: np.ndarray | None = None

    def _check_not_synced(self):
        if self._synced:
            raise cache_error("synced")

    def _check_bit(self, bit: int) -> int:
        bit = int(bit)
        if not 0 <= bit < self.num_active_bits:
            raise cache_error("bit_range", bit=bit, active=self.num_active_bits)
        return bit

    def record_hit(self, bit: int) -> None:
        """This rank has a cached tensor at ``bit`` ready."""
        self._check_not_synced()
        bit = self._check_bit(bit)
        self._cache_hits.add(int(bit))

    def record_invalid_bit(self, bit: int) -> None:
        """This rank submitted the name at ``bit`` with different parameters: the entry must go everywhere."""
        self._check_not_synced()
        self._invalid_bits.add(self._check_bit(bit))
        self._invalid_in_queue = True

    def erase_hit(self, bit: int) -> None:
        """Forget a hit (e.g. already handled)."""
        self._cache_hits.discard(int(bit))

    def set_should_shut_down(self, value: bool) -> None:
        self._check_not_synced()
        self._should_shut_down = bool(value)

    def set_uncached_in_queue(self, value: bool) -> None:
        self._check_not_synced()
        self._uncached_in_queue = bool(value)

    @property
    def cache_hits(self) -> list[int]:
        """Hit bits, ascending (before sync: this rank's; after: those common to every rank)."""
        return sorted(self._cache_hits)

    @property
    def invalid_bits(self) -> list[int]:
        """Invalid bits, ascending (after sync: those seen invalid on any rank)."""
        return sorted(self._invalid_bits)

    def common_hit(self, bit: int) -> bool:
        """Whether ``bit`` is a hit (after sync: on every rank)."""
        return bit in self._cache_hits

    @property
    def should_shut_down(self) -> bool:
        return self._should_shut_down

    @property
    def uncached_in_queue(self) -> bool:
        return self._uncached_in_queue

    @property
    def invalid_in_queue(self) -> bool:
        return self._invalid_in_queue

    @property
    def synced(self) -> bool:
        return self._synced

    def bitvector(self) -> np.ndarray:
        """The uint64 words this rank contributes to the AND allreduce (status bits inverted, then hits)."""
        words = np.zeros(self.num_words, dtype=np.uint64)
        status = 0
        if not self._should_shut_down:
            status |= 1 << SHOULD_SHUT_DOWN
        if not self._uncached_in_queue:
            status |= 1 << UNCACHED_IN_QUEUE
        if not self._invalid_in_queue:
            status |= 1 << INVALID_IN_QUEUE
        words[0] = status
        for bit in self._cache_hits - self._invalid_bits:   # an invalid bit is never a hit
            shifted = bit + NUM_STATUS_BITS
            words[shifted // 64] |= np.uint64(1 << (shifted % 64))
        return words

    def sync(self, allreduce) -> None:
        """Agree with every rank on common hits, status and invalid bits (mirrors CacheCoordinator::sync).

        Parameters
        ----------
        allreduce : callable
            ``allreduce(words, op)`` reduces the uint64 array ``words`` across ranks with ``op`` ``"band"`` or
            ``"bor"``, in place (or returns the result). Injectable so the logic is testable without MPI.
        """
        self._check_not_synced()
        words = self.bitvector()
        self.sent_words = words.copy()
        words = _reduce(allreduce, words, "band")
        hits = _set_bits(words)
        # Status bits were sent inverted: a cleared bit means some rank said "yes".
        self._should_shut_down = SHOULD_SHUT_DOWN not in hits
        self._uncached_in_queue = UNCACHED_IN_QUEUE not in hits
        self._invalid_in_queue = INVALID_IN_QUEUE not in hits
        self._cache_hits = {b - NUM_STATUS_BITS for b in hits if b >= NUM_STATUS_BITS}
        if self._invalid_in_queue:
            invalid = np.zeros(self.num_words, dtype=np.uint64)
            for bit in self._invalid_bits:
                invalid[bit // 64] |= np.uint64(1 << (bit % 64))
            invalid = _reduce(allreduce, invalid, "bor")
            self._invalid_bits = set(_set_bits(invalid))
            self._cache_hits -= self._invalid_bits
        self._synced = True


def _reduce(allreduce, words: np.ndarray, op: str) -> np.ndarray:
    result = allreduce(words, op)
    return words if result is None else np.asarray(result, dtype=np.uint64)


def _set_bits(words: np.ndarray) -> list[int]:
    """Positions of the set bits, ascending (Horovod scans with ffsll)."""
    bits = []
    for index, word in enumerate(int(w) for w in words):
        while word:
            low = word & -word
            bits.append(index * 64 + low.bit_length() - 1)
            word ^= low
    return bits
