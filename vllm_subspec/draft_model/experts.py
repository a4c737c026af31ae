"""A mixture-of-experts block in the draft: `SubstituteExperts` stands in for vLLM's MoE runner
(the block's `experts`, a `MoERunner`) in a substituted layer. The target's router picks the
experts (its gate and `select_experts`: the same top-k and weights); each routed expert runs
4-bit copies of its own fused gate/up and down weights; a shared expert (Qwen2-MoE) runs its
substitute linears.

Design: docs/moe.md.
"""

from __future__ import annotations

from typing import Any

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


class TritonExpertKernel:
    """CUDA: every routed expert of a pass in two Triton launches (experts_triton.py), from each
    expert's packed 4-bit codes and HQQ's scale and fractional zero in their own dtype."""

    name = "triton_moe"

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        n, k = qw.shape
        return (
            device.type == "cuda"
            and qw.bits == 4
            and k % qw.group_size == 0
            and qw.group_size in (16, 32, 64, 128, 256)
        )

    @staticmethod
    def pack(qw: QuantizedWeight) -> list[torch.Tensor]:
        from vllm_subspec.draft_model import experts_triton  # imports triton: CUDA only

        return [experts_triton.pack(qw.codes), qw.scale.contiguous(), qw.zero.contiguous()]


# The kernels routed experts run, by name: their per-expert tensors are stacked per layer, so
# one operator call runs every expert a pass routes to.
EXPERT_KERNELS = {
    k.name: k for k in (Int4DotCpuKernel, Int4CpuKernel, ReferenceKernel, TritonExpertKernel)
}


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
    then up rows) and w2 [E, H, I], I and H as allocated (a backend may pad them: see
    `checkpoint_part`)."""
    experts = runner.routed_experts
    return experts.w13_weight, experts.w2_weight


def checkpoint_part(runner: nn.Module, e: int, which: str) -> torch.Tensor:
    """Expert e's `which` ("w13" / "w2") weight as the checkpoint holds it: w13 [2u, h], w2
    [h, u]. Some backends (FlashInfer's on Blackwell) allocate the intermediate size padded to
    p > u (and may pad the hidden size), load gate rows at [0, u) and up rows at [p, p + u),
    and zero the padding only when vLLM processes the weights, after the substitutes are
    built (`oracle.unquantized._zero_intermediate_padding`): the padding is left out here.
    A copy where the gate and up parts are apart; else a view."""
    w13, w2 = expert_weights(runner)
    config = getattr(runner, "moe_config", None)
    p = w13.shape[1] // 2
    u = getattr(config, "intermediate_size_per_partition_unpadded", None) or p
    h = getattr(config, "hidden_dim_unpadded", None) or w13.shape[2]
    if which == "w2":
        return w2[e, :h, :u]
    if u == p:
        return w13[e, :, :h]
    return torch.cat([w13[e, :u, :h], w13[e, p : p + u, :h]])


class ExpertWeight:
    """One expert's weight as a substitute job reads it (`.weight`, no bias), taken from the
    runner when read (`checkpoint_part`: a copy where the weight is padded)."""

    bias = None

    def __init__(self, runner: nn.Module, e: int, which: str):
        self.runner, self.e, self.which = runner, e, which

    @property
    def weight(self) -> torch.Tensor:
        return checkpoint_part(self.runner, self.e, self.which)


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    kernel: str,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x) with each expert's
    down(silu(gate(x)) * up(x)) run by `kernel` from its stacked tensors (`w13[t][e]`: tensor t
    of expert e). Only the experts some row routes to run, each on its rows."""
    if kernel == TritonExpertKernel.name:
        from vllm_subspec.draft_model import experts_triton

        return experts_triton.routed_experts(x, topk_weights, topk_ids, w13, w2, group_size)
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

        def run_dequantized(x, tensors):
            codes, scale, zero = tensors
            qw = QuantizedWeight(
                codes=codes, scale=scale, zero=zero, bits=bits, group_size=group_size
            )
            return F.linear(x, qw.dequantize(x.dtype))

        return run_dequantized
    cls = EXPERT_KERNELS[kernel]

    def run(x, tensors):
        packed, meta = tensors
        # the activation dtype the tensors were packed for (`_tensors`): tinygemm's fp16
        # scales take fp16 activations
        y = cls.linear(
            x.to(cls.activation_dtype(x.dtype)).contiguous(), packed, meta, group_size, _NO_TWIN, 0
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)

    return run


_NO_TWIN = torch.empty(0)


# An operator opaque to torch.compile, like the linears' (kernels.py): which experts run, and
# on how many rows each, is decided per call from the routing.
torch.library.custom_op(
    "vllm_subspec::routed_experts", routed_experts, mutates_args=()
).register_fake(lambda x, *_: torch.empty_like(x))


class SubstituteExperts(nn.Module):
    """Stands in for a sparse MoE block's `MoERunner` inside the draft: same call
    (hidden_states, router_logits) -> the block's output before any all-reduce."""

    def __init__(
        self,
        runner: nn.Module,
        w13: list[list[torch.Tensor]],
        w2: list[list[torch.Tensor]],
        kernel: Any,
        group_size: int,
        bits: int,
        source_name: str = "",
    ):
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
        # tensor parallelism: each rank holds a shard of every expert's intermediate dim (and
        # of the shared expert's), so its output is a partial sum, all-reduced once as the
        # runner's `MoERunner._maybe_reduce_final_output` does
        self.all_reduce = _reduces_final_output(runner)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:  # the block passed its hidden states as router_logits
            router_logits, _ = self.gate(hidden_states)
        topk_weights, topk_ids = self.router.select_experts(
            hidden_states=hidden_states, router_logits=router_logits
        )
        run = (
            torch.ops.vllm_subspec.routed_experts
            if torch.compiler.is_compiling()
            else routed_experts
        )
        out = run(
            hidden_states,
            topk_weights,
            topk_ids,
            self.w13,
            self.w2,
            self.kernel_name,
            self.group_size,
            self.bits,
        )
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        if self.all_reduce:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out = tensor_model_parallel_all_reduce(out)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [*self.w13, *self.w2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def extra_repr(self) -> str:
        return f"{self.source_name}, {self.num_experts} experts, kernel={self.kernel_name}"


def _reduces_final_output(runner: nn.Module) -> bool:
    """Whether the draft's block output must be all-reduced: tensor parallelism without
    sequence parallelism or a skipped final reduce (`MoERunner._maybe_reduce_final_output`).
    vLLM's other case, a kernel that reduced the routed part itself (then the shared part is
    reduced apart), gives the same sum: the substitutes' routed part is always partial.
    Expert parallelism (its `ep_size`) is refused: engine_rules._refuse_moe_extras."""
    config = getattr(runner, "moe_config", None)
    return (
        config is not None
        and getattr(config, "tp_size", 1) > 1
        and not getattr(config, "is_sequence_parallel", False)
        and not getattr(config, "skip_final_all_reduce", False)
    )


def expert_kernel(
    w13: QuantizedWeight, w2: QuantizedWeight, device: torch.device, kernel: str = "auto"
) -> type:
    """The kernel class a layer's routed experts run. CUDA: the Triton kernels (whatever
    `kernel` chose for the linears: the others read the routing on the host, which a CUDA graph
    cannot). CPU: `kernel`'s choice where it takes both the fused gate/up and the down weight's
    shapes, else tinygemm where it does, else the reference (dequantize + matmul)."""
    if device.type == "cuda":
        if not (
            TritonExpertKernel.supports(w13, device) and TritonExpertKernel.supports(w2, device)
        ):
            raise ValueError(
                f"vllm-subspec: routed experts on CUDA run 4-bit weights in groups "
                f"dividing their inputs, not {w13.bits}-bit {w13.shape} / "
                f"{w2.shape} in groups of {w13.group_size}"
            )
        return TritonExpertKernel
    if device.type != "cpu":
        raise ValueError(
            f"vllm-subspec: routed expert substitutes run on CPU or CUDA, not {device.type}"
        )
    for cls in (choose_kernel(w13, device, kernel), Int4CpuKernel):
        if (
            cls in EXPERT_KERNELS.values()
            and cls.supports(w13, device)
            and cls.supports(w2, device)
        ):
            return cls
    return ReferenceKernel


def expert_tensors(cls: Any, qw: QuantizedWeight, dtype: torch.dtype) -> list[torch.Tensor]:
    """One expert weight's tensors for `cls` (packed as its kernel reads them)."""
    if cls is ReferenceKernel:
        return [qw.codes, qw.scale, qw.zero]
    if cls is TritonExpertKernel:
        return TritonExpertKernel.pack(qw)
    packed, meta = cls.pack(qw, cls.activation_dtype(dtype))
    return [packed, meta]


def _stack(per_expert: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(ts).contiguous() for ts in zip(*per_expert)]
