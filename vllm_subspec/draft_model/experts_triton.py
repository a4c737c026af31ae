"""Routed experts on CUDA: a draft pass's routed MoE computation with every expert's 4-bit HQQ
weights, in two Triton launches plus a fixed number of torch operations, with no host read (so
it is captured in the draft's CUDA graphs like the rest of the pass).

The (row, expert) pairs of the routing are sorted by expert and padded per expert to whole
blocks of BLOCK_M (`align_by_expert`, as vLLM's `moe_align_block_size` does for its fused MoE
kernel); each program multiplies one block of pairs, all routed to one expert, by a BLOCK_N slice
of that expert's dequantized weight with `tl.dot`. The first launch runs the fused gate/up
weight and applies silu(gate) * up; the second runs the down weight and scales each pair by its
routing weight; a sum over the top-k slots gives the block's output.

Weights: codes packed two per byte along the input (`pack`), HQQ's scale and fractional zero
per group of `group_size` inputs, W[n, k] = (codes - zero) * scale. Design: docs/moe.md, "CUDA".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs per program (tl.dot's least M): a draft pass routes few rows per expert
BLOCK_N = 64  # output features per program
MAX_BLOCK_K = 64  # inputs per step; at most a group, so each step reads one scale/zero column


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 16) -> [N, K/2], input 2j in the low nibble, 2j+1 in the high."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def packs(n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether the kernels take an [n, k] weight: 4 bits, groups of 16-256 (a power of two)
    that divide k."""
    return bits == 4 and group_size in (16, 32, 64, 128, 256) and k % group_size == 0


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of `topk_ids` [M, top_k] grouped by expert, each expert's padded to a multiple
    of block_m: (pair_ids [capacity]: flat pair indices, M * top_k where padding;
    block_expert [capacity / block_m]: each block's expert, -1 past the last). capacity is the
    bound M*top_k + min(M*top_k, E) * (block_m - 1), rounded up to whole blocks: it depends
    on shapes only, and nothing here reads the routing on the host."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount reads its max on the host)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair indices, by expert
    expert = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert]
    slots = (ends - padded)[expert] + rank
    bound = pairs + min(pairs, num_experts) * (block_m - 1)
    capacity = -(-bound // block_m) * block_m
    pair_ids = torch.full((capacity,), pairs, dtype=torch.int64, device=device)
    pair_ids.scatter_(0, slots, order)
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(starts < ends[-1], block_expert, -1)
    return pair_ids, block_expert


@triton.jit
def _dequantized(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    rows,
    rows_ok,
    k0,
    stride_cn,
    stride_sn,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    dtype: tl.constexpr,
):
    """[len(rows), BLOCK_K] of (codes - zero) * scale for inputs k0 .. k0 + BLOCK_K."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(
        codes_ptr + rows[:, None].to(tl.int64) * stride_cn + half[None, :],
        mask=rows_ok[:, None],
        other=0,
    )
    q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)
    g = k0 // GROUP
    scale = tl.load(scale_ptr + rows.to(tl.int64) * stride_sn + g, mask=rows_ok, other=0.0)
    zero = tl.load(zero_ptr + rows.to(tl.int64) * stride_sn + g, mask=rows_ok, other=0.0)
    return ((q - zero.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]).to(dtype)


# num_pairs varies with the rows of a pass: not specialized (Triton compiles apart for values
# divisible by 16), so an eager pass of a new row count compiles nothing mid-serving
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemm(
    a_ptr,
    out_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_om,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[p, n] for the BLOCK_M pairs p of this block (one expert) and BLOCK_N features n.
    GATE_UP: A row = the pair's token (p // TOP_K), the weight holds 2N rows (gate, then up),
    out = silu(A @ gate.T) * (A @ up.T); else A row = p and out = weight_p * (A @ W.T)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:  # past the last expert's blocks
        return
    pair = tl.load(pair_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    a_row = pair // TOP_K if GATE_UP else pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    codes_ptr += expert.to(tl.int64) * stride_ce
    scale_ptr += expert.to(tl.int64) * stride_se
    zero_ptr += expert.to(tl.int64) * stride_se
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_row[:, None].to(tl.int64) * stride_am + k[None, :],
            mask=pair_ok[:, None],
            other=0.0,
        )
        w = _dequantized(
            codes_ptr, scale_ptr, zero_ptr, n, n_ok, k0, stride_cn, stride_sn, GROUP, BLOCK_K, dtype
        )
        acc += tl.dot(a, tl.trans(w))
        if GATE_UP:
            w = _dequantized(
                codes_ptr,
                scale_ptr,
                zero_ptr,
                n + N,
                n_ok,
                k0,
                stride_cn,
                stride_sn,
                GROUP,
                BLOCK_K,
                dtype,
            )
            acc_up += tl.dot(a, tl.trans(w))
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        acc *= tl.load(weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_om + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=pair_ok[:, None] & n_ok[None, :],
    )


def _launch(a, out, weight, pair_ids, block_expert, topk_weights, top_k, gate_up, group_size):
    codes, scale, zero = weight
    n = out.shape[1]
    k = a.shape[1]
    grid = (block_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _expert_gemm[grid](
        a,
        out,
        codes,
        scale,
        zero,
        pair_ids,
        block_expert,
        topk_weights,
        out.shape[0],
        n,
        k,
        a.stride(0),
        out.stride(0),
        codes.stride(0),
        codes.stride(1),
        scale.stride(0),
        scale.stride(1),
        TOP_K=top_k,
        GATE_UP=gate_up,
        GROUP=group_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=min(MAX_BLOCK_K, group_size),
        num_warps=4,
    )


def routed_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x), expert e computing
    down(silu(gate(x)) * up(x)); w13, w2: the layer's stacked (packed codes [E, N, K/2],
    scale [E, N, G], zero [E, N, G]). In x's dtype (fp16/bf16 activations; fp32 runs in bf16)."""
    compute = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    a = x.to(compute).contiguous()
    m, top_k = topk_ids.shape
    pair_ids, block_expert = align_by_expert(topk_ids, w13[0].shape[0])
    inter = w13[0].shape[1] // 2
    hidden = w2[0].shape[1]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(m * top_k, inter, dtype=compute, device=x.device)
    _launch(a, act, w13, pair_ids, block_expert, weights, top_k, True, group_size)
    out = torch.empty(m * top_k, hidden, dtype=torch.float32, device=x.device)
    _launch(act, out, w2, pair_ids, block_expert, weights, top_k, False, group_size)
    return out.view(m, top_k, hidden).sum(1).to(x.dtype)
