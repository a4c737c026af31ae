"""`--cpu-offload-gb N` as a prefetch plan (vllm_hooks/prefetch_plan.py): vLLM's own layer rule,
at least N GB freed net of the GPU slots, the fewest and most spread-out layers."""

import math

import pytest
from vllm.model_executor.offloader.prefetch import PrefetchOffloader

from vllm_subspec.vllm_hooks.prefetch_plan import (
    decoder_layer_bytes,
    offloaded_layers,
    plan_prefetch,
    substitute_share,
)

GiB = 2**30


def test_the_layer_rule_is_vllms():
    """`offloaded_layers` against vLLM's own `PrefetchOffloader.wrap_modules` selection,
    read from its source: layer i iff i % group_size >= group_size - num_in_group."""
    import inspect

    src = inspect.getsource(PrefetchOffloader.wrap_modules)
    assert "module_index % self.group_size >= self.group_size - self.num_in_group" in src
    assert offloaded_layers(8, 4, 2) == [2, 3, 6, 7]
    assert offloaded_layers(10, 5, 1) == [4, 9]


@pytest.mark.parametrize("share", [0.0, substitute_share(4, 64)])
@pytest.mark.parametrize("num_layers, gb", [(28, 4), (28, 8), (28, 10), (30, 1), (80, 30)])
def test_a_plan_leaves_the_gpu_what_uva_would_with_the_fewest_layers(num_layers, gb, share):
    """UVA with N GB offloads ceil(N / layer) layers, each with a substitute (`share` of it) on
    the GPU; the plan's layers, net of its slots and their substitutes, free at least that."""
    layer = 466_115_584  # Qwen2.5-7B's decoder layer in bf16
    plan = plan_prefetch(num_layers, layer, gb, share)
    assert plan is not None and plan.prefetch_step == 2
    assert plan.offloaded == offloaded_layers(num_layers, plan.group_size, plan.num_in_group)
    uva_layers = math.ceil(gb * GiB / layer)
    uva_freed = uva_layers * layer * (1 - share)
    assert plan.freed_bytes >= uva_freed - 1
    fewest = min(n for g in range(1, num_layers + 1) for m in range(1, g + 1)
                 if (n := len(offloaded_layers(num_layers, g, m))) * (1 - share) - 2
                 >= uva_layers * (1 - share) - 1e-9)
    assert len(plan.offloaded) == fewest
    assert "prefetch offloader" in plan.describe(gb)


def test_substitutes_cost_the_plan_a_third_layer():
    """4-bit substitutes at 28.1 %: two slots need 2 / (1 - 0.281) = 2.8, so 3 more layers."""
    assert substitute_share(4, 64) == pytest.approx(4.5 / 16)
    layer = 466_115_584
    bare = plan_prefetch(28, layer, 4, 0.0)
    with_substitutes = plan_prefetch(28, layer, 4, substitute_share(4, 64))
    assert len(with_substitutes.offloaded) - len(bare.offloaded) >= 1
    assert len(bare.offloaded) >= math.ceil(4 * GiB / layer) + 2


def test_no_plan_when_the_slots_would_not_fit():
    assert plan_prefetch(28, 466_115_584, 12) is None  # 28 layers + 2 slots > 28
    # the paper's 8 GB card needs ~26 layers offloaded with substitutes: no room for 3 more
    assert plan_prefetch(28, 466_115_584, 11.3, substitute_share(4, 64)) is None


def test_layer_bytes_of_qwen2_and_llama_configs():
    from transformers import LlamaConfig, Qwen2Config

    qwen = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4)
    # q, k, v (+ their biases), o, gate, up, down, two norms; bf16
    params = 3584 * 4608 + 4608 + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert decoder_layer_bytes(qwen, 2) == 2 * params
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2)
    assert decoder_layer_bytes(llama, 4) == 4 * (64 * (4 + 4) * 16 + 64 * 64 + 3 * 64 * 128
                                                 + 2 * 64)
