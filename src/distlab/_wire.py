"""Wire constants shared by both twins (codes that cross process boundaries must be defined once)."""
from __future__ import annotations

__all__ = ["COLLECTIVE_OPS", "REDUCE_OP_CODES", "FINGERPRINT_WORDS", "FINGERPRINT_MAX_DIMS", "FINGERPRINT_VERSION",
           "RPC_KINDS", "RPC_KIND_CODES", "RPC_USER_KIND_BASE", "RFD_TUPLE_SIZE",
           "COMM_RESERVED_TAGS", "COMM_SETUP_TAG", "COMM_NOTE_TAG", "COMM_NOTE_VERSION", "COMM_NOTE_HEADER",
           "COMM_NOTE_KINDS", "COMM_NOTE_STATES", "COMM_SLOT_WORDS"]

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

#: RRef fork data tuple layout (mirrors rref_impl.h RRefForkData, RFD_TUPLE_SIZE):
#: (owner, rref_id.created_on, rref_id.local_id, fork_id.created_on, fork_id.local_id, parent)
RFD_TUPLE_SIZE = 6

#: Tags the comm layer reserves on every communicator it is given or creates: the top of the range every MPI
#: supports (0..32767). ProcessGroup.send/recv refuse them.
COMM_RESERVED_TAGS = range(32760, 32768)
#: Bounded setup (comm.bounded_barrier/bounded_dup): one notice from each rank to each peer, two int64 words
#: [sender rank, check word] (the check word lets the ranks compare an argument, e.g. new_group's rank list).
COMM_SETUP_TAG = 32767
#: The missing-rank side channel between nodes: a note is COMM_NOTE_HEADER int64 words, then ``count`` triples
#: (group rank, last collective seq it entered, that collective's op code) read from the sender's node board.
COMM_NOTE_TAG = 32766
COMM_NOTE_VERSION = 1
COMM_NOTE_HEADER = ("version", "kind", "state", "seq", "sender", "count")
COMM_NOTE_KINDS = ("ask", "answer")  # an "ask" is answered once by a rank that receives it; codes: index
COMM_NOTE_STATES = ("elsewhere", "waiting", "gave_up")  # the sender, in this group, at seq: codes: index
#: A rank's slot on its node's arrival board: int64 words [last collective seq entered, its op code].
COMM_SLOT_WORDS = 2
