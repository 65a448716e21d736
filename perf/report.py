"""Refresh docs/notes/perf-tables.md from perf/results/*.json: `python -m perf report`.

Each suite's measured table, machine and date sit between markers <!-- perf:SUITE --> and
<!-- /perf:SUITE --> and are replaced here, so the tables are always the last ones the
harness measured. The headline figures of docs/PERFORMANCE.md are written by people from
these.
"""
import json
import os
import re

from dynar.atomic_write import write_text

from . import harness

DOC = os.path.join(os.path.dirname(harness.RESULTS_DIR), "..", "docs", "notes", "perf-tables.md")


def _block(result):
    m = result["machine"]
    blas = ", ".join(f"{b['internal_api']} {b['version']} ({b['architecture']})"
                     for b in m.get("blas", []))
    mpi = f", MPI {m['mpi']['library']}" if m.get("mpi") else ""
    plot = result.get("plot")
    picture = f"\n\n![{result['suite']}](../../perf/results/{os.path.basename(plot)})" if plot \
        else ""
    return (f"{result['table']}{picture}\n\n"
            f"<sub>Measured {result['time']} at commit {m.get('git_commit')}: {m['cpu']}, "
            f"{m['cores_available']} cores, numpy {m['numpy']}, torch {m.get('torch')}, "
            f"BLAS {blas}{mpi}. Raw samples: perf/results/{result['suite']}.json.</sub>")


def refresh(doc_path=DOC):
    with open(doc_path) as f:
        text = f.read()
    updated = []
    for name in sorted(os.listdir(harness.RESULTS_DIR)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(harness.RESULTS_DIR, name)) as f:
            result = json.load(f)
        suite = result.get("suite")
        if suite is None:        # not a suite's result (e.g. a saved trace)
            continue
        pattern = re.compile(rf"(<!-- perf:{suite} -->\n)(?:.*?\n)?(<!-- /perf:{suite} -->)", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda mm: mm.group(1) + _block(result) + "\n" + mm.group(2), text)
            updated.append(suite)
    write_text(doc_path, text)
    return updated


def run(quick=False):
    updated = refresh()
    print(f"docs/notes/perf-tables.md: refreshed {', '.join(updated) or 'nothing'}")
