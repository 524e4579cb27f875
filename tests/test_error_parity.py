"""Every error path of every twinned component raises the same exception, word for word, on both twins.

Each case below is a function of a twin's module that must raise. The test runs it on the reference twin and on
the core twin and compares the exception's class and message: a learner reading the reference's error, and a
program catching it, must see exactly what the compiled twin raises. Each case also names the class it expects,
so a case that raises for the wrong reason (a typo in the test, say) fails instead of passing on both twins.

Only paths reachable without MPI are here (a one-rank world at most); the multi-rank error paths are exercised by
the scenarios under tests/mpi/.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import distlab
from distlab import _backend, comm, nn
from distlab._common.negotiation import dtype_code
from distlab._common.rpc_framing import HEADER, MAX_BUFFERS
from distlab._common.stall import StallInspector
from distlab._wire import (RPC_FLAG_DEVICES, RPC_KIND_CODES, RPC_WIRE_MAGIC, RPC_WIRE_VERSION, VERSION_OFFSET,
                          RequestType, ResponseType)
from distlab.errors import (AutogradContextNotFoundError, AutogradIdOverflowError, CacheStateError,
                            DistAutogradError, DistTimeoutError, MessageFormatError, RpcMessageError,
                            RRefDeletedError, RRefIdOverflowError, RRefProtocolError)

from conftest import IN_CI

CASES: list = []


def case(component: str, expected: type[BaseException]):
    """Register the decorated function as an error case of ``component`` that must raise ``expected``."""

    def register(make_error):
        CASES.append(pytest.param(component, expected, make_error, id=f"{component}-{make_error.__name__}"))
        return make_error

    return register


def outcome(make_error, module, expected) -> tuple[type, str]:
    try:
        make_error(module)
    except BaseException as exc:  # noqa: BLE001 - the point is to see whatever the twin raised
        assert isinstance(exc, expected), f"raised {type(exc).__name__}: {exc} (expected {expected.__name__})"
        return type(exc), str(exc)
    pytest.fail(f"{module.__name__} raised nothing (expected {expected.__name__})")


@pytest.mark.parametrize("component, expected, make_error", CASES)
def test_both_twins_raise_the_same_error(component, expected, make_error):
    if not _backend.core_available():
        message = f"the distlab core twin is not compiled; {_backend.BUILD_HINT}"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    twins = _backend.load_twins(component)
    reference = outcome(make_error, twins["reference"], expected)
    core = outcome(make_error, twins["core"], expected)
    assert core == reference, (f"{component}: the twins raise differently\n  reference: {reference[0].__name__}: "
                               f"{reference[1]}\n  core:      {core[0].__name__}: {core[1]}")


def test_reducer_errors_are_the_same_on_device_arrays(xp):
    """Every reducer case again with its parameters, gradients and inputs on the device stand-in (``xp``): the
    same class and words as on numpy, on both twins (a device array must not reach another branch)."""
    if not _backend.core_available():
        pytest.skip(_backend.BUILD_HINT)
    twins = _backend.load_twins("reducer")
    cases = [p.values for p in CASES if p.values[0] == "reducer"]
    XP[0] = xp
    try:
        on_device = [[outcome(make, twins[t], expected) for t in ("reference", "core")]
                     for _, expected, make in cases]
    finally:
        XP[0] = np
    on_host = [[outcome(make, twins[t], expected) for t in ("reference", "core")] for _, expected, make in cases]
    # the same words but the device's name, where a message names it
    assert [[(kind, words.replace(" cuda ", " cpu ")) for kind, words in twins_] for twins_ in on_device] == on_host


def test_there_are_cases_for_every_component():
    covered = {param.values[0] for param in CASES}
    assert covered == set(_backend.COMPONENTS), set(_backend.COMPONENTS) - covered


# ---------------------------------------------------------------------------------------------- fingerprint
@case("fingerprint", ValueError)
def unknown_collective(m):
    m.make_fingerprint(0, "allfoo", (2,), "float32")


@case("fingerprint", KeyError)
def unknown_reduce_op(m):
    m.make_fingerprint(0, "allreduce", (2,), "float32", reduce_op="xor")


@case("fingerprint", TypeError)
def not_a_dtype(m):
    m.make_fingerprint(0, "allreduce", (2,), "no such dtype")


@case("fingerprint", ValueError)
def a_shape_of_words(m):
    m.make_fingerprint(0, "allreduce", ("two",), "float32")


@case("fingerprint", (TypeError, ValueError))
def a_sequence_number_that_is_not_a_number(m):
    m.make_fingerprint("first", "allreduce", (2,), "float32")


# -------------------------------------------------------------------------------------------------- reducer
#: the array module the reducer's cases build their arrays with: numpy, or the device stand-in for
#: test_reducer_errors_are_the_same_on_device_arrays
XP = [np]


def _ones(*args, **kwargs):
    return XP[0].ones(*args, **kwargs)


def _params(*dtypes):
    return [nn.Parameter(_ones(3 - i, dtype=dtype)) for i, dtype in enumerate(dtypes)]


def _ready_reducer(m, params, buckets, **kwargs):
    reducer = m.Reducer(params, buckets, comm.world(), **kwargs)
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([])
    for p in params:
        p.grad = distlab.tensor(XP[0].ones_like(p.data))
    return reducer


@case("reducer", RuntimeError)
def marked_ready_twice(m):
    reducer = _ready_reducer(m, _params(np.float32, np.float32), [[1, 0]], param_names=["a.w", "b.w"])
    reducer.mark_variable_ready(1)
    reducer.mark_variable_ready(1)


@case("reducer", TypeError)
def gradient_of_another_dtype(m):
    params = _params(np.float32)
    reducer = _ready_reducer(m, params, [[0]], param_names=["w"])
    params[0].grad = distlab.tensor(_ones(3, dtype=np.float64))
    reducer.mark_variable_ready(0)


@case("reducer", ValueError)
def gradient_of_another_shape(m):
    params = _params(np.float32)
    reducer = _ready_reducer(m, params, [[0]], param_names=["w"])
    params[0].grad = distlab.tensor(_ones(5, dtype=np.float32))
    reducer.mark_variable_ready(0)


@case("reducer", ValueError)
def an_empty_bucket(m):
    m.Reducer(_params(np.float32, np.float32), [[0, 1], []], comm.world())


@case("reducer", ValueError)
def a_parameter_in_no_bucket(m):
    m.Reducer(_params(np.float32, np.float32), [[0]], comm.world())


@case("reducer", ValueError)
def a_sparse_parameter_sharing_its_bucket(m):
    m.Reducer(_params(np.float32, np.float32), [[0, 1]], comm.world(), [True, False], param_names=["a", "b"])


@case("reducer", ValueError)
def too_few_sparse_flags(m):
    m.Reducer(_params(np.float32, np.float32), [[1, 0]], comm.world(), expect_sparse_gradients=[False])


@case("reducer", ValueError)
def too_few_names(m):
    m.Reducer(_params(np.float32, np.float32), [[1, 0]], comm.world(), param_names=["a"])


@case("reducer", TypeError)
def a_bucket_of_two_dtypes(m):
    m.Reducer(_params(np.float32, np.float64), [[0, 1]], comm.world(), param_names=["a", "b"])


@case("reducer", ValueError)
def bucket_view_with_a_reduce_dtype(m):
    m.Reducer(_params(np.float32), [[0]], comm.world(), gradient_as_bucket_view=True, reduce_dtype=np.float16)


@case("reducer", ValueError)
def a_bucket_cap_that_is_not_a_size(m):
    m.Reducer(_params(np.float32), [[0]], comm.world(), bucket_bytes_cap="large")


@case("reducer", ValueError)
def no_parameter_requires_grad(m):
    m.Reducer([], [], comm.world())


@case("reducer", TypeError)
def a_comm_hook_that_is_not_callable(m):
    m.Reducer(_params(np.float32), [[0]], comm.world()).register_comm_hook(None, 42)


@case("reducer", RuntimeError)
def a_second_comm_hook(m):
    reducer = m.Reducer(_params(np.float32), [[0]], comm.world())
    reducer.register_comm_hook(None, lambda state, bucket: bucket)
    reducer.register_comm_hook(None, lambda state, bucket: bucket)


@case("reducer", RuntimeError)
def static_graph_after_the_first_iteration(m):
    reducer = m.Reducer(_params(np.float32), [[0]], comm.world())
    reducer.prepare_for_forward()
    reducer.set_static_graph()


class _TwoBranch(nn.Module):
    """fc1 always used, fc2 only when asked (an unused parameter otherwise)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3, seed=1)
        self.fc2 = nn.Linear(3, 3, seed=2)

    def forward(self, x, use_fc2=True):
        h = self.fc1(x)
        return (self.fc2(h) if use_fc2 else h).sum()


