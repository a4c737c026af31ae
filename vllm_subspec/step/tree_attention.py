"""Ancestor-only attention for tree tokens, on top of vLLM's paged KV cache.

vLLM 0.32 has no tree attention (removed in PR #42121), so SubSpec adds it around the backend's
own `forward` (wrapped in vllm_hooks/patches.py): the backend writes the KV of the step and
computes ordinary causal attention for every row; then, for the rows of tree requests listed in
the active `TreePlan`, the output is recomputed with the right mask: the whole prefix [0, L)
plus the node's ancestors and itself. Rows of other requests (prefills, plain decodes) are left
exactly as the backend computed them.

On the CPU backend the tree rows are recomputed by vLLM's own attention kernel, run as one decode
row per tree node over a scratch paged cache that holds exactly that node's context in order
(the prefix, then its ancestors, then itself), so every row gets the bits plain decoding would
give that token (`_cpu_kernel_rows`). The cache layout is backend specific
(`paged_kv.layout_for`; the CPU backend's is checked against its own writer before first use,
AMX layouts are refused). Other backends (FlashAttention) gather K/V with torch and compute the
masked attention in fp32 (`_torch_rows`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from vllm_subspec.step.paged_kv import (
    CpuVecLayout,
    check_cpu_layout,
    layout_for,
    logical_to_slots,
)

@dataclass
class TreeRows:
    """One request's tree rows in the current forward."""

    req_index: int  # row of the request in the attention metadata's block table
    q_start: int  # first query row of the request in this forward
    prefix_len: int  # L: logical positions [0, L) are visible to every row
    tree_mask: torch.Tensor  # [q_len, m] bool over logical positions L .. L + m - 1


@dataclass
class TreePlan:
    rows: list[TreeRows] = field(default_factory=list)


class TreeMask:
    """The tree rows of the forward in progress, shared by SubSpec's drafter and verifier and the
    target's attention layers (`attach`, at load). A plan is active only inside
    `with mask.active(plan):`, i.e. for one forward; outside it the backends run untouched."""

    def __init__(self):
        self.plan: TreePlan | None = None

    @contextlib.contextmanager
    def active(self, plan: TreePlan | None):
        previous, self.plan = self.plan, (plan if plan is not None and plan.rows else None)
        try:
            yield
        finally:
            self.plan = previous

    def attach(self, impl) -> None:
        """Let an attention backend impl (one per decoder layer) find this mask."""
        impl.__dict__[_MASK_ATTR] = self


_MASK_ATTR = "_subspec_tree_mask"


def tree_attention_rows(query: torch.Tensor, layout, block_table: torch.Tensor, rows: TreeRows,
                        scale: float) -> torch.Tensor:
    """Attention output [q_len, heads, head_dim] for one request's tree rows.

    Row r sees the prefix [0, L) and the tree slots its mask allows (its ancestors and itself,
    at least one position in all). On the CPU backend this is vLLM's own kernel over exactly those
    positions (`_cpu_kernel_rows`: bit-identical to the decode row plain decoding computes for that
    token); elsewhere a torch fp32 recomputation (`_torch_rows`).
    """
    if isinstance(layout, CpuVecLayout) and layout.kv_cache.dtype == query.dtype:
        return _cpu_kernel_rows(query, layout, block_table, rows, scale)
    return _torch_rows(query, layout, block_table, rows, scale)


