"""The script an MPI launcher runs in place of ``ssh`` to start its daemon on a virtual host.

Hydra's ssh launcher (MPICH) runs ``<launcher-exec> [ssh options] HOST COMMAND...``, and so does Open MPI's
(PRRTE's ``plm_ssh_agent``). The script drops the options, refuses a host that is not one of the cluster's, and
runs the command in that host's network namespace with ``ip netns exec``, which also bind-mounts
``/etc/netns/HOST/hosts`` over ``/etc/hosts`` so the host names resolve to the cluster's addresses.

Open MPI's script (``hostname=True``) also gives the command a UTS namespace of its own whose host name is the
virtual host's (``unshare --uts``): otherwise every host reports the machine's name, and Open MPI 5.0's TCP
transport between two hosts of one name never completes its connections (ranks reach ``MPI_Init`` and hang in
their first collective across hosts).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ClusterError

__all__ = ["write_exec_script", "ip_command", "unshare_command", "own_hostname"]


def ip_command() -> str:
    """The ``ip`` tool of iproute2 (for ``ip netns exec``), or a clear error naming the package."""
    for candidate in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ClusterError("the virtual cluster runs processes in its hosts with `ip netns exec`, and no `ip` tool "
                       "was found: install iproute2 (e.g. `apt-get install iproute2`)")


def unshare_command() -> str:
    """The ``unshare`` tool of util-linux (a host name per virtual host, for Open MPI), or a clear error."""
    found = shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)),
                                            None)
    if found is None:
        raise ClusterError("Open MPI on the virtual cluster gives each host its own host name with `unshare --uts`, "
                           "and no `unshare` tool was found: install util-linux")
    return found


def own_hostname(host: str) -> list[str]:
    """The words that run a command (the words after them) as host ``host``: in a UTS namespace of its own,
    named after it."""
    return [unshare_command(), "--uts", "/bin/sh", "-c", 'hostname "$0" && exec "$@"', host]


def write_exec_script(path: Path, hosts, hostname: bool = False) -> Path:
    """Write the launcher script for ``hosts`` at ``path`` (executable) and return it; ``hostname``: each host
    runs the command under its own host name (Open MPI's script)."""
    allowed = "|".join(hosts)
    run = (f'{unshare_command()} --uts /bin/sh -c \'hostname "$0" && exec /bin/sh -c "$1"\' "$host" "$*"'
           if hostname else '/bin/sh -c "$*"')
    text = f"""#!/bin/sh
# Written by distlab.cluster: the MPI launcher runs this in place of ssh to reach a virtual host ({", ".join(hosts)}).
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
host=$1; shift
case "$host" in
  {allowed}) ;;
  *) echo "distlab cluster: $host is not a host of this cluster ({", ".join(hosts)})" >&2; exit 255 ;;
esac
exec {ip_command()} netns exec "$host" {run}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
