"""Option validation: bad input fails in the front end with one clear message."""

import json

import pytest

from vllm_subspec import architectures
from vllm_subspec import config as config_module
from vllm_subspec.config import SubSpecConfigError, SubSpecOptions


def test_defaults_and_roundtrip():
    opts = SubSpecOptions.from_dict({})
    assert (opts.bits, opts.group_size, opts.draft_temperature) == (4, 64, 0.2)
    assert opts.substitute_layers == "offloaded"
    # an auto shape by default: widths up to 6, depths up to 32 on CPU (this suite's platform);
    # vLLM reserves and schedules at most 6 * 32 draft tokens
    assert (opts.tree_width, opts.tree_depth, opts.num_draft_tokens) == (6, 32, 192)
    assert opts.is_tree and opts.auto_width and opts.auto_depth
    assert opts.widths == (1, 2, 4, 6)
    assert SubSpecOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts
    assert opts.to_dict()["tree_width"] == opts.to_dict()["tree_depth"] == "auto"


@pytest.mark.parametrize("raw, shape, auto", [
    ({"tree_width": "auto", "tree_depth": "auto"}, (6, 32), (True, True)),
    ({"tree_width": 4}, (4, 32), (False, True)),        # fixed width, depth adaptive
    ({"tree_depth": 16}, (6, 16), (True, False)),       # fixed depth, width tuned
    ({"tree_width": 6, "tree_depth": 16}, (6, 16), (False, False)),  # fixed: as before
    ({"tree_width": 1}, (1, 16), (False, False)),       # a chain keeps a fixed depth
    ({"tree_width": 6, "max_tree_depth": 48}, (6, 48), (False, True)),  # a deeper bound
    ({"max_tree_depth": 8}, (6, 8), (True, True)),      # vLLM then reserves 6 * 8 tokens
])
def test_auto_and_fixed_shapes(raw, shape, auto):
    opts = SubSpecOptions.from_dict(raw)
    assert (opts.tree_width, opts.tree_depth) == shape
    assert (opts.auto_width, opts.auto_depth) == auto
    assert opts.widths == ((1, 2, 4, 6) if auto[0] else (shape[0],))
    assert SubSpecOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts


def test_chain_shorthand():
    opts = SubSpecOptions.from_dict({"num_speculative_tokens": 5})
    assert (opts.tree_width, opts.tree_depth, opts.num_draft_tokens) == (1, 5, 5)
    assert not opts.is_tree
    assert SubSpecOptions.from_dict(opts.to_dict()) == opts
    again = SubSpecOptions.from_dict(json.loads(json.dumps(
        SubSpecOptions.from_dict({"substitute_layers": [3, 1]}).to_dict())))
    assert again.substitute_layers == (3, 1)


@pytest.mark.parametrize("raw, heads", [
    ({}, ("target", "quantized")),                      # an auto shape: its tuner picks
    ({"tree_width": 4}, ("target", "quantized")),       # a fixed width, an adaptive depth
    ({"tree_width": 6, "tree_depth": 16}, ("target",)),  # fixed: nothing measures the heads
    ({"num_speculative_tokens": 4}, ("target",)),       # a chain: vLLM verifies it
    ({"draft_lm_head": "quantized"}, ("quantized",)),   # a user's choice is kept
    ({"draft_lm_head": "target"}, ("target",)),
    ({"num_speculative_tokens": 4, "draft_lm_head": "quantized"}, ("quantized",)),
])
def test_the_draft_holds_the_heads_a_tuner_can_choose_between(raw, heads):
    opts = SubSpecOptions.from_dict(raw)
    assert opts.draft_lm_heads == heads
    assert SubSpecOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts


