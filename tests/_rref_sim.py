"""An in-process world of RRef contexts driven by a seeded scheduler (no MPI).

Every message (control messages from the contexts, and the "user" messages the simulated application sends:
``remote`` calls and calls carrying RRef arguments) goes into one in-flight pool; each step delivers a message
chosen by the seeded RNG, so delivery order is arbitrary (reordering), and with ``loss`` > 0 control messages or
their acknowledgements are dropped (the sender sees a timeout and retries) and with ``dup`` > 0 delivered twice.
Both twins driven with the same seed must produce identical traces and final states.

Invariants checked after every step (ANCHORS section 5):
- G1 accounting: the owner counts every confirmed, not-yet-deleted UserRRef as a fork;
- G2 safety: when an owner drops an OwnerRRef, no live UserRRef of it exists anywhere and no message in flight
  carries it;
- user functions run only once their RRef arguments are confirmed (or the OwnerRRef exists).
At the end (everything released, queue drained, graceful shutdown) no worker holds any state: nothing leaks.
"""
from __future__ import annotations

import random

from distlab.errors import DistTimeoutError
from distlab.futures import Future


def _plain(item):
    """A twin-independent form of a message field (ids become tuples, RRefs their repr)."""
    if hasattr(item, "key"):
        return item.key()
    if isinstance(item, list):
        return tuple(_plain(x) for x in item)
    if item is None or isinstance(item, (int, str, tuple)):
        return item
    return repr(item)


