"""Helpers shared by the tests (and, for launching jobs, the benchmarks)."""
