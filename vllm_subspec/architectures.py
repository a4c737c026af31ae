"""What SubSpec needs of a target, per architecture family: one `Family` adapter each (`FAMILIES`),
naming the Hugging Face architectures it covers, the decoder-layer linears the draft substitutes,
where a sparse MoE block keeps its experts and shared expert, and the config keys that give the
tensor-parallel shard widths. Callers look the adapter up (`family_of(hf_config)`; a decoder
layer's: `layer_family`) instead of testing architecture names.

Adding an architecture: add its names to a family, or a new `Family`, here, and check it in
tests/unit/test_architectures.py against the vLLM model class it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One architecture family's adapter: what SubSpec reads of a target of the family."""

    name: str
    architectures: tuple[str, ...]
    """The `hf_config.architectures` names served (vLLM's model classes of the same names)."""
    model_types: tuple[str, ...]
    """`hf_config.model_type`s of the family (for configs that name no architecture)."""
    moe: bool = False
    """Sparse mixture-of-experts: routed experts get 4-bit substitutes (draft_model/experts.py);
    refusals and the offload plan differ (refusals.py, vllm_hooks/engine_rules.py)."""
    attention: str = "self_attn"
    """The decoder layer's attention module (its `attn`, the KV cache, is shared)."""
    attention_linears: tuple[str, ...] = ("qkv_proj", "o_proj")
    mlp: str = "mlp"
    """A dense decoder layer's MLP module."""
    mlp_linears: tuple[str, ...] = ("gate_up_proj", "down_proj")
    moe_block: str | None = None
    """A MoE decoder layer's sparse block (holding the `MoERunner`, the router's gate)."""
    shared_expert: str | None = None
    """The block's shared expert, where a checkpoint has one (Qwen2-MoE; not Qwen3-MoE)."""
    shared_expert_linears: tuple[str, ...] = ("gate_up_proj", "down_proj")
    router_parts: tuple[str, ...] = ()
    """The block's routing modules the draft shares with the target."""
    tp_shard_widths: tuple[tuple[str, str], ...] = (("down_proj", "intermediate_size"),)
    """(row-parallel linear, the config key of its input width) besides o_proj (attention heads
    x head_dim): each tensor-parallel rank quantizes its shard of these."""
    qkv_bias_model_types: tuple[str, ...] = ()
    """model_types whose q, k, v projections carry biases whatever `attention_bias` says."""

    def substituted_linears(self, has_shared_expert: bool = False) -> list[str]:
        """The fused linears of one decoder layer that get a substitute, as
        `draft_model.model.layer_linear` names them: attention's, then the dense MLP's, or in a
        MoE layer its shared expert's (the routed experts are substituted apart)."""
        names = list(self.attention_linears)
        if not self.moe:
            return names + list(self.mlp_linears)
        if has_shared_expert and self.shared_expert is not None:
            names += [f"{self.shared_expert}.{n}" for n in self.shared_expert_linears]
        return names


DENSE = Family(
    name="dense",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ),
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    qkv_bias_model_types=("qwen2",),
)
MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    moe=True,
    moe_block="block_sparse_moe",
    router_parts=("gate",),
    # the experts' down weights are `intermediate_size` wide
    tp_shard_widths=(("down_proj", "intermediate_size"),),
)
QWEN_MOE = Family(
    name="qwen_moe",
    architectures=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    model_types=("qwen2_moe", "qwen3_moe"),
    moe=True,
    moe_block="mlp",
    shared_expert="shared_expert",
    router_parts=("gate", "shared_expert_gate"),
    tp_shard_widths=(
        ("down_proj", "intermediate_size"),
        ("experts' down_proj", "moe_intermediate_size"),
        ("shared_expert.down_proj", "shared_expert_intermediate_size"),
    ),
)
FAMILIES: tuple[Family, ...] = (DENSE, MIXTRAL, QWEN_MOE)

DENSE_ARCHITECTURES = frozenset(a for f in FAMILIES if not f.moe for a in f.architectures)
MOE_ARCHITECTURES = frozenset(a for f in FAMILIES if f.moe for a in f.architectures)
# config keys that mark a checkpoint as mixture-of-experts, whatever its architecture name
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def architectures_of(hf_config: Any) -> list[str]:
    return list(getattr(hf_config, "architectures", None) or [])


def family_of(hf_config: Any) -> Family | None:
    """The family of a target's config: by its first served architecture name, else (a config
    naming none) by its model_type; None when SubSpec serves neither."""
    archs = architectures_of(hf_config)
    for arch in archs:
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    if archs:
        return None
    model_type = getattr(hf_config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def is_moe(hf_config: Any) -> bool:
    """Whether the target is one of the served mixture-of-experts architectures."""
    return any(a in MOE_ARCHITECTURES for a in architectures_of(hf_config))


def layer_family(moe_block: str | None) -> Family:
    """The family of a decoder layer from where its sparse MoE block sits (`moe_block`: the
    block's attribute name; None for a dense layer)."""
    if moe_block is None:
        return DENSE
    return next((f for f in FAMILIES if f.moe and f.moe_block == moe_block), QWEN_MOE)


def tp_shard_widths(hf_config: Any) -> dict[str, int]:
    """Each tensor-parallel row-parallel linear's full input width (0: absent from the config):
    o_proj's (heads x head_dim), then the family's `tp_shard_widths` (every family's, in order,
    for a config of no served family)."""
    heads = getattr(hf_config, "num_attention_heads", 0)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // max(heads, 1)
    family = family_of(hf_config)
    keys = (
        family.tp_shard_widths
        if family is not None
        else tuple(dict.fromkeys(kw for f in FAMILIES for kw in f.tp_shard_widths))
    )
    widths = {"o_proj": heads * head_dim}
    for name, key in keys:
        widths.setdefault(name, getattr(hf_config, key, 0))
    return widths


def has_qkv_bias(hf_text_config: Any) -> bool:
    """Whether the q, k, v projections carry biases (`attention_bias`, or a model type whose
    layers always do: Qwen2)."""
    always = {t for f in FAMILIES for t in f.qkv_bias_model_types}
    return (
        bool(getattr(hf_text_config, "attention_bias", False))
        or getattr(hf_text_config, "model_type", None) in always
    )
