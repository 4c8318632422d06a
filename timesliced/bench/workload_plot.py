"""``bench workload --plot FILE``: a PNG of a report (makespan and duty per mode, a timeline per mode).

matplotlib is an optional extra (``pip install 'timesliced[plot]'``); it is imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

INSTALL = "pip install 'timesliced[plot]'"


def require_matplotlib() -> None:
    """Raises ``ValueError`` saying how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot needs matplotlib: {INSTALL} (or run without --plot)") from None


def check_writable(path: Path) -> None:
    """Raises ``ValueError`` when ``path`` cannot take the PNG: checked before a run of minutes, not after it."""
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"--plot {path} is a folder: give a file name, such as {path / 'workload.png'}")
    if not folder.is_dir():
        raise ValueError(
            f"--plot {path}: the folder {folder} does not exist; create it (mkdir -p {folder}) or plot elsewhere"
        )
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--plot {path}: this user cannot write there; pick a path it can write")


def plot(report: dict[str, Any], path: Path) -> None:
    """Write the PNG; raises ``ValueError`` without matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    modes = report["modes"]
    names = list(modes)
    fig = plt.figure(figsize=(12, 3 + 1.6 * len(names)), constrained_layout=True)
    grid = fig.add_gridspec(1 + len(names), 2, height_ratios=[2.2] + [1.0] * len(names))

    ax = fig.add_subplot(grid[0, 0])
    ax.bar(names, [modes[n]["makespan_s"] for n in names], color="tab:blue")
    ax.axhline(report["lower_bound_s"], color="black", linestyle="--", linewidth=1, label="lower bound")
    ax.set_ylabel("makespan (s)")
    ax.legend(loc="upper right", fontsize=8)

    ax = fig.add_subplot(grid[0, 1])
    width = 0.8 / max(len(modes[n]["duty"]) for n in names)
    for i, n in enumerate(names):
        for k, duty in enumerate(modes[n]["duty"].values()):
            ax.bar(i - 0.4 + width * (k + 0.5), duty * 100, width, color="tab:gray" if k % 2 else "tab:green")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("duty per GPU (%), gpu0 first")
    ax.set_ylim(0, 110)

    jobs = sorted({s["job"] for n in names for s in modes[n]["timeline"]})
    color = {job: f"C{i % 10}" for i, job in enumerate(jobs)}
    span = max(modes[n]["makespan_s"] for n in names)
    for row, n in enumerate(names, start=1):
        ax = fig.add_subplot(grid[row, :])
        for s in modes[n]["timeline"]:
            ax.broken_barh(
                [(s["start"], s["end"] - s["start"])],
                (s["gpu"] - 0.4, 0.8),
                facecolors=color[s["job"]],
                edgecolor="white" if s["phase"] != "sync" else "black",
                linewidth=0.3,
            )
        ax.set_xlim(0, span * 1.02)
        ax.set_yticks(range(modes[n]["gpus"]), [f"gpu{g}" for g in range(modes[n]["gpus"])], fontsize=7)
        ax.set_title(f"{n}: makespan {modes[n]['makespan_s']:.1f} s", fontsize=9, loc="left")
        if row == len(names):
            ax.set_xlabel("seconds")
    handles = [Rectangle((0, 0), 1, 1, color=color[j]) for j in jobs]
    fig.legend(handles, jobs, loc="lower center", ncol=min(len(jobs), 6), fontsize=8, bbox_to_anchor=(0.5, -0.02))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
