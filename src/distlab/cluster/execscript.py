"""The script hydra runs in place of ``ssh`` to start its proxy on a virtual host.

Hydra's ssh launcher runs ``<launcher-exec> [ssh options] HOST COMMAND...``. The script drops the options,
refuses a host that is not one of the cluster's, and runs the command in that host's network namespace with
``ip netns exec``, which also bind-mounts ``/etc/netns/HOST/hosts`` over ``/etc/hosts`` so the host names
resolve to the cluster's addresses.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ClusterError

__all__ = ["write_exec_script", "ip_command"]


def ip_command() -> str:
    """The ``ip`` tool of iproute2 (for ``ip netns exec``), or a clear error naming the package."""
    for candidate in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ClusterError("the virtual cluster runs processes in its hosts with `ip netns exec`, and no `ip` tool "
                       "was found: install iproute2 (e.g. `apt-get install iproute2`)")


def write_exec_script(path: Path, hosts) -> Path:
    """Write the launcher script for ``hosts`` at ``path`` (executable) and return it."""
    allowed = "|".join(hosts)
    text = f"""#!/bin/sh
# Written by distlab.cluster: hydra runs this in place of ssh to reach a virtual host ({", ".join(hosts)}).
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
host=$1; shift
case "$host" in
  {allowed}) ;;
  *) echo "distlab cluster: $host is not a host of this cluster ({", ".join(hosts)})" >&2; exit 255 ;;
esac
exec {ip_command()} netns exec "$host" /bin/sh -c "$*"
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
