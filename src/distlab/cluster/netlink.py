"""The system calls behind the virtual cluster, over netlink (pyroute2): namespaces, veth pairs, a bridge,
addresses, tc shaping and the links' byte counters; plus the privilege check and the processes of a namespace.

Every function takes names, never handles, and opens its netlink socket for the one job, so a crash leaves no
socket behind and ``down`` can run in a fresh process. Errors come back as
:class:`~distlab.errors.ClusterError` naming the object and the operation.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from ..errors import ClusterError, ClusterPermissionError

__all__ = ["require_privileges", "namespaces", "create_namespace", "delete_namespace", "add_veth", "add_bridge",
           "configure", "shape", "qdisc_of", "counters", "root_links", "delete_root_link", "namespace_pids",
           "kill_namespace_processes", "NETNS_DIR", "ETC_NETNS"]

NETNS_DIR = Path("/run/netns")   # where `ip netns` (and pyroute2) pin named namespaces
ETC_NETNS = Path("/etc/netns")   # per-namespace /etc overrides, bind-mounted by `ip netns exec`
CAP_SYS_ADMIN, CAP_NET_ADMIN = 21, 12
HOW_TO_RUN = "sudo .venv/bin/python -m distlab cluster up ..."


def _pyroute2():
    try:
        import pyroute2
    except ImportError as exc:  # declared in pyproject.toml; missing only in a hand-made environment
        raise ClusterError("the virtual cluster needs pyroute2 (a netlink library): `pip install pyroute2`, or "
                           "reinstall distlab with its dependencies (`make build`)") from exc
    # pyroute2 forks short-lived children to enter a namespace and stops them with SIGTERM. A child must die of
    # it: with the launcher's SIGTERM handler (which raises SystemExit) it would instead unwind our stack and
    # finalise a copy of MPI at exit, which breaks the parent's (UCX: "epoll_ctl ... failed").
    pyroute2.config.disable_mp_signal = True
    return pyroute2


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def require_privileges(action: str = "up") -> None:
    """Refuse clearly unless this process may create namespaces and links (CAP_SYS_ADMIN and CAP_NET_ADMIN)."""
    caps = _effective_capabilities()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        who = "root without " + " and ".join(missing) if os.geteuid() == 0 else f"uid {os.geteuid()}, not root"
        raise ClusterPermissionError(
            f"`cluster {action}` builds network namespaces and virtual links, which needs root ({' and '.join(missing)}"
            f"); this process is {who}. Run it as root, e.g. `{HOW_TO_RUN.replace(' up ', f' {action} ')}`")


@contextlib.contextmanager
def _ipr(namespace: str | None = None):
    """An IPRoute socket in ``namespace`` (None: the root namespace), closed after use."""
    pyroute2 = _pyroute2()
    try:
        ipr = pyroute2.IPRoute(netns=namespace) if namespace else pyroute2.IPRoute()
    except Exception as exc:  # noqa: BLE001 - pyroute2 raises several kinds; name the namespace
        raise ClusterError(f"cannot open a netlink socket in namespace {namespace or '(root)'}: {exc}") from exc
    try:
        yield ipr
    finally:
        ipr.close()


def _index(ipr, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise ClusterError(f"interface {ifname} not found")
    return found[0]


def namespaces() -> list[str]:
    """Names of every named network namespace on the machine."""
    return sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []


def create_namespace(name: str, hosts_file: str | None = None) -> None:
    """Create namespace ``name`` (nothing if it exists), bring its loopback up, write its /etc/hosts override."""
    if name not in namespaces():
        try:
            _pyroute2().netns.create(name)
        except OSError as exc:
            raise ClusterError(f"cannot create network namespace {name}: {exc}") from exc
    with _ipr(name) as ipr:
        ipr.link("set", index=_index(ipr, "lo"), state="up")
    if hosts_file is not None:
        etc = ETC_NETNS / name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)


def delete_namespace(name: str) -> None:
    """Remove namespace ``name`` and its /etc/netns entry; nothing if absent. Its links die with it."""
    if name in namespaces():
        try:
            _pyroute2().netns.remove(name)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise ClusterError(f"cannot remove network namespace {name}: {exc}") from exc
    etc = ETC_NETNS / name
    if etc.is_dir():
        for entry in etc.iterdir():
            entry.unlink()
        etc.rmdir()


def _links(namespace: str) -> dict[str, dict]:
    with _ipr(namespace) as ipr:
        return {link.get_attr("IFLA_IFNAME"): link for link in ipr.get_links()}


def link_is_up(namespace: str, ifname: str) -> bool:
    """Whether interface ``ifname`` of ``namespace`` exists and is administratively up (``ip link set up``)."""
    try:
        link = _links(namespace).get(ifname)
    except Exception:  # noqa: BLE001 - a namespace that cannot be entered is no working host
        return False
    return link is not None and bool(link["flags"] & 1)  # IFF_UP


def add_veth(a: str, a_ns: str, b: str, b_ns: str) -> None:
    """A veth pair with end ``a`` in ``a_ns`` and end ``b`` in ``b_ns``, made in place (never in the root
    namespace); nothing if ``a`` exists already."""
    if a in _links(a_ns):
        return
    with _ipr(a_ns) as ipr:
        try:
            ipr.link("add", ifname=a, kind="veth", peer={"ifname": b, "net_ns_fd": b_ns})
        except Exception as exc:  # noqa: BLE001
            raise ClusterError(f"cannot create the veth pair {a} ({a_ns}) <-> {b} ({b_ns}): {exc}") from exc


def add_bridge(bridge: str, namespace: str, ports: list[str]) -> None:
    """A bridge ``bridge`` in ``namespace`` with ``ports`` enslaved, all up (nothing to do for what exists)."""
    with _ipr(namespace) as ipr:
        if not ipr.link_lookup(ifname=bridge):
            try:
                ipr.link("add", ifname=bridge, kind="bridge")
            except Exception as exc:  # noqa: BLE001
                raise ClusterError(f"cannot create bridge {bridge} in {namespace}: {exc}") from exc
        master = _index(ipr, bridge)
        for port in ports:
            ipr.link("set", index=_index(ipr, port), master=master, state="up")
        ipr.link("set", index=master, state="up")


def configure(namespace: str, ifname: str, address: str | None = None, prefixlen: int = 24) -> None:
    """Give ``ifname`` its address (once) and bring it up."""
    with _ipr(namespace) as ipr:
        index = _index(ipr, ifname)
        if address is not None:
            have = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=index)]
            if address not in have:
                ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
        ipr.link("set", index=index, state="up")


def _burst(rate_bps: int) -> int:
    """tbf bucket: 1 ms worth of bytes at the rate, at least 64 KiB (a GSO segment passes whole)."""
    return max(64 << 10, rate_bps // 8 // 1000)


def shape(namespace: str, ifname: str, rate_bps: int | None, delay_ms: float | None = None) -> None:
    """Limit what ``ifname`` sends to ``rate_bps`` (tbf), optionally delayed (netem, when the kernel has it);
    ``rate_bps=None`` and no delay removes the shaping. Replaces what was there (a reshape)."""
    with _ipr(namespace) as ipr:
        index = _index(ipr, ifname)
        with contextlib.suppress(Exception):  # nothing to remove is fine
            ipr.tc("del", index=index, handle="1:", parent=0xFFFFFFFF)
        with contextlib.suppress(Exception):
            ipr.tc("del", index=index)
        if delay_ms:
            try:
                ipr.tc("add", "netem", index=index, handle="1:", delay=int(delay_ms * 1000))
            except Exception as exc:  # noqa: BLE001
                raise ClusterError(
                    f"cannot add {delay_ms:g} ms of delay on {ifname}: the netem qdisc is not available on this "
                    f"kernel ({exc}); added delay is offered only where netem exists. Leave out --delay") from exc
        if rate_bps:
            parent = {"parent": "1:1"} if delay_ms else {}
            try:
                ipr.tc("add", "tbf", index=index, handle="10:" if delay_ms else "1:", rate=f"{int(rate_bps)}bit",
                       burst=_burst(rate_bps), latency="50ms", **parent)
            except Exception as exc:  # noqa: BLE001
                raise ClusterError(f"cannot shape {ifname} in {namespace} to {rate_bps} bit/s with tbf: {exc}") from exc


def qdisc_of(namespace: str, ifname: str) -> dict:
    """The shaping on ``ifname`` as the kernel reports it: ``{"rate_bps": int|None, "delay_ms": float|None}``."""
    result = {"rate_bps": None, "delay_ms": None}
    with _ipr(namespace) as ipr:
        index = _index(ipr, ifname)
        for q in ipr.get_qdiscs(index=index):
            kind = q.get_attr("TCA_KIND")
            options = q.get_attr("TCA_OPTIONS")
            if kind == "tbf" and options is not None:
                parms = options.get_attr("TCA_TBF_PARMS")
                rate64 = options.get_attr("TCA_TBF_RATE64")
                result["rate_bps"] = int(rate64 or parms["rate"]) * 8
            elif kind == "netem" and options is not None:
                result["delay_ms"] = options.get("delay", 0) / 1000
    return result


def counters(namespace: str, ifname: str) -> dict:
    """``{"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}`` of ``ifname`` in ``namespace``."""
    link = _links(namespace).get(ifname)
    if link is None:
        raise ClusterError(f"interface {ifname} not found in namespace {namespace}")
    stats = link.get_attr("IFLA_STATS64") or link.get_attr("IFLA_STATS")
    return {key: int(stats[key]) for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}


def root_links() -> list[str]:
    """Interface names in the root namespace (a crash between creating and moving a veth could leave one)."""
    return sorted(_links(None))


def delete_root_link(ifname: str) -> None:
    with _ipr(None) as ipr, contextlib.suppress(Exception):
        ipr.link("del", index=_index(ipr, ifname))


def namespace_pids(name: str) -> list[int]:
    """Processes whose network namespace is ``name`` (what ``ip netns pids`` shows), never this process."""
    try:
        pinned = os.stat(NETNS_DIR / name)
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            st = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (pinned.st_ino, pinned.st_dev):
            pids.append(int(entry.name))
    return sorted(pids)


def kill_namespace_processes(name: str, grace: float = 3.0) -> list[int]:
    """SIGTERM every process in namespace ``name``, SIGKILL what is left after ``grace`` seconds; the pids."""
    pids = namespace_pids(name)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and namespace_pids(name):
            time.sleep(0.05)
        if not namespace_pids(name):
            break
    return pids
