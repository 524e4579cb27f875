"""The RRef protocol in-process (no MPI): fork cases, errors, idempotency, reordering stress, twin equivalence."""
from __future__ import annotations

import types

import pytest

from _rref_sim import SimWorld
from distlab import _backend
from distlab._wire import RPC_KIND_CODES
from distlab.errors import (DistTimeoutError, RRefCreationTimeoutError, RRefDeletedError, RRefLeakError,
                            RRefProtocolError)
from distlab.futures import Future

K_DEL, K_FORK, K_ACCEPT = (RPC_KIND_CODES[k] for k in ("user_delete", "fork_request", "child_accept"))


class Net:
    """A tiny manual network: contexts' control messages queue up; ``deliver`` runs them in the given order."""

    def __init__(self, mod, n):
        self.queue = []
        self.ctxs = [mod.RRefContext(i, self.sender(i), trace=True) for i in range(n)]

    def sender(self, src):
        def send(dst, kind, payload):
            fut = Future()
            self.queue.append((src, dst, kind, payload, fut))
            return fut
        return send

    def deliver_all(self):
        while self.queue:
            src, dst, kind, payload, fut = self.queue.pop(0)
            self.ctxs[dst].handle(src, kind, payload)
            fut.set_result(None)


def test_ids_fork_data_and_string_forms(rref):
    ctx = rref.RRefContext(3, lambda *a: Future())
    gid = ctx.gen_id()
    assert repr(gid) == "GloballyUniqueId(created_on=3, local_id=0)"
    assert gid == rref.GloballyUniqueId(3, 0) and hash(gid) == hash(rref.GloballyUniqueId(3, 0))
    owner = ctx.create_owner_rref(7)
    assert repr(owner) == "OwnerRRef(rref_id=GloballyUniqueId(created_on=3, local_id=1))"
    assert owner.get_value() == 7 and owner.is_owner() and owner.confirmed_by_owner()
    user, rid, fid = ctx.create_remote(0)
    assert repr(user) == ("UserRRef(rref_id=GloballyUniqueId(created_on=3, local_id=2), "
                          "fork_id=GloballyUniqueId(created_on=3, local_id=3))")
    assert not user.is_owner() and not user.confirmed_by_owner() and user.owner() == 0
    fd = rref.parse_fork_data((0, 3, 2, 3, 9, 3))
    assert fd.to_tuple() == (0, 3, 2, 3, 9, 3)
    assert "RRefForkData(owner=0" in repr(fd)
    assert ctx.debug_info() == {"num_owner_rrefs": 0, "num_pending_futures": 0, "num_pending_users": 1,
                                "num_forks": 0, "num_pending_children": 0, "num_confirmed_users": 0}


@pytest.mark.parametrize("bad", [None, (1, 2, 3), (0, 1, 2, 3, 4, "5"), [0, 1, 2, 3, 4, 5]])
def test_malformed_fork_data(rref, bad):
    with pytest.raises(RRefProtocolError, match="malformed RRef fork data"):
        rref.parse_fork_data(bad)


@pytest.mark.parametrize("kind,payload", [(K_DEL, (1, 2)), (K_FORK, "x"), (K_ACCEPT, (1, "a")), (99, (1, 2))])
def test_malformed_control_message(rref, kind, payload):
    ctx = rref.RRefContext(0, lambda *a: Future())
    with pytest.raises(RRefProtocolError, match="malformed"):
        ctx.handle(1, kind, payload)


def test_owner_to_user_and_user_deletion(rref):
    net = Net(rref, 2)
    owner_ctx, user_ctx = net.ctxs
    owner = owner_ctx.create_owner_rref("v")
    fd = owner_ctx.prepare_child_fork(owner)          # owner -> user: early fork registration
    assert owner_ctx.debug_info()["num_forks"] == 1 and owner_ctx.debug_info()["num_owner_rrefs"] == 1
    user, wait = user_ctx.receive_fork(fd)
    assert wait is None and user.confirmed_by_owner()  # confirmed at once
    user_ctx.release_user(user)
    user_ctx.release_user(user)                        # the deletion notice is sent once
    assert [m[2] for m in net.queue] == [K_DEL]
    net.deliver_all()
    assert owner_ctx.idle() and user_ctx.idle()
    with pytest.raises(RRefDeletedError, match="has been deleted"):
        user.check_usable("to_here()")
    with pytest.raises(RRefDeletedError, match="Cannot call fork on it after deletion"):
        user_ctx.prepare_child_fork(user)


def test_owner_to_self_deletes_the_fork(rref):
    net = Net(rref, 1)
    ctx = net.ctxs[0]
    owner = ctx.create_owner_rref(1)
    fd = ctx.prepare_child_fork(owner)
    got, fut = ctx.receive_fork(fd)
    assert got is None and fut.done() and fut.value() is owner
    assert ctx.idle() and not net.queue


