"""What the launcher needs to run a job on a virtual cluster: where mpiexec runs, its host arguments, the
transport environment, and the clean-up of any rank that outlives the job.

The launcher builds its usual ``mpiexec -n N python -m distlab._bootstrap script`` command and hands it to
:meth:`ClusterJob.wrap`, which returns::

    ip netns exec dl-h1  mpiexec -hosts dl-h1:2,dl-h2:2 -launcher ssh -launcher-exec <nsexec>  -n 4 python ...

mpiexec runs inside host 1 (the proxies it starts on the other hosts must reach it over the cluster's
network), and hydra starts one proxy per host through the cluster's exec script instead of ssh. Ranks are
placed in blocks: ranks 0-1 on host 1, 2-3 on host 2 (hydra gives a host as many consecutive ranks as it has
slots), so MPICH sees one node per host: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` are per host and MPICH's own
shared memory carries the traffic within a host, while UCX carries it between hosts over TCP on the veth link
(``UCX_TLS``; without it UCX would take shared memory across namespaces, the machine being one).

Open MPI (``family="openmpi"``) runs the same way with its own words: ``mpirun --host dl-h1:2,dl-h2:2 --prtemca
plm_ssh_agent <nsexec-openmpi>``, its TCP transport between hosts and shared memory within one
(``--mca btl self,sm,tcp``), and each host, mpirun's included, under its own host name
(:func:`~distlab.cluster.execscript.own_hostname`), which Open MPI's TCP transport needs.
"""
from __future__ import annotations

import contextlib
import os
import signal
import uuid
from dataclasses import dataclass, field

from . import netlink
from .execscript import ip_command, own_hostname
from .layout import DEFAULT_NAME, Layout
from .lifecycle import exists, layout_of, up
from .state import read_state, work_dir
from ..errors import ClusterError

__all__ = ["ClusterJob", "cluster_job", "placement", "current_host", "TRANSPORT_ENV", "JOB_MARKER"]

