"""A mixture-of-experts block in the draft: `SubstituteExperts` stands in for vLLM's MoE runner
(the block's `experts`, a `MoERunner`) in a substituted layer. The target's router picks the
experts (its gate and `select_experts`: the same top-k and weights); each routed expert runs
4-bit copies of its own fused gate/up and down weights; a shared expert (Qwen2-MoE) runs its
substitute linears.

Design: docs/moe.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_subspec.draft_model.kernels import (
    Int4CpuKernel,
    Int4DotCpuKernel,
    ReferenceKernel,
    choose_kernel,
)
from vllm_subspec.draft_model.quantize import QuantizedWeight

# The kernels routed experts run, by name: their per-expert tensors are stacked per layer, so
# one operator call runs every expert a pass routes to (CUDA has none yet: config.py refuses
# MoE targets there).
EXPERT_KERNELS = {k.name: k for k in (Int4DotCpuKernel, Int4CpuKernel, ReferenceKernel)}


def moe_runner(layer: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """(the sparse MoE block, its attribute name in the layer, its `MoERunner`) of a decoder
    layer, or None for a dense layer."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for block_name, block in layer.named_children():
        for child in block.children():
            if isinstance(child, MoERunner):
                return block, block_name, child
    return None


def expert_weights(runner: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's raw expert weights, before vLLM processes them: w13 [E, 2I, H] (gate rows,
    then up rows) and w2 [E, H, I]."""
    experts = runner.routed_experts
    return experts.w13_weight, experts.w2_weight


class ExpertWeight:
    """One expert's weight as a substitute job reads it (`.weight`, no bias)."""

    bias = None

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13: list[torch.Tensor], w2: list[torch.Tensor], kernel: str,
                   group_size: int, bits: int) -> torch.Tensor:
    """sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x) with each expert's
    down(silu(gate(x)) * up(x)) run by `kernel` from its stacked tensors (`w13[t][e]`: tensor t
    of expert e). Only the experts some row routes to run, each on its rows."""
    out = torch.zeros(x.shape[0], _out_features(kernel, w2), dtype=torch.float32)
    run = _expert_linear(kernel, group_size, bits)
    for e in torch.unique(topk_ids).tolist():  # the CPU path: a host read costs nothing here
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        h = run(x[rows], [t[e] for t in w13])
        d = h.shape[-1] // 2
        h = run(F.silu(h[:, :d]) * h[:, d:], [t[e] for t in w2])
        out.index_add_(0, rows, h.float() * topk_weights[rows, slots, None].float())
    return out.to(x.dtype)


def _out_features(kernel: str, w2: list[torch.Tensor]) -> int:
    if kernel == "reference":
        return w2[0].shape[1]  # codes [E, H, I]
    if kernel == Int4DotCpuKernel.name:
        from vllm_subspec.draft_model import int4_dot_cpu

        return w2[0].shape[1] * int4_dot_cpu.TILE
    return w2[0].shape[1]  # tinygemm packed [E, N, K/2]


def _expert_linear(kernel: str, group_size: int, bits: int):
    """x, one expert's tensors -> x @ W.T in x's dtype."""
    if kernel == "reference":
        def run(x, tensors):
            codes, scale, zero = tensors
            qw = QuantizedWeight(codes=codes, scale=scale, zero=zero, bits=bits,
                                 group_size=group_size)
            return F.linear(x, qw.dequantize(x.dtype))
        return run
    cls = EXPERT_KERNELS[kernel]

    def run(x, tensors):
        packed, meta = tensors
        # the activation dtype the tensors were packed for (`_tensors`): tinygemm's fp16
        # scales take fp16 activations
        y = cls.linear(x.to(cls.activation_dtype(x.dtype)).contiguous(), packed, meta,
                       group_size, _NO_TWIN, 0)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return run


_NO_TWIN = torch.empty(0)


# An operator opaque to torch.compile, like the linears' (kernels.py): which experts run, and
# on how many rows each, is decided per call from the routing.
torch.library.custom_op("vllm_subspec::routed_experts", routed_experts, mutates_args=()) \
    .register_fake(lambda x, *_: torch.empty_like(x))


