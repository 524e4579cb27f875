"""CacheCoordinator.sync over MPI (a ProcessGroup's band/bor allreduce), both twins and a mixed world.

Argument ``mixed``: even ranks use the reference twin, odd ranks the core twin.
"""
import sys


from distlab import _backend, comm

pg = comm.ProcessGroup(name="sync-test")
r, n = pg.rank, pg.size
impls = ["reference" if r % 2 == 0 else "core"] if "mixed" in sys.argv[1:] else ["reference", "core"]


def allreduce(words, op):
    pg.allreduce(words, op=op, name=f"bits-{op}")


for impl in impls:
    m = _backend.load("negotiation", impl)
    # common hits across word boundaries; rank-specific hits drop out; nothing else set
    c = m.CacheCoordinator(300)
    for bit in (0, 60, 61, 63, 64, 200, 299):
        c.record_hit(bit)
    c.record_hit(100 + r)
    sent = c.bitvector().copy()
    c.sync(allreduce)
    assert c.cache_hits == [0, 60, 61, 63, 64, 200, 299] + ([100] if n == 1 else []), c.cache_hits
    assert not (c.should_shut_down or c.uncached_in_queue or c.invalid_in_queue)
    # the words on the wire are identical across twins for the same input
    gathered = pg.allgather(sent)
    assert gathered.shape == (n, 5)
    # status flags: any rank's "yes" wins (inverted bits + AND); one rank's invalid bit reaches everyone (OR)
    c = m.CacheCoordinator(130)
    c.record_hit(5)
    c.record_hit(6)
    if r == n - 1:
        c.record_invalid_bit(6)
        c.set_should_shut_down(True)
    if r == 0:
        c.set_uncached_in_queue(True)
    c.sync(allreduce)
    assert c.cache_hits == [5] and c.invalid_bits == [6], (c.cache_hits, c.invalid_bits)
    assert c.should_shut_down and c.uncached_in_queue and c.invalid_in_queue
# every rank sent the same first-case vector whatever its twin (up to the rank-specific bit)
ref = _backend.load("negotiation", impls[0]).CacheCoordinator(300)
for bit in (0, 60, 61, 63, 64, 200, 299):
    ref.record_hit(bit)
table = pg.allgather(ref.bitvector())
assert (table == table[0]).all(), table
pg.destroy()
print(f"rank {r}: sync OK ({'/'.join(impls)})", flush=True)
