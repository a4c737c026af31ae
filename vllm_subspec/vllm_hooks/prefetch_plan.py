"""`--cpu-offload-gb N` as vLLM's prefetch offloader: which layers, how many GPU slots.

With SubSpec the offloaded layers are streamed every verify, and the prefetch offloader's copies
of the next verify's first layers run while the draft drafts (prefetch_overlap.py), where UVA's
reads happen only inside the verify. The plan leaves the GPU as much memory as UVA would: the
layers worth N GB, plus enough more to pay for the GPU slots and for the extra layers' 4-bit
substitutes. Arithmetic and its projection: docs/gpu.md, "Prefetch overlap".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_subspec.architectures import has_qkv_bias

SLOTS = 2  # GPU slots: the verify's copy stream never waits for a compute, and 2 layers'
# copies fit in any draft step (docs/gpu.md)


def substitute_share(bits: int, group_size: int) -> float:
    """A substitute's bytes over its bf16 layer's: packed codes plus a bf16 scale and zero per
    group (4-bit, groups of 64: 28.1 %)."""
    return (bits + 32 / group_size) / 16


@dataclass(frozen=True)
class PrefetchPlan:
    group_size: int  # vLLM's offload_group_size: layer i is offloaded iff
    num_in_group: int  # i % group_size >= group_size - num_in_group
    prefetch_step: int  # GPU slots
    offloaded: list[int]  # the offloaded decoder layers
    layer_bytes: int  # one decoder layer's parameters
    substitute_share: float = 0.0  # GPU bytes each offloaded layer adds back (its substitute)

    @property
    def freed_bytes(self) -> int:
        """GPU memory freed net of the slots and the offloaded layers' substitutes."""
        n = len(self.offloaded)
        return int((n * (1 - self.substitute_share) - self.prefetch_step) * self.layer_bytes)

    def describe(self, cpu_offload_gb: float) -> str:
        return (
            f"vllm-subspec: --cpu-offload-gb {cpu_offload_gb:g} runs as vLLM's prefetch "
            f"offloader: {len(self.offloaded)} decoder layers in host memory (group size "
            f"{self.group_size}, {self.num_in_group} per group), {self.prefetch_step} GPU "
            f"slots, {self.freed_bytes / 2**30:.2f} GiB freed net of the slots and "
            f"substitutes; the next verify's first {self.prefetch_step} layers are copied "
            "while the draft drafts (--offload-backend uva keeps UVA: docs/gpu.md, "
            "'Prefetch overlap')"
        )


def offloaded_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """vLLM's rule (`PrefetchOffloader.wrap_modules`): the last num_in_group of each group."""
    return [i for i in range(num_layers) if i % group_size >= group_size - num_in_group]


def plan_prefetch(
    num_layers: int, layer_bytes: int, cpu_offload_gb: float, share: float = 0.0, slots: int = SLOTS
) -> PrefetchPlan | None:
    """The prefetch plan leaving the GPU at least the memory UVA would with `cpu_offload_gb`
    (its ceil(N / layer) layers, each adding back `share` of itself as a substitute), net of
    `slots` GPU slots and of the extra layers' substitutes; its offloaded layers spread as
    evenly as vLLM's group rule allows (the fewest layers, then the smallest groups). None when
    that needs more layers than the model has."""
    uva_layers = math.ceil(cpu_offload_gb * 2**30 / layer_bytes)
    wanted = uva_layers + math.ceil(slots / (1 - share) - 1e-9)
    if wanted > num_layers:
        return None
    best = None
    for g in range(1, num_layers + 1):
        for m in range(1, g + 1):
            n = num_layers // g * m + max(0, num_layers % g - (g - m))  # offloaded_layers' len
            if n >= wanted and (best is None or (n, g) < (best[0], best[1])):
                best = (n, g, m)
    _, g, m = best
    return PrefetchPlan(g, m, slots, offloaded_layers(num_layers, g, m), layer_bytes, share)


def decoder_layer_bytes(hf_text_config, dtype_bytes: int) -> int:
    """One dense decoder layer's parameter bytes from a Llama/Qwen-style config: attention
    (q, k, v with their biases when the config has them: `architectures.has_qkv_bias`, o), the
    gated MLP, two norms."""
    h = hf_text_config.hidden_size
    heads = hf_text_config.num_attention_heads
    kv_heads = getattr(hf_text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_text_config, "head_dim", None) or h // heads
    qkv_out = (heads + 2 * kv_heads) * head_dim
    bias = qkv_out if has_qkv_bias(hf_text_config) else 0
    params = (
        h * qkv_out + bias + heads * head_dim * h + 3 * h * hf_text_config.intermediate_size + 2 * h
    )
    return params * dtype_bytes
