"""Wire constants shared by both twins (codes that cross process boundaries must be defined once)."""
from __future__ import annotations

__all__ = ["COLLECTIVE_OPS", "REDUCE_OP_CODES", "FINGERPRINT_WORDS", "FINGERPRINT_MAX_DIMS", "FINGERPRINT_VERSION",
           "RPC_KINDS", "RPC_KIND_CODES", "RPC_USER_KIND_BASE", "RPC_WIRE_MAGIC", "RPC_WIRE_VERSION",
           "RPC_HEADER_FORMAT", "RPC_FLAG_ERROR", "RPC_FLAG_INLINE", "RPC_FLAG_NOREPLY", "RPC_TAG_HEADER",
           "RPC_TAG_BUFFER", "RPC_TAG_HELLO", "RFD_TUPLE_SIZE", "RREF_WORKER_ID_BITS", "RREF_LOCAL_ID_BITS"]

#: Collective operation names and their codes (index in this tuple). Append only: codes travel between ranks.
COLLECTIVE_OPS = (
    "none", "allreduce", "broadcast", "allgather", "allgather_object", "reduce_scatter",
    "alltoall", "barrier", "send", "recv", "gather_object", "broadcast_object",
)

#: Reduce-op names and their codes; 0 means "not a reduction".
REDUCE_OP_CODES = {"": 0, "sum": 1, "avg": 2, "min": 3, "max": 4, "product": 5, "band": 6, "bor": 7}

#: A collective fingerprint is FINGERPRINT_WORDS int64 words:
#: [version, seq, op code, reduce-op code, root, dtype code, ndim, dim0 .. dim(FINGERPRINT_MAX_DIMS-1)]
#: A shape with more dims than fit folds the rest into the last dim slot (their product).
FINGERPRINT_VERSION = 1
FINGERPRINT_MAX_DIMS = 9
FINGERPRINT_WORDS = 7 + FINGERPRINT_MAX_DIMS

#: RPC message kinds (distlab.rpc agent and the twinned RRef protocol). Codes travel between ranks: append only.
#: Kinds below RPC_USER_KIND_BASE are reserved for distlab.rpc; other subsystems (distributed autograd, ...)
#: register their own kinds at or above it through ``agent.register_handler``.
RPC_KINDS = (
    "response",      # 0: the reply to a request (matched by message id)
    "call",          # 1: rpc_sync / rpc_async: run a function, reply with its result
    "remote_call",   # 2: remote(): run a function into an OwnerRRef, reply with an ack
    "rref_fetch",    # 3: to_here(): reply with the OwnerRRef's value once it is set
    "user_delete",   # 4: RRef control: a UserRRef was deleted (G1)
    "fork_request",  # 5: RRef control: a user forked to a user; the child asks the owner to add it
    "child_accept",  # 6: RRef control: the owner knows the child; the parent may drop its pending child (G2)
    "stop",          # 7: agent internal: stop the listener (sent to self)
    "wake",          # 8: agent internal: break the listener out of a blocking probe to re-check idleness
    "batch",         # 9: several small messages (length-prefixed header messages) in one MPI message
)
RPC_KIND_CODES = {name: code for code, name in enumerate(RPC_KINDS)}
RPC_USER_KIND_BASE = 64

#: An RPC message (distlab.rpc.framing) starts with this fixed header: magic, wire version, a reserved byte (0),
#: kind, flags, message id, number of out-of-band buffers, number of RRef fork records, length of the pickled
#: metadata. Bump the version whenever the layout changes: a worker refuses messages of another version with a
#: clear error.
RPC_WIRE_MAGIC = b"dR"
RPC_WIRE_VERSION = 2
RPC_HEADER_FORMAT = "<2sBBiiqiii"
RPC_FLAG_ERROR = 1      # response: the body is a remote exception description
RPC_FLAG_INLINE = 2     # request: cheap, run on the listener thread
RPC_FLAG_NOREPLY = 4    # request: no response expected
#: MPI tags on the agent's own communicator: header messages, then each out-of-band buffer.
RPC_TAG_HEADER = 17
RPC_TAG_BUFFER = 18
#: MPI tag on COMM_WORLD of the "I have called init_rpc, my name is ..." message each worker sends every other
#: worker while the agent's communicator is being made (how a timed-out init_rpc names the missing workers).
RPC_TAG_HELLO = 21590

#: RRef fork data tuple layout (mirrors rref_impl.h RRefForkData, RFD_TUPLE_SIZE):
#: (owner, rref_id.created_on, rref_id.local_id, fork_id.created_on, fork_id.local_id, parent)
RFD_TUPLE_SIZE = 6

#: RRef ids (``GloballyUniqueId(created_on, local_id)``, mirrors types.h): ``created_on`` is a worker id in
#: [0, 2**RREF_WORKER_ID_BITS) (as PyTorch's int16 worker_id_t), ``local_id`` a per-worker counter in
#: [0, 2**RREF_LOCAL_ID_BITS). Both twins reject anything else with the same RRefProtocolError; the core twin
#: packs an id into one int64 (``created_on << RREF_LOCAL_ID_BITS | local_id``), one-to-one within these ranges.
RREF_WORKER_ID_BITS = 16
RREF_LOCAL_ID_BITS = 40
