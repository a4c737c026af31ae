"""Benchmarks: run from the repository root as modules, e.g. `python -m benchmarks.cpu_speed`."""
