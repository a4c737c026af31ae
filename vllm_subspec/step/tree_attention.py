"""Ancestor-only attention for tree tokens, on top of vLLM's paged KV cache.

The attention backends' `forward` is wrapped (vllm_hooks/patches.py): the backend computes
causal attention for every row (over the KV its layer wrote before), then
`apply_tree_attention` recomputes the rows of the active `TreePlan` (`tree_plan`) over the
prefix [0, L), the node's ancestors and itself, in one call per layer for every tree request:
vLLM's own CPU kernel over a scratch cache (`_cpu_kernel_rows`), or on CUDA one Triton kernel
(`tree_attention_triton`); a CPU cache of another dtype than the query's falls back to torch,
per request (`_torch_rows`). Rows of other requests stay as the backend computed them; when
every row is a tree row (`TreePlan.num_rows`), the backend's pass is not run. Design:
docs/tree_attention.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
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
    """The tree rows of one forward (active for exactly that forward: `tree_plan`)."""

    rows: list[TreeRows] = field(default_factory=list)
    # what the kernels read besides K/V (`cpu_scratch`, `tree_rows_layout`), laid out by the
    # forward's first attention layer and reused by the others: key -> (block table, layout)
    layouts: dict = field(default_factory=dict)

    @functools.cached_property
    def num_rows(self) -> int:
        """Query rows of all its requests (host ints: the masks' shapes)."""
        return sum(r.tree_mask.shape[0] for r in self.rows)

    def layout(self, key, block_table: torch.Tensor, make):
        """The layout under `key` for this block table (every layer of one forward reads the
        same table; another table gets its own)."""
        held = self.layouts.get(key)
        if held is None or held[0] is not block_table:
            held = self.layouts[key] = (block_table, make())
        return held[1]


# The plan of the forward in progress in this thread: set only by `tree_plan`, read by
# `apply_tree_attention` (the attention backends' wrapped forward).
_ACTIVE_PLAN: contextvars.ContextVar[TreePlan | None] = contextvars.ContextVar(
    "subspec_tree_plan", default=None
)


@contextlib.contextmanager
def tree_plan(plan: TreePlan | None):
    """`plan`'s rows get ancestor-only attention in the forward run inside the block; outside
    it (and with no rows) the backends run untouched."""
    token = _ACTIVE_PLAN.set(plan if plan is not None and plan.rows else None)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)


def active_tree_plan() -> TreePlan | None:
    return _ACTIVE_PLAN.get()


def _triton_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    layout: FlashAttentionLayout,
    block_table: torch.Tensor,
    rows,
    scale: float,
) -> None:
    """The Triton kernel over FlashAttention's cache views, in place into `out`. On CPU
    tensors (only the Triton interpreter runs it there) products are computed in fp32: the
    interpreter does bf16 arithmetic on raw bits."""
    from vllm_subspec.step.tree_attention_triton import tree_attention_into

    tree_attention_into(
        out,
        query,
        layout.keys,
        layout.values,
        block_table,
        rows,
        scale,
        upcast=query.device.type != "cuda",
    )


def uses_cpu_kernel(layout, query: torch.Tensor) -> bool:
    return isinstance(layout, (CpuVecLayout, CpuAmxLayout)) and layout.kv_cache.dtype == query.dtype


SCRATCH_BLOCK = 32  # tokens per block of the kernel's scratch cache (its tile: 32 tokens)
SPLIT_BYTES = 512 << 10  # cache blocks split into the scratch per copy, at most (one at least)


