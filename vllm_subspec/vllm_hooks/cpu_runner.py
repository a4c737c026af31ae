"""SubSpec's runner and worker on vLLM's CPU backend (imported only there)."""

from __future__ import annotations

import contextlib

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_subspec.vllm_hooks.runner import SubSpecRunner, SubSpecWorker


class SubSpecCPUModelRunner(SubSpecRunner, CPUModelRunner):
    pass


class SubSpecCPUWorker(SubSpecWorker, cpu_worker.CPUWorker):
    """vLLM's CPU worker, building SubSpec's runner. `CPUWorker.init_device` builds its runner
    from its module's `CPUModelRunner` (it has no `_make_model_runner`, 0.32 and 0.33): for
    that call the name is SubSpec's runner."""

    def init_device(self) -> None:
        with _module_attr(cpu_worker, "CPUModelRunner", SubSpecCPUModelRunner):
            super().init_device()


@contextlib.contextmanager
def _module_attr(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
