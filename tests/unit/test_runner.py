"""The seam (vllm_hooks/runner.py, cpu_runner.py): vLLM builds SubSpec's runner through SubSpec's
worker classes, the weight hook hands only the loading runner's target over, and the one
accessor finds a worker's SubSpec parts. Engines run the whole seam in tests/e2e."""

from types import SimpleNamespace

import pytest

from vllm_subspec.vllm_hooks import cpu_runner, patches, runner
from vllm_subspec.vllm_hooks.cpu_runner import SubSpecCPUModelRunner, SubSpecCPUWorker
from vllm_subspec.vllm_hooks.runner import (
    SubSpecGPUModelRunner,
    SubSpecGPUWorker,
    SubSpecRunner,
    loading_runner,
    subspec_of,
)


def test_the_gpu_worker_builds_subspecs_runner(monkeypatch):
    """`Worker.init_device` calls `self._make_model_runner()`; SubSpec's worker answers with
    its own runner class, and refuses Model Runner V2 (patches.py forces V1)."""
    built = []
    monkeypatch.setattr(SubSpecGPUModelRunner, "__init__",
                        lambda self, config, device: built.append((config, device)))
    worker = SimpleNamespace(use_v2_model_runner=False, vllm_config="config", device="cuda:0")
    made = SubSpecGPUWorker._make_model_runner(worker)
    assert isinstance(made, SubSpecGPUModelRunner) and isinstance(made, SubSpecRunner)
    assert built == [("config", "cuda:0")]
    worker.use_v2_model_runner = True
    with pytest.raises(RuntimeError, match="V1 model runner"):
        SubSpecGPUWorker._make_model_runner(worker)


def test_the_cpu_worker_builds_subspecs_runner_for_its_init_device_only(monkeypatch):
    """`CPUWorker.init_device` builds its runner from its module's `CPUModelRunner` name: that
    name is SubSpec's runner during the call, and vLLM's again after it (also on an error)."""
    from vllm.v1.worker import cpu_worker
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    seen = []

    def init_device(self):
        seen.append(cpu_worker.CPUModelRunner)
        raise RuntimeError("stop here")  # the rest binds threads and memory: not for a test

    monkeypatch.setattr(cpu_worker.CPUWorker, "init_device", init_device)
    with pytest.raises(RuntimeError, match="stop here"):
        SubSpecCPUWorker.init_device(object.__new__(SubSpecCPUWorker))
    assert seen == [SubSpecCPUModelRunner]
    assert cpu_worker.CPUModelRunner is CPUModelRunner
    assert SubSpecCPUModelRunner.__mro__[1:3] == (SubSpecRunner, CPUModelRunner)
    assert cpu_runner.SubSpecCPUModelRunner.load_model is SubSpecRunner.load_model


def test_the_weight_hook_hands_over_only_the_loading_runners_target():
    """vLLM's `process_weights_after_loading` (wrapped, patch #3): outside a SubSpec runner's
    `load_model`, or for another model config (a drafter's own model), the original alone
    runs; for the loading runner's target, the runner builds around the original."""
    original_calls, handed = [], []
    hook = patches.weight_hook(lambda m, c, d: original_calls.append((m, c, d)))

    class Loading:  # what the hook reads of its runner
        model_config = "target config"

        def target_weights_loaded(self, model, device, process_weights):
            handed.append((model, device))
            process_weights()

    assert loading_runner() is None
    token = runner._LOADING.set(Loading())
    try:
        hook("target", "target config", "cpu")
        hook("draft", "draft config", "cpu")
    finally:
        runner._LOADING.reset(token)
    hook("later", "target config", "cpu")
    assert handed == [("target", "cpu")]
    assert original_calls == [("target", "target config", "cpu"),
                              ("draft", "draft config", "cpu"),
                              ("later", "target config", "cpu")]


def test_the_accessor_finds_subspecs_runner_and_refuses_any_other():
    ours = object.__new__(SubSpecGPUModelRunner)
    assert subspec_of(SimpleNamespace(model_runner=ours)) is ours
    assert subspec_of(ours) is ours
    with pytest.raises(TypeError, match="not a SubSpec model runner"):
        subspec_of(SimpleNamespace(model_runner=object()))


def test_the_front_end_names_subspecs_worker_and_refuses_another():
    from vllm.config import ParallelConfig

    from vllm_subspec.config import SubSpecConfigError
    from vllm_subspec.vllm_hooks.engine_rules import _use_subspec_worker, subspec_worker_cls

    cpu = SimpleNamespace(is_cpu=lambda: True)
    cuda = SimpleNamespace(is_cpu=lambda: False)
    for platform, cls in ((cpu, SubSpecCPUWorker), (cuda, SubSpecGPUWorker)):
        config = ParallelConfig()
        _use_subspec_worker(config, platform)
        assert config.worker_cls == subspec_worker_cls(platform) \
            == f"{cls.__module__}.{cls.__qualname__}"
        _use_subspec_worker(config, platform)  # idempotent
    with pytest.raises(SubSpecConfigError, match="cannot be combined with SubSpec"):
        _use_subspec_worker(ParallelConfig(worker_cls="my.Worker"), cpu)
