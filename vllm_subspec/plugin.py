"""vLLM plugin entry point (`vllm.general_plugins`: `subspec = vllm_subspec.plugin:register`).

vLLM calls it once in every process it starts (front end, engine core, each worker), so the
patches reach spawned workers without user code or environment variables. The first process
also names the folder through which workers hand SubSpec's metrics to the front end's
Prometheus collector (`vllm_hooks/metrics.py`); the processes vLLM starts inherit it.
"""

import os

from vllm_subspec.vllm_hooks import metrics, patches


def register() -> None:
    os.environ.setdefault(metrics.METRICS_DIR_ENV, metrics.default_metrics_dir())
    patches.apply_all()
