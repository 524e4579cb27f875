"""What a virtual cluster is made of, derived from its name and host count alone (no system access here).

A cluster named ``dl`` with N hosts is:

- one network namespace per host, ``dl-h1`` ... ``dl-hN``; the namespace name is also the host name MPI uses,
  resolved through ``/etc/netns/dl-hI/hosts`` (which ``ip netns exec`` bind-mounts over ``/etc/hosts``);
- links: with 2 hosts, one veth pair ``dl-h1`` <-> ``dl-h2`` straight between them; with more, a switch: a
  bridge ``dl-br`` in a namespace of its own, ``dl-sw``, and one veth pair per host, ``dl-hI`` (in the host) <->
  ``dl-sI`` (a bridge port in the switch). The root namespace never holds any of it;
- addresses: host I is ``10.251.S.I/24``, where the subnet byte S comes from the name. The /24 exists only
  inside the namespaces: no route, NAT or bridge leads to a real interface, so nothing can reach another address.

Everything here is a pure function of ``(name, hosts)``, so ``down`` can find what ``up`` made, and a sweep can
find it by name even when the state file is gone.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

from ..errors import ClusterError

__all__ = ["DEFAULT_NAME", "MAX_HOSTS", "IFNAMSIZ", "Link", "Layout", "layout", "check_name", "owns"]

DEFAULT_NAME = "dl"
#: Linux interface names hold at most 15 characters (IFNAMSIZ 16 with the terminating NUL).
IFNAMSIZ = 15
#: Host addresses are .1 to .N of one /24.
MAX_HOSTS = 254
_NAME = re.compile(r"^[a-z][a-z0-9]*$")
SUBNET_PREFIX = "10.251"


@dataclass(frozen=True)
class Link:
    """One veth pair: ``a`` in namespace ``a_ns``, ``b`` in ``b_ns``; ``host`` is the host whose NIC ``a`` is."""

    a: str
    a_ns: str
    b: str
    b_ns: str
    host: str | None = None
    to_bridge: bool = False


@dataclass(frozen=True)
class Layout:
    """The namespaces, links and addresses of cluster ``name`` with ``hosts`` hosts."""

    name: str
    hosts: tuple[str, ...]
    addresses: dict = field(hash=False)
    subnet: str = ""
    switch: str | None = None
    bridge: str | None = None
    links: tuple[Link, ...] = ()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster, hosts first."""
        return list(self.hosts) + ([self.switch] if self.switch else [])

    def nic(self, host: str) -> str:
        """The host's interface toward the others (its name is the host's name)."""
        return host

    def interfaces(self) -> list[tuple[str, str]]:
        """Every (namespace, interface) the cluster made, each shaped to the link rate."""
        ends = []
        for link in self.links:
            ends += [(link.a_ns, link.a), (link.b_ns, link.b)]
        return ends

    def hosts_file(self) -> str:
        """``/etc/hosts`` as every host of the cluster sees it."""
        lines = ["127.0.0.1 localhost"] + [f"{self.addresses[h]} {h}" for h in self.hosts]
        return "\n".join(lines) + "\n"


def check_name(name: str, hosts: int = 2) -> None:
    """Refuse a name that is not lowercase letters and digits, or that would make an interface name too long."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ClusterError(f"cluster name {name!r} must start with a lowercase letter and contain only lowercase "
                           "letters and digits (it prefixes namespace and interface names)")
    if not 1 <= int(hosts) <= MAX_HOSTS:
        raise ClusterError(f"a cluster has 1 to {MAX_HOSTS} hosts (one /24), got {hosts}")
    longest = f"{name}-s{int(hosts)}" if hosts > 2 else f"{name}-h{int(hosts)}"
    if len(longest) > IFNAMSIZ:
        room = IFNAMSIZ - len(longest) + len(name)
        raise ClusterError(f"cluster name {name!r} is too long for {hosts} hosts: interface {longest!r} would have "
                           f"{len(longest)} characters, Linux allows {IFNAMSIZ}; use at most {room} characters")


def subnet_of(name: str) -> str:
    """The cluster's /24, ``10.251.S.0/24`` with S from a checksum of the name (two clusters rarely share one,
    and sharing would be harmless: each lives in its own namespaces)."""
    return f"{SUBNET_PREFIX}.{zlib.crc32(name.encode()) % 250 + 1}.0/24"


def layout(name: str = DEFAULT_NAME, hosts: int = 2) -> Layout:
    """The layout of cluster ``name`` with ``hosts`` hosts (see the module docstring)."""
    check_name(name, hosts)
    hosts = int(hosts)
    host_names = tuple(f"{name}-h{i}" for i in range(1, hosts + 1))
    subnet = subnet_of(name)
    base = subnet.rsplit(".", 1)[0]
    addresses = {h: f"{base}.{i}" for i, h in enumerate(host_names, start=1)}
    if hosts == 1:
        return Layout(name, host_names, addresses, subnet)
    if hosts == 2:
        h1, h2 = host_names
        return Layout(name, host_names, addresses, subnet, links=(Link(h1, h1, h2, h2, host=h1),))
    switch, bridge = f"{name}-sw", f"{name}-br"
    links = tuple(Link(h, h, f"{name}-s{i}", switch, host=h, to_bridge=True)
                  for i, h in enumerate(host_names, start=1))
    return Layout(name, host_names, addresses, subnet, switch=switch, bridge=bridge, links=links)


def owns(name: str, resource: str) -> bool:
    """Whether a namespace, interface or /etc/netns entry called ``resource`` belongs to cluster ``name``.

    Exact patterns, so that sweeping cluster ``dl`` never touches cluster ``dl2`` (``dl2-h1``).
    """
    return re.fullmatch(rf"{re.escape(name)}-(h\d+|s\d+|sw|br)", resource) is not None
