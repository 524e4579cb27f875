"""Wire constants shared by both twins (codes that cross process boundaries must be defined once)."""
from __future__ import annotations

import struct

__all__ = ["COLLECTIVE_OPS", "REDUCE_OPS", "REDUCE_OP_CODES", "FINGERPRINT_WORDS", "FINGERPRINT_MAX_DIMS",
           "FINGERPRINT_VERSION", "RPC_KINDS", "RPC_KIND_CODES", "RPC_USER_KIND_BASE", "RPC_WIRE_MAGIC",
           "RPC_WIRE_VERSION", "RPC_HEADER_FORMAT", "RPC_FLAG_ERROR", "RPC_FLAG_INLINE", "RPC_FLAG_NOREPLY",
           "RPC_FLAG_DEVICES", "RPC_HOST_DEVICE",
           "RPC_TAG_HEADER", "RPC_TAG_BUFFER", "RPC_TAG_REPLY_BASE", "RPC_REPLY_SLOTS", "RFD_TUPLE_SIZE", "RREF_WORKER_ID_BITS",
           "RREF_LOCAL_ID_BITS", "NEGOTIATION_WIRE_VERSION", "REQUEST_MAGIC", "RESPONSE_MAGIC", "FLAG_SHUTDOWN",
           "LIST_FLAGS", "GLOBAL_PROCESS_SET_ID", "NO_GROUP", "VERSION_OFFSET", "LIST_HEADER", "REQUEST_HEAD",
           "RESPONSE_HEAD", "RequestType", "ResponseType", "REQUEST_TYPE_NAMES", "RESPONSE_TYPE_NAMES",
           "NEGOTIATED_REDUCE_OP_MAX", "DTYPE_NAMES", "DTYPE_SIZES", "DTYPE_CODES", "CPU_DEVICE_ID",
           "SHOULD_SHUT_DOWN", "UNCACHED_IN_QUEUE", "INVALID_IN_QUEUE", "NUM_STATUS_BITS", "JOIN_TENSOR_NAME",
           "COMM_RESERVED_TAGS", "COMM_SETUP_TAG", "COMM_NOTE_TAG", "COMM_NOTE_VERSION", "COMM_NOTE_HEADER",
           "COMM_NOTE_KINDS", "COMM_NOTE_STATES", "COMM_SLOT_WORDS", "COMM_OBJECT_TAG", "COMM_MONITOR_TAG",
           "COMM_MONITOR_VERDICTS", "NCCL_BOOTSTRAP_TAG", "NCCL_BOOTSTRAP_REPLY_TAG",
           "ENGINE_FAILURE_TAG", "ENGINE_FAILURE_NOTE_BYTES",
           "DIST_AUTOGRAD_KIND_CODES", "AUTOGRAD_METADATA_FIELDS"]

#: Collective operation names and their codes (index in this tuple). Append only: codes travel between ranks.
COLLECTIVE_OPS = (
    "none", "allreduce", "broadcast", "allgather", "allgather_object", "reduce_scatter",
    "alltoall", "barrier", "send", "recv", "gather_object", "broadcast_object", "shared_allreduce",
    "reduce", "gather", "scatter", "scatter_object_list", "all_to_all_single", "monitored_barrier",
)

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

#: An RPC message (distlab.rpc.framing) starts with this fixed header: magic, wire version, the reply slot (a
#: request's; 0 on every other message), kind, flags, message id, number of out-of-band buffers, number of RRef
#: fork records, length of the pickled metadata. Bump the version whenever the layout changes: a worker refuses
#: messages of another version with a clear error. Version 3 added the device records (``RPC_FLAG_DEVICES``),
#: version 4 the reply slot (the byte was reserved before).
RPC_WIRE_MAGIC = b"dR"
RPC_WIRE_VERSION = 4
RPC_HEADER_FORMAT = "<2sBBiiqiii"
RPC_FLAG_ERROR = 1      # response: the body is a remote exception description
RPC_FLAG_INLINE = 2     # request: cheap, run on the listener thread
RPC_FLAG_NOREPLY = 4    # request: no response expected
#: The message carries device arrays: after the buffer sizes come as many int64 device records, the device each
#: out-of-band buffer is rebuilt on at the receiver (its device index there, RPC_HOST_DEVICE for host memory).
RPC_FLAG_DEVICES = 8
RPC_HOST_DEVICE = -1
#: MPI tags on the agent's own communicator: header messages, then each out-of-band buffer.
RPC_TAG_HEADER = 17
RPC_TAG_BUFFER = 18
#: A request whose reply slot is ``s`` (1 to RPC_REPLY_SLOTS) is answered on tag ``RPC_TAG_REPLY_BASE + s``, header and
#: buffers, straight to the thread of the caller that waits for it; slot 0: on RPC_TAG_HEADER, to the listener.
RPC_TAG_REPLY_BASE = 256
RPC_REPLY_SLOTS = 255