def _ddp(m, **kwargs):
    from distlab.ddp import DistributedDataParallel

    impl = "core" if m.__name__.startswith("distlab.core") else "reference"
    return DistributedDataParallel(_TwoBranch().to("cpu" if XP[0] is np else "cuda"), impl=impl, **kwargs)


def _x():
    return distlab.tensor(_ones((2, 4), dtype=np.float32))


@case("reducer", RuntimeError)
def a_forward_before_the_last_reduction_finished(m):
    model = _ddp(m)
    model(_x(), use_fc2=False).backward()
    model(_x(), use_fc2=False)


@case("reducer", RuntimeError)
def a_static_graph_that_changes(m):
    model = _ddp(m, static_graph=True)
    model(_x()).backward()
    model(_x()).backward()
    model(_x(), use_fc2=False).backward()
    model(_x())


def _returns_an_int_hook(state, bucket):
    return 1


@case("reducer", TypeError)
def a_comm_hook_that_returns_no_future(m):
    model = _ddp(m)
    model.register_comm_hook(None, _returns_an_int_hook)
    model(_x()).backward()


# ----------------------------------------------------------------------------------------------------- join
class _NotJoinable:
    pass


_ANOTHER_GROUP = object()  # one object, so that both twins' messages show the same repr


def _joinable(m, group):
    class Toy(m.Joinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            return m.JoinHook()

        join_device = "cpu"

        @property
        def join_process_group(self):
            return group

    return Toy()


@case("join", ValueError)
def no_joinables(m):
    m.Join([])


@case("join", TypeError)
def an_object_that_is_not_joinable(m):
    m.Join([_joinable(m, comm.world()), _NotJoinable()])


@case("join", TypeError)
def a_joinable_that_skipped_its_constructor(m):
    class Skipper(m.Joinable):
        def __init__(self):
            pass

        def join_hook(self, **kwargs):
            return m.JoinHook()

        join_device = "cpu"
        join_process_group = None

    m.Join([Skipper()])


@case("join", ValueError)
def joinables_on_two_groups(m):
    m.Join([_joinable(m, comm.world()), _joinable(m, _ANOTHER_GROUP)])


@case("join", AttributeError)
def notify_from_an_object_without_configuration(m):
    m.Join.notify_join_context(_NotJoinable())


# ---------------------------------------------------------------------------------------------- negotiation
F32 = dtype_code("float32")


def _request(m, name="grad.w", shape=(2, 3), rank=0, dtype=F32, op=1, kind=RequestType.ALLREDUCE):
    return m.Request(name, kind, dtype, shape, request_rank=rank, reduce_op=op)


def _coordinate(m, per_rank_requests, process_set_id=0):
    """Rank 0's coordinator over one cycle where rank r sent ``per_rank_requests[r]``; returns its ResponseList."""
    size = len(per_rank_requests)
    coordinator = m.Coordinator(size, 0, 64 << 20, StallInspector(size, check_time=0))
    gathered = [m.RequestList(requests, process_set_id=process_set_id).to_bytes() for requests in per_rank_requests]
    return coordinator.coordinate(gathered, m.ResponseCache(0), [])


def _coordinated_error(m, **second):
    """The ERROR response of a cycle where rank 1's request differs from rank 0's by ``second``, raised."""
    responses = _coordinate(m, [[_request(m, rank=0)], [_request(m, rank=1, **second)]]).responses
    assert [r.response_type for r in responses] == [ResponseType.ERROR]
    raise RuntimeError(responses[0].error_message)


@case("negotiation", RuntimeError)
def requests_of_two_shapes(m):
    _coordinated_error(m, shape=(3, 2))


@case("negotiation", RuntimeError)
def requests_of_two_dtypes(m):
    _coordinated_error(m, dtype=dtype_code("float64"))


@case("negotiation", RuntimeError)
def requests_of_two_reduce_ops(m):
    _coordinated_error(m, op=2)


@case("negotiation", RuntimeError)
def requests_of_two_collectives(m):
    _coordinated_error(m, kind=RequestType.ALLGATHER)


@case("negotiation", RuntimeError)
def a_rank_speaking_for_another(m):
    responses = _coordinate(m, [[_request(m, rank=0)], [_request(m, rank=0)]])
    assert responses.shutdown
    raise RuntimeError(responses.shutdown_reason)


@case("negotiation", ValueError)
def a_tensor_name_too_long(m):
    m.RequestList([_request(m, name="x" * 70000)]).to_bytes()


@case("negotiation", MessageFormatError)
def a_truncated_request_list(m):
    m.RequestList.from_bytes(m.RequestList([_request(m)]).to_bytes()[:-3])


@case("negotiation", MessageFormatError)
def a_request_list_with_trailing_bytes(m):
    m.RequestList.from_bytes(m.RequestList([_request(m)]).to_bytes() + b"\0")


@case("negotiation", MessageFormatError)
def a_response_list_read_as_a_request_list(m):
    m.RequestList.from_bytes(m.ResponseList([]).to_bytes())


@case("negotiation", MessageFormatError)
def a_response_list_of_another_wire_version(m):
    data = bytearray(m.ResponseList([]).to_bytes())
    data[VERSION_OFFSET] += 1
    m.ResponseList.from_bytes(bytes(data))


@case("negotiation", CacheStateError)
def a_cache_bit_holding_no_entry(m):
    m.ResponseCache(8).peek_response(3)


@case("negotiation", CacheStateError)
def an_uncacheable_response(m):
    response = m.Response(ResponseType.BROADCAST, ["a"], F32, devices=[-1], tensor_sizes=[6])
    m.ResponseCache(8).put(response, {"a": _request(m, "a")})


@case("negotiation", CacheStateError)
def a_cached_response_without_its_request(m):
    response = m.Response(ResponseType.ALLREDUCE, ["a"], F32, devices=[-1], tensor_sizes=[6], reduce_op=1)
    m.ResponseCache(8).put(response, {})


@case("negotiation", CacheStateError)
def overwriting_an_invalid_entry(m):
    cache = m.ResponseCache(8)
    response = m.Response(ResponseType.ALLREDUCE, ["a"], F32, devices=[-1], tensor_sizes=[6], reduce_op=1)
    cache.put(response, {"a": _request(m, "a")})
    cache.put(response, {"a": _request(m, "a", shape=(6,))})


@case("negotiation", ValueError)
def a_negative_cache_capacity(m):
    m.ResponseCache(-1)


@case("negotiation", CacheStateError)
def a_hit_bit_out_of_range(m):
    m.CacheCoordinator(4).record_hit(10_000)


# ----------------------------------------------------------------------------------------------------- rref
@case("rref", RRefProtocolError)
def an_id_from_a_worker_out_of_range(m):
    m.GloballyUniqueId(1 << 16, 0)


@case("rref", RRefProtocolError)
def a_negative_local_id(m):
    m.GloballyUniqueId(0, -1)


@case("rref", RRefProtocolError)
def a_local_id_past_its_bits(m):
    m.GloballyUniqueId(0, 1 << 40)


@case("rref", RRefProtocolError)
def an_id_of_strings(m):
    m.GloballyUniqueId("0", 0)


@case("rref", RRefProtocolError)
def fork_data_as_a_list(m):
    m.parse_fork_data([0, 0, 1, 0, 2, 0])


@case("rref", RRefProtocolError)
def fork_data_too_short(m):
    m.parse_fork_data((0, 0, 1, 0, 2))


@case("rref", RRefProtocolError)
def fork_data_with_a_bad_parent(m):
    m.parse_fork_data((0, 0, 1, 0, 2, -1))


@case("rref", RRefProtocolError)
def fork_data_with_a_bad_fork_id(m):
    m.parse_fork_data((0, 0, 1, 0, 1 << 41, 0))


def _context(m, worker_id=0):
    from distlab.futures import Future

    def send(dst, kind, payload):
        future = Future()
        future.set_result(None)
        return future

    return m.RRefContext(worker_id, send)


@case("rref", ValueError)
def a_context_of_a_negative_worker(m):
    _context(m, worker_id=-1)


@case("rref", RRefProtocolError)
def a_control_message_of_an_unknown_kind(m):
    _context(m).handle(1, 999, (0, 0, 0, 1))


@case("rref", RRefProtocolError)
def a_control_payload_of_the_wrong_length(m):
    _context(m).handle(1, RPC_KIND_CODES["user_delete"], (0, 0))


@case("rref", RRefProtocolError)
def a_control_payload_with_a_negative_id(m):
    _context(m).handle(1, RPC_KIND_CODES["child_accept"], (1, -5))


@case("rref", RRefProtocolError)
def a_control_payload_as_a_list(m):
    _context(m).handle(1, RPC_KIND_CODES["fork_request"], [0, 0, 1, 1])


@case("rref", RRefDeletedError)
def using_a_user_rref_deleted_on_its_owner(m):
    user, _, _ = _context(m).create_remote(1)
    user.deleted_on_owner = True
    user.check_usable("to_here")


@case("rref", RRefDeletedError)
def forking_a_deleted_user_rref(m):
    ctx = _context(m)
    user, _, _ = ctx.create_remote(1)
    user.deleted_on_owner = True
    user.fork(ctx)


@case("rref", DistTimeoutError)
def an_owner_value_that_never_comes(m):
    _context(m).create_owner_rref().get_value(timeout=0.01)


@case("rref", RRefProtocolError)
def the_same_pending_user_twice(m):
    ctx = _context(m)
    user, _, fork_id = ctx.create_remote(1)
    ctx.add_pending_user(fork_id, m.UserRRef(1, user.rref_id, fork_id))


@case("rref", RRefProtocolError)
def the_same_pending_child_twice(m):
    ctx = _context(m)
    user, _, _ = ctx.create_remote(1)
    child = ctx.gen_id()
    ctx.add_pending_child(child, user)
    ctx.add_pending_child(child, user)


@case("rref", RRefIdOverflowError)
def local_ids_run_out(m):
    ctx = _context(m)
    ctx.next_local_id = 1 << 40
    ctx.gen_id()


# ------------------------------------------------------------------------------------------------ rpc_framing
LIMIT = 1 << 20


def _header(kind=1, flags=0, mid=7, nbuf=0, nforks=0, nmeta=0, magic=RPC_WIRE_MAGIC, version=RPC_WIRE_VERSION):
    return HEADER.pack(magic, version, 0, kind, flags, mid, nbuf, nforks, nmeta)


@case("rpc_framing", RpcMessageError)
def a_message_shorter_than_its_header(m):
    m.unpack_header(b"short", LIMIT)


@case("rpc_framing", RpcMessageError)
def a_message_without_the_magic(m):
    m.unpack_header(_header(magic=b"xx"), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_message_of_another_wire_version(m):
    m.unpack_header(_header(version=RPC_WIRE_VERSION + 1), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_message_of_a_kind_that_exists_nowhere(m):
    m.unpack_header(_header(kind=33), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_response_with_a_request_flag(m):
    m.unpack_header(_header(kind=0, flags=2), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_reply_slot_on_a_response(m):
    m.unpack_header(_header(kind=0)[:3] + b"\x01" + _header(kind=0)[4:] + b"\x80\x05N.", LIMIT)


@case("rpc_framing", RpcMessageError)
def a_stop_message_with_a_body(m):
    m.unpack_header(_header(kind=7) + b"\x80\x05N.", LIMIT)


@case("rpc_framing", RpcMessageError)
def a_body_taking_fewer_buffers_than_announced(m):
    m.unpack_header(_header(nbuf=1) + struct.pack("<q", 4) + b"\x80\x05N.", LIMIT)


@case("rpc_framing", RpcMessageError)
def a_pickle_of_protocol_0(m):
    m.unpack_header(_header() + b"N.", LIMIT)


@case("rpc_framing", RpcMessageError)
def metadata_with_bytes_after_its_stop(m):
    m.unpack_header(_header(nmeta=5) + b"\x80\x05N.x" + b"\x80\x05N.", LIMIT)


@case("rpc_framing", RpcMessageError)
def too_many_buffers(m):
    m.unpack_header(_header(nbuf=MAX_BUFFERS + 1), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_header_cut_short(m):
    m.unpack_header(_header(nbuf=3), LIMIT)


@case("rpc_framing", RpcMessageError)
def buffers_over_the_limit(m):
    m.unpack_header(_header(nbuf=2) + struct.pack("<2q", LIMIT, 1), LIMIT)


@case("rpc_framing", RpcMessageError)
def a_batch_frame_overrunning_the_batch(m):
    m.split_batch(struct.pack("<I", 100) + b"abc")


@case("rpc_framing", RpcMessageError)
def a_batch_with_a_cut_frame_length(m):
    m.split_batch(m.pack_batch([b"one"]) + b"\x01\x02")


@case("rpc_framing", RpcMessageError)
def a_pickle_claiming_a_terabyte(m):
    m.check_pickle(b"\x80\x05\x8e" + (1 << 40).to_bytes(8, "little") + b".")


@case("rpc_framing", RpcMessageError)
def a_pickle_without_stop(m):
    m.check_pickle(b"\x80\x05K\x01")


@case("rpc_framing", ValueError)
def a_fork_record_of_five_ints(m):
    m.pack_header(1, 0, 7, [], [(0, 1, 2, 3, 4)], b"", b"body")


@case("rpc_framing", ValueError)
def a_reply_slot_beyond_the_last(m):
    m.pack_header(1, 0, 7, [], [], b"", b"body", (), 256)


@case("rpc_framing", ValueError)
def device_records_not_one_per_buffer(m):
    m.pack_header(1, 0, 7, [8, 8], [], b"", b"body", (0,))


@case("rpc_wait", ValueError)
def a_waiter_polling_for_negative_seconds(m):
    from mpi4py import MPI

    m.Waiter(MPI.COMM_SELF, -1.0, 0.001)


@case("rpc_wait", ValueError)
def a_seat_taken_over_at_once(m):
    m.Seat(0, 0.001)


@case("rpc_framing", RpcMessageError)
def a_device_record_naming_no_device(m):
    m.unpack_devices(_header(flags=RPC_FLAG_DEVICES, nbuf=1) + struct.pack("<2q", 8, -2))


@case("rpc_framing", RpcMessageError)
def device_records_cut_short(m):
    m.unpack_devices(_header(flags=RPC_FLAG_DEVICES, nbuf=2) + struct.pack("<3q", 8, 8, 0))


# ------------------------------------------------------------------------------------------ autograd_container
@case("autograd_container", ValueError)
def a_container_of_a_worker_out_of_range(m):
    m.DistAutogradContainer(1 << 16)


@case("autograd_container", ValueError)
def a_container_of_three_shards(m):
    m.DistAutogradContainer(0, num_shards=3)


@case("autograd_container", AutogradContextNotFoundError)
def retrieving_an_unknown_context(m):
    m.DistAutogradContainer(3).retrieve_context(12345)


@case("autograd_container", AutogradContextNotFoundError)
def releasing_an_unknown_context(m):
    m.DistAutogradContainer(3).release_context(12345)


@case("autograd_container", ValueError)
def a_context_id_past_64_bits(m):
    m.DistAutogradContainer(3).retrieve_context(1 << 64)


@case("autograd_container", DistAutogradError)
def a_current_context_when_there_is_none(m):
    container = m.DistAutogradContainer(3)
    container.clear_current_context_id()
    container.current_context()


@case("autograd_container", DistAutogradError)
def a_context_inside_a_context(m):
    container = m.DistAutogradContainer(3)
    container.new_context()
    try:
        container.new_context()
    finally:
        container.clear_current_context_id()


@case("autograd_container", AutogradIdOverflowError)
def message_ids_run_out(m):
    container = m.DistAutogradContainer(3, start=(1 << 48) - 1)
    container.new_autograd_message_id()
    container.new_autograd_message_id()


@case("autograd_container", DistAutogradError)
def the_same_send_function_twice(m):
    container = m.DistAutogradContainer(3)
    context = container.new_context()
    container.clear_current_context_id()
    context.add_send_function(object(), 5)
    context.add_send_function(object(), 5)


@case("autograd_container", DistAutogradError)
def a_missing_send_function(m):
    container = m.DistAutogradContainer(3)
    context = container.new_context()
    container.clear_current_context_id()
    context.retrieve_send_function(9)


@case("autograd_container", DistAutogradError)
def a_send_function_of_none(m):
    container = m.DistAutogradContainer(3)
    context = container.new_context()
    container.clear_current_context_id()
    context.add_recv_function(None, 1)


@case("autograd_container", ValueError)
def a_negative_context_id(m):
    m.DistAutogradContainer(3).get_or_create_context(-1)


@case("autograd_container", ValueError)
def a_message_id_past_64_bits(m):
    container = m.DistAutogradContainer(3)
    context = container.new_context()
    container.clear_current_context_id()
    context.add_send_function(object(), 1 << 64)


# ---------------------------------------------------------------------------------------------------------- fsdp
def _fsdp_params(m, *dtypes):
    from distlab._common.fsdp import MixedPrecisionPolicy
    from distlab._common.fsdp_param import ParamModuleInfo

    params = []
    for dtype in dtypes:
        layer = nn.Linear(3, 2)
        layer.weight = nn.Parameter(np.ones((2, 3), dtype=dtype))
        params.append(m.FSDPParam(layer.weight, ParamModuleInfo(layer, "weight"), 1, 0, 0, MixedPrecisionPolicy()))
    return params


@case("fsdp", AssertionError)
def a_group_of_two_dtypes(m):
    from distlab._common.fsdp import MixedPrecisionPolicy

    m.FSDPParamGroup(_fsdp_params(m, np.float32, np.float64), (), m.MeshInfo(comm.world()), None,
                     MixedPrecisionPolicy(), "block")


@case("fsdp", AssertionError)
def gradients_of_two_dtypes_in_one_reduce_scatter(m):
    grads = [np.ones((2, 3), np.float32), np.ones((2, 3), np.float16)]
    m.foreach_reduce(_fsdp_params(m, np.float32, np.float32), grads, comm.world(), np.dtype(np.float32), None, np,
                     None, None, True, "block")
