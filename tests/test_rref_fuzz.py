"""The RRef twins on malformed input: id ranges, fork data and control messages, fuzzed with hypothesis.

Both twins must accept exactly the same messages, raise the same error (class and words) for the others, and
end in the same state. Before the shared id validation, the core packed ids beyond 40 bits into one int64 (a
delete for (0, 2**40) deleted the owner (1, 0)) and raised OverflowError where the reference accepted.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlab import _backend
from distlab._common.rref import LOCAL_ID_LIMIT, WORKER_ID_LIMIT
from distlab._wire import RPC_KIND_CODES
from distlab.errors import DistlabError, RRefIdOverflowError, RRefProtocolError
from distlab.futures import Future

K_DEL, K_FORK, K_ACCEPT = (RPC_KIND_CODES[k] for k in ("user_delete", "fork_request", "child_accept"))
TWINS = _backend.load_twins("rref") if _backend.core_available() else {"reference": _backend.load("rref", "reference")}

EDGES = [0, 1, 2, 3, -1, WORKER_ID_LIMIT - 1, WORKER_ID_LIMIT, LOCAL_ID_LIMIT - 1, LOCAL_ID_LIMIT, 2 ** 31,
         2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63)]
ints = st.one_of(st.sampled_from(EDGES), st.integers(-3, 8), st.integers())
scalars = st.one_of(ints, st.booleans(), st.none(), st.floats(allow_nan=False), st.text(max_size=3),
                    st.binary(max_size=3))
payloads = st.one_of(st.lists(ints, min_size=0, max_size=6).map(tuple),
                     st.lists(scalars, min_size=0, max_size=6).map(tuple),
                     st.lists(ints, max_size=4), st.none(), st.text(max_size=4), st.integers(),
                     st.tuples(st.tuples(ints, ints), st.tuples(ints, ints)))
kinds = st.one_of(st.sampled_from([K_DEL, K_FORK, K_ACCEPT]), ints, st.booleans(), st.none(), st.text(max_size=2))


def _world(mod):
    """Worker 0 owns RRef (0, 0), forked to worker 1 (fork (0, 1)) and requested by worker 2 (fork (2, 7));
    it also holds a pending child (1, 9) of a user RRef owned by worker 1."""
    sent = []

    def send(dst, kind, payload):
        sent.append((dst, kind, payload))
        fut = Future()
        fut.set_result(None)
        return fut

    ctx = mod.RRefContext(0, send, trace=True)
    owner = ctx.create_owner_rref("v")
    ctx.prepare_child_fork(owner)
    ctx.handle(2, K_FORK, (0, 0, 2, 7))
    user = ctx.receive_fork((1, 1, 3, 0, 5, 1))[0]
    ctx.prepare_child_fork(user)
    return ctx, sent


def _outcome(mod, action):
    ctx, sent = _world(mod)
    try:
        action(ctx, mod)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test compares what each twin raises
        assert isinstance(exc, DistlabError), f"{type(exc).__name__}: {exc}"
        error = (type(exc), str(exc))
    return error, ctx.state(), sent, ctx.debug_info()


def _same_everywhere(action):
    outcomes = {impl: _outcome(mod, action) for impl, mod in TWINS.items()}
    first = next(iter(outcomes.values()))
    for impl, got in outcomes.items():
        assert got == first, f"{impl} differs: {got} vs {first}"
    return first


def _check_control(src, kind, payload):
    error, _state, _sent, _info = _same_everywhere(lambda ctx, mod: ctx.handle(src, kind, payload))
    if error is not None:
        assert error[0] is RRefProtocolError and "malformed RRef control message" in error[1]


def _check_fork_data(data):
    error, _state, _sent, _info = _same_everywhere(lambda ctx, mod: ctx.receive_fork(data))
    if error is not None:
        assert error[0] is RRefProtocolError and "malformed RRef fork data" in error[1]


@settings(max_examples=200, deadline=None)
@given(src=ints, kind=kinds, payload=payloads)
def test_fuzzed_control_messages_agree(src, kind, payload):
    _check_control(src, kind, payload)


@settings(max_examples=100, deadline=None)
@given(data=payloads)
def test_fuzzed_fork_data_agrees(data):
    _check_fork_data(data)


# Valid messages that hit the state _world builds, and mutations of them. Hypothesis draws the seed (and shrinks
# it); a plain RNG makes the mutations, so a run covers thousands of inputs in seconds.
VALID_CONTROL = [(K_DEL, (0, 0, 0, 1)), (K_DEL, (0, 0, 2, 7)), (K_FORK, (0, 0, 4, 2)), (K_ACCEPT, (1, 9)),
                 (K_ACCEPT, (0, 4)), (K_DEL, (1, 1, 0, 2))]
VALID_FORK_DATA = [(1, 1, 3, 0, 6, 1), (0, 0, 0, 0, 9, 2), (0, 0, 0, 0, 8, 0), (2, 2, 0, 2, 1, 1)]


def _mutant(rng, value):
    value = list(value)
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        if choice < 0.5 and value:
            value[rng.randrange(len(value))] = rng.choice(EDGES + [True, None, 1.0, "1", b"", (0, 1), [0]])
        elif choice < 0.65 and value:
            i = rng.randrange(len(value))
            if type(value[i]) is int:
                value[i] += rng.choice([1, -1, 2 ** 40, -(2 ** 40), 2 ** 16])
        elif choice < 0.8 and value:
            del value[rng.randrange(len(value))]
        else:
            value.insert(rng.randint(0, len(value)), rng.choice(EDGES))
    return tuple(value) if rng.random() < 0.9 else value


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_mutated_messages_agree(seed):
    import random

    rng = random.Random(seed)
    for _ in range(80):  # 25 x 80 = 2,000 control messages per run
        kind, payload = rng.choice(VALID_CONTROL)
        if rng.random() < 0.1:
            kind = rng.choice(EDGES + [K_DEL, K_FORK, K_ACCEPT])
        _check_control(rng.randrange(4), kind, _mutant(rng, payload))
    for _ in range(40):  # and 1,000 fork data tuples
        _check_fork_data(_mutant(rng, rng.choice(VALID_FORK_DATA)))


@settings(max_examples=200, deadline=None)
@given(created_on=st.one_of(ints, st.booleans(), st.none()), local_id=st.one_of(ints, st.booleans()))
def test_fuzzed_ids_agree(created_on, local_id):
    error, *_ = _same_everywhere(lambda ctx, mod: mod.GloballyUniqueId(created_on, local_id))
    valid = (type(created_on) is int and type(local_id) is int and 0 <= created_on < WORKER_ID_LIMIT
             and 0 <= local_id < LOCAL_ID_LIMIT)
    assert (error is None) == valid


def test_ids_beyond_40_bits_do_not_alias(rref):
    # Before: the core packed (0, 2**40) into the key of (1, 0) and deleted worker 1's RRef.
    ctx = rref.RRefContext(0, lambda *a: Future())
    with pytest.raises(RRefProtocolError, match=r"local_id in \[0, 2\*\*40\)"):
        ctx.handle(1, K_DEL, (0, 2 ** 40, 0, 1))
    with pytest.raises(RRefProtocolError, match=r"created_on in \[0, 65536\)"):
        rref.GloballyUniqueId(2 ** 16, 0)
    with pytest.raises(RRefProtocolError, match="malformed RRef fork data"):
        rref.parse_fork_data((0, 0, 2 ** 40, 0, 1, 1))
    with pytest.raises(RRefProtocolError, match="malformed RRef fork data"):
        rref.parse_fork_data((2 ** 16, 0, 1, 0, 1, 1))
    assert rref.GloballyUniqueId(WORKER_ID_LIMIT - 1, LOCAL_ID_LIMIT - 1).key() == (65535, 2 ** 40 - 1)


def test_id_counter_exhaustion_is_an_error(rref):
    ctx = rref.RRefContext(3, lambda *a: Future())
    ctx.next_local_id = LOCAL_ID_LIMIT - 1
    assert ctx.gen_id().key() == (3, LOCAL_ID_LIMIT - 1)
    with pytest.raises(RRefIdOverflowError, match="worker 3 has used all 2\\*\\*40 RRef ids"):
        ctx.gen_id()
    assert ctx.next_local_id == LOCAL_ID_LIMIT


@pytest.mark.parametrize("worker_id", [-1, 2 ** 16, 1.0, "0", True])
def test_context_worker_id_is_checked(rref, worker_id):
    with pytest.raises(ValueError, match="RRef worker id must be an int"):
        rref.RRefContext(worker_id, lambda *a: Future())
