"""Draw docs/_static/virtual_cluster.png: what ``python -m distlab cluster up`` builds.

Left: 2 hosts joined by one veth pair. Right: 3 hosts plugged into a switch (a bridge in a namespace of its
own). Names and addresses are those of a cluster named ``dl`` (the subnet byte comes from the name). Re-run
after changing the layout: ``.venv/bin/python docs/_scripts/virtual_cluster_figure.py``.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from distlab.cluster import layout  # noqa: E402

HOST, SWITCH, NIC, RANK = "#dbe8f4", "#f1e3c8", "#e07b5f", "#9bbcd9"


def box(ax, x, y, w, h, color, title, lines=()):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=0.8))
    ax.text(x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=8.5, weight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.42 - 0.22 * i, line, ha="center", va="top", fontsize=7)


def host(ax, x, y, name, address, ranks):
    box(ax, x, y, 1.9, 1.5, HOST, f"namespace {name}", [f"{address}/24 on {name}"])
    for i, r in enumerate(ranks):
        ax.add_patch(FancyBboxPatch((x + 0.15 + 0.85 * i, y + 0.15), 0.75, 0.45, boxstyle="round,pad=0.01",
                                    fc=RANK, ec="black", lw=0.5))
        ax.text(x + 0.525 + 0.85 * i, y + 0.375, f"rank {r}", ha="center", va="center", fontsize=7)
    ax.text(x + 0.95, y + 0.72, "shared memory within", ha="center", fontsize=6.5, style="italic")


def link(ax, x0, y0, x1, y1, label):
    ax.plot([x0, x1], [y0, y1], color=NIC, lw=2.5, solid_capstyle="round")
    ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.08, label, ha="center", va="bottom", fontsize=6.5)


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.3), dpi=110)
    two, three = layout("dl", 2), layout("dl", 3)
    h1, h2 = two.hosts
    host(left, 0.1, 1.0, h1, two.addresses[h1], [0, 1])
    host(left, 3.0, 1.0, h2, two.addresses[h2], [2, 3])
    link(left, 2.0, 1.75, 3.0, 1.75, "veth pair\ntbf rate R\nboth ways")
    left.set_title("--hosts 2: one direct link (run -n 4: ranks in blocks)", fontsize=9)
    for i, name in enumerate(three.hosts):
        host(right, 0.1 + 2.05 * i, 0.1, name, three.addresses[name], [i])
        link(right, 1.05 + 2.05 * i, 1.6, 3.15, 2.45, "")
    box(right, 2.15, 2.45, 2.0, 0.9, SWITCH, f"namespace {three.switch}", [f"bridge {three.bridge}",
                                                                            "ports dl-s1 .. dl-s3"])
    right.set_title("--hosts 3: a switch in its own namespace", fontsize=9)
    for ax in (left, right):
        ax.set_xlim(0, 6.3)
        ax.set_ylim(0, 3.5)
        ax.axis("off")
    fig.text(0.5, 0.01, f"a private /24 ({two.subnet} for 'dl') that exists only inside these namespaces: no route, "
             "NAT or bridge to the machine's interfaces", ha="center", fontsize=7.5)
    out = Path(__file__).resolve().parent.parent / "_static" / "virtual_cluster.png"
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main()