@dataclass
class CpuScratch:
    """Where `_cpu_kernel_rows` puts each tree row's context, computed once per forward (every
    layer of a forward has the same requests, masks and block tables; only K/V differ)."""

    num_blocks: int  # scratch blocks: each request's prefix blocks, then each row's tail
    num_prefix: int  # the prefix blocks (zeroed: never; tails: zeroed every layer)
    whole: torch.Tensor  # [W] cache blocks split block-wise into scratch blocks 0, 1, ...
    src: torch.Tensor  # [T] cache slots copied token-wise ...
    dst: torch.Tensor  # [T] ... to these scratch token slots
    query_rows: torch.Tensor  # [rows] the forward's query rows, the requests' in order
    block_table: torch.Tensor  # [rows, blocks] int32, per decode row of the kernel call
    seq_lens: torch.Tensor  # [rows] int32
    query_start_loc: torch.Tensor  # [rows + 1] int32
    metadata: torch.Tensor  # the kernel's scheduler metadata for these rows


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """[n] -> [n]: the sum of the counts before each."""
    return torch.cumsum(counts, 0) - counts


def cpu_scratch(
    layout: CpuVecLayout | CpuAmxLayout,
    tables: torch.Tensor,
    requests: list[TreeRows],
    heads: int,
    dtype: torch.dtype,
) -> CpuScratch:
    """The scratch layout of `_cpu_kernel_rows` for `requests` (`tables` [R, blocks]: each
    one's block-table row): every row becomes one decode request over a scratch paged cache
    with 32-token blocks, holding exactly the context plain decoding has at that node, at the
    same positions: the prefix [0, L), then the tree slots the row sees, in slot order (root,
    ancestors, itself). A request's whole 32-token prefix blocks are filled once and shared by
    its rows (`whole`: split block-wise from whole cache blocks; the others token-wise); each
    row has its own tail blocks (the rest of the prefix, under 32 tokens, then its tree slots).
    Laid out for all requests at once, in as many torch operations for one as for 100
    (docs/tree_attention.md)."""
    from vllm import _custom_ops as ops

    bs, cache_bs, kv = SCRATCH_BLOCK, layout.block_size, layout.kv_cache
    kv_heads, d = kv.shape[1], kv.shape[3] // 2
    masks = [r.tree_mask for r in requests]
    shapes = [tuple(m.shape) for m in masks]
    num_rows = sum(q for q, _ in shapes)
    # every mask row-major, one after another (`_chunk_cat` with one chunk: any shapes in one
    # operation; a draft level's all have one shape: stacked)
    flat = (
        (torch.stack(masks) if len(set(shapes)) == 1 else torch._chunk_cat(masks, 0, 1))
        .to(device="cpu", dtype=torch.bool)
        .view(-1)
    )  # [sum of q_len * m]
    table = tables.to(device="cpu", dtype=torch.int64)  # [R, cache blocks]
    q_start, q_len, m, prefix = torch.tensor(
        [
            [r.q_start for r in requests],
            [q for q, _ in shapes],
            [n for _, n in shapes],
            [int(r.prefix_len) for r in requests],
        ]
    )  # [R] each
    full, lead = prefix // bs, prefix % bs  # whole scratch blocks of the prefix; tokens after
    # of those, the ones in whole cache blocks are split block-wise, the others token-wise
    per = cache_bs // bs if cache_bs % bs == 0 else 0  # scratch blocks per cache block
    split = full - full % per if per else full * 0
    other = full - split
    # scratch: [split blocks][other prefix blocks][each row's tail blocks], each part in order
    num_split = split.sum()  # 0-d
    split_at = _exclusive_cumsum(split)  # [R] each request's first split block
    other_at = num_split + _exclusive_cumsum(other)  # [R] ... and first other block
    row_req = torch.repeat_interleave(q_len, output_size=num_rows)  # [N] each row's request
    row_full, row_lead, row_m, row_split, row_split_at, row_other_at, row_query_shift = (
        torch.stack(
            [full, lead, m, split, split_at, other_at, q_start - _exclusive_cumsum(q_len)], 1
        )
        .index_select(0, row_req)
        .T
    )  # [N]
    # a row's tail: the positions [full * bs, L + m) it sees, in order (the prefix's last
    # `lead`, then its tree slots), i.e. the nonzeros of its mask led by `lead` ones; those
    # extended masks of every row, one after another:
    span = row_lead + row_m  # [N]
    span_end = torch.cumsum(span, 0)
    spans = torch.ones(flat.numel() + int(row_lead.sum()), dtype=torch.bool)
    mask_row = torch.repeat_interleave(row_m, output_size=flat.numel())  # [sum of q_len * m]
    spans[torch.arange(flat.numel()) + torch.cumsum(row_lead, 0).index_select(0, mask_row)] = flat
    tok = spans.nonzero().view(-1)  # [T] every row's tail tokens, in order
    tok_row = torch.searchsorted(span_end, tok, right=True)  # [T]
    tail_len = torch.bincount(tok_row, minlength=num_rows)  # [N]
    row_tail = (tail_len + bs - 1) // bs  # [N] its tail blocks
    prefix_blocks = full.sum()  # 0-d
    first = prefix_blocks + _exclusive_cumsum(row_tail)  # [N] each row's first tail block
    num_prefix, num_tail, width = torch.stack(
        [prefix_blocks, row_tail.sum(), (row_full + row_tail).max()]
    ).tolist()
    col = torch.arange(width)[:, None]  # [width, 1] block-table columns
    req_table = torch.where(
        col < row_full + row_tail,
        torch.where(
            col < row_split,
            row_split_at,
            torch.where(col < row_full, row_other_at - row_split, first - row_full),
        )
        + col,
        0,
    ).T.to(torch.int32, memory_format=torch.contiguous_format)  # [N, width]
    logical = tok + (row_full * bs - span_end + span).index_select(0, tok_row)
    dst = torch.arange(tok.numel()) + (first * bs - _exclusive_cumsum(tail_len)).index_select(
        0, tok_row
    )
    req = row_req.index_select(0, tok_row)
    # the prefixes' whole cache blocks, split into scratch blocks [0, num_split) in order ...
    whole = table[torch.arange(table.shape[1]) < split[:, None] // max(per, 1)]  # [W]
    # ... and their other blocks token-wise, once (contiguous in the scratch, in order)
    other_req = torch.repeat_interleave(other * bs)  # [sum of other * bs] each one's request
    other_slot = torch.arange(other_req.numel())
    req = torch.cat([other_req, req])
    logical = torch.cat(
        [
            other_slot + (split * bs - _exclusive_cumsum(other * bs)).index_select(0, other_req),
            logical,
        ]
    )
    dst = torch.cat([num_split * bs + other_slot, dst])
    src = table[req, logical // cache_bs] * cache_bs + logical % cache_bs
    seq_lens = (row_full * bs + tail_len).to(torch.int32)
    starts = torch.arange(num_rows + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_rows,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=layout.isa,
        enable_kv_split=False,
    )
    return CpuScratch(
        num_prefix + num_tail,
        num_prefix,
        whole,
        src,
        dst,
        row_query_shift + torch.arange(num_rows),
        req_table,
        seq_lens,
        starts,
        metadata,
    )


def _cpu_kernel_rows(
    query: torch.Tensor, layout: CpuVecLayout | CpuAmxLayout, scratch_plan: CpuScratch, scale: float
) -> torch.Tensor:
    """The tree rows of a forward through one call of vLLM's CPU attention kernel
    (`cpu_attention_with_kv_cache`) over the scratch cache `scratch_plan` lays out
    (`cpu_scratch`); returns [rows, heads, d], the requests' rows in order. Each row is the
    kernel's own decode of that token, bit for bit, alone or batched (KV splitting off; the
    scratch takes the cache's layout, the kernel its ISA): docs/tree_attention.md,
    tests/unit/test_tree_attention_kernel.py."""
    from vllm import _custom_ops as ops

    plan, kv = scratch_plan, layout.kv_cache
    kv_heads, d, heads = kv.shape[1], kv.shape[3] // 2, query.shape[1]
    scratch = kv.new_empty(plan.num_blocks, kv_heads, SCRATCH_BLOCK, kv.shape[3])
    out_layout = cpu_layout(scratch, layout.isa)
    # the kernel reads V up to its 32-token alignment (times a zero probability: NaN would stay)
    scratch[plan.num_prefix :].zero_()
    # the prefixes' whole cache blocks, 512 KiB at a time: the copy's temporaries then stay
    # in a core's cache (all at once, hundreds of MiB for 32 requests of 4k tokens, it took
    # twice as long; 4 MiB at a time, 10-20 % longer)
    per = layout.block_size // SCRATCH_BLOCK
    chunk = max(1, SPLIT_BYTES // (kv[0].numel() * kv.element_size()))
    for at in range(0, plan.whole.numel(), chunk):
        layout.split_blocks(plan.whole[at : at + chunk], out_layout, at * per)
    out_layout.put(plan.dst, *layout.gather(plan.src))
    key_cache, value_cache = scratch.view(scratch.shape[0], kv_heads, 2 * SCRATCH_BLOCK, d).chunk(
        2, dim=2
    )
    out = torch.empty(plan.query_rows.numel(), heads, d, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(
        query=query[plan.query_rows],
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=plan.query_start_loc,
        seq_lens=plan.seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=plan.block_table,
        softcap=0.0,
        scheduler_metadata=plan.metadata,
        s_aux=None,
    )
    return out


def _torch_rows(
    query: torch.Tensor, layout, block_table: torch.Tensor, rows: TreeRows, scale: float
) -> torch.Tensor:
    """The tree rows recomputed with torch in fp32 (a CPU cache whose dtype differs from the
    query's). Scores against the prefix and against the tree slots are two
    batched matmuls over all rows; masked tree slots get -inf, so they add exact zeros. Against
    vLLM's CPU kernel, ~0.05 % of bf16 outputs differ, mostly by 1 ulp (docs/tree_attention.md)."""
    q_len, m = rows.tree_mask.shape
    dev = query.device
    q = query[rows.q_start : rows.q_start + q_len].float()  # [q_len, heads, d]
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
    scores[:, :, int(rows.prefix_len) :].masked_fill_(hidden.unsqueeze(0), float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [kv_heads, groups * q_len, d]
    out = out.view(kv_heads, groups, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)
    return out.to(query.dtype)


def apply_tree_attention(impl, layer, query, kv_cache, attn_metadata, output) -> None:
    """Overwrite the tree rows of `output` (the backend's causal result) with masked attention."""
    plan = active_tree_plan()
    if plan is None or attn_metadata is None:
        return
    isa = getattr(layer, "isa", None)  # the CPU backend's, stamped on the layer
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        check_cpu_layout(isa or "?", kv_cache.shape[-1] // 2, kv_cache.shape[2], kv_cache.dtype)
    layout = layout_for(impl, kv_cache, isa)
    block_table = (
        attn_metadata.block_table
        if hasattr(attn_metadata, "block_table")
        else attn_metadata.block_table_tensor
    )
    heads = query.shape[1]
    out = output.view(output.shape[0], heads, -1)
    if uses_cpu_kernel(layout, query):  # every request's rows in one kernel call
        key = (layout.isa, layout.block_size, tuple(kv_cache.shape[1:]), heads, query.dtype)
        scratch = plan.layout(
            key,
            block_table,
            lambda: cpu_scratch(
                layout,
                block_table[torch.tensor([r.req_index for r in plan.rows])],
                plan.rows,
                heads,
                query.dtype,
            ),
        )
        out[scratch.query_rows] = _cpu_kernel_rows(query, layout, scratch, impl.scale)
        return
    if isinstance(layout, FlashAttentionLayout):  # every request's rows in one Triton launch
        from vllm_subspec.step.tree_attention_triton import tree_rows_layout

        rows = plan.layout(
            ("triton", heads, layout.kv_heads),
            block_table,
            lambda: tree_rows_layout(
                plan.rows,
                query.device,
                heads // layout.kv_heads,
                layout.kv_heads,
                block_table.shape[-1] * layout.block_size,
            ),
        )
        _triton_rows(out, query, layout, block_table, rows, impl.scale)
        return
    for rows in plan.rows:
        res = _torch_rows(query, layout, block_table[rows.req_index], rows, impl.scale)
        out[rows.q_start : rows.q_start + res.shape[0]] = res