def test_user_to_owner_sends_child_accept_and_g2_defers_deletion(rref):
    net = Net(rref, 2)
    owner_ctx, user_ctx = net.ctxs
    user, rid, fid = user_ctx.create_remote(0)
    owner_ctx.handle_remote_call(rid, fid)
    user_ctx.finish_remote(user)                       # the remote's acknowledgement
    fd = user_ctx.prepare_child_fork(user)             # user -> owner
    assert user_ctx.debug_info()["num_pending_children"] == 1
    user_ctx.release_user(user)                        # dropped while its child is pending: G2 defers
    assert not net.queue
    got, fut = owner_ctx.receive_fork(fd)
    assert got is None and fut.done()
    assert [m[2] for m in net.queue] == [K_ACCEPT]
    net.deliver_all()                                  # child accepted -> the deferred deletion goes out
    assert [m[:3] for m in net.queue] == []
    assert owner_ctx.idle() and user_ctx.idle()
    assert user.deleted_on_owner


def test_user_to_user_fork_request(rref):
    net = Net(rref, 3)
    owner_ctx, a, b = net.ctxs
    user, rid, fid = a.create_remote(0)
    owner_ctx.handle_remote_call(rid, fid)
    a.finish_remote(user)
    fd = a.prepare_child_fork(user)
    child, wait = b.receive_fork(fd)
    assert not wait.done() and b.debug_info()["num_pending_users"] == 1
    assert [m[2] for m in net.queue] == [K_FORK]
    net.deliver_all()                                   # fork request -> ack -> child accept to the parent
    assert wait.done() and child.confirmed_by_owner()
    assert a.debug_info()["num_pending_children"] == 0
    assert owner_ctx.debug_info()["num_forks"] == 2
    a.release_user(user)
    b.release_user(child)
    net.deliver_all()
    assert all(c.idle() for c in net.ctxs)
    assert [t[2] for t in a.trace] == [K_DEL] and [t[2] for t in b.trace] == [K_FORK, K_ACCEPT, K_DEL]


def test_pending_owner_future_and_remote_to_self(rref):
    net = Net(rref, 2)
    owner_ctx, user_ctx = net.ctxs
    user, rid, fid = user_ctx.create_remote(0)
    fd = user_ctx.prepare_child_fork(user)
    got, fut = owner_ctx.receive_fork(fd)               # used before the remote call arrived
    assert not fut.done() and owner_ctx.debug_info()["num_pending_futures"] == 1
    owner = owner_ctx.handle_remote_call(rid, fid)
    assert fut.done() and fut.value() is owner and owner_ctx.debug_info()["num_pending_futures"] == 0
    self_rref, srid, sfid = owner_ctx.create_remote(0)  # remote to self: self fork until handled
    assert srid == sfid and owner_ctx.debug_info()["num_forks"] == 2
    owner_ctx.handle_remote_call(srid, sfid)
    assert owner_ctx.debug_info()["num_forks"] == 1


def test_duplicate_and_retried_control_messages_are_idempotent(rref):
    net = Net(rref, 3)
    owner_ctx, a, b = net.ctxs
    user, rid, fid = a.create_remote(0)
    owner_ctx.handle_remote_call(rid, fid)
    a.finish_remote(user)
    a.finish_remote(user)                              # duplicate acknowledgement
    fd = a.prepare_child_fork(user)
    child, _ = b.receive_fork(fd)
    src, dst, kind, payload, fut = net.queue.pop(0)
    owner_ctx.handle(src, kind, payload)
    fut.set_exception(DistTimeoutError("ack lost"))    # the sender retries
    assert [m[2] for m in net.queue] == [K_FORK]
    net.deliver_all()
    a.release_user(user)
    b.release_user(child)
    net.deliver_all()
    assert owner_ctx.idle()
    owner_ctx.handle(2, K_FORK, payload)               # a late duplicate must not resurrect the fork
    owner_ctx.handle(2, K_DEL, payload)                # nor a duplicate deletion break anything
    owner_ctx.handle(0, K_ACCEPT, payload[2:])
    assert owner_ctx.idle() and owner_ctx.check_leaks() is None


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_control_message_is_sent_max_retries_more_times_then_reported(rref, max_retries):
    """Each lost acknowledgement (a timeout) re-sends the message, ``max_retries`` times at most; then the failure
    is kept in ``errors``, naming the message and its destination."""
    sent = []

    def send(dst, kind, payload):
        sent.append((dst, kind))
        fut = Future()
        fut.set_exception(DistTimeoutError("ack lost"))
        return fut

    ctx = rref.RRefContext(1, send, max_retries=max_retries)
    user, _rid, _fid = ctx.create_remote(0)
    ctx.finish_remote(user)
    ctx.release_user(user)                              # the deletion notice, to the owner (worker 0)
    assert sent == [(0, K_DEL)] * (1 + max_retries)
    assert len(ctx.errors) == 1 and "ack lost" in str(ctx.errors[0])


