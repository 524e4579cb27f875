"""The virtual cluster tool (distlab.cluster): names and rates without root; up/status/down, idempotence,
reshaping, a crashed ``up``, leftovers, the switch of a 3-host cluster and the not-root error as root."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.cluster import format_rate, layout, parse_rate, placement
from distlab.cluster.layout import owns
from distlab.errors import ClusterError, ClusterPermissionError

REPO = Path(__file__).resolve().parent.parent


# -- pure functions: no root needed -------------------------------------------------------------------------
def test_layout_of_two_hosts_is_one_direct_link():
    plan = layout("dl", 2)
    assert plan.hosts == ("dl-h1", "dl-h2") and plan.switch is None and len(plan.links) == 1
    assert plan.interfaces() == [("dl-h1", "dl-h1"), ("dl-h2", "dl-h2")]
    base = plan.subnet.rsplit(".", 1)[0]
    assert plan.subnet.startswith("10.251.") and plan.subnet.endswith(".0/24")
    assert plan.addresses == {"dl-h1": f"{base}.1", "dl-h2": f"{base}.2"}
    assert plan.hosts_file().splitlines() == ["127.0.0.1 localhost", f"{base}.1 dl-h1", f"{base}.2 dl-h2"]


def test_layout_of_more_hosts_is_a_switch_in_its_own_namespace():
    plan = layout("lab", 3)
    assert plan.switch == "lab-sw" and plan.bridge == "lab-br"
    assert plan.namespaces == ["lab-h1", "lab-h2", "lab-h3", "lab-sw"]
    assert [(k.a, k.a_ns, k.b, k.b_ns) for k in plan.links] == [
        ("lab-h1", "lab-h1", "lab-s1", "lab-sw"), ("lab-h2", "lab-h2", "lab-s2", "lab-sw"),
        ("lab-h3", "lab-h3", "lab-s3", "lab-sw")]


@pytest.mark.parametrize("name,hosts,text", [
    ("Dl", 2, "lowercase"), ("d-l", 2, "lowercase"), ("", 2, "lowercase"), ("9dl", 2, "lowercase"),
    ("abcdefghijklm", 2, "too long for 2 hosts: interface 'abcdefghijklm-h2' would have 16 characters, Linux "
                         "allows 15; use at most 12 characters"),
    ("abcdefghijkl", 10, "use at most 11 characters"), ("dl", 0, "1 to 254 hosts"), ("dl", 255, "1 to 254")])
def test_bad_names_and_sizes_are_refused_clearly(name, hosts, text):
    with pytest.raises(ClusterError) as info:
        layout(name, hosts)
    assert text in str(info.value)


def test_every_interface_name_fits_ifnamsiz():
    for hosts in (2, 3, 9, 10, 99, 254):
        room = 15 - len(f"-s{hosts}")
        plan = layout("a" * room, hosts)
        assert all(len(i) <= 15 for _, i in plan.interfaces()) and all(len(n) <= 15 for n in plan.namespaces)


def test_ownership_is_exact_so_sweeps_never_touch_another_cluster():
    assert owns("dl", "dl-h1") and owns("dl", "dl-h12") and owns("dl", "dl-sw") and owns("dl", "dl-s3")
    assert owns("dl", "dl-br")
    assert not owns("dl", "dl2-h1") and not owns("dl", "dl-h1x") and not owns("dl", "xdl-h1")
    assert not owns("dl", "dl-hx") and not owns("dl", "dl")


@pytest.mark.parametrize("text,bps", [("10gbit", 10**10), ("1gbit", 10**9), ("100mbit", 10**8),
                                      ("1.5Gbit", 15 * 10**8), ("64kbit", 64000), (None, None),
                                      ("unshaped", None), ("none", None), (2 * 10**9, 2 * 10**9)])
def test_rates_read_as_tc_writes_them(text, bps):
    assert parse_rate(text) == bps
    if bps:
        assert parse_rate(format_rate(bps)) == bps


@pytest.mark.parametrize("bad", ["fast", "10gb", "10 gbyte", "-1gbit", "1bit"])
def test_bad_rates_are_refused(bad):
    with pytest.raises(ClusterError, match="rate"):
        parse_rate(bad)


def test_ranks_are_placed_in_blocks_per_host():
    assert placement(4, 2) == [2, 2] and placement(2, 2) == [1, 1] and placement(3, 2) == [2, 1]
    assert placement(1, 2) == [1] and placement(5, 3) == [2, 2, 1] and placement(8, 2) == [4, 4]
    with pytest.raises(ValueError):
        placement(0, 2)


def test_missing_privileges_are_a_clear_error(monkeypatch):
    from distlab.cluster import netlink

    monkeypatch.setattr(netlink, "_effective_capabilities", lambda: 0)
    with pytest.raises(ClusterPermissionError) as info:
        netlink.require_privileges("up")
    text = str(info.value)
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in text
    assert "sudo .venv/bin/python -m distlab cluster up ..." in text
    with pytest.raises(ClusterPermissionError, match="cluster down"):
        netlink.require_privileges("down")


def test_exec_script_runs_only_the_cluster_s_hosts(tmp_path):
    from distlab.cluster.execscript import write_exec_script

    script = write_exec_script(tmp_path / "nsexec", ("dl-h1", "dl-h2"))
    assert os.access(script, os.X_OK)
    done = subprocess.run([str(script), "-x", "-q", "elsewhere", "echo", "hi"], capture_output=True, text=True)
    assert done.returncode == 255 and "elsewhere is not a host of this cluster (dl-h1, dl-h2)" in done.stderr


def test_rate_without_cluster_is_refused():
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "run", "--rate", "1gbit", "x.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --cluster HOSTS too" in done.stderr


# -- as root: real namespaces -------------------------------------------------------------------------------
@pytest.fixture
def names(request):
    """Fresh cluster names for one test; every one is taken down afterwards, whatever happened."""
    from conftest import cluster_privileges_or_skip

    from distlab.cluster import down

    cluster_privileges_or_skip()
    made = []

    def make(suffix: str) -> str:
        made.append(f"dlt{os.getpid():x}{suffix}")
        return made[-1]

    yield make
    for name in made:
        down(name)


def leftovers(name: str) -> list[str]:
    """Everything of cluster ``name`` still on the machine: namespaces, /etc/netns entries, links, state."""
    from distlab.cluster import netlink
    from distlab.cluster.state import state_path, work_dir

    found = [ns for ns in netlink.namespaces() if owns(name, ns)]
    found += [f"/etc/netns/{p.name}" for p in netlink.ETC_NETNS.glob("*") if owns(name, p.name)]
    found += [i for i in netlink.root_links() if owns(name, i)]
    found += [str(p) for p in (state_path(name), work_dir(name)) if p.exists()]
    return found


def cli(*args, check=True):
    done = subprocess.run([sys.executable, "-P", "-m", "distlab", "cluster", *args], capture_output=True,
                          text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.cluster
def test_up_status_down_from_the_command_line(names):
    name = names("a")
    assert cli("down", "--name", name).stdout.strip() == f"cluster {name}: nothing to remove"
    shown = cli("up", "--hosts", "2", "--rate", "1gbit", "--name", name).stdout
    assert f"cluster {name}: 2 hosts, up" in shown and "link rate 1gbit" in shown and f"{name}-h2" in shown
    info = json.loads(cli("status", "--name", name, "--json").stdout)
    assert info["up"] and info["rate"] == "1gbit" and [h["host"] for h in info["hosts"]] == [f"{name}-h1",
                                                                                             f"{name}-h2"]
    for host in info["hosts"]:
        assert host["rate_bps"] == 10**9 and host["interface"] == host["host"]
        assert host["tx_bytes"] >= 0 and host["rx_bytes"] >= 0 and host["address"].startswith("10.251.")
    assert Path(f"/etc/netns/{name}-h1/hosts").read_text().splitlines()[1:] == [
        f"{h['address']} {h['host']}" for h in info["hosts"]]
    cli("down", "--name", name)
    assert leftovers(name) == []
    gone = cli("status", "--name", name, check=False)
    assert gone.returncode == 3 and "not up" in gone.stdout


@pytest.mark.cluster
def test_up_is_idempotent_and_another_rate_reshapes(names):
    from distlab.cluster import netlink, status, up

    name = names("b")
    up(2, "10gbit", name)
    before = sorted(ns for ns in netlink.namespaces() if owns(name, ns))
    again = up(2, "10gbit", name)
    assert sorted(ns for ns in netlink.namespaces() if owns(name, ns)) == before == [f"{name}-h1", f"{name}-h2"]
    assert [h["rate_bps"] for h in again["hosts"]] == [10**10, 10**10]
    assert [h["rate_bps"] for h in up(2, "100mbit", name)["hosts"]] == [10**8, 10**8]
    assert [h["rate_bps"] for h in up(2, None, name)["hosts"]] == [None, None]
    assert status(name)["rate"] == "unshaped"
    with pytest.raises(ClusterError, match="is up with 2 hosts, not 3; take it down first"):
        up(3, None, name)


@pytest.mark.cluster
def test_down_after_a_crashed_up_and_without_any_state(names, monkeypatch):
    from distlab.cluster import down, lifecycle, netlink, up
    from distlab.cluster.state import read_state, remove_state

    name = names("c")

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("the up process died here")

    monkeypatch.setattr(lifecycle.netlink, "shape", crash)
    with pytest.raises(KeyboardInterrupt):
        up(2, "1gbit", name)
    monkeypatch.undo()
    assert read_state(name)["phase"] == "building" and leftovers(name)
    assert not lifecycle.exists(name)
    removed = down(name)
    assert f"{name}-h1" in removed and leftovers(name) == []
    # no state file at all (lost): the sweep by name still finds the namespaces and /etc/netns entries
    up(2, None, name)
    remove_state(name)
    down(name)
    assert leftovers(name) == []
    # processes left running inside a host are ended before its namespace goes
    up(2, None, name)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{name}-h2", "sleep", "300"], start_new_session=True)
    try:
        for _ in range(100):
            if netlink.namespace_pids(f"{name}-h2"):
                break
            import time

            time.sleep(0.05)
        assert netlink.namespace_pids(f"{name}-h2") == [sleeper.pid]
        down(name)
        assert sleeper.wait(timeout=10) != 0 and leftovers(name) == []
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


@pytest.mark.cluster
def test_three_hosts_share_a_switch_and_reach_each_other_only_there(names):
    from distlab.cluster import status, up

    name = names("d")
    info = up(3, "1gbit", name)
    assert info["switch"] == f"{name}-sw" and len(info["hosts"]) == 3
    h3 = info["hosts"][2]["address"]
    probe = ("import socket; s = socket.create_connection(({!r}, 9), timeout=2)")
    # host 1 reaches host 3 through the switch (connection refused = the packet got there and back)
    reach = subprocess.run(["ip", "netns", "exec", f"{name}-h1", sys.executable, "-c", probe.format(h3)],
                           capture_output=True, text=True, timeout=30)
    assert "ConnectionRefusedError" in reach.stderr, reach.stderr
    # and nothing else: no route out of the cluster's /24, not even to the machine's own addresses
    out = subprocess.run(["ip", "netns", "exec", f"{name}-h1", sys.executable, "-c", probe.format("8.8.8.8")],
                         capture_output=True, text=True, timeout=30)
    assert "Network is unreachable" in out.stderr, out.stderr
    after = status(name)
    assert after["hosts"][0]["tx_bytes"] > 0 and after["hosts"][2]["rx_bytes"] > 0


@pytest.mark.cluster
def test_not_root_is_a_clear_error_on_the_command_line(names):
    """Root without CAP_NET_ADMIN/CAP_SYS_ADMIN (dropped from the bounding set) is refused, saying how to run."""
    name = names("e")
    done = subprocess.run(["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all", sys.executable,
                           "-P", "-m", "distlab", "cluster", "up", "--name", name], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in done.stderr
    assert "sudo .venv/bin/python -m distlab cluster up" in done.stderr
    assert leftovers(name) == []


@pytest.mark.cluster
def test_added_delay_needs_netem_and_says_so_when_missing(names):
    """--delay uses the netem qdisc where the kernel has it; elsewhere a clear error (and down still cleans)."""
    from distlab.cluster import down, status, up

    name = names("f")
    try:
        info = up(2, "1gbit", name, delay_ms=2)
    except ClusterError as exc:
        assert "the netem qdisc is not available on this kernel" in str(exc) and "Leave out --delay" in str(exc)
        assert f"is half built: `python -m distlab cluster down --name {name}` removes" in str(exc)
    else:
        assert [h["delay_ms"] for h in info["hosts"]] == [2, 2] and status(name)["delay_ms"] == 2
    down(name)
    assert leftovers(name) == []


@pytest.mark.cluster
def test_a_killed_test_session_s_cluster_is_swept_by_the_next(names):
    """A session killed outright (no teardown) leaves its cluster; the next session's sweep takes it down."""
    import json as json_

    from conftest import sweep_dead_test_clusters

    from distlab.cluster import up
    from distlab.cluster.state import read_state, state_path

    name = names("g")
    up(2, None, name)
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = read_state(name)
    state["owner_pid"] = dead.pid           # as if the session that made it had been killed
    state_path(name).write_text(json_.dumps(state))
    alive = names("h")
    up(2, None, alive)                      # a live session's cluster (ours) is left alone
    sweep_dead_test_clusters()
    assert leftovers(name) == [] and leftovers(alive) != []