#: RRef fork data tuple layout (mirrors rref_impl.h RRefForkData, RFD_TUPLE_SIZE):
#: (owner, rref_id.created_on, rref_id.local_id, fork_id.created_on, fork_id.local_id, parent)
RFD_TUPLE_SIZE = 6

#: RRef ids (``GloballyUniqueId(created_on, local_id)``, mirrors types.h): ``created_on`` is a worker id in
#: [0, 2**RREF_WORKER_ID_BITS) (as PyTorch's int16 worker_id_t), ``local_id`` a per-worker counter in
#: [0, 2**RREF_LOCAL_ID_BITS). Both twins reject anything else with the same RRefProtocolError; the core twin
#: packs an id into one int64 (``created_on << RREF_LOCAL_ID_BITS | local_id``), one-to-one within these ranges.
RREF_WORKER_ID_BITS = 16
RREF_LOCAL_ID_BITS = 40

# -- reduce ops: THE one table -------------------------------------------------------------------------------
#: Reduce-op names by code; 0 (``""``) means "not a reduction". Used by the collective fingerprint, the comm layer
#: and the negotiation requests (which accept codes up to :data:`NEGOTIATED_REDUCE_OP_MAX`). Append only: the
#: codes travel between ranks.
REDUCE_OPS = ("", "sum", "avg", "min", "max", "product", "band", "bor")
REDUCE_OP_CODES = {name: code for code, name in enumerate(REDUCE_OPS)}


# -- negotiation (Horovod's controller and response cache; distlab.collectives) -------------------------------
#: Version of the negotiation messages' binary format; a message of any other version is refused. Version 2 added
#: the process set id and the shutdown reason to the lists, the group id and size to requests and the group id
#: to responses.
NEGOTIATION_WIRE_VERSION = 2
REQUEST_MAGIC = b"DLRQ"
RESPONSE_MAGIC = b"DLRS"
#: List header flag bits; any other bit set is refused.
FLAG_SHUTDOWN = 1
LIST_FLAGS = FLAG_SHUTDOWN
#: The process set every rank belongs to (Horovod's global process set); added sets get 1, 2, ...
GLOBAL_PROCESS_SET_ID = 0
#: ``group_id`` of a request or response that belongs to no group.
NO_GROUP = -1

#: struct layouts (``<`` = little-endian, no padding); the layout of each message is described below.
#:
#: .. code-block:: text
#:
#:     RequestList  := "DLRQ" version:u8 flags:u8 process_set:i32 count:u32 reason_len:u16
#:                     reason:utf8  Request*count
#:     Request      := rank:i32 type:u8 dtype:u8 reduce_op:u8 ndim:u8 root:i32 device:i32
#:                     group_id:i32 group_size:i32 prescale:f64 postscale:f64 name_len:u16
#:                     name:utf8  dims:i64*ndim
#:     ResponseList := "DLRS" version:u8 flags:u8 process_set:i32 count:u32 reason_len:u16
#:                     reason:utf8  Response*count
#:     Response     := type:u8 dtype:u8 reduce_op:u8 pad:u8 last_joined_rank:i32 group_id:i32
#:                     prescale:f64 postscale:f64
#:                     n_names:u32 (name_len:u16 name:utf8)*n_names
#:                     n_devices:u32 device:i32*n_devices  n_sizes:u32 size:i64*n_sizes
#:                     error_len:u32 error:utf8
#:
#: ``reason`` says why a rank asks to shut down (request list) or why every rank shuts down (response list).
LIST_HEADER = struct.Struct("<4sBBiIH")
REQUEST_HEAD = struct.Struct("<iBBBBiiiiddH")
RESPONSE_HEAD = struct.Struct("<BBBBiiddI")
#: The bytes before the version: enough to recognise a message of another version whatever its layout.
VERSION_OFFSET = 4


class RequestType:
    """Request type codes (mirror message.h ``Request::RequestType``)."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7


class ResponseType:
    """Response type codes (mirror message.h ``Response::ResponseType``); ERROR carries a message."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    ERROR = 8


REQUEST_TYPE_NAMES = ("allreduce", "allgather", "broadcast", "join", "adasum", "alltoall", "barrier",
                      "reducescatter")
RESPONSE_TYPE_NAMES = REQUEST_TYPE_NAMES + ("error",)
#: The largest reduce-op code a negotiation request may carry (Horovod reduces with sum, average, min, max and
#: product; band/bor are the comm layer's only).
NEGOTIATED_REDUCE_OP_MAX = REDUCE_OP_CODES["product"]

