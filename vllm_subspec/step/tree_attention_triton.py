"""Tree attention for every tree row of a forward in one Triton kernel (the CUDA path).

FlashAttention has no per-row mask, so the rows of tree requests are recomputed after the backend
(`tree_attention.apply_tree_attention`). Here that is one launch per layer for all requests:
each program takes a tile of one request's tree rows (times the query heads of one KV head, as
vLLM's `kernel_unified_attention_2d` packs GQA) and streams that request's context straight
from the paged cache, with an online softmax in fp32: the prefix [0, L) is visible to every row,
tree slot L + j only to the rows whose ancestor mask has j. Nothing is gathered or copied to fp32
first; each K/V tile is read once per tile of rows, not once per row. The result is written in
place into the backend's output rows.

Products run on tensor cores in the cache's dtype (fp32 accumulation), as FlashAttention's do;
`upcast=True` computes them in fp32 instead, which the Triton interpreter needs for bf16 (it
does bf16 arithmetic on raw bits). Everything the kernel reads is laid out once per forward
(`TritonTreeRows`); no host value is read inside it, so it can run in a captured graph.

Refused with trees at start-up (engine_rules.py): FP8 caches and sliding windows. Not applied
(as in the torch fallback): logit soft-capping, ALiBi and attention sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# query rows per program (tree rows x the query heads sharing a KV head); context per tile
BLOCK_M = 64
BLOCK_N = 32


# Strides are int64, as in vLLM's kernel_unified_attention_2d (triton_unified_attention.py
# 0.32.0 :71-72, :202-233): a head-major layout (LHBNC) has a KV-head stride of
# blocks x page x 2d, which times a head index passes 2**31 on a large cache. The mask strides
# change with every level and batch: not specialized on, so no forward compiles a new variant.
@triton.jit(do_not_specialize=["stride_mr", "stride_mq"])
def _tree_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr, block_table_ptr, masks_ptr,
    tiles_ptr, requests_ptr, scale,
    stride_qt: tl.int64, stride_qh: tl.int64, stride_kb: tl.int64, stride_ks: tl.int64,
    stride_kh: tl.int64, stride_kd: tl.int64, stride_vb: tl.int64, stride_vs: tl.int64,
    stride_vh: tl.int64, stride_vd: tl.int64, stride_ot: tl.int64, stride_oh: tl.int64,
    stride_bt: tl.int64, stride_mr: tl.int64, stride_mq: tl.int64,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + 2 * tile)  # the tile's request, and its first tree row
    first = tl.load(tiles_ptr + 2 * tile + 1)
    table_row = tl.load(requests_ptr + 8 * req)  # its row in the batch's block table
    q_start = tl.load(requests_ptr + 8 * req + 1)  # its first query row in this forward
    q_len = tl.load(requests_ptr + 8 * req + 2)
    prefix = tl.load(requests_ptr + 8 * req + 3)  # L
    tree_len = tl.load(requests_ptr + 8 * req + 4)  # m: tree slots L .. L + m - 1

    offs_m = tl.arange(0, BLOCK_M)
    row = first + offs_m // GROUPS  # tree row of each M entry, and its query head
    head = kv_head * GROUPS + offs_m % GROUPS
    row_ok = (offs_m // GROUPS < BLOCK_Q) & (row < q_len)  # M entries past BLOCK_Q: padding
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(query_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for start in range(0, prefix + tree_len, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # logical positions of this tile
        t_ok = t < prefix + tree_len
        block = tl.load(block_table_ptr + table_row * stride_bt + t // PAGE, mask=t_ok, other=0)
        off = t % PAGE
        k = tl.load(key_cache_ptr + block[None, :].to(tl.int64) * stride_kb
                    + off[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                    mask=t_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_P, BLOCK_N]
        v = tl.load(value_cache_ptr + block[:, None].to(tl.int64) * stride_vb
                    + off[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_P]
        if UPCAST:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        j = t - prefix  # tree slot of each position (negative: the prefix)
        in_tree = (j >= 0) & t_ok
        seen = tl.load(masks_ptr + req * stride_mr + row[:, None] * stride_mq + j[None, :],
                       mask=row_ok[:, None] & in_tree[None, :], other=0)
        visible = row_ok[:, None] & ((j < 0)[None, :] | (seen != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(output_ptr + (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], out.to(output_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class TritonTreeRows:
    """What the kernel reads of a forward's tree rows, laid out once per forward (every layer
    has the same requests, rows and masks)."""

    tiles: torch.Tensor  # [tiles, 2] int32: (request, first tree row) per program
    # [R, 8] int32: block-table row, first query row, rows, L, m (padded to 8: `tiles`, packed
    # after it, stays 32-byte aligned, so Triton's alignment specialization never changes)
    requests: torch.Tensor
    masks: torch.Tensor  # [R, rows, m] int8: row r of request i sees tree slot L + j
    block_q: int


def tree_rows_layout(requests: list, device: torch.device, groups: int) -> TritonTreeRows:
    """The kernel's inputs for `requests` (`tree_attention.TreeRows`): their integers in one
    host-to-device copy (pinned and asynchronous on CUDA: no host sync), roots given as device
    tensors (a draft pass's) stacked on the device, and their masks padded into one tensor on
    the device."""
    block_q = max(1, BLOCK_M // groups)  # tree rows per program
    rows = [r.tree_mask.shape[0] for r in requests]
    on_device = [isinstance(r.prefix_len, torch.Tensor) for r in requests]
    ints = [[r.req_index, r.q_start, n, 0 if dev else r.prefix_len, r.tree_mask.shape[1], 0,
             0, 0] for r, n, dev in zip(requests, rows, on_device)]
    tiles = [v for i, n in enumerate(rows) for first in range(0, n, block_q) for v in (i, first)]
    host = torch.tensor([v for r in ints for v in r] + tiles, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    split = 8 * len(ints)
    per_request = packed[:split].view(-1, 8)
    if any(on_device):
        per_request[:, 3] = torch.stack([
            r.prefix_len.reshape(()) if dev else
            torch.full((), r.prefix_len, dtype=torch.int64, device=device)  # a fill, no copy
            for r, dev in zip(requests, on_device)]).to(torch.int32)
    masks = [r.tree_mask for r in requests]
    if len({m.shape for m in masks}) == 1:  # a draft level: every request k rows over m slots
        padded = torch.stack(masks).to(device=device, dtype=torch.int8)
    else:
        padded = torch.zeros(len(masks), max(rows), max(m.shape[1] for m in masks),
                             dtype=torch.int8, device=device)
        for out, m in zip(padded, masks):
            out[: m.shape[0], : m.shape[1]] = m
    return TritonTreeRows(packed[split:].view(-1, 2), per_request, padded, block_q)


def tree_attention_into(output: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, block_table: torch.Tensor, rows: TritonTreeRows,
                        scale: float, upcast: bool = False) -> None:
    """Overwrite the tree rows of `output` [T, heads, d] with ancestor-only attention.

    query [T, heads, d]; keys/values [blocks, page, kv_heads, d], strided views of vLLM's
    cache in any of its physical orders (`paged_kv.FlashAttentionLayout`); block_table
    [batch, max_blocks] int32."""
    heads, d = query.shape[1], query.shape[2]
    kv_heads, page = keys.shape[2], keys.shape[1]
    groups = heads // kv_heads
    for t in (query, output, block_table, rows.masks):
        assert t.stride(-1) == 1, "the kernel assumes a contiguous last dimension"
    _tree_attention_kernel[(rows.tiles.shape[0], kv_heads)](
        query, keys, values, output, block_table, rows.masks, rows.tiles, rows.requests, scale,
        query.stride(0), query.stride(1), *keys.stride(), *values.stride(), output.stride(0),
        output.stride(1), block_table.stride(0), rows.masks.stride(0), rows.masks.stride(1),
        GROUPS=groups, HEAD_DIM=d, HEAD_DIM_P=triton.next_power_of_2(d), PAGE=page,
        BLOCK_Q=rows.block_q, BLOCK_M=max(BLOCK_M, triton.next_power_of_2(groups)),
        BLOCK_N=BLOCK_N, UPCAST=upcast,
        # 4 warps spill registers at head_dim 128 on sm_90 (ptxas -v, independent audit)
        num_warps=8 if d >= 128 else 4)
