"""Per-rank entry point of :func:`distlab.run`: ``python -m distlab._runner payload.pkl workdir``.

Starts the rank as :mod:`distlab._bootstrap` does (watcher, rank variables, start record, stop handler), loads
``(fn, args, kwargs)`` with cloudpickle, runs it, and writes ``workdir/rank<N>.pkl`` holding ``(True, result)``
or ``(False, traceback text)``, then the completion record. A failing rank ends the job once its traceback is
written, so peers blocked in a collective do not wait out their timeout.
"""
from __future__ import annotations

import sys
from pathlib import Path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def forget_results(workdir: str) -> None:
    """Before a restart: the results the failed attempt's ranks left are not the job's."""
    for path in Path(workdir).glob("rank*.pkl"):
        path.unlink(missing_ok=True)


def collect_results(workdir: Path, np: int, job):
    """The return values each rank of :func:`distlab.run` left (``job``: its JobResult); a failure raised as
    :class:`~distlab.errors.RankFailedError` naming the rank."""
    import cloudpickle

    from .errors import RankFailedError

    results, failures = [], {}
    for rank in range(np):
        path = workdir / f"rank{rank}.pkl"
        if not path.exists():
            results.append(None)
            continue
        ok, value = cloudpickle.loads(path.read_bytes())
        results.append(value if ok else None)
        if not ok:
            failures[rank] = value
    culprits = [e for e in job.ranks if e.culprit]
    if failures:
        first = next((e.rank for e in culprits if e.rank in failures), min(failures))
        raise RankFailedError(f"rank {first} of {np} raised:\n{failures[first]}", rank=first,
                              remote_traceback=failures[first], failures=failures)
    if job.returncode != 0:
        first = culprits[0].rank if culprits else None
        raise RankFailedError("\n".join(job.summary) or f"the job failed with exit status {job.returncode}",
                              rank=first)
    return results


def main(payload_path: str, workdir: str) -> None:
    import cloudpickle

    from ._bootstrap import fail, finish_rank, start_rank, user_traceback

    rank = start_rank()
    out = Path(workdir) / f"rank{rank}.pkl"
    try:
        fn, args, kwargs = cloudpickle.loads(Path(payload_path).read_bytes())
        data = cloudpickle.dumps((True, fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - report any failure to the caller
        summary, trace = user_traceback(exc)
        _write(out, cloudpickle.dumps((False, trace)))
        fail(1, rank, summary, trace)
        return
    _write(out, data)
    finish_rank(rank)


if __name__ == "__main__":
    main(*sys.argv[1:3])
