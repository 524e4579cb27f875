"""Link rates as ``tc`` writes them (``10gbit``, ``100mbit``, ``1.5gbit``) and back."""
from __future__ import annotations

import re

from ..errors import ClusterError

__all__ = ["parse_rate", "format_rate", "UNSHAPED"]

UNSHAPED = ("", "none", "unshaped", "0")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*$", re.IGNORECASE)


def parse_rate(rate) -> int | None:
    """Bits per second from ``"10gbit"`` (tc's units: bit, kbit, mbit, gbit, tbit) or an int; None = unshaped."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in UNSHAPED):
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bps = int(rate)
    else:
        match = _RATE.match(str(rate))
        if not match:
            raise ClusterError(f"link rate {rate!r} is not a rate: write it as tc does, e.g. 10gbit, 1gbit, "
                               "100mbit (or 'unshaped')")
        bps = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bps < 8000:
        raise ClusterError(f"link rate {rate!r} is below 8 kbit/s; tbf cannot shape that usefully")
    return bps


def format_rate(bps: int | None) -> str:
    """``10gbit`` for 10**10, ``unshaped`` for None."""
    if not bps:
        return "unshaped"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}"
    return f"{bps}bit"
