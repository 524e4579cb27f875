"""``up``, ``down`` and ``status`` of a virtual cluster: idempotent, and ``down`` undoes a crashed ``up``.

``up`` records its intent in the state file first, then makes each piece only if it is missing, so running it
twice gives one cluster and running it after a crash finishes the job; with another rate it only reshapes.
``down`` ends the processes still running in the cluster's namespaces (ranks of a job that outlived its
launcher), then deletes the namespaces (their links go with them), the ``/etc/netns`` entries and the state,
and finally sweeps by name for anything of the cluster that the state file did not list.
"""
from __future__ import annotations

from . import netlink
from .layout import DEFAULT_NAME, Layout, layout, owns
from .rates import format_rate, parse_rate
from .state import list_states, read_state, remove_state, write_state, work_dir
from .execscript import write_exec_script
from ..errors import ClusterError

__all__ = ["up", "down", "status", "exists", "layout_of"]


def layout_of(name: str = DEFAULT_NAME) -> Layout:
    """The layout of the running cluster ``name`` (from its state file)."""
    state = read_state(name)
    if state is None or not exists(name):
        raise ClusterError(f"there is no virtual cluster named {name!r}; start one with "
                           f"`python -m distlab cluster up --hosts 2 --name {name}`")
    return layout(name, state["hosts"])


def exists(name: str = DEFAULT_NAME) -> bool:
    """Whether cluster ``name`` is up: a state file that says so, and all of its namespaces."""
    state = read_state(name)
    if not state or state.get("phase") != "up":
        return False
    present = set(netlink.namespaces())
    return all(ns in present for ns in layout(name, state["hosts"]).namespaces)


def up(hosts: int = 2, rate=None, name: str = DEFAULT_NAME, delay_ms: float | None = None) -> dict:
    """Bring cluster ``name`` up with ``hosts`` hosts and links shaped to ``rate`` (None: unshaped).

    Idempotent: an existing cluster of the same size is kept (and reshaped if the rate or delay differ). A
    cluster of another size is an error (take it down first). Returns :func:`status`.
    """
    netlink.require_privileges("up")
    plan = layout(name, hosts)
    rate_bps = parse_rate(rate)
    state = read_state(name)
    if state and state.get("hosts") != len(plan.hosts) and exists(name):
        raise ClusterError(f"cluster {name!r} is up with {state['hosts']} hosts, not {hosts}; take it down first "
                           f"(`python -m distlab cluster down --name {name}`) or choose another --name")
    # The record comes first (phase "building"): if anything below fails or the process dies, `down` finds
    # whatever was made, and `up` again finishes the job.
    write_state(name, hosts=len(plan.hosts), rate_bps=rate_bps, delay_ms=delay_ms, phase="building",
                namespaces=plan.namespaces, subnet=plan.subnet)
    try:
        _build(plan, rate_bps, delay_ms)
    except ClusterError as exc:
        raise ClusterError(f"{exc}\n(cluster {name!r} is half built: `python -m distlab cluster down --name {name}` "
                           "removes what was made)") from exc
    write_exec_script(work_dir(name) / "nsexec", plan.hosts)
    write_exec_script(work_dir(name) / "nsexec-openmpi", plan.hosts, hostname=True)
    write_state(name, phase="up")
    return status(name)


def _build(plan: Layout, rate_bps, delay_ms) -> None:
    """Make each missing piece of ``plan``: namespaces, veth pairs, the bridge, addresses, shaping."""
    for host in plan.hosts:
        netlink.create_namespace(host, plan.hosts_file())
    if plan.switch:
        netlink.create_namespace(plan.switch)
    for link in plan.links:
        netlink.add_veth(link.a, link.a_ns, link.b, link.b_ns)
    if plan.bridge:
        netlink.add_bridge(plan.bridge, plan.switch, [link.b for link in plan.links])
    for link in plan.links:
        netlink.configure(link.a_ns, link.a, plan.addresses[link.host] if link.host else None)
        netlink.configure(link.b_ns, link.b, None if link.to_bridge else plan.addresses.get(link.b_ns))
    for namespace, ifname in plan.interfaces():
        netlink.shape(namespace, ifname, rate_bps, delay_ms)


def down(name: str = DEFAULT_NAME) -> list[str]:
    """Remove everything cluster ``name`` made (nothing to do is fine); returns what was removed."""
    netlink.require_privileges("down")
    state = read_state(name)
    listed = list(state.get("namespaces", [])) if state else []
    swept = [ns for ns in netlink.namespaces() if owns(name, ns)]
    etc = [p.name for p in netlink.ETC_NETNS.iterdir() if owns(name, p.name)] if netlink.ETC_NETNS.is_dir() else []
    removed = []
    targets = list(dict.fromkeys(listed + swept + etc))
    for namespace in targets:
        netlink.kill_namespace_processes(namespace)
    for namespace in targets:
        netlink.delete_namespace(namespace)
        removed.append(namespace)
    for ifname in netlink.root_links():
        if owns(name, ifname):
            netlink.delete_root_link(ifname)
            removed.append(ifname)
    remove_state(name)
    return removed


def status(name: str | None = DEFAULT_NAME) -> dict:
    """What cluster ``name`` is (``None``: every cluster with a state file, as ``{"clusters": [...]}``).

    Per host: its namespace, address, interface, link rate and delay as the kernel reports them, and the bytes
    and packets sent and received on its link.
    """
    if name is None:
        return {"clusters": [status(n) for n in list_states()]}
    state = read_state(name)
    if state is None:
        return {"name": name, "up": False}
    plan = layout(name, state["hosts"])
    present = set(netlink.namespaces())
    hosts = []
    for host in plan.hosts:
        entry = {"host": host, "namespace": host, "address": plan.addresses[host] if plan.links else None,
                 "interface": plan.nic(host) if plan.links else None, "present": host in present}
        if entry["present"] and plan.links:
            try:
                entry.update(netlink.qdisc_of(host, plan.nic(host)))
                entry.update(netlink.counters(host, plan.nic(host)))
            except ClusterError as exc:
                entry["error"] = str(exc)
        hosts.append(entry)
    return {"name": name, "up": exists(name), "phase": state.get("phase"), "hosts_count": len(plan.hosts),
            "subnet": plan.subnet, "switch": plan.switch, "bridge": plan.bridge,
            "rate_bps": state.get("rate_bps"), "rate": format_rate(state.get("rate_bps")),
            "delay_ms": state.get("delay_ms"), "hosts": hosts}
