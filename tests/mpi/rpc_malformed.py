"""Malformed messages on 2 ranks (run with DISTLAB_RPC_MAX_MESSAGE_BYTES=4000000): every one is refused with a
clear error, answered to its sender when its header names a request, and the listener never wedges.

Before the checks: a negative or huge out-of-band size was accepted (bytearray(-5), or a 1 TiB allocation), a
12-byte pickle made the callee ask for 1 TiB, a header whose buffer never came blocked the listener for good, and
a message of a kind nobody handles had its metadata unpickled (a pickle that creates a file did) before it was
refused. Rank 0 sends raw bytes on the agent's communicator; rank 1 refuses them, unpickling nothing of them.
"""
import os
import pickle
import struct
import tempfile
import threading
import time

import numpy as np
from mpi4py import MPI

import distlab.rpc as rpc
from distlab._common.rpc_framing import HEADER
from distlab._wire import RPC_KIND_CODES, RPC_TAG_BUFFER, RPC_TAG_HEADER, RPC_WIRE_MAGIC, RPC_WIRE_VERSION
from distlab.errors import RemoteError, RpcMessageError
from distlab.futures import Future
from distlab.rpc import framing

class Marker:
    """Unpickling this creates the file ``path`` (a pickle that runs code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


rank = int(os.environ["RANK"])
assert int(os.environ["WORLD_SIZE"]) == 2
assert framing.MAX_MESSAGE_BYTES == 4_000_000
K_CALL = RPC_KIND_CODES["call"]
K_RESPONSE = RPC_KIND_CODES["response"]
_done = threading.Event()
TERA_PICKLE = b"\x80\x05\x8e" + (1 << 40).to_bytes(8, "little") + b"."   # 12 bytes claiming 1 TiB


def finish():
    _done.set()


def add(a, b):
    return a + b


def errors():
    return list(rpc.get_agent().errors)


def short_buffer_wait(seconds):
    rpc.get_agent()._messenger.buffer_timeout = seconds  # the test does not wait 20 s for a buffer that never comes


def answer_badly(src, payload, meta):
    """Handler of kind 66: answer the request with a malformed response (then never with a real one)."""
    from distlab.rpc import current_call

    mid = current_call().mid
    bad = HEADER.pack(RPC_WIRE_MAGIC, RPC_WIRE_VERSION, 0, K_RESPONSE, 0, mid, 1, 0, 0) + struct.pack("<q", -1)
    rpc.get_agent().comm.Send([bad, MPI.BYTE], src, RPC_TAG_HEADER)
    return Future()


rpc.init_rpc(f"w{rank}", rpc_timeout=20)
agent = rpc.get_agent()
agent.register_handler(66, answer_badly)
mids = iter(range(10**6, 10**7))


def raw(kind=K_CALL, flags=0, mid=None, sizes=(), forks=0, meta=b"", body=b"", version=RPC_WIRE_VERSION,
        nbuf=None, nmeta=None):
    """A header message with any field set, and a future for the answer the callee sends to ``mid``."""
    mid = next(mids) if mid is None else mid
    data = (HEADER.pack(RPC_WIRE_MAGIC, version, 0, kind, flags, mid, len(sizes) if nbuf is None else nbuf, forks,
                        len(meta) if nmeta is None else nmeta)
            + struct.pack(f"<{len(sizes)}q", *sizes) + bytes(48 * forks) + meta + body)
    fut = Future(description=f"answer to raw message #{mid}")
    agent._pending[mid] = (fut, 1, kind, 0.0)   # the answer comes back like any response
    agent.comm.Send([data, MPI.BYTE], 1, RPC_TAG_HEADER)
    return fut


def refused(fut, *words):
    try:
        fut.wait(15)
    except RemoteError as exc:
        assert exc.exc_type == "distlab.errors.RpcMessageError", exc
        assert all(w in str(exc) for w in words), (words, str(exc))
        assert isinstance(exc.remote_exception, RpcMessageError)
        return str(exc)
    raise AssertionError(f"not refused: {words}")


def one_buffer(size):
    """A call body taking one out-of-band buffer of ``size`` bytes."""
    return pickle.dumps((framing.by_value(add), (pickle.PickleBuffer(bytearray(size)), b""), None), protocol=5,
                        buffer_callback=lambda b: False)


if rank == 0:
    body = framing.dumps((framing.by_value(add), (1, 2), None))[0]
    # well-formed raw messages work (the helper is right)
    assert raw(body=body).wait(15) == 3
    # sizes: negative, huge (beyond DISTLAB_RPC_MAX_MESSAGE_BYTES), too many buffers, counts beyond the message
    refused(raw(sizes=(-5,), body=body), "buffer 0 of -5 bytes")
    refused(raw(sizes=(1 << 50,), body=body), f"buffer 0 of {1 << 50} bytes", "DISTLAB_RPC_MAX_MESSAGE_BYTES")
    refused(raw(sizes=(3_000_000, 3_000_000), body=body), "total so far 6000000")
    refused(raw(nbuf=70000, body=body), "70000 out-of-band buffers")
    refused(raw(nmeta=-1, body=body), "-1 metadata bytes")
    refused(raw(forks=2, nmeta=99), "needs")
    # another wire version
    refused(raw(version=RPC_WIRE_VERSION + 7, body=body), f"wire version {RPC_WIRE_VERSION + 7}")
    # pickles that claim a terabyte: in the body (checked before the call runs) and in the metadata
    refused(raw(body=TERA_PICKLE), "claims 1099511627776 bytes")
    refused(raw(meta=TERA_PICKLE, body=body), "metadata", "claims 1099511627776 bytes")
    refused(raw(body=b"\x80\x05]r\xff\xff\xff\x7f."), "memo index 2147483647")
    refused(raw(body=b"\x80\x05K\x01"), "no STOP opcode")
    # a buffer that never comes, and one of the wrong size: refused after a bounded wait, the listener goes on
    rpc.rpc_sync(1, short_buffer_wait, (0.5,))
    t0 = time.monotonic()
    refused(raw(sizes=(100,), body=one_buffer(100)), "did not arrive within 0.5 s")
    assert time.monotonic() - t0 < 10
    fut = raw(sizes=(100,), body=one_buffer(100))
    agent.comm.Send([bytearray(50), MPI.BYTE], 1, RPC_TAG_BUFFER)
    refused(fut, "has 50 bytes, its header said 100")
    # Nothing of a refused message is unpickled: its kind, flags, counts and pickles are checked first. Each of
    # these carries pickles that would create the marker file as they load.
    marker = os.path.join(tempfile.mkdtemp(), "marker")
    mark = pickle.dumps(Marker(marker), protocol=5)
    refused(raw(kind=33, meta=mark, body=mark), "unknown message kind 33")           # no such kind anywhere
    refused(raw(kind=70, meta=mark, body=mark), "worker w1 has no handler for message kind 70")   # none here
    refused(raw(kind=K_CALL, flags=16, meta=mark, body=mark), "flags 0x10 on a call message")
    refused(raw(meta=mark, body=b"\x80\x05K\x01"), "no STOP opcode")                # a malformed body
    refused(raw(meta=mark + b"N.", body=mark), "malformed RPC metadata", "2 bytes follow the STOP opcode")
    refused(raw(meta=mark, body=mark + b"?"), "malformed RPC payload", "1 bytes follow the STOP opcode")
    # ... nor is a message whose buffers the body does not take: its buffer is received into nothing, so the
    # next message's buffer is its own
    fut = raw(sizes=(100,), meta=mark, body=mark)
    agent.comm.Send([bytearray(100), MPI.BYTE], 1, RPC_TAG_BUFFER)
    refused(fut, "its payload takes 0 out-of-band buffers but its header announces 1")
    fut = raw(kind=70, sizes=(200,), meta=mark, body=one_buffer(200))
    agent.comm.Send([bytearray(200), MPI.BYTE], 1, RPC_TAG_BUFFER)
    refused(fut, "no handler for message kind 70")
    assert rpc.rpc_sync(1, len, (np.ones(1000),)) == 1000                       # an out-of-band buffer, in step
    # stop and wake come only from a worker's own listener
    agent.comm.Send([HEADER.pack(RPC_WIRE_MAGIC, RPC_WIRE_VERSION, 0, RPC_KIND_CODES["stop"], 0, 0, 0, 0, 0),
                     MPI.BYTE], 1, RPC_TAG_HEADER)
    assert rpc.rpc_sync(1, add, (1, 1)) == 2
    assert not os.path.exists(marker), "a refused message's pickle ran"
    # a header message larger than the limit is dropped without being received into memory
    agent.comm.Send([bytearray(4_000_001), MPI.BYTE], 1, RPC_TAG_HEADER)
    # one-way garbage: logged, nobody to answer
    agent.comm.Send([b"not an RPC message at all....................", MPI.BYTE], 1, RPC_TAG_HEADER)
    # a malformed response fails the request it answers at once (not after its timeout)
    t0 = time.monotonic()
    try:
        agent.send(1, 66, None).wait(15)
        raise AssertionError("malformed response accepted")
    except RpcMessageError as exc:
        assert "buffer 0 of -1 bytes" in str(exc) and time.monotonic() - t0 < 10, exc
    # and through all that the agent kept working
    assert rpc.rpc_sync(1, add, (2, 2)) == 4
    seen = rpc.rpc_sync(1, errors)
    assert any("larger than DISTLAB_RPC_MAX_MESSAGE_BYTES" in e for e in seen), seen
    assert any("does not start with distlab's magic" in e for e in seen), seen
    assert any("only a worker's own listener sends those" in e for e in seen), seen
    assert any("unknown message kind 33" in e for e in seen), seen
    assert len(seen) >= 22, seen   # (payload pickles are refused by the callee's handler, answered, not logged)
    rpc.rpc_sync(1, finish)
else:
    assert _done.wait(90), "rank 0 never finished"
rpc.shutdown()
print(f"rpc malformed OK rank {rank}", flush=True)
