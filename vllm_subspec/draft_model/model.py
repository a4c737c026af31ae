"""The draft model: the target model in "draft mode". Embedding, final norm and every
non-substituted decoder layer are the target's own modules, the lm_head the target's or the
draft's quantized copy. A substituted layer is a copy of the target layer that shares its
`Attention` (hence its KV cache), rotary embedding and MoE router, and runs `SubstituteLinear`s
(and `SubstituteExperts` for a sparse MoE block's experts).

Design: docs/substitutes.md, "The draft model".
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vllm_subspec import architectures
from vllm_subspec.draft_model.experts import SubstituteExperts, moe_runner
from vllm_subspec.draft_model.substitute import SubstituteLinear


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _family(layer: nn.Module):
    """(the layer's architecture family, its sparse MoE block's (block, name, runner) or None)."""
    moe = moe_runner(layer)
    return architectures.layer_family(None if moe is None else moe[1]), moe


def layer_linear_names(layer: nn.Module) -> list[str]:
    """The fused linears of a decoder layer that get a substitute: attention's, then the dense
    MLP's, or in a sparse MoE layer its shared expert's (the routed experts: experts.py), as
    the layer's family names them (`architectures.Family.substituted_linears`)."""
    family, moe = _family(layer)
    shared = (
        moe is not None
        and family.shared_expert is not None
        and getattr(moe[0], family.shared_expert, None) is not None
    )
    return family.substituted_linears(shared)


def layer_linear(layer: nn.Module, name: str) -> nn.Module:
    """A decoder layer's fused linear `name` (a `layer_linear_names` entry)."""
    family, moe = _family(layer)
    if name in family.attention_linears:
        return getattr(getattr(layer, family.attention), name)
    if family.shared_expert is not None and name.startswith(family.shared_expert + "."):
        return getattr(getattr(moe[0], family.shared_expert), name.split(".", 1)[1])
    return getattr(getattr(layer, family.mlp), name)


def substitute_layer(
    layer: nn.Module,
    linears: dict[str, SubstituteLinear],
    device: torch.device,
    experts: SubstituteExperts | None = None,
) -> nn.Module:
    """A copy of `layer` on `device` that runs `linears` (and `experts` in place of a sparse
    MoE block's runner) and shares the target's attention, rotary embedding and router."""
    family, moe = _family(layer)
    attn = getattr(layer, family.attention)
    shared: dict[int, object] = {id(attn.attn): attn.attn}
    if hasattr(attn, "rotary_emb"):
        shared[id(attn.rotary_emb)] = attn.rotary_emb
    for name, sub in linears.items():
        shared[id(layer_linear(layer, name))] = sub
    if moe is not None:
        block, _, runner = moe
        if experts is None:
            raise ValueError("vllm-subspec: a sparse MoE layer needs its expert substitutes")
        shared[id(runner)] = experts
        for router_part in family.router_parts:  # the target's, shared
            module = getattr(block, router_part, None)
            if module is not None:
                shared[id(module)] = module
        # The block's plain attributes (process groups, configs: Mixtral keeps its expert-
        # parallel group) are shared, not copied.
        for name, value in vars(block).items():
            if not name.startswith("_"):
                shared[id(value)] = value
    # deepcopy with a pre-seeded memo: the shared objects map to themselves (or to their
    # substitute) and are not copied; everything else (norms, activations) is small and copied.
    shared_modules = {
        id(m) for obj in shared.values() if isinstance(obj, nn.Module) for m in obj.modules()
    }
    clone = copy.deepcopy(layer, memo=shared)  # (fills the memo with every copied object)
    for m in clone.modules():
        # Offloaders install an instance-level `forward` hook on the target layer; the copy must
        # call its class forward, never the hook (which would fetch the offloaded weights).
        # (The shared modules are the target's: left as they are.)
        if id(m) not in shared_modules:
            m.__dict__.pop("forward", None)
    # The prefetch offloader keeps an offloaded layer's norms in CPU memory (it serves them from
    # its GPU slots), so the copy moves its own small tensors to the draft's device; the shared
    # modules are left alone (the offloader manages their tensors).
    for m in clone.modules():
        if id(m) in shared_modules:
            continue
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.device != device:
                moved = t.detach().to(device)
                setattr(
                    m,
                    name,
                    nn.Parameter(moved, requires_grad=False)
                    if isinstance(t, nn.Parameter)
                    else moved,
                )
    if moe is not None:  # the copy's shared expert runs its substitutes (Qwen2-MoE)
        experts.__dict__["shared_expert"] = (
            None
            if family.shared_expert is None
            else getattr(getattr(clone, moe[1]), family.shared_expert, None)
        )
    return clone


