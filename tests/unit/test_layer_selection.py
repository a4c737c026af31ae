"""Which layers get substitutes, against vLLM's real offload configuration objects."""

import pytest
import torch
from torch import nn
from vllm.config.offload import OffloadConfig, PrefetchOffloadConfig, UVAOffloadConfig

from vllm_subspec.draft_model.layer_selection import offloaded_layer_indices, planned_offload

MIB = 2**20


def layers(n=8, mib_per_layer=4, device="cpu"):
    # one bf16 parameter of `mib_per_layer` MiB per layer
    numel = mib_per_layer * MIB // 2
    out = nn.ModuleList()
    for _ in range(n):
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device=device),
                                requires_grad=False)
        out.append(m)
    return out


def test_no_offload_selects_nothing():
    assert planned_offload(layers(), OffloadConfig()) == []
    assert offloaded_layer_indices(layers(), OffloadConfig(), torch.device("cpu")) == []


def test_uva_budget_takes_leading_layers():
    cfg = OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=10 * MIB / 2**30))
    assert cfg.offload_backend == "auto"
    # 10 MiB over 4 MiB layers: layers 0, 1 whole and part of 2
    assert planned_offload(layers(), cfg) == [0, 1, 2]


def test_uva_param_filter():
    cfg = OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=1.0, cpu_offload_params={"bias"}))
    assert planned_offload(layers(), cfg) == []


def test_prefetch_groups():
    cfg = OffloadConfig(prefetch=PrefetchOffloadConfig(offload_group_size=4,
                                                       offload_num_in_group=2))
    assert planned_offload(layers(8), cfg) == [2, 3, 6, 7]


def test_live_offloader_wins():
    ls = layers(4)

    class FakePrefetchOffloader:  # the shape of vLLM's PrefetchOffloader.module_offloaders
        module_offloaders = [type("M", (), {"module": ls[1]})(), type("M", (), {"module": ls[3]})()]

    assert offloaded_layer_indices(ls, OffloadConfig(), torch.device("cuda"),
                                   FakePrefetchOffloader()) == [1, 3]


def test_uva_marker_detected_on_accelerator():
    ls = layers(3, device="meta")  # stands for accelerator-resident weights
    ls[0].weight._vllm_is_uva_offloaded = True
    assert offloaded_layer_indices(ls, OffloadConfig(), torch.device("cuda")) == [0]


@pytest.mark.parametrize("group,num,params", [(4, 2, set()), (3, 1, set()), (4, 4, {"weight"}),
                                              (2, 1, {"bias"})])
def test_prefetch_plan_matches_vllm_prefetch_offloader(monkeypatch, group, num, params):
    """Our plan vs the selection vLLM's own PrefetchOffloader.wrap_modules makes (run for real,
    with its CUDA-only per-layer offloader replaced by a recorder)."""
    from vllm.model_executor.offloader import prefetch

    picked = []
    monkeypatch.setattr(prefetch, "_ModuleOffloader",
                        lambda module, **kw: picked.append(module) or object())
    monkeypatch.setattr(prefetch.PrefetchOffloader, "_hook_module_forward", lambda *a: None)
    offloader = object.__new__(prefetch.PrefetchOffloader)  # __init__ makes a CUDA stream
    offloader.__dict__.update(group_size=group, num_in_group=num, prefetch_step=1,
                              offload_params=params, mode="cpu", module_offloaders=[],
                              copy_stream=None)
    ls = layers(9)
    offloader.wrap_modules(iter(ls))
    vllm_choice = [i for i, layer in enumerate(ls) if any(layer is m for m in picked)]
    cfg = OffloadConfig(prefetch=PrefetchOffloadConfig(
        offload_group_size=group, offload_num_in_group=num, offload_params=params))
    assert planned_offload(ls, cfg) == vllm_choice


def test_prefetch_streamed_layers_must_all_be_substituted(monkeypatch):
    """A layer the prefetch ring streams but the draft runs at full precision would run the
    ring's hooks inside the draft (docs/gpu.md, "Prefetch overlap"): refused at load."""
    from types import SimpleNamespace

    from vllm.model_executor.offloader import base

    from vllm_subspec.config import SubSpecConfigError, SubSpecOptions
    from vllm_subspec.draft_model.substitute_set import build_substitute_set

    ls = layers(4)
    model = SimpleNamespace(model=SimpleNamespace(layers=ls))
    offloader = SimpleNamespace(module_offloaders=[SimpleNamespace(module=ls[1]),
                                                   SimpleNamespace(module=ls[3])])
    monkeypatch.setattr(base, "get_offloader", lambda: offloader)
    cfg = SimpleNamespace(offload_config=OffloadConfig())
    with pytest.raises(SubSpecConfigError, match=r"missing \[3\]"):
        build_substitute_set(model, SubSpecOptions(substitute_layers=(1,)), cfg,
                             torch.device("cpu"))