def _cpu_kernel_rows(query: torch.Tensor, layout: CpuVecLayout, block_table: torch.Tensor,
                     rows: TreeRows, scale: float) -> torch.Tensor:
    """Tree rows through vLLM's CPU attention kernel (`cpu_attention_with_kv_cache`).

    Each row becomes one decode request over a scratch paged cache: the whole blocks of the prefix
    are copied once and shared by all rows; each row gets its own tail blocks holding the rest of
    the prefix followed by the K/V of the tree slots it sees, in slot order (root, ancestors,
    itself), i.e. exactly the context plain decoding has at that node, at the same positions.
    The kernel's arithmetic (fp32 FMA dot products, its polynomial exp, lane-wise sums, sequential
    P·V, one rounding at the end) is thus reproduced by construction, not imitated. KV splitting is
    off, as in a decode that is not split across threads (always the case with one OMP thread).
    Masked slots are simply not in a row's context.
    """
    from vllm import _custom_ops as ops

    mask = rows.tree_mask.to(device="cpu", dtype=torch.bool)
    q_len = mask.shape[0]
    L, bs = rows.prefix_len, layout.block_size
    kv = layout.kv_cache
    kv_heads, d = kv.shape[1], kv.shape[3] // 2
    heads = query.shape[1]
    seen = mask.sum(1)  # tree slots visible to each row
    full, lead = divmod(L, bs)  # whole prefix blocks; prefix tokens in the block after them
    tail = -(-(lead + int(seen.max())) // bs)  # blocks per row after the shared ones
    table = block_table.to(device="cpu", dtype=torch.int64)

    scratch = kv.new_empty(full + q_len * tail, *kv.shape[1:])
    if full:
        torch.index_select(kv, 0, table[:full], out=scratch[:full])
    tails = scratch[full:].view(q_len, tail, *kv.shape[1:])
    tails.zero_()  # the kernel reads V up to its 32-token alignment (times a zero probability)
    if lead:
        tails[:, 0] = kv[table[full]]
    r, j = mask.nonzero(as_tuple=True)  # row-major: each row's slots in ascending order
    k, v = layout.gather(logical_to_slots(table, L + j, bs))
    start = torch.cumsum(seen, 0) - seen
    pos = lead + torch.arange(r.numel()) - start[r]  # position inside the row's tail blocks
    CpuVecLayout(scratch).put((full + r * tail + pos // bs) * bs + pos % bs, k, v)

    req_table = torch.empty(q_len, full + tail, dtype=torch.int32)
    req_table[:, :full] = torch.arange(full, dtype=torch.int32)
    req_table[:, full:] = full + torch.arange(q_len, dtype=torch.int32)[:, None] * tail \
        + torch.arange(tail, dtype=torch.int32)
    seq_lens = (L + seen).to(torch.int32)
    starts = torch.arange(q_len + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=q_len, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
        isa=layout.isa, enable_kv_split=False)
    key_cache, value_cache = scratch.view(scratch.shape[0], kv_heads, 2 * bs, d).chunk(2, dim=2)
    q = query[rows.q_start: rows.q_start + q_len]
    out = torch.empty(q_len, heads, d, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=starts, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=req_table, softcap=0.0, scheduler_metadata=metadata,
        s_aux=None)
    return out


def _torch_rows(query: torch.Tensor, layout, block_table: torch.Tensor, rows: TreeRows,
                scale: float) -> torch.Tensor:
    """The tree rows recomputed with torch in fp32 (FlashAttention, or a CPU cache whose dtype
    differs from the query's). Scores against the prefix and against the tree slots are two
    batched matmuls over all rows; masked tree slots get -inf, so they add exact zeros. Against
    vLLM's CPU kernel, ~0.05 % of bf16 outputs differ, mostly by 1 ulp (docs/tree_attention.md)."""
    q_len, m = rows.tree_mask.shape
    dev = query.device
    q = query[rows.q_start: rows.q_start + q_len].float()  # [q_len, heads, d]
    heads, d = q.shape[1], q.shape[2]
    kv_heads = layout.kv_heads
    groups = heads // kv_heads  # query head h reads KV head h // groups
    # grouped, not repeated: each KV head's keys serve its `groups` query heads in one matmul
    q = q.view(q_len, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(kv_heads, -1, d)
    logical = torch.arange(rows.prefix_len + m, device=dev)
    k, v = layout.gather(logical_to_slots(block_table, logical, layout.block_size))
    k = k.float().transpose(0, 1)  # [kv_heads, L + m, d]
    v = v.float().transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [kv_heads, groups * q_len, L + m]
    hidden = (~rows.tree_mask.to(dev)).repeat(groups, 1)  # [groups * q_len, m]
    scores[:, :, rows.prefix_len:].masked_fill_(hidden.unsqueeze(0), float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [kv_heads, groups * q_len, d]
    out = out.view(kv_heads, groups, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)
    return out.to(query.dtype)


def apply_tree_attention(impl, layer, query, kv_cache, attn_metadata, output) -> None:
    """Overwrite the tree rows of `output` (the backend's causal result) with masked attention."""
    mask = impl.__dict__.get(_MASK_ATTR)
    plan = None if mask is None else mask.plan
    if plan is None or attn_metadata is None:
        return
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        check_cpu_layout(getattr(layer, "isa", "?"), kv_cache.shape[-1] // 2, kv_cache.shape[2],
                         kv_cache.dtype)
    layout = layout_for(impl, kv_cache)
    if isinstance(layout, CpuVecLayout):
        layout.isa = getattr(layer, "isa", layout.isa)
    block_table = attn_metadata.block_table if hasattr(attn_metadata, "block_table") \
        else attn_metadata.block_table_tensor
    heads = query.shape[1]
    out = output.view(output.shape[0], heads, -1)
    for rows in plan.rows:
        res = tree_attention_rows(query, layout, block_table[rows.req_index], rows, impl.scale)
        out[rows.q_start: rows.q_start + res.shape[0]] = res
