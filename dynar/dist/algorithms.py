"""The allreduce algorithms by name, in the order of pyx/allreduce.pyx's Algorithm enum: that
extension runs them, costmodel.py prices them and the planner chooses among them. Importing
this does not load MPI."""

ALGORITHMS = ("mpi", "ring", "recursive_doubling", "rabenseifner", "hierarchical")