def cpu_fused_norms(layers: list[nn.Module]) -> int:
    """In `layers` (the draft's own copies), each RMSNorm vLLM's C++ CPU kernels cover becomes
    a `CpuFusedRMSNorm`: one dispatched op a norm where vLLM's CPU forward dispatches about
    nine (4 vs 30-38 µs a call at one row). For eager CPU drafts only (compiled, inductor fuses
    the native norm). Returns the norms replaced (none without the kernels)."""
    ops = getattr(torch.ops, "_C", None)
    if ops is None or not (hasattr(ops, "rms_norm") and hasattr(ops, "fused_add_rms_norm")):
        return 0
    from vllm.model_executor.layers.layernorm import RMSNorm

    replaced = 0
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None:
                setattr(layer, name, CpuFusedRMSNorm(norm))
                replaced += 1
    return replaced


class CpuFusedRMSNorm(nn.Module):
    """A copied RMSNorm run by vLLM's C++ kernels `torch.ops._C.rms_norm` and
    `fused_add_rms_norm` (in place, as vLLM's CUDA path calls them), with vLLM's own forward
    where the kernels do not apply (strided rows, mixed dtypes, a hidden size off their vector
    width). In bf16 they round like the native norm up to the last bit; the draft only
    proposes."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.native = norm  # the copy's own RMSNorm: its weight, eps and forward
        self.weight = norm.weight.data  # a detached view, taken once
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        w = self.weight
        if (
            not x.is_contiguous()
            or w.dtype != x.dtype
            or x.shape[-1] % 16
            or (
                residual is not None and (not residual.is_contiguous() or residual.dtype != x.dtype)
            )
        ):
            return self.native.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, w, self.eps)
            return out
        torch.ops._C.fused_add_rms_norm(x, residual, w, self.eps)
        return x, residual


class DraftModel(nn.Module):
    """Callable like vLLM's CausalLM: forward(input_ids, positions) -> hidden states."""

    def __init__(self, target: nn.Module, substitutes, device: torch.device):
        """substitutes: the `SubstituteSet` built for `target` (the drafter's)."""
        super().__init__()
        # Kept out of the module tree: these are the target's modules, owned by the runner.
        self.__dict__["target"] = target
        base = decoder_layers(target)
        self.__dict__["layers"] = [
            substitute_layer(layer, substitutes.layers[i], device, substitutes.experts.get(i))
            if i in substitutes.layers
            else layer
            for i, layer in enumerate(base)
        ]
        self.substituted = sorted(substitutes.layers)
        self.__dict__["lm_head"] = substitutes.lm_head

    def embed_input_ids(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.target.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        lm = self.target.model
        hidden = inputs_embeds if inputs_embeds is not None else lm.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = lm.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor, head: str | None = None) -> torch.Tensor:
        """The draft's logits through `head`: "quantized", its own lm_head, finished as vLLM
        0.32's `LogitsProcessor.forward` finishes the target's (vocabulary padding cut, soft
        cap, scale), or "target", the target's own; None: its own when it has one."""
        if head == "quantized" and self.lm_head is None:
            raise ValueError("vllm-subspec: the draft holds no quantized lm_head")
        if self.lm_head is None or head == "target":
            return self.target.compute_logits(hidden_states)
        lp = self.target.logits_processor
        logits = self.lm_head(hidden_states)[0]
        # each rank holds a shard of the vocabulary
        if getattr(self.target.lm_head, "tp_size", 1) > 1:
            from vllm.distributed import tensor_model_parallel_all_gather

            logits = tensor_model_parallel_all_gather(logits)
        logits = logits[..., : lp.org_vocab_size]
        if lp.soft_cap is not None:
            logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
        if lp.scale != 1.0:
            logits = logits * lp.scale
        return logits
