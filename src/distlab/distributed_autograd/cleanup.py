"""Releasing a context on every worker it reached (mirrors container.cpp releaseContext /
sendReleaseContextRpc and the CleanupAutogradContextReq handler).

Leaving ``with context()`` releases the context here and sends a release to every known worker, which releases
it and forwards the release to the workers *it* knows (nested RPC chains: A called B, B called C). A release
that fails is retried; all attempts together are bounded by the RPC timeout (each gets an equal share), so a
worker that never answers costs at most one timeout. After a failed pass the caller gets the pass's error at once
and the release goes on in the background (bounded the same way); a worker that could not be reached is named
in a warning, or in the log when the release ran in the background.
"""
from __future__ import annotations

import logging
import threading
import time
import warnings

from distlab._wire import DIST_AUTOGRAD_KIND_CODES
from distlab.futures import Future, collect_all
from distlab.rpc import api as rpc_api

from . import _state, config

__all__ = ["release", "releases_in_flight", "warn_failures", "handle_cleanup"]

K_CLEANUP = DIST_AUTOGRAD_KIND_CODES["dist_autograd_cleanup"]
log = logging.getLogger("distlab.distributed_autograd")

_in_flight = 0  # background releases not finished yet (debug_info reports it)
_in_flight_lock = threading.Lock()


def releases_in_flight() -> int:
    """Releases sent in the background (after a failed pass) and not answered yet, on this worker."""
    return _in_flight


def release(context_id, *, background: bool = False) -> dict:
    """Release ``context_id`` here and on every worker it reached; return ``{worker: error}`` of the failures.

    ``background``: do not wait (after a failed pass, so that its error reaches the caller first); failures are
    then logged when the last answer arrives, and ``{}`` is returned.
    """
    container = _state.twin().get_container()
    _state.remember_released(context_id)
    known = container.release_context_if_present(context_id)
    container.clear_current_context_id()
    if not known or not rpc_api.is_initialized():
        return {}
    agent = rpc_api.get_agent()
    limit = _state.timeout(agent)
    futures = _release_futures(agent, known, context_id, exclude=None, limit=limit)
    if background:
        _report_later(futures, context_id)
        return {}
    return _wait(futures, limit)


def _release_futures(agent, known, context_id, exclude, limit):
    return {w: _send_with_retries(agent, w, context_id, limit)
            for w in sorted(known) if w != exclude and w != agent.rank}


def _send_with_retries(agent, dst, context_id, limit):
    """Send a release with up to CLEANUP_ATTEMPTS attempts sharing ``limit`` seconds; a Future of None or of the
    last error (control messages are idempotent: a retry of a release that did arrive does no harm)."""
    result = Future(description=f"release autograd context {context_id} on worker {dst}")
    attempts = max(int(config.CLEANUP_ATTEMPTS), 1)
    deadline = time.monotonic() + limit

    def attempt(left):
        share = max((deadline - time.monotonic()) / left, 1e-3)
        fut = agent.send(dst, K_CLEANUP, context_id, timeout=share, inline=True)

        def done(f):
            exc = f.exception()
            if exc is None:
                result.set_result(None)
            elif left > 1 and agent.running and time.monotonic() < deadline:
                try:
                    attempt(left - 1)
                except Exception as again:  # noqa: BLE001 - the agent stopped meanwhile: report, never raise
                    result.set_exception(again)
            else:
                result.set_exception(exc)

        fut.add_done_callback(done)

    try:
        attempt(attempts)
    except Exception as exc:  # noqa: BLE001 - agent stopped: report, never raise from cleanup
        result.set_exception(exc)
    return result


def _wait(futures, limit) -> dict:
    """Wait for the releases (all together bounded by ``limit`` plus a margin); return ``{worker: error}``."""
    deadline = time.monotonic() + limit + 1.0  # the attempts' own timeouts fire first and name the worker
    failures = {}
    for worker, fut in futures.items():
        try:
            fut.wait(max(deadline - time.monotonic(), 1e-3))
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            failures[worker] = exc
    return failures


def _report_later(futures, context_id) -> None:
    global _in_flight
    if not futures:
        return
    with _in_flight_lock:
        _in_flight += 1

    def finished(_all):
        global _in_flight
        with _in_flight_lock:
            _in_flight -= 1
        failures = {w: f.exception() for w, f in futures.items() if f.exception() is not None}
        if failures:
            log.warning("distributed autograd context %s could not be released on %s", context_id, failures)

    collect_all(list(futures.values())).add_done_callback(finished)


def warn_failures(context_id, failures) -> None:
    """Warn about the workers a release did not reach (the caller's frame is the ``with`` statement)."""
    if failures:
        warnings.warn(f"distributed autograd context {context_id} could not be released on {failures}",
                      RuntimeWarning, stacklevel=3)


@_state.handles(K_CLEANUP)
def handle_cleanup(src, context_id, meta):
    """A known worker left the context: release it here and forward to the workers this one knows; answer once
    the forwards are answered (each bounded by this worker's timeout)."""
    _state.remember_released(context_id)
    known = _state.twin().get_container().release_context_if_present(context_id)
    agent = rpc_api.get_agent()
    futures = list(_release_futures(agent, known, context_id, exclude=src, limit=_state.timeout(agent)).values())
    if not futures:
        return None
    return collect_all(futures).then(lambda f: None)
