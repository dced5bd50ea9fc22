"""Experiments on top of runs: comparison grids, their reports, benchmarks."""