class SimWorld:
    def __init__(self, mod, n, seed, loss=0.0, dup=0.0):
        self.mod = mod
        self.n = n
        self.rng = random.Random(seed)
        self.loss = loss
        self.dup = dup
        self.inflight = []
        self.waiting = []
        self.log = []
        self.users = []
        self.held = [[] for _ in range(n)]
        self.ctxs = [mod.RRefContext(i, self._sender(i), max_retries=50, trace=True) for i in range(n)]
        self.owners_seen = [set() for _ in range(n)]
        self.counter = 0

    # -- transport ----------------------------------------------------------------------------------------------
    def _sender(self, src):
        def send(dst, kind, payload):
            fut = Future(description=f"ack {kind} {payload}")
            self.inflight.append(("ctl", src, dst, kind, payload, fut))
            return fut
        return send

    def _deliver(self, msg):
        tag = msg[0]
        self.log.append(tuple(_plain(m) for m in msg if not isinstance(m, Future)))
        if tag == "ctl":
            _, src, dst, kind, payload, fut = msg
            roll = self.rng.random()
            if roll < self.loss / 2:  # the request is lost: the sender times out
                self.inflight.append(("ack", dst, src, "timeout", fut))
                return
            self.ctxs[dst].handle(src, kind, payload)
            if self.rng.random() < self.dup:
                self.inflight.append(("ctl", src, dst, kind, payload, Future()))  # a duplicate, ack ignored
            if roll < self.loss:  # processed, but the acknowledgement is lost
                self.inflight.append(("ack", dst, src, "timeout", fut))
            else:
                self.inflight.append(("ack", dst, src, "ok", fut))
        elif tag == "ack":
            _, _src, _dst, status, fut = msg
            if fut.done():
                return
            if status == "ok":
                fut.set_result(None)
            else:
                fut.set_exception(DistTimeoutError("simulated lost message"))
        elif tag == "remote":
            _, src, dst, rid, fid, user = msg
            owner = self.ctxs[dst].handle_remote_call(rid, fid)
            if not owner.has_value():
                owner.set_value(("value", rid.key()))
            self.inflight.append(("remote_ret", dst, src, fid.key(), user))
        elif tag == "remote_ret":
            _, _src, dst, _fid, user = msg
            if user is not None:
                self.ctxs[dst].finish_remote(user, None)
        elif tag == "call":
            _, src, dst, forks, action = msg
            got, waits = [], []
            for fd in forks:
                r, fut = self.ctxs[dst].receive_fork(fd)
                if r is not None:
                    self.users.append(r)
                got.append((r, fut))
                if fut is not None:
                    waits.append(fut)
            self.waiting.append((dst, got, waits, action))
        self._run_ready()

    def _run_ready(self):
        still = []
        for dst, got, waits, action in self.waiting:
            if not all(w.done() for w in waits):
                still.append((dst, got, waits, action))
                continue
            # The "user function" runs now: every RRef argument must be usable.
            for r, fut in got:
                rref = r if r is not None else fut.value()
                assert rref.confirmed_by_owner(), f"user function ran before {rref!r} was confirmed"
                if action == "hold":
                    self.held[dst].append(rref)
                elif not rref.is_owner():
                    self.ctxs[dst].release_user(rref)
        self.waiting = still

    # -- application --------------------------------------------------------------------------------------------
    def act(self):
        w = self.rng.randrange(self.n)
        ctx = self.ctxs[w]
        choice = self.rng.random()
        held = self.held[w]
        if choice < 0.25:
            dst = self.rng.randrange(self.n)
            r, rid, fid = ctx.create_remote(dst)
            if not r.is_owner():
                self.users.append(r)
            held.append(r)
            self.inflight.append(("remote", w, dst, rid, fid, None if r.is_owner() else r))
        elif choice < 0.35:
            self.counter += 1
            held.append(ctx.create_owner_rref(self.counter))
        elif choice < 0.75 and held:
            rref = held[self.rng.randrange(len(held))]
            dst = self.rng.randrange(self.n)
            fd = ctx.prepare_child_fork(rref)
            self.inflight.append(("call", w, dst, [fd], "hold" if self.rng.random() < 0.6 else "drop"))
        elif held:
            rref = held.pop(self.rng.randrange(len(held)))
            if not rref.is_owner():
                ctx.release_user(rref)

    def step(self):
        if self.inflight:
            msg = self.inflight.pop(self.rng.randrange(len(self.inflight)))
            self._deliver(msg)
            self.check()

    # -- invariants -----------------------------------------------------------------------------------------------
    def _inflight_rids(self):
        rids = set()
        for msg in self.inflight:
            if msg[0] == "call":
                for fd in msg[3]:
                    rids.add((fd[1], fd[2]))
            elif msg[0] == "remote":
                rids.add(msg[3].key())
        for _dst, got, _waits, _action in self.waiting:
            for r, _fut in got:
                if r is not None:
                    rids.add(r.rref_id.key())
        return rids

    def check(self):
        states = [ctx.state() for ctx in self.ctxs]
        live = {}
        for u in self.users:
            if not u.deleted_on_owner:
                live.setdefault(u.rref_id.key(), []).append(u)
        inflight = None
        for w, st in enumerate(states):
            owners_now = set(st["owners"])
            for rid in self.owners_seen[w] - owners_now:
                if inflight is None:
                    inflight = self._inflight_rids()
                assert rid not in live, f"G2 violated: owner {w} dropped {rid} while users {live[rid]} live"
                assert rid not in inflight, f"G2 violated: owner {w} dropped {rid} while it is in flight"
            self.owners_seen[w] = owners_now
            forks = dict(st["forks"])
            for rid, users in live.items():
                for u in users:
                    if u.owner() == w and u.confirmed_by_owner():
                        assert u.fork_id.key() in forks.get(rid, ()), (
                                f"G1 accounting violated: owner {w} does not count confirmed {u!r}")

    # -- a whole run ----------------------------------------------------------------------------------------------
    def run(self, actions=60):
        for _ in range(actions):
            self.act()
            for _ in range(self.rng.randrange(3)):
                self.step()
        for w in range(self.n):
            for rref in self.held[w]:
                if not rref.is_owner():
                    self.ctxs[w].release_user(rref)
            self.held[w] = []
        self.drain()
        for ctx in self.ctxs:  # graceful shutdown
            assert not ctx.has_pending(), ctx.state()
            ctx.delete_all_users()
            ctx.drop_unforked_owners()
        self.drain()
        return self

    def drain(self, limit=100000):
        for _ in range(limit):
            if not self.inflight:
                break
            self.step()
        assert not self.inflight and not self.waiting, "the simulated world did not quiesce"

    def assert_clean(self):
        for ctx in self.ctxs:
            assert ctx.check_leaks() is None, str(ctx.check_leaks())
            assert ctx.idle(), ctx.state()
            assert not ctx.errors, ctx.errors
        assert all(u.deleted_on_owner for u in self.users), [u for u in self.users if not u.deleted_on_owner]

    def traces(self):
        return [list(ctx.trace) for ctx in self.ctxs]

    def states(self):
        return [ctx.state() for ctx in self.ctxs]
