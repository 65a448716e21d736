"""PNG plots of benchmark results (matplotlib, without a display). A machine without
matplotlib still gets every table and JSON file; the plot is skipped with a note."""
import os
import sys

from .harness import RESULTS_DIR


def line_panels(name, panels, xlabel, ylabel, logx=False, logy=False):
    """perf/results/<name>.png: one subplot per panel {title: {series: [(x, y)]}}; returns
    the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; {name}.png not drawn", file=sys.stderr)
        return None
    cols = min(3, len(panels)) or 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for label, points in series.items():
            points = sorted(points)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3,
                    label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if logx:
            ax.set_xscale("log", base=2 if logx == 2 else 10)
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
