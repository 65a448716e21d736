"""The one exception type of perf.cluster."""


class ClusterError(Exception):
    """A problem setting up or running the emulated cluster, worded for the user (the CLI
    prints it without a traceback)."""
