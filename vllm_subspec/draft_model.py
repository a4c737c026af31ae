"""The draft model is the target model in "draft mode".

Embedding, final norm, lm_head and every non-substituted decoder layer are the target's own
modules. A substituted layer is a copy of the target layer that shares the target's `Attention`
module (hence its KV cache and its name in vLLM's forward context) and its rotary embedding, owns
copies of its small tensors (norms, biases), and runs its linears through `SubstituteLinear`s.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_subspec.config import SUBSTITUTE_LINEARS, SubSpecOptions
from vllm_subspec.substitute import SubstituteLinear, build_substitute_linear

logger = logging.getLogger(__name__)

_SUBSTITUTES_ATTR = "_subspec_substitutes"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _linear_owner(layer: nn.Module, name: str) -> nn.Module:
    return layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp


@dataclass
class SubstituteSet:
    """The substitutes built for one target model, keyed by decoder layer index."""

    layers: dict[int, dict[str, SubstituteLinear]] = field(default_factory=dict)
    replaced_bytes: int = 0  # bytes of the target linear weights they stand in for

    def nbytes(self) -> int:
        return sum(s.nbytes() for subs in self.layers.values() for s in subs.values())

    def attach_to(self, model: nn.Module) -> None:
        # A plain attribute (not a submodule): vLLM must not see these in named_parameters().
        model.__dict__[_SUBSTITUTES_ATTR] = self

    @staticmethod
    def of(model: nn.Module) -> SubstituteSet | None:
        return model.__dict__.get(_SUBSTITUTES_ATTR)


def build_substitutes(model: nn.Module, layer_indices: list[int], options: SubSpecOptions,
                      device: torch.device) -> SubstituteSet:
    """Quantize the linears of the chosen layers. Called on freshly loaded target weights."""
    from tqdm import tqdm

    layers = decoder_layers(model)
    subs = SubstituteSet()
    jobs = [(i, name) for i in layer_indices for name in SUBSTITUTE_LINEARS]
    for i, name in tqdm(jobs, desc=f"SubSpec: {options.bits}-bit substitutes", unit="linear",
                        disable=not jobs):
        linear = getattr(_linear_owner(layers[i], name), name)
        subs.layers.setdefault(i, {})[name] = build_substitute_linear(
            linear, device, options.bits, options.group_size, options.quantizer,
            options.kernel, name=f"layers.{i}.{name}")
        subs.replaced_bytes += linear.weight.numel() * linear.weight.element_size()
    return subs


def substitute_layer(layer: nn.Module, linears: dict[str, SubstituteLinear]) -> nn.Module:
    """A copy of `layer` that runs `linears` and shares the target's attention and rotary."""
    attn = layer.self_attn
    shared: dict[int, object] = {id(attn.attn): attn.attn}
    if hasattr(attn, "rotary_emb"):
        shared[id(attn.rotary_emb)] = attn.rotary_emb
    for name, sub in linears.items():
        shared[id(getattr(_linear_owner(layer, name), name))] = sub
    # deepcopy with a pre-seeded memo: the shared objects map to themselves (or to their
    # substitute) and are not copied; everything else (norms, activations) is small and copied.
    clone = copy.deepcopy(layer, memo=shared)
    for m in clone.modules():
        # Offloaders install an instance-level `forward` hook on the target layer; the copy must
        # call its class forward, never the hook (which would fetch the offloaded weights).
        m.__dict__.pop("forward", None)
    return clone


class DraftModel(nn.Module):
    """Callable like vLLM's CausalLM: forward(input_ids, positions) -> hidden states."""

    def __init__(self, target: nn.Module, substitutes: SubstituteSet):
        super().__init__()
        # Kept out of the module tree: these are the target's modules, owned by the runner.
        self.__dict__["target"] = target
        base = decoder_layers(target)
        self.__dict__["layers"] = [
            substitute_layer(layer, substitutes.layers[i]) if i in substitutes.layers else layer
            for i, layer in enumerate(base)
        ]
        self.substituted = sorted(substitutes.layers)

    def embed_input_ids(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.target.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        lm = self.target.model
        hidden = inputs_embeds if inputs_embeds is not None else lm.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = lm.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden_states)