def test_idle_only_when_nothing_at_all_is_held(rref):
    """Any one of an owner RRef, a pending user, a pending child or a confirmed user keeps a worker busy."""
    net = Net(rref, 2)
    owner_ctx, user_ctx = net.ctxs
    assert owner_ctx.idle() and user_ctx.idle()
    user, rid, fid = user_ctx.create_remote(0)          # a pending user alone
    assert not user_ctx.idle() and user_ctx.debug_info()["num_pending_users"] == 1
    owner_ctx.handle_remote_call(rid, fid)              # an owner RRef (and its fork) alone
    assert not owner_ctx.idle() and owner_ctx.debug_info()["num_owner_rrefs"] == 1
    user_ctx.finish_remote(user)                        # now a confirmed user alone
    assert not user_ctx.idle() and user_ctx.debug_info() == {
        "num_owner_rrefs": 0, "num_pending_futures": 0, "num_pending_users": 0, "num_forks": 0,
        "num_pending_children": 0, "num_confirmed_users": 1}
    fd = user_ctx.prepare_child_fork(user)              # and a pending child with it
    user_ctx.release_user(user)                         # dropped while its child is pending: still busy (G2)
    assert not user_ctx.idle() and user_ctx.debug_info()["num_pending_children"] == 1
    owner_ctx.receive_fork(fd)
    net.deliver_all()
    assert user_ctx.idle() and owner_ctx.idle()


def test_inconsistent_states_are_errors(rref):
    ctx = rref.RRefContext(1, lambda *a: Future())
    user, rid, fid = ctx.create_remote(0)
    with pytest.raises(RRefProtocolError, match="same UserRRef twice"):
        ctx.add_pending_user(fid, user)
    fd = ctx.prepare_child_fork(user)
    with pytest.raises(RRefProtocolError, match="same child fork twice"):
        ctx.add_pending_child(rref.parse_fork_data(fd).fork_id, user)


def test_creation_timeout_and_error(rref):
    ctx = rref.RRefContext(1, lambda *a: Future())
    user, _rid, _fid = ctx.create_remote(0)
    user.timed_out = True
    with pytest.raises(RRefCreationTimeoutError, match="timed out"):
        user.check_usable("to_here()")
    user2, _rid, _fid = ctx.create_remote(0)
    ctx.finish_remote(user2, ValueError("owner could not run it"))
    with pytest.raises(ValueError, match="could not run"):
        user2.check_usable("to_here()")
    ctx.release_user(user2)                             # no deletion notice: the owner never had the fork
    assert ctx.debug_info()["num_pending_users"] == 1   # user (timed out) still awaits its acknowledgement


def test_leak_check_names_every_rref_and_fork(rref):
    net = Net(rref, 2)
    owner_ctx, user_ctx = net.ctxs
    owner = owner_ctx.create_owner_rref(0)
    fd1 = owner_ctx.prepare_child_fork(owner)
    fd2 = owner_ctx.prepare_child_fork(owner)
    err = owner_ctx.check_leaks()
    assert isinstance(err, RRefLeakError)
    text = str(err)
    assert text.count("Leaking RRef GloballyUniqueId(created_on=0, local_id=0)") == 2
    assert "fork Id GloballyUniqueId(created_on=0, local_id=1)" in text
    assert "fork Id GloballyUniqueId(created_on=0, local_id=2)" in text
    for fd in (fd1, fd2):                               # graceful shutdown path clears it
        user_ctx.receive_fork(fd)
    assert user_ctx.delete_all_users() == 2
    net.deliver_all()
    assert owner_ctx.check_leaks() is None and owner_ctx.idle() and user_ctx.idle()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reordering_stress_keeps_g1_g2_and_leaks_nothing(rref, n):
    # >= 200 seeds per twin in total (100 per world size), with loss (retries) and duplicates.
    for seed in range(100 if n != 2 else 40):
        SimWorld(rref, n, seed * 7919 + n, loss=0.1, dup=0.1).run(50).assert_clean()


def test_reordering_stress_without_loss(rref):
    for seed in range(60):
        SimWorld(rref, 3, seed).run(60).assert_clean()


def test_checker_catches_a_protocol_without_g2():
    reference = _backend.load("rref", "reference")

    class NoG2(reference.RRefContext):
        def add_pending_child(self, fork_id, rref):
            pass  # the parent no longer waits for its child's confirmation

    failures = 0
    for seed in range(40):
        try:
            SimWorld(types.SimpleNamespace(RRefContext=NoG2), 3, seed).run(60).assert_clean()
        except AssertionError:
            failures += 1
    assert failures > 10


def test_twins_produce_identical_traces_and_states():
    twins = _backend.load_twins("rref")
    for seed in range(40):
        worlds = {impl: SimWorld(mod, 3 + seed % 2, seed, loss=0.1, dup=0.1).run(60) for impl, mod in twins.items()}
        ref, core = worlds["reference"], worlds["core"]
        assert ref.traces() == core.traces(), f"seed {seed}: control message traces differ"
        assert ref.log == core.log, f"seed {seed}: delivery logs differ"
        assert ref.states() == core.states()
        assert sum(map(len, ref.traces())) > 0
