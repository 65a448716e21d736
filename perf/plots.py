"""PNG plots of benchmark results (matplotlib, without a display). A machine without
matplotlib still gets every table and JSON file; the plot is skipped with a note."""
import os
import sys

from .harness import RESULTS_DIR


def _pyplot(name):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"note: matplotlib is not installed; {name}.png not drawn", file=sys.stderr)
        return None


def _save(fig, plt, name):
    fig.tight_layout()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(name, events, title):
    """perf/results/<name>.png: Chrome-trace spans ("X" events: pid = rank, tid = thread)
    as one bar row per rank and thread, colored by kind (forward, backward layers,
    allreduce, wait, update); returns the path, or None without matplotlib."""
    plt = _pyplot(name)
    if plt is None:
        return None
    colors = {"forward": "tab:blue", "backward": "tab:green", "allreduce": "tab:red",
              "wait": "tab:orange", "update": "tab:purple"}
    spans = [e for e in events if e.get("ph") == "X" and e["name"] != "backward"]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    t0 = min(e["ts"] for e in spans)
    for y, row in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == row):
            kind = e["name"].split()[0]
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05))], (y - 0.4, 0.8),
                           color=colors.get(kind, "gray"), edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(rows)),
                  [f"rank {p} {'comm' if t else 'train'}" for p, t in rows])
    ax.set(xlabel="ms")
    ax.set_title(title, loc="left")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=list(colors), fontsize=7, loc="lower right", ncol=5,
              bbox_to_anchor=(1.0, 1.02))
    ax.invert_yaxis()
    return _save(fig, plt, name)


def line_panels(name, panels, xlabel, ylabel, logx=False, logy=False):
    """perf/results/<name>.png: one subplot per panel {title: {series: [(x, y)]}}; returns
    the path, or None without matplotlib."""
    plt = _pyplot(name)
    if plt is None:
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
    return _save(fig, plt, name)
