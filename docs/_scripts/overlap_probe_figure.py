"""Draw docs/_static/overlap_probe.png from the overlap probe's figures quoted in DESIGN.md.

The figures were measured by ``mpiexec -n 2 python overlap_probe.py`` (MPICH wheel, 2 ranks, 2 cores; the probe
is in the design notes' probes folder and is reproduced on the comm page). Re-run this script after re-measuring:
``.venv/bin/python docs/_scripts/overlap_probe_figure.py``.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, compute ms before Wait, Wait ms) - Iallreduce of 16 MiB, medians.
CASES = [
    ("Iallreduce alone", 0.0, 7.0),
    ("20 ms compute,\nthen Wait", 20.0, 10.0),
    ("20 ms compute testing\nthe request, then Wait", 20.0, 3.8),
]

fig, ax = plt.subplots(figsize=(6.4, 2.2), dpi=100)
for i, (label, compute, wait) in enumerate(CASES):
    y = len(CASES) - 1 - i
    if compute:
        ax.barh(y, compute, color="#9bbcd9", edgecolor="black", linewidth=0.5)
        ax.text(compute / 2, y, "compute", ha="center", va="center", fontsize=8)
    ax.barh(y, wait, left=compute, color="#e07b5f", edgecolor="black", linewidth=0.5)
    ax.text(compute + wait + 0.4, y, f"Wait {wait:g} ms", va="center", fontsize=8)
ax.set_yticks(range(len(CASES)))
ax.set_yticklabels([c[0] for c in reversed(CASES)], fontsize=8)
ax.set_xlabel("ms since the Iallreduce started (rank 0)", fontsize=8)
ax.set_xlim(0, 36)
ax.tick_params(axis="x", labelsize=8)
ax.set_title("A 16 MiB Iallreduce only moves inside MPI calls (MPICH wheel, 2 ranks)", fontsize=9)
fig.tight_layout()
out = Path(__file__).resolve().parents[1] / "_static" / "overlap_probe.png"
fig.savefig(out)
print(out)
