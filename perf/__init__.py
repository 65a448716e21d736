"""dynar's benchmark harness: `python -m perf <suite>` (see perf/run.py)."""
