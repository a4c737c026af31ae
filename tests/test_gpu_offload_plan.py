"""benchmarks/gpu_offload.py compares plain offloading and SubSpec under the same memory limit."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gpu_offload import layers_to_offload, offload_kwargs, prefetch_groups  # noqa: E402
from projection import SUBSTITUTE_FRACTION, GpuSetting  # noqa: E402

# Qwen2.5-7B: 28 layers of 0.466 GB bf16, 15.23 GB in all; the paper's 8 GB card
W, LAYER, N, BUDGET = 15.23, 0.466, 28, 8.0 - 1.5


def resident_gb(n, subspec):
    return W - n * LAYER + (n * SUBSTITUTE_FRACTION * LAYER if subspec else 0.0)


@pytest.mark.parametrize("subspec", [False, True])
def test_fewest_layers_that_fit_the_same_budget(subspec):
    n = layers_to_offload(W, LAYER, N, BUDGET, subspec)
    assert resident_gb(n, subspec) <= BUDGET < resident_gb(n - 1, subspec)


def test_subspec_offloads_more_than_plain_like_the_projection():
    plain = layers_to_offload(W, LAYER, N, BUDGET, subspec=False)
    spec = layers_to_offload(W, LAYER, N, BUDGET, subspec=True)
    assert spec > plain
    # the projection's offloaded bytes, rounded up to whole layers
    setting = GpuSetting(weight_gb=W, memory_gb=8.0, reserved_gb=1.5)
    assert plain == pytest.approx(setting.offloaded_gb(False) / LAYER, abs=1)
    assert spec == pytest.approx(setting.offloaded_gb(True) / LAYER, abs=1)


def test_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="cannot fit"):
        layers_to_offload(W, LAYER, N, 0.5, subspec=True)


def vllm_prefetch_count(group: int, in_group: int) -> int:
    """Layers vLLM's prefetch backend offloads for this grouping, by `planned_offload`, which
    test_layer_selection checks against PrefetchOffloader.wrap_modules run for real."""
    from torch import nn
    from vllm.config import OffloadConfig, PrefetchOffloadConfig

    from vllm_subspec.layer_selection import planned_offload

    layers = [nn.Linear(2, 2) for _ in range(N)]
    cfg = OffloadConfig(prefetch=PrefetchOffloadConfig(
        offload_group_size=group, offload_num_in_group=in_group))
    return len(planned_offload(layers, cfg))


@pytest.mark.parametrize("want", [1, 5, 14, 19, 27, 28])
def test_prefetch_groups_offload_the_fewest_layers_needed(want):
    kwargs = offload_kwargs("prefetch", N, want, LAYER)
    group, in_group = kwargs["offload_group_size"], kwargs["offload_num_in_group"]
    assert (group, in_group) == prefetch_groups(N, want)
    got = vllm_prefetch_count(group, in_group)
    assert got >= want
    # no grouping vLLM accepts offloads fewer layers while still covering `want`
    assert not any(want <= vllm_prefetch_count(g, k) < got
                   for g in range(1, N + 1) for k in range(1, g + 1))


def test_uva_bytes_cover_the_layers():
    kwargs = offload_kwargs("uva", N, 10, LAYER)
    assert kwargs["cpu_offload_gb"] * 2**30 == pytest.approx(10 * LAYER * 1e9)
