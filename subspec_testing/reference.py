"""Per-request oracles for the tests and benchmarks: the plain, one-request forms of what the
plugin does for a whole batch at once, kept out of the package because the runtime never calls
them.

- `accepted_path`: the sample-then-match walk over one tree (the runtime's is
  `step.verify.accepted_paths`, every request at once);
- `node_paths`: each node's tokens from the root (the runtime's: `VerifyRows.path_tokens`);
- `move_kv`: one request's KV moved between logical positions (the runtime compacts with
  `step.paged_kv.move_accepted_kv` / `copy_kv`, every request at once);
- `tree_attention_rows`: one request's tree rows alone (the runtime's:
  `step.tree_attention.apply_tree_attention`, every tree request of a forward in one call);
- `substitute_experts_from_quantized`: a `SubstituteExperts` from every expert's quantized
  weights at once (the engine packs each expert as it is quantized:
  `substitute_set.build_substitutes`).
"""

from __future__ import annotations

import torch

from vllm_subspec.draft_model.experts import (
    SubstituteExperts,
    expert_kernel,
    expert_tensors,
)
from vllm_subspec.draft_model.quantize import QuantizedWeight
from vllm_subspec.step import tree_attention
from vllm_subspec.step.paged_kv import (
    FlashAttentionLayout,
    layout_for,
    logical_to_slots,
)
from vllm_subspec.step.tree import StoredTree
from vllm_subspec.step.tree_attention import TreeRows


def accepted_path(tokens: list[int], parents: list[int], target: list[int]) -> list[int]:
    """Sample-then-match walk over one tree: the accepted node indices (root excluded).
    target[i] is the target's token drawn at node i (argmax when greedy): from the root, move to
    the child whose token equals the draw at the current node, while there is one. The emitted
    tokens are target[a] for a in [0] + path: the draws along the path, the last the bonus."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        # keep the first (highest-scored) child per token; a duplicate could never be reached
        children.setdefault(parents[i], {}).setdefault(tokens[i], i)
    path, cur = [], 0
    while True:
        nxt = children.get(cur, {}).get(target[cur])
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def node_paths(tree: StoredTree, n: int) -> list[list[int]]:
    """For nodes 0 .. n-1 of `tree`, the tokens from the root (exclusive) down to the node
    (inclusive): what the request would have generated after its last verified token if
    the walk reached that node. Dead nodes (no parent) get none."""
    out: list[list[int]] = []
    for i in range(n):  # parents precede their children
        p = tree.parents[i]
        out.append([] if p < 0 else out[p] + [tree.tokens[i]])
    return out


def move_kv(
    kv_caches: list[tuple[object, torch.Tensor, str | None]],
    block_table_row: torch.Tensor,
    table_block_size: int,
    src_logical: torch.Tensor,
    dst_logical: torch.Tensor,
) -> None:
    """Move K/V between logical positions of one request, in every layer (KV compaction).

    kv_caches: (attention impl, per-layer cache, CPU attention ISA or None) per layer. Layers
    whose views alias the same bytes (same data pointer, shape and strides) are moved once.
    block_table_row holds blocks of `table_block_size` tokens (the runner's table: KV-manager
    blocks); a cache may be viewed in smaller kernel blocks (vLLM splits a manager block into
    `ratio` kernel blocks, `vllm.v1.kv_cache_interface.create_kv_cache_views`), and a flat slot
    number is the same in both views, so slots are computed at the table's block size and each
    layout splits them at its own."""
    if src_logical.numel() == 0:
        return
    src = logical_to_slots(block_table_row, src_logical, table_block_size)
    dst = logical_to_slots(block_table_row, dst_logical, table_block_size)
    seen = set()
    for impl, kv, isa in kv_caches:
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride())
        if key in seen:
            continue
        seen.add(key)
        layout_for(impl, kv, isa).move(src, dst)


def tree_attention_rows(
    query: torch.Tensor, layout, block_table: torch.Tensor, rows: TreeRows, scale: float
) -> torch.Tensor:
    """Attention output [q_len, heads, head_dim] for one request's tree rows (`block_table`:
    its row), through the kernel `apply_tree_attention` would pick for that layout.

    Row r sees the prefix [0, L) and the tree slots its mask allows (its ancestors and itself,
    at least one position in all). On the CPU backend this is vLLM's own kernel over exactly those
    positions (`_cpu_kernel_rows`: bit-identical to the decode row plain decoding computes for that
    token); with FlashAttention's cache the Triton kernel (`tree_attention_triton`); else a
    torch fp32 recomputation (`_torch_rows`).
    """
    ta = tree_attention
    if ta.uses_cpu_kernel(layout, query):
        return ta._cpu_kernel_rows(
            query,
            layout,
            ta.cpu_scratch(layout, block_table[None], [rows], query.shape[1], query.dtype),
            scale,
        )
    if isinstance(layout, FlashAttentionLayout):
        from vllm_subspec.step.tree_attention_triton import tree_rows_layout

        one = TreeRows(0, 0, rows.prefix_len, rows.tree_mask)
        out = torch.empty(
            rows.tree_mask.shape[0], *query.shape[1:], dtype=query.dtype, device=query.device
        )
        ta._triton_rows(
            out,
            query[rows.q_start : rows.q_start + out.shape[0]],
            layout,
            block_table[None],
            tree_rows_layout(
                [one],
                query.device,
                query.shape[1] // layout.kv_heads,
                layout.kv_heads,
                block_table.shape[-1] * layout.block_size,
            ),
            scale,
        )
        return out
    return ta._torch_rows(query, layout, block_table, rows, scale)


def substitute_experts_from_quantized(
    runner: torch.nn.Module,
    w13: list[QuantizedWeight],
    w2: list[QuantizedWeight],
    dtype: torch.dtype,
    device: torch.device,
    kernel: str = "auto",
    source_name: str = "",
) -> SubstituteExperts:
    """A layer's `SubstituteExperts` from every expert's quantized fused gate/up (`w13`) and
    down (`w2`) weights, in expert order, packed for the kernel `expert_kernel` picks."""
    chosen = expert_kernel(w13[0], w2[0], device, kernel)
    return SubstituteExperts(
        runner,
        [expert_tensors(chosen, q, dtype) for q in w13],
        [expert_tensors(chosen, q, dtype) for q in w2],
        chosen,
        w13[0].group_size,
        w13[0].bits,
        source_name,
    )
