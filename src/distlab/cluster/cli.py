"""``python -m distlab cluster up|down|status``: the command line of the virtual cluster."""
from __future__ import annotations

import argparse
import json
import sys

from .layout import DEFAULT_NAME
from .rates import format_rate
from ..errors import ClusterError

__all__ = ["add_parser", "run_command", "format_status"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``cluster`` with its ``up``, ``down`` and ``status`` subcommands to ``python -m distlab``."""
    parser = subparsers.add_parser(
        "cluster", help="a virtual cluster of hosts (network namespaces) on this machine, over real TCP (root)",
        description="Several virtual hosts on this machine: network namespaces joined by veth links (a bridge "
                    "for more than 2), a private /24 that exists only inside them, links shaped with tc tbf. "
                    "Needs root: sudo .venv/bin/python -m distlab cluster up --hosts 2")
    actions = parser.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="bring a cluster up (idempotent; another --rate reshapes it)")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    up.add_argument("--rate", default=None, help="link rate as tc writes it, e.g. 10gbit, 1gbit (default unshaped)")
    up.add_argument("--delay", type=float, default=None, metavar="MS",
                    help="added one-way delay per link end in ms (needs the netem qdisc, missing on some kernels)")
    down = actions.add_parser("down", help="remove everything `up` made (also after a crash; nothing is fine)")
    status = actions.add_parser("status", help="hosts, addresses, link rate and bytes on each host's link")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--all", action="store_true", help="every cluster that has a state file")
    for each in (up, down, status):
        each.add_argument("--name", default=DEFAULT_NAME, help=f"the cluster's name (default {DEFAULT_NAME})")
    return parser


def run_command(options) -> int:
    """Carry out a parsed ``cluster`` command; errors print one clear line and give exit status 1."""
    from . import lifecycle

    try:
        if options.action == "up":
            info = lifecycle.up(options.hosts, options.rate, options.name, options.delay)
            print(format_status(info))
        elif options.action == "down":
            removed = lifecycle.down(options.name)
            print(f"cluster {options.name}: removed {', '.join(removed)}" if removed
                  else f"cluster {options.name}: nothing to remove")
        else:
            info = lifecycle.status(None if options.all else options.name)
            print(json.dumps(info, indent=1) if options.json else format_status(info))
            return 0 if options.all or info.get("up") else 3
    except ClusterError as exc:
        print(f"distlab cluster: {exc}", file=sys.stderr)
        return 1
    return 0


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_status(info: dict) -> str:
    """A table of the cluster's hosts, as ``cluster status`` prints it."""
    if "clusters" in info:
        return "\n\n".join(format_status(c) for c in info["clusters"]) or "no clusters"
    if not info.get("hosts"):
        return f"cluster {info['name']}: not up"
    topology = f"switch {info['switch']} (bridge {info['bridge']})" if info.get("switch") else "one direct link"
    delay = f", delay {info['delay_ms']:g} ms" if info.get("delay_ms") else ""
    lines = [f"cluster {info['name']}: {info['hosts_count']} hosts, {'up' if info['up'] else info.get('phase')}, "
             f"subnet {info['subnet']}, {topology}, link rate {info['rate']}{delay}",
             f"{'host':<14} {'address':<15} {'interface':<15} {'rate':>9} {'sent':>11} {'received':>11}"]
    for h in info["hosts"]:
        if not h.get("present"):
            lines.append(f"{h['host']:<14} (namespace missing)")
            continue
        lines.append(f"{h['host']:<14} {h.get('address') or '-':<15} {h.get('interface') or '-':<15} "
                     f"{format_rate(h.get('rate_bps')):>9} {_bytes(h.get('tx_bytes')):>11} "
                     f"{_bytes(h.get('rx_bytes')):>11}")
    return "\n".join(lines)
