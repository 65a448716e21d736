"""The allreduce algorithms by name. A name's index is the id pyx/allreduce.pyx's Algorithm
enum gives it: that extension runs them, costmodel.py prices them and the planner chooses
among them. Importing this does not load MPI."""

ALGORITHMS = ("mpi", "ring", "recursive_doubling", "rabenseifner", "hierarchical")


def algorithm_id(name):
    """The extension's id of the algorithm called `name`."""
    try:
        return ALGORITHMS.index(name)
    except ValueError:
        raise ValueError(f"algorithm: unknown allreduce algorithm {name!r}; choose one of "
                         f"{', '.join(ALGORITHMS)}") from None