#: UCX, the network layer MPICH's wheel uses between nodes: TCP (and "self" for a rank to itself). Within a
#: host, MPICH's shared-memory transport handles ranks before UCX sees them.
TRANSPORT_ENV = {"UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
#: Every process of a cluster job carries this variable (a per-job id), so survivors can be found and ended.
JOB_MARKER = "DISTLAB_CLUSTER_JOB"


def placement(np: int, hosts: int) -> list[int]:
    """Ranks per host, in blocks: as many per host as the fullest needs, the last host takes the rest."""
    if np < 1:
        raise ValueError(f"np must be at least 1, got {np}")
    per_host = -(-np // hosts)
    slots = []
    while np > 0:
        slots.append(min(per_host, np))
        np -= slots[-1]
    return slots


@dataclass
class ClusterJob:
    """One job's view of the cluster: :meth:`wrap` its mpiexec command, :attr:`env` its ranks' environment."""

    layout: Layout
    np: int
    slots: list = field(default_factory=list)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: the hosts this job runs on: the layout's, less those a restart left out (:meth:`without`)
    hosts: tuple = ()

    def __post_init__(self):
        self.hosts = tuple(self.hosts) or tuple(self.layout.hosts)

    @property
    def env(self) -> dict:
        # on one host (what a restart without the lost hosts may leave) the ranks keep to shared memory: the
        # host's link may be down with its peer's
        transport = TRANSPORT_ENV if len(self.hosts) > 1 else {"UCX_WARN_UNUSED_ENV_VARS": "n"}
        return {**transport, JOB_MARKER: self.marker, "DISTLAB_CLUSTER": self.layout.name}

    def host_arguments(self, family: str = "mpich") -> list[str]:
        """The launcher's words for the hosts and the exec script: Hydra's, or Open MPI's (``family``)."""
        hosts = ",".join(f"{h}:{n}" for h, n in zip(self.hosts, self.slots))
        script = work_dir(self.layout.name) / ("nsexec-openmpi" if family == "openmpi" else "nsexec")
        if not script.exists():
            raise ClusterError(f"the exec script of cluster {self.layout.name!r} is missing ({script}); run "
                               f"`python -m distlab cluster up --name {self.layout.name}` again")
        if family == "openmpi":
            return ["--host", hosts, "--prtemca", "plm_ssh_agent", str(script), "--mca", "btl", "self,sm,tcp"]
        return ["-hosts", hosts, "-launcher", "ssh", "-launcher-exec", str(script)]

    def wrap(self, command: list[str], family: str = "mpich") -> list[str]:
        """``command`` (``[mpiexec, -n, N, ...]``) run in host 1, with the cluster's hosts and launcher (Open MPI's
        under host 1's own host name)."""
        first = own_hostname(self.hosts[0]) if family == "openmpi" else []
        return [ip_command(), "netns", "exec", self.hosts[0], *first, command[0], *self.host_arguments(family),
                *command[1:]]

    def hosts_of_ranks(self) -> list[str]:
        """The host of each rank, in rank order."""
        return [h for h, n in zip(self.hosts, self.slots) for _ in range(n)]

    def lost_hosts(self) -> list[str]:
        """The hosts of this job that died: their namespace is gone or their network interface is down (the
        link cut). A host whose processes were only killed is alive: it can run the next attempt."""
        present = set(netlink.namespaces())
        return [h for h in self.hosts if h not in present or not netlink.link_is_up(h, self.layout.nic(h))]

    def without(self, lost) -> "ClusterJob":
        """This job on the hosts that remain, each with the ranks it had: fewer ranks, the same per host."""
        kept = [(h, n) for h, n in zip(self.hosts, self.slots) if h not in set(lost)]
        return ClusterJob(self.layout, sum(n for _, n in kept), [n for _, n in kept], hosts=tuple(h for h, _ in kept))

    def processes(self) -> dict[int, tuple[str, int | None]]:
        """This job's live processes on every host: ``{pid: (host, rank or None for hydra's proxies)}``."""
        needle = f"{JOB_MARKER}={self.marker}".encode()
        found = {}
        for namespace in self.layout.namespaces:
            for pid in netlink.namespace_pids(namespace):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        variables = f.read().split(b"\0")
                except OSError:
                    continue
                if needle in variables:
                    rank = [v.split(b"=", 1)[1] for v in variables  # MPICH's, Open MPI's
                            if v.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="))]
                    found[pid] = (namespace, int(rank[0]) if rank else None)
        return found

    def watch(self, interval: float = 0.25) -> "RankWatch":
        """Start recording which pid is which rank on which host, to name a rank that dies (hydra names only
        its pid); stop it with ``.stop()``."""
        return RankWatch(self, interval)

    def end_survivors(self, grace: float = 2.0) -> list[int]:
        """End every process of this job still alive in any host (SIGTERM, then SIGKILL); their pids."""
        found = list(self.processes())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = []
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    alive.append(pid)
            if not alive:
                break
            _wait_gone(alive, grace)
        return found


class RankWatch:
    """A thread recording the job's ``pid -> (host, rank)`` while it runs; :meth:`explain` turns hydra's
    ``BAD TERMINATION ... PID 1186 RUNNING AT dl-h2 ... EXIT CODE: 9`` into a line that names the rank."""

    def __init__(self, job: ClusterJob, interval: float):
        import threading

        self.job, self.interval, self.seen = job, interval, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distlab-cluster-watch", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.seen.update({pid: v for pid, v in self.job.processes().items() if v[1] is not None})
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def explain(self, output: str | None) -> str:
        """One line per rank hydra reported as terminated badly, naming rank, host and signal; "" if none.

        Without the job's output (it went straight to the terminal), the ranks by pid, so that hydra's report
        (which names only a pid and a host) can be read.
        """
        import re

        if output is None:
            ranks = sorted((rank, pid, host) for pid, (host, rank) in self.seen.items())
            return ("distlab: the job failed; to read the pid in hydra's report, its ranks were: "
                    + ", ".join(f"rank {r} = pid {p} on {h}" for r, p, h in ranks) + "\n") if ranks else ""
        lines = []
        for pid, host, code in re.findall(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)", output):
            where, rank = self.seen.get(int(pid), (host, None))
            who = f"rank {rank}" if rank is not None else "a rank"
            how = f"killed by signal {code}" if 0 < int(code) < 32 else f"exit code {code}"
            lines.append(f"distlab: {who} (pid {pid}) on host {where} was lost ({how}); the job was ended on "
                         f"every host")
        return "".join(line + "\n" for line in lines)


def _wait_gone(pids, grace):
    import time

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return
        time.sleep(0.05)


def cluster_job(np: int, cluster, rate=None) -> ClusterJob:
    """The :class:`ClusterJob` for ``np`` ranks on ``cluster``: a number of hosts (cluster ``dl``, or
    ``DISTLAB_CLUSTER_NAME``; brought up if needed, with ``rate`` if given) or the name of a running cluster
    (reshaped to ``rate`` if given)."""
    if isinstance(cluster, bool) or not isinstance(cluster, (int, str)):
        raise ClusterError(f"cluster must be a number of hosts or a cluster's name, got {cluster!r}")
    if isinstance(cluster, str) and not cluster.isdigit():
        name = cluster
        if rate is not None:
            state = read_state(name) or {}
            up(state.get("hosts", 2), rate, name, state.get("delay_ms"))
        plan = layout_of(name)
    else:
        hosts = int(cluster)
        name = os.environ.get("DISTLAB_CLUSTER_NAME") or DEFAULT_NAME
        if not exists(name) or rate is not None or (read_state(name) or {}).get("hosts") != hosts:
            state = read_state(name) or {}
            keep = state.get("rate_bps") if rate is None and state.get("hosts") == hosts else rate
            up(hosts, keep, name, state.get("delay_ms"))
        plan = layout_of(name)
    slots = placement(np, len(plan.hosts))
    return ClusterJob(plan, np, slots)


def current_host(name: str | None = None) -> str | None:
    """The virtual host this process runs in (``dl-h2``), from its namespace's interfaces; None outside one.

    ``name`` defaults to ``DISTLAB_CLUSTER``, which the launcher sets for every rank of a cluster job.
    """
    name = name or os.environ.get("DISTLAB_CLUSTER")
    if not name:
        return None
    try:
        with open("/proc/self/net/dev") as f:
            interfaces = [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]
    except OSError:
        return None
    mine = [i for i in interfaces if i.startswith(f"{name}-h") and i[len(name) + 2:].isdigit()]
    return mine[0] if len(mine) == 1 else None