class SubstituteExperts(nn.Module):
    """Stands in for a sparse MoE block's `MoERunner` inside the draft: same call
    (hidden_states, router_logits) -> the block's output before any all-reduce."""

    def __init__(self, runner: nn.Module, w13: list[list[torch.Tensor]],
                 w2: list[list[torch.Tensor]], kernel: type, group_size: int, bits: int,
                 source_name: str = ""):
        """runner: the target's `MoERunner`; w13, w2: each expert's `expert_tensors` of its
        fused gate/up and down weights, in expert order, for `kernel` (`expert_kernel`)."""
        super().__init__()
        # the target's router, and its gate where the runner applies it (Qwen3-MoE)
        self.__dict__["router"] = runner.router
        self.__dict__["gate"] = getattr(runner, "gate", None)
        self.routed_scaling_factor = float(getattr(runner, "routed_scaling_factor", 1.0))
        # the draft's copy of the block's shared expert, if any (set by substitute_layer; not
        # a submodule here: the copy's block owns it)
        self.__dict__["shared_expert"] = None
        self.kernel_name = kernel.name
        self.group_size, self.bits = group_size, bits
        self.num_experts = len(w13)
        self.source_name = source_name
        self.w13 = _stack(w13)
        self.w2 = _stack(w2)

    @classmethod
    def from_quantized(cls, runner: nn.Module, w13: list[QuantizedWeight],
                       w2: list[QuantizedWeight], dtype: torch.dtype, device: torch.device,
                       kernel: str = "auto", source_name: str = "") -> SubstituteExperts:
        """From every expert's quantized weights at once (tests; the engine packs each expert
        as it is quantized: substitute_set.build_substitutes)."""
        chosen = expert_kernel(w13[0], w2[0], device, kernel)
        return cls(runner, [expert_tensors(chosen, q, dtype) for q in w13],
                   [expert_tensors(chosen, q, dtype) for q in w2], chosen, w13[0].group_size,
                   w13[0].bits, source_name)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor
                ) -> torch.Tensor:
        if self.gate is not None:  # the block passed its hidden states as router_logits
            router_logits, _ = self.gate(hidden_states)
        topk_weights, topk_ids = self.router.select_experts(hidden_states=hidden_states,
                                                           router_logits=router_logits)
        run = torch.ops.vllm_subspec.routed_experts if torch.compiler.is_compiling() \
            else routed_experts
        out = run(hidden_states, topk_weights, topk_ids, self.w13, self.w2, self.kernel_name,
                  self.group_size, self.bits)
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [*self.w13, *self.w2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def extra_repr(self) -> str:
        return f"{self.source_name}, {self.num_experts} experts, kernel={self.kernel_name}"


def expert_kernel(w13: QuantizedWeight, w2: QuantizedWeight, device: torch.device,
                  kernel: str = "auto") -> type:
    """The kernel class a layer's routed experts run: `kernel`'s choice where it takes both the
    fused gate/up and the down weight's shapes, else tinygemm where it does, else the
    reference (dequantize + matmul)."""
    if device.type != "cpu":
        raise ValueError("vllm-subspec: routed expert substitutes run on CPU only")
    for cls in (choose_kernel(w13, device, kernel), Int4CpuKernel):
        if cls in EXPERT_KERNELS.values() and cls.supports(w13, device) and \
                cls.supports(w2, device):
            return cls
    return ReferenceKernel


def expert_tensors(cls: type, qw: QuantizedWeight, dtype: torch.dtype) -> list[torch.Tensor]:
    """One expert weight's tensors for `cls` (packed as its kernel reads them)."""
    if cls is ReferenceKernel:
        return [qw.codes, qw.scale, qw.zero]
    packed, meta = cls.pack(qw, cls.activation_dtype(dtype))
    return [packed, meta]


def _stack(per_expert: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(ts).contiguous() for ts in zip(*per_expert)]
