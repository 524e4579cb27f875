"""What both twins of the collective fingerprint share: the word positions, the dtype packing and every text.

The layout itself (how many words, which version) is a wire fact and lives in :mod:`distlab._wire`. Describing a
fingerprint, grouping the ranks by what they sent and wording a mismatch only run when something went wrong, so
they live here once; the twins build and compare fingerprints, which runs before every collective.
"""
from __future__ import annotations

import numpy as np

from distlab._wire import COLLECTIVE_OPS, FINGERPRINT_MAX_DIMS, REDUCE_OPS

__all__ = ["VERSION", "SEQ", "OP", "REDUCE", "ROOT", "DTYPE", "NDIM", "DIMS", "unknown_op", "dtype_word",
           "describe_fingerprint", "fingerprint_groups", "mismatch_message"]

#: Word positions inside a fingerprint (see distlab._wire).
VERSION, SEQ, OP, REDUCE, ROOT, DTYPE, NDIM, DIMS = range(8)


def unknown_op(op) -> ValueError:
    """The error for a collective name that is not in ``COLLECTIVE_OPS``."""
    return ValueError(f"{op!r} is not a collective op; expected one of {', '.join(COLLECTIVE_OPS[1:])}")


def dtype_word(dtype) -> int:
    """Pack the dtype's string form (``'<f4'``) into one int64, so it can be unpacked for the message (0: none)."""
    if dtype is None:
        return 0
    text = np.dtype(dtype).str.encode("ascii")[:8]
    return int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)


def _dtype_text(code: int) -> str:
    if code == 0:
        return "-"
    text = int(code).to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii", "replace")
    try:
        return np.dtype(text).name
    except TypeError:
        return text


def describe_fingerprint(words) -> str:
    """Return a human-readable form, e.g. ``"#3 allreduce(sum) float32[4, 2]"``."""
    op = int(words[OP])
    reduce_code = int(words[REDUCE])
    text = f"#{int(words[SEQ])} {COLLECTIVE_OPS[op] if 0 <= op < len(COLLECTIVE_OPS) else f'op{op}'}"
    reduce_name = REDUCE_OPS[reduce_code] if 0 <= reduce_code < len(REDUCE_OPS) else "?"
    if reduce_name:
        text += f"({reduce_name})"
    ndim = int(words[NDIM])
    if ndim >= 0:
        dims = [int(d) for d in words[DIMS:DIMS + min(ndim, FINGERPRINT_MAX_DIMS)]]
        text += f" {_dtype_text(int(words[DTYPE]))}[{', '.join(map(str, dims))}]"
    if int(words[ROOT]) >= 0:
        text += f" root={int(words[ROOT])}"
    return text


def fingerprint_groups(table) -> dict:
    """Group ranks by fingerprint: ``{description: [ranks]}`` in order of first appearance.

    Parameters
    ----------
    table : array_like
        ``(world_size, FINGERPRINT_WORDS)`` int64: row ``r`` is rank ``r``'s fingerprint.
    """
    groups: dict[str, list[int]] = {}
    for rank, row in enumerate(np.asarray(table)):
        groups.setdefault(describe_fingerprint(row), []).append(rank)
    return groups


def mismatch_message(table) -> str:
    """The message of a table whose rows differ: who called what, and a hint when the ranks are out of step."""
    table = np.asarray(table)
    parts = []
    for description, ranks in fingerprint_groups(table).items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} called {description}")
    hint = ""
    if len({int(s) for s in table[:, SEQ]}) > 1:
        hint = " (the ranks are out of step: some skipped or added a collective earlier)"
    return f"collective mismatch across {len(table)} ranks: " + "; ".join(parts) + hint