#: numpy dtype names and their wire codes (append only), with their sizes in bytes (bfloat16 is ml_dtypes').
DTYPE_NAMES = ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool",
               "uint32", "uint64", "complex64", "complex128", "bfloat16")
DTYPE_SIZES = (1, 1, 2, 2, 4, 8, 2, 4, 8, 1, 4, 8, 8, 16, 2)
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}

#: The device of a host array; GPU ordinals are >= 0.
CPU_DEVICE_ID = -1

#: Status bits at the start of the cache coordinator's bit vector, stored inverted (1 = "no"); cache bit ``b`` is
#: bit ``NUM_STATUS_BITS + b``.
SHOULD_SHUT_DOWN, UNCACHED_IN_QUEUE, INVALID_IN_QUEUE = 0, 1, 2
NUM_STATUS_BITS = 3

#: The name a join request travels under.
JOIN_TENSOR_NAME = "join.noname"

# -- the comm layer's side channel and bounded set-up -------------------------------------------------------
#: Tags the comm layer reserves on every communicator it is given or creates: the top of the range every MPI
#: supports (0..32767). ProcessGroup.send/recv refuse them.
COMM_RESERVED_TAGS = range(32760, 32768)
#: Bounded setup (comm.bounded_barrier/bounded_dup): one notice from each rank to each peer, two int64 words
#: [sender rank, check word] (the check word lets the ranks compare an argument, e.g. new_group's rank list).
COMM_SETUP_TAG = 32767
#: The missing-rank side channel between nodes: a note is COMM_NOTE_HEADER int64 words, then ``count`` triples
#: (group rank, last collective seq it entered, that collective's op code) read from the sender's node board.
COMM_NOTE_TAG = 32766
#: send_object_list/recv_object_list: one message per call, int64 words [count, size of each pickle] then the
#: pickles' bytes (received through a matched probe, so its length need not be known in advance).
COMM_OBJECT_TAG = 32765
#: monitored_barrier: each rank's arrival at rank 0 (its fingerprint, FINGERPRINT_WORDS int64 words) and rank
#: 0's verdict back (COMM_MONITOR_VERDICTS code, the missing ranks, every rank's fingerprint).
COMM_MONITOR_TAG = 32764
COMM_MONITOR_VERDICTS = ("passed", "timed_out", "mismatch")  # codes: index
#: The stand-in NCCL's bootstrap (distlab.fakegpu._nccl), on COMM_WORLD: each member's request to the unique id's
#: owner, int64 words [token, rank, world rank, ndev]; and the owner's reply, [token, status, count, world rank
#: per member] (status 0) or [token, status, count, the missing or clashing ranks] (status 1: timed out; 2: bad
#: arguments).
NCCL_BOOTSTRAP_TAG = 32763
NCCL_BOOTSTRAP_REPLY_TAG = 32762
#: distlab.collectives' failure notes, on its engine's own communicator: a rank whose cycle thread failed sends
#: each peer the reason, UTF-8, at most ENGINE_FAILURE_NOTE_BYTES bytes (collectives/_failures.py).
ENGINE_FAILURE_TAG = 32761
ENGINE_FAILURE_NOTE_BYTES = 4096
COMM_NOTE_VERSION = 1
COMM_NOTE_HEADER = ("version", "kind", "state", "seq", "sender", "count")
COMM_NOTE_KINDS = ("ask", "answer")  # an "ask" is answered once by a rank that receives it; codes: index
COMM_NOTE_STATES = ("elsewhere", "waiting", "gave_up")  # the sender, in this group, at seq: codes: index
#: A rank's slot on its node's arrival board: int64 words [last collective seq entered, its op code].
COMM_SLOT_WORDS = 2


# -- distributed autograd (distlab.distributed_autograd) ------------------------------------------------------
#: RPC message kinds of distributed autograd (at or above RPC_USER_KIND_BASE). Codes travel: never change them.
#: Payloads: backward = (context id, message id, pass id, retain_graph, [gradient or None per tensor]);
#: prepare = (context id, pass id, retain_graph); cleanup = context id.
DIST_AUTOGRAD_KIND_CODES = {"dist_autograd_backward": 80, "dist_autograd_prepare": 81, "dist_autograd_cleanup": 82}
#: The autograd metadata an RPC made inside a context carries ahead of its function (mirrors
#: rpc_with_autograd.h: autogradMetadata + fromWorkerId): a tuple of these fields, in this order.
AUTOGRAD_METADATA_FIELDS = ("context_id", "message_id", "from_worker")
