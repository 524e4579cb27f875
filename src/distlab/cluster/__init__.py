"""A virtual cluster on one machine: several "hosts" that talk over real TCP through links of a chosen rate.

On one machine MPI moves bytes through shared memory, which hides what the protocols exist for: overlapping a
network transfer with backward, the round trips a response cache saves, a slow or lost host. A virtual cluster
puts each host in a network namespace of its own, joins the hosts with veth links (a bridge in a namespace of
its own for more than two), gives them addresses in a private /24 that exists only inside those namespaces, and
shapes every link with ``tc tbf``. MPI jobs then run across the hosts: TCP between hosts, shared memory within.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)::

    sudo .venv/bin/python -m distlab cluster up --hosts 2 --rate 1gbit
    sudo .venv/bin/python -m distlab run -n 4 --cluster 2 examples/train_ddp.py
    sudo .venv/bin/python -m distlab cluster status --json      # bytes sent/received on each host's link
    sudo .venv/bin/python -m distlab cluster down

Modules, one job each: :mod:`~distlab.cluster.layout` (names and addresses, derived from the cluster's name),
:mod:`~distlab.cluster.netlink` (the system calls, through pyroute2), :mod:`~distlab.cluster.state` (the
state file that lets ``down`` undo a crashed ``up``), :mod:`~distlab.cluster.lifecycle` (``up``, ``down``,
``status``), :mod:`~distlab.cluster.jobs` (what the launcher needs), :mod:`~distlab.cluster.cli`.
"""
from __future__ import annotations

from .jobs import ClusterJob, cluster_job, current_host, placement
from .layout import DEFAULT_NAME, Layout, layout
from .lifecycle import down, exists, status, up
from .netlink import require_privileges
from .rates import format_rate, parse_rate

__all__ = ["up", "down", "status", "exists", "layout", "Layout", "cluster_job", "ClusterJob", "placement",
           "current_host",
           "require_privileges", "parse_rate", "format_rate", "DEFAULT_NAME"]
