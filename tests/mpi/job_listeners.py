"""What the processes of a job listen on (run by the launcher; Linux).

Each rank lists the listening TCP sockets (IPv4 and IPv6) of its own process, its watcher, and the process manager
above them on its host (distlab's, or hydra's ``hydra_pmi_proxy`` and ``mpiexec``), by matching the socket inodes of their open files to
``/proc/self/net/tcp{,6}`` (its network namespace's sockets), after MPI is up and has moved bytes.

Modes (first argument):
- ``local`` (every rank on this host): the ranks and their watchers listen on loopback at most (before: hydra's
  control port on every interface, inherited by every rank, and UCX's TCP listeners on the host's external
  address and on loopback). Under distlab's process manager (the default) it listens on nothing: the ranks reach
  it over socketpairs. Under hydra (``DISTLAB_PROCESS_MANAGER=mpiexec``) hydra's own processes hold one listening
  socket, hydra's control port (hydra binds it to every interface and has no option to do otherwise).
- ``cluster`` (a virtual cluster): every process listens only on loopback, this host's cluster address, or the
  wildcard address of a namespace whose only interfaces are loopback and this host's cluster link.
"""
import ipaddress
import os
import socket
import sys

import numpy as np

from distlab import comm

mode = sys.argv[1]
pg = comm.world()
a = np.ones(1 << 16)
pg.allreduce(a)   # MPI is up and has moved bytes
assert a[0] == pg.size


def listening() -> dict:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for table, family in (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":   # TCP_LISTEN
                continue
            address, port = local.split(":")
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            found[inode] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def sockets_of(pid: int) -> set:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def name_of(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    return " ".join(a.decode(errors="replace") for a in args[:4])


def chain() -> list:
    """(role, pid): this rank, its watcher, then the process manager's processes above it on this host."""
    out = [("rank", os.getpid())]
    pid = os.getppid()
    while pid > 1:
        name = name_of(pid)
        if "distlab._bootstrap" in name or "distlab._runner" in name:
            out.append(("watcher", pid))
        elif "hydra_pmi_proxy" in name or "mpiexec" in name:
            out.append(("hydra", pid))
        elif "distlab._process_manager" in name:
            out.append(("manager", pid))
        else:
            break
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


table = listening()
held = {(role, pid): sorted(table[i] for i in sockets_of(pid) if i in table) for role, pid in chain()}
print(f"rank {pg.rank} UCX_TLS={os.environ.get('UCX_TLS')} listeners {held}", flush=True)
ours = [addr for (role, _), addrs in held.items() if role in ("rank", "watcher") for addr in addrs]
hydra = {addr for (role, _), addrs in held.items() if role == "hydra" for addr in addrs}
manager = [addr for (role, _), addrs in held.items() if role == "manager" for addr in addrs]
assert any(role in ("hydra", "manager") for role, _ in held), held     # the chain reached the process manager
print(f"rank {pg.rank} process manager {'distlab' if any(r == 'manager' for r, _ in held) else 'hydra'}, "
      f"{sum(map(len, held.values()))} listening sockets", flush=True)

if mode == "local":
    assert all(ipaddress.ip_address(host).is_loopback for host, _ in ours), held
    assert manager == [], held     # distlab's process manager listens on nothing
    assert len(hydra) <= 1, held   # hydra's control port, nothing else
elif mode == "cluster":
    from distlab.cluster import current_host
    from distlab.cluster.layout import layout

    host = current_host()
    cluster = os.environ["DISTLAB_CLUSTER"]
    interfaces = sorted(name for _, name in socket.if_nameindex())
    assert interfaces == sorted(["lo", host]), interfaces
    mine = layout(cluster, int(sys.argv[2])).addresses[host]
    for address, _ in ours + sorted(hydra):
        ip = ipaddress.ip_address(address)
        assert ip.is_loopback or ip.is_unspecified or address == mine.split("/")[0], (address, held)
else:
    raise SystemExit(f"unknown mode {mode!r}")
pg.barrier()
print(f"listeners OK rank {pg.rank}", flush=True)
