"""Helpers for vllm-subspec's tests, benchmarks and demo (not part of the runtime plugin).

- `assets`: the models (converted once from registry packages, cached) and prompt sets;
- `harness`: timed engine runs with acceptance statistics;
- `metrics`: τ and per-position acceptance read from vLLM's own spec-decode counters.

Not installed with the plugin: tests, benchmarks and scripts import it from the repository root.
"""
