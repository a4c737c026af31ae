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
(`paged_kv.layout_for`; the CPU backend's, vec or amx, is checked against its own writer before
first use). With FlashAttention (CUDA) every request's tree rows are recomputed by one Triton
kernel that reads the paged cache in place (`tree_attention_triton`). Both are one call per
layer for all requests, laid out once per forward (`TreePlan.layouts`). A CPU cache whose dtype
differs from the query's falls back to torch in fp32, per request (`_torch_rows`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from vllm_subspec.step.paged_kv import (
    CpuAmxLayout,
    CpuVecLayout,
    FlashAttentionLayout,
    check_cpu_layout,
    cpu_layout,
    layout_for,
    logical_to_slots,
)

@dataclass
class TreeRows:
    """One request's tree rows in the current forward."""

    req_index: int  # row of the request in the attention metadata's block table
    q_start: int  # first query row of the request in this forward
    # L: logical positions [0, L) are visible to every row (in a draft pass on a device, a 0-d
    # device tensor: the root's position is not read on the host there)
    prefix_len: int | torch.Tensor
    tree_mask: torch.Tensor  # [q_len, m] bool over logical positions L .. L + m - 1


@dataclass
class TreePlan:
    """The tree rows of one forward (a plan is active for exactly one forward: `TreeMask`)."""

    rows: list[TreeRows] = field(default_factory=list)
    # what the kernels read besides K/V (`cpu_scratch`, `tree_rows_layout`), computed by the
    # forward's first attention layer and reused by the others, keyed by cache shape and table
    layouts: dict = field(default_factory=dict)


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
    """Attention output [q_len, heads, head_dim] for one request's tree rows (`block_table`:
    its row).

    Row r sees the prefix [0, L) and the tree slots its mask allows (its ancestors and itself,
    at least one position in all). On the CPU backend this is vLLM's own kernel over exactly those
    positions (`_cpu_kernel_rows`: bit-identical to the decode row plain decoding computes for that
    token); with FlashAttention's cache the Triton kernel (`tree_attention_triton`); else a
    torch fp32 recomputation (`_torch_rows`).
    """
    if uses_cpu_kernel(layout, query):
        return _cpu_kernel_rows(query, layout, cpu_scratch(layout, [block_table], [rows],
                                                           query.shape[1], query.dtype), scale)
    if isinstance(layout, FlashAttentionLayout):
        from vllm_subspec.step.tree_attention_triton import tree_rows_layout

        one = TreeRows(0, 0, rows.prefix_len, rows.tree_mask)
        out = torch.empty(rows.tree_mask.shape[0], *query.shape[1:], dtype=query.dtype,
                          device=query.device)
        _triton_rows(out, query[rows.q_start: rows.q_start + out.shape[0]], layout,
                     block_table[None], tree_rows_layout([one], query.device,
                                                         query.shape[1] // layout.kv_heads),
                     scale)
        return out
    return _torch_rows(query, layout, block_table, rows, scale)


def _triton_rows(out: torch.Tensor, query: torch.Tensor, layout: FlashAttentionLayout,
                 block_table: torch.Tensor, rows, scale: float) -> None:
    """The Triton kernel over FlashAttention's cache views, in place into `out`. On CPU
    tensors (only the Triton interpreter runs it there) products are computed in fp32: the
    interpreter does bf16 arithmetic on raw bits."""
    from vllm_subspec.step.tree_attention_triton import tree_attention_into

    tree_attention_into(out, query, layout.keys, layout.values, block_table, rows, scale,
                        upcast=query.device.type != "cuda")


def uses_cpu_kernel(layout, query: torch.Tensor) -> bool:
    return isinstance(layout, (CpuVecLayout, CpuAmxLayout)) \
        and layout.kv_cache.dtype == query.dtype


SCRATCH_BLOCK = 32  # tokens per block of the kernel's scratch cache (its tile: 32 tokens)


@dataclass
class CpuScratch:
    """Where `_cpu_kernel_rows` puts each tree row's context, computed once per forward (every
    layer of a forward has the same requests, masks and block tables; only K/V differ)."""

    num_blocks: int  # scratch blocks: the shared prefix blocks, then every row's tail blocks
    num_prefix: int  # the shared prefix blocks (zeroed: never; tails: zeroed every layer)
    whole: list[tuple[torch.Tensor, int]]  # (cache blocks copied block-wise, first scratch block)
    src: torch.Tensor  # [T] cache slots copied token-wise ...
    dst: torch.Tensor  # [T] ... to these scratch token slots
    query_rows: torch.Tensor  # [rows] the forward's query rows, the requests' in order
    block_table: torch.Tensor  # [rows, blocks] int32, per decode row of the kernel call
    seq_lens: torch.Tensor  # [rows] int32
    query_start_loc: torch.Tensor  # [rows + 1] int32
    metadata: torch.Tensor  # the kernel's scheduler metadata for these rows


def cpu_scratch(layout: CpuVecLayout | CpuAmxLayout, tables: list[torch.Tensor],
                requests: list[TreeRows], heads: int, dtype: torch.dtype) -> CpuScratch:
    """The scratch layout of `_cpu_kernel_rows` for `requests` (each with its block-table row
    in `tables`): every row becomes one decode request over a scratch paged cache with 32-token
    blocks. The whole scratch blocks of a request's prefix are filled once and shared by its
    rows; each row gets its own tail blocks holding the rest of the prefix followed by the K/V
    of the tree slots it sees, in slot order (root, ancestors, itself), i.e. exactly the
    context plain decoding has at that node, at the same positions."""
    from vllm import _custom_ops as ops

    bs, kv = SCRATCH_BLOCK, layout.kv_cache
    kv_heads, d = kv.shape[1], kv.shape[3] // 2
    masks = [r.tree_mask.to(device="cpu", dtype=torch.bool) for r in requests]
    seen = [m.sum(1) for m in masks]  # tree slots visible to each row
    cpu_tables = [t.to(device="cpu", dtype=torch.int64) for t in tables]
    split = [divmod(r.prefix_len, bs) for r in requests]  # whole scratch blocks; tokens after
    tails = [-(-(lead + int(s.max())) // bs) for (_, lead), s in zip(split, seen)]
    num_prefix = sum(full for full, _ in split)  # scratch: [shared prefix blocks][row tails]
    num_rows = sum(m.shape[0] for m in masks)
    num_tail = sum(m.shape[0] * t for m, t in zip(masks, tails))
    req_table = torch.zeros(num_rows, max(full + t for (full, _), t in zip(split, tails)),
                            dtype=torch.int32)
    whole_jobs, src, dst, query_rows = [], [], [], []
    prefix_at, tail_at, row = 0, num_prefix, 0
    for req, table, mask, s, (full, lead), tail in zip(requests, cpu_tables, masks, seen, split,
                                                       tails):
        q_len, L = mask.shape[0], req.prefix_len
        first = tail_at + torch.arange(q_len) * tail  # each row's first tail block
        req_table[row: row + q_len, :full] = prefix_at + torch.arange(full, dtype=torch.int32)
        req_table[row: row + q_len, full: full + tail] = (
            first[:, None] + torch.arange(tail)).to(torch.int32)
        # the prefix's whole scratch blocks, once: whole cache blocks as blocks, then tokens
        whole = full * bs // layout.block_size if layout.block_size % bs == 0 else 0
        if whole:
            whole_jobs.append((table[:whole], prefix_at))
        shared = torch.arange(whole * layout.block_size, full * bs)
        src.append(logical_to_slots(table, shared, layout.block_size))
        dst.append(prefix_at * bs + shared)
        # per row: the prefix's last `lead` tokens, then the tree slots it sees, in order
        r, j = mask.nonzero(as_tuple=True)  # row-major: each row's slots in ascending order
        rows = torch.cat([torch.arange(q_len).repeat_interleave(lead), r])
        logical = torch.cat([(full * bs + torch.arange(lead)).repeat(q_len), L + j])
        pos = torch.cat([torch.arange(lead).repeat(q_len),
                         lead + torch.arange(r.numel()) - (torch.cumsum(s, 0) - s)[r]])
        src.append(logical_to_slots(table, logical, layout.block_size))
        dst.append((first[rows] + pos // bs) * bs + pos % bs)
        query_rows.append(req.q_start + torch.arange(q_len))
        prefix_at, tail_at, row = prefix_at + full, tail_at + q_len * tail, row + q_len
    seq_lens = torch.cat([req.prefix_len + s for req, s in zip(requests, seen)]).to(torch.int32)
    starts = torch.arange(num_rows + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=starts, causal=True,
        sliding_window_size=-1, isa=layout.isa, enable_kv_split=False)
    return CpuScratch(num_prefix + num_tail, num_prefix, whole_jobs, torch.cat(src),
                      torch.cat(dst), torch.cat(query_rows), req_table, seq_lens, starts,
                      metadata)


def _cpu_kernel_rows(query: torch.Tensor, layout: CpuVecLayout | CpuAmxLayout,
                     scratch_plan: CpuScratch, scale: float) -> torch.Tensor:
    """The tree rows of a forward through one call of vLLM's CPU attention kernel
    (`cpu_attention_with_kv_cache`) over the scratch cache `scratch_plan` lays out
    (`cpu_scratch`); returns [rows, heads, d], the requests' rows in order.

    The kernel's arithmetic (fp32 FMA dot products, its polynomial exp, lane-wise sums,
    sequential P·V over 32-token tiles, one rounding at the end) is thus reproduced by
    construction, not imitated; each decode request is computed on its own (KV splitting off,
    as in a decode that is not split across threads, always the case with one OMP thread), so
    batching every request's rows into one call changes no bit
    (tests/unit/test_tree_attention_kernel.py). The scratch has the cache's layout and the
    kernel its ISA (vec/vec16, or amx, whose decode rows are also the same bits in any batch
    and any block size). Masked slots are simply not in a row's context. Small blocks keep the
    per-row tails (at most 31 prefix tokens and the row's path) small: the scratch is written,
    zeroed and read for every layer of every tree pass.
    """
    from vllm import _custom_ops as ops

    plan, kv = scratch_plan, layout.kv_cache
    kv_heads, d, heads = kv.shape[1], kv.shape[3] // 2, query.shape[1]
    scratch = kv.new_empty(plan.num_blocks, kv_heads, SCRATCH_BLOCK, kv.shape[3])
    out_layout = cpu_layout(scratch, layout.isa)
    # the kernel reads V up to its 32-token alignment (times a zero probability: NaN would stay)
    scratch[plan.num_prefix:].zero_()
    for blocks, first in plan.whole:
        layout.split_blocks(blocks, out_layout, first)
    out_layout.put(plan.dst, *layout.gather(plan.src))
    key_cache, value_cache = scratch.view(scratch.shape[0], kv_heads, 2 * SCRATCH_BLOCK,
                                          d).chunk(2, dim=2)
    out = torch.empty(plan.query_rows.numel(), heads, d, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(
        query=query[plan.query_rows], key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=plan.block_table, softcap=0.0,
        scheduler_metadata=plan.metadata, s_aux=None)
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
    logical = torch.arange(int(rows.prefix_len) + m, device=dev)
    k, v = layout.gather(logical_to_slots(block_table, logical, layout.block_size))
    k = k.float().transpose(0, 1)  # [kv_heads, L + m, d]
    v = v.float().transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [kv_heads, groups * q_len, L + m]
    hidden = (~rows.tree_mask.to(dev)).repeat(groups, 1)  # [groups * q_len, m]
    scores[:, :, int(rows.prefix_len):].masked_fill_(hidden.unsqueeze(0), float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [kv_heads, groups * q_len, d]
    out = out.view(kv_heads, groups, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)
    return out.to(query.dtype)


def apply_tree_attention(impl, layer, query, kv_cache, attn_metadata, output) -> None:
    """Overwrite the tree rows of `output` (the backend's causal result) with masked attention."""
    mask = impl.__dict__.get(_MASK_ATTR)
    plan = None if mask is None else mask.plan
    if plan is None or attn_metadata is None:
        return
    isa = getattr(layer, "isa", None)  # the CPU backend's, stamped on the layer
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        check_cpu_layout(isa or "?", kv_cache.shape[-1] // 2, kv_cache.shape[2], kv_cache.dtype)
    layout = layout_for(impl, kv_cache, isa)
    block_table = attn_metadata.block_table if hasattr(attn_metadata, "block_table") \
        else attn_metadata.block_table_tensor
    heads = query.shape[1]
    out = output.view(output.shape[0], heads, -1)
    if uses_cpu_kernel(layout, query):  # every request's rows in one kernel call
        # laid out once per forward: the first layer's call computes it, the others reuse it
        key = (layout.isa, layout.block_size, tuple(kv_cache.shape[1:]), heads, query.dtype,
               block_table.data_ptr())
        scratch = plan.layouts.get(key)
        if scratch is None:
            scratch = plan.layouts[key] = cpu_scratch(
                layout, [block_table[r.req_index] for r in plan.rows], plan.rows, heads,
                query.dtype)
        out[scratch.query_rows] = _cpu_kernel_rows(query, layout, scratch, impl.scale)
        return
    if isinstance(layout, FlashAttentionLayout):  # every request's rows in one Triton launch
        from vllm_subspec.step.tree_attention_triton import tree_rows_layout

        key = ("triton", heads, layout.kv_heads, block_table.data_ptr())
        rows = plan.layouts.get(key)
        if rows is None:
            rows = plan.layouts[key] = tree_rows_layout(plan.rows, query.device,
                                                        heads // layout.kv_heads)
        _triton_rows(out, query, layout, block_table, rows, impl.scale)
        return
    for rows in plan.rows:
        res = _torch_rows(query, layout, block_table[rows.req_index], rows, impl.scale)
        out[rows.q_start: rows.q_start + res.shape[0]] = res
