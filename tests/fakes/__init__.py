"""Fake modules standing in for CuPy and mpi4py in the bookkeeping tests."""