@pytest.mark.parametrize("raw, fragment", [
    ({"draft_lm_head": "int8"}, "draft_lm_head must be one of ['auto', 'quantized', 'target']"),
    ({"bitz": 4}, "unknown speculative_config key(s) ['bitz']"),
    ({"bits": 5}, "bits must be one of"),
    ({"group_size": 48}, "group_size must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"tree_width": 0}, 'tree_width must be an integer in [1, 16] or "auto"'),
    ({"tree_depth": "deep"}, 'tree_depth must be an integer in [1, 64] or "auto"'),
    ({"auto_width": True}, "unknown speculative_config key(s) ['auto_width']"),
    ({"tree_depth": 65}, "tree_depth must be an integer in [1, 64]"),
    ({"tree_width": 16, "tree_depth": 64}, "at most 512"),
    ({"num_speculative_tokens": 4, "tree_depth": 8}, "num_speculative_tokens is the chain depth"),
    ({"num_speculative_tokens": 4, "tree_width": 6}, "num_speculative_tokens is the chain depth"),
    ({"draft_temperature": 0}, "draft_temperature must be a number"),
    ({"substitute_layers": "some"}, "substitute_layers must be one of"),
    ({"substitute_layers": [1, 1]}, "duplicate"),
    ({"substitute_layers": [-1]}, "non-negative"),
    ({"kernel": "int4_cpu", "bits": 3}, "needs bits=4"),
    ({"kernel": "int4_cpu_dot", "bits": 3}, "needs bits=4"),
    ({"quantizer": "gptq"}, "quantizer must be one of"),
    ({"max_tree_depth": 0}, "max_tree_depth must be an integer in [1, 64]"),
    ({"max_tree_depth": "48"}, "max_tree_depth must be an integer in [1, 64]"),
    ({"tree_depth": 16, "max_tree_depth": 48}, 'bounds "tree_depth": "auto" only'),
    ({"num_speculative_tokens": 4, "max_tree_depth": 8}, 'bounds "tree_depth": "auto" only'),
    ({"tree_width": 1, "max_tree_depth": 8}, 'bounds "tree_depth": "auto" only'),
    ({"tree_width": 16, "max_tree_depth": 48}, "at most 512"),
])
def test_bad_options_are_rejected(raw, fragment):
    with pytest.raises(SubSpecConfigError) as e:
        SubSpecOptions.from_dict(raw)
    assert str(e.value).startswith("vllm-subspec: ")
    assert fragment in str(e.value)


def test_several_problems_in_one_message():
    with pytest.raises(SubSpecConfigError) as e:
        SubSpecOptions.from_dict({"bits": 7, "group_size": 7})
    assert "bits" in str(e.value) and "group_size" in str(e.value)


def test_resolve_layers():
    assert SubSpecOptions.from_dict({"substitute_layers": "all"}).resolve_layers(3, []) == [0, 1, 2]
    assert SubSpecOptions.from_dict({}).resolve_layers(4, [2, 0]) == [0, 2]
    assert SubSpecOptions.from_dict({"substitute_layers": [2, 0]}).resolve_layers(3, []) == [0, 2]
    with pytest.raises(SubSpecConfigError, match="out of range"):
        SubSpecOptions.from_dict({"substitute_layers": [5]}).resolve_layers(3, [])


# ---- targets --------------------------------------------------------------------------------
def _hf(arch, **extra):
    from types import SimpleNamespace

    return SimpleNamespace(architectures=[arch], **extra)


@pytest.mark.parametrize("arch", sorted(architectures.MOE_ARCHITECTURES))
def test_moe_targets_accepted_on_cpu_and_cuda_with_4bit_substitutes(arch, monkeypatch):
    for cpu in (True, False):
        monkeypatch.setattr(config_module, "_platform_is_cpu", lambda cpu=cpu: cpu)
        config_module.check_target_supported(_hf(arch, num_experts=8), 1, bits=4)
    monkeypatch.setattr(config_module, "_platform_is_cpu", lambda: True)
    config_module.check_target_supported(_hf(arch, num_experts=8), 1, bits=8)  # reference
    monkeypatch.setattr(config_module, "_platform_is_cpu", lambda: False)
    with pytest.raises(SubSpecConfigError, match=rf"mixture-of-experts targets \({arch}\) run "
                       r"with SubSpec on CUDA with 4-bit substitutes.*not bits=8; use bits=4"):
        config_module.check_target_supported(_hf(arch, num_experts=8), 1, bits=8)


def test_moe_checkpoints_with_substituted_experts_are_refused(monkeypatch):
    """vLLM 0.33 serves checkpoints whose pruned experts are constants, stored compacted and
    remapped inside its kernel (`fused_moe/expert_substitution.py`): refused."""
    monkeypatch.setattr(config_module, "_platform_is_cpu", lambda: True)
    for extra in (dict(approximate_experts={"0": [3]}),
                  dict(compression_config={"transform_config": {"expert_substitution": {
                      "layers": {"0": [3]}}}})):
        with pytest.raises(SubSpecConfigError, match="replaces pruned experts by constants"):
            config_module.check_target_supported(
                _hf("Qwen3MoeForCausalLM", num_experts=8, **extra), 1)
    config_module.check_target_supported(  # a compression config without it: served
        _hf("Qwen3MoeForCausalLM", num_experts=8, compression_config={"format": "dense"}), 1)


def test_other_moe_architectures_refused_naming_the_supported_ones(monkeypatch):
    monkeypatch.setattr(config_module, "_platform_is_cpu", lambda: True)
    with pytest.raises(SubSpecConfigError, match=r"unsupported architecture \['OlmoeForCausalLM'\]"
                       r".*mixture-of-experts models \['MixtralForCausalLM', "
                       r"'Qwen2MoeForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        config_module.check_target_supported(_hf("OlmoeForCausalLM", num_experts=8), 1)
    # a dense architecture name over a checkpoint with experts
    with pytest.raises(SubSpecConfigError, match="has mixture-of-experts settings"):
        config_module.check_target_supported(_hf("LlamaForCausalLM", num_local_experts=8), 1)
    config_module.check_target_supported(_hf("LlamaForCausalLM"), 1)


def test_parallel_configurations(monkeypatch):
    """Tensor parallelism is served (dense and MoE: check_tensor_parallel_shards), pipeline
    parallelism refused."""
    monkeypatch.setattr(config_module, "_platform_is_cpu", lambda: True)
    with pytest.raises(SubSpecConfigError, match=r"pipeline parallelism.*Use tensor parallelism"):
        config_module.check_target_supported(_hf("Qwen2ForCausalLM"), 2)
    with pytest.raises(SubSpecConfigError, match=r"pipeline parallelism"):
        config_module.check_target_supported(_hf("MixtralForCausalLM", num_local_experts=4), 2)


def test_tensor_parallel_shards_must_be_whole_groups():
    from types import SimpleNamespace

    llama7b = SimpleNamespace(num_attention_heads=32, hidden_size=4096, intermediate_size=11008)
    config_module.check_tensor_parallel_shards(llama7b, 1, 64)
    config_module.check_tensor_parallel_shards(llama7b, 2, 64)  # 2048 and 5504 inputs
    with pytest.raises(SubSpecConfigError, match=r"down_proj \(1376 inputs\).*group_size 64"):
        config_module.check_tensor_parallel_shards(llama7b, 8, 64)
    config_module.check_tensor_parallel_shards(llama7b, 8, 32)
    # MoE: the experts' and the shared expert's down weights are sharded too
    qwen3_30b_a3b = SimpleNamespace(num_attention_heads=32, head_dim=128, hidden_size=2048,
                                    intermediate_size=6144, moe_intermediate_size=768)
    config_module.check_tensor_parallel_shards(qwen3_30b_a3b, 4, 64)  # 192 inputs a rank
    with pytest.raises(SubSpecConfigError, match=r"experts' down_proj \(96 inputs\)"):
        config_module.check_tensor_parallel_shards(qwen3_30b_a3b, 8, 64)
    qwen2_moe = SimpleNamespace(num_attention_heads=16, hidden_size=2048, intermediate_size=5632,
                                moe_intermediate_size=1408, shared_expert_intermediate_size=2880)
    config_module.check_tensor_parallel_shards(qwen2_moe, 2, 32)
    with pytest.raises(SubSpecConfigError, match=r"of shared_expert.down_proj \(1440 inputs\) "
                       r"is not"):
        config_module.check_tensor_parallel_shards(qwen2_moe, 2, 64)
