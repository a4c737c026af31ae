"""Each architecture family's adapter (vllm_subspec/architectures.py) against the vLLM model
classes and the transformers configs it names, and `family_of` on synthetic configs."""

import importlib
import inspect
from types import SimpleNamespace

import pytest
import transformers

from vllm_subspec import architectures
from vllm_subspec.architectures import DENSE, FAMILIES, MIXTRAL, QWEN_MOE

ARCHS = [(f, a) for f in FAMILIES for a in f.architectures]


def _vllm_source(arch: str) -> str:
    """The source of vLLM's module for `arch` and of every module its classes inherit from
    (Mistral's and Qwen3's layers build on Llama's and Qwen2's)."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    module_name, cls_name = _TEXT_GENERATION_MODELS[arch]
    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    assert inspect.isclass(getattr(module, cls_name))
    modules = {module}
    for cls in [c for c in vars(module).values() if inspect.isclass(c)
                and c.__module__ == module.__name__]:
        modules.update(inspect.getmodule(base) for base in cls.__mro__[1:])
    return "\n".join(inspect.getsource(m) for m in modules
                     if m is not None and m.__name__.startswith("vllm.model_executor.models"))


@pytest.mark.parametrize("family, arch", ARCHS, ids=[a for _, a in ARCHS])
def test_the_vllm_model_class_has_what_the_adapter_names(family, arch):
    source = _vllm_source(arch)
    names = [family.attention, *family.attention_linears]
    if family.moe:
        names += [family.moe_block, "experts", *family.router_parts]
        if family.shared_expert is not None and arch != "Qwen3MoeForCausalLM":  # Qwen2-MoE's
            names += [family.shared_expert]
            names += family.shared_expert_linears
    else:
        names += [family.mlp, *family.mlp_linears]
    missing = [n for n in names if f"self.{n} =" not in source]
    assert not missing, f"{arch}: vLLM's classes set no {missing}"


@pytest.mark.parametrize("family, arch", ARCHS, ids=[a for _, a in ARCHS])
def test_the_transformers_config_has_the_shard_width_keys(family, arch):
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls()
    assert config.model_type in family.model_types
    for _, key in family.tp_shard_widths:
        if key == "shared_expert_intermediate_size" and arch == "Qwen3MoeForCausalLM":
            continue  # Qwen3-MoE has no shared expert (its width reads as 0)
        assert getattr(config, key, None), f"{arch}: its config has no {key}"
    assert architectures.family_of(SimpleNamespace(architectures=[arch])) is family
    assert architectures.family_of(SimpleNamespace(model_type=config.model_type)) is family


def test_family_of_synthetic_configs():
    assert architectures.family_of(SimpleNamespace(architectures=["OlmoeForCausalLM"])) is None
    assert architectures.family_of(SimpleNamespace(architectures=["X", "MixtralForCausalLM"])) \
        is MIXTRAL
    assert architectures.family_of(SimpleNamespace(architectures=None)) is None
    assert architectures.family_of(SimpleNamespace(architectures=None, model_type="qwen3")) \
        is DENSE
    assert architectures.is_moe(SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]))
    assert not architectures.is_moe(SimpleNamespace(architectures=["Qwen3ForCausalLM"]))
    assert architectures.MOE_ARCHITECTURES == {"MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                               "Qwen3MoeForCausalLM"}
    assert architectures.DENSE_ARCHITECTURES == {"LlamaForCausalLM", "MistralForCausalLM",
                                                 "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    names = [a for f in FAMILIES for a in f.architectures]
    assert len(names) == len(set(names))


def test_layers_linears_and_shard_widths():
    assert architectures.layer_family(None) is DENSE
    assert architectures.layer_family("block_sparse_moe") is MIXTRAL
    assert architectures.layer_family("mlp") is QWEN_MOE
    assert DENSE.substituted_linears() == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert MIXTRAL.substituted_linears(True) == ["qkv_proj", "o_proj"]
    assert QWEN_MOE.substituted_linears(True) == [
        "qkv_proj", "o_proj", "shared_expert.gate_up_proj", "shared_expert.down_proj"]
    assert QWEN_MOE.substituted_linears(False) == ["qkv_proj", "o_proj"]
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], num_attention_heads=4,
                            hidden_size=64, intermediate_size=128)
    assert architectures.tp_shard_widths(llama) == {"o_proj": 64, "down_proj": 128}
    # no family named: every family's widths
    bare = SimpleNamespace(num_attention_heads=4, head_dim=8, hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32)
    assert architectures.tp_shard_widths(bare) == {
        "o_proj": 32, "down_proj": 128, "experts' down_proj": 32, "shared_expert.down_proj": 0}
    assert architectures.has_qkv_bias(SimpleNamespace(model_type="qwen2"))
    assert architectures.has_qkv_bias(SimpleNamespace(model_type="llama", attention_bias=True))
    assert not architectures.has_qkv_bias(SimpleNamespace(model_type="qwen3"))
