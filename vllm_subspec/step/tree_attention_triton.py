"""Tree attention for every tree row of a forward in one Triton launch per layer (the CUDA path).

Each program takes a tile of one request's tree rows (times the query heads of one KV head, as
vLLM's `kernel_unified_attention_2d` packs GQA) and one split of that request's context, read
straight from the paged cache with an online softmax in fp32; where a forward has fewer tiles
than the GPU has SMs (a draft level of one request), the context is split (flash-decoding) and
a second launch merges the splits. Layout and precision: docs/tree_attention.md, "The
attention: the tree rows are recomputed, on CPU and CUDA"; what is not applied:
docs/limitations.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_subspec.step.transfer import to_device

MAX_SPLITS = 64  # context splits per tile at most (each a BLOCK_N multiple)


@dataclass(frozen=True)
class KernelConfig:
    """The kernel's tile sizes and launch settings (scripts/gpu_components.py times the
    alternatives on a GPU)."""

    block_m: int = 64  # query entries per program: tree rows x the query heads of a KV head
    block_n: int = 32  # context positions per tile
    num_warps: int = 0  # 0: 8 at head_dim >= 128 (4 spill registers on sm_90), else 4
    num_stages: int = 0  # 0: Triton's default
    k_rows: bool = False  # load K along the head dim and transpose it in registers
    # whole prefix tiles in a loop of their own that reads no tree mask and checks no bound
    prefix_phase: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):  # tl.arange and tl.dot need powers of two >= 16
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, not {value}")

    def warps(self, head_dim: int) -> int:
        return self.num_warps or (8 if head_dim >= 128 else 4)


DEFAULT_CONFIG = KernelConfig()
BLOCK_M, BLOCK_N = DEFAULT_CONFIG.block_m, DEFAULT_CONFIG.block_n


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    hi,
    prefix,
    row,
    row_ok,
    kv_head,
    table_row,
    req,
    offs_d,
    d_ok,
    scale,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    masks_ptr,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_mr,
    stride_mq,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    MASKED: tl.constexpr,
    K_ROWS: tl.constexpr,
):
    """One BLOCK_N tile of context folded into the online softmax. MASKED: the tile may hold
    tree slots or run past `hi` (the tree mask and bounds are applied); else every position is
    a prefix position every row sees (no mask is read, no bound is checked)."""
    t = start + tl.arange(0, BLOCK_N)  # logical positions of this tile
    t_ok = t < hi
    if MASKED:
        j = t - prefix  # tree slot of each position (negative: the prefix)
        in_tree = (j >= 0) & t_ok
        seen = tl.load(
            masks_ptr + req * stride_mr + row[:, None] * stride_mq + j[None, :],
            mask=row_ok[:, None] & in_tree[None, :],
            other=0,
        )
        # K/V are read only where a row of the tile sees them: a head start's rows never
        # read the verify's slots, which the verify writes meanwhile (step/head_start.py)
        t_ok = t_ok & ((j < 0) | (tl.max(seen, axis=0) != 0))
        block = tl.load(block_table_ptr + table_row * stride_bt + t // PAGE, mask=t_ok, other=0)
    else:
        block = tl.load(block_table_ptr + table_row * stride_bt + t // PAGE)
    off = t % PAGE
    kv_ok = t_ok[:, None] & d_ok[None, :]
    if K_ROWS:  # [BLOCK_N, HEAD_DIM_P] along the cache's contiguous head dim, transposed
        k = tl.trans(
            tl.load(
                key_cache_ptr
                + block[:, None].to(tl.int64) * stride_kb
                + off[:, None] * stride_ks
                + kv_head * stride_kh
                + offs_d[None, :] * stride_kd,
                mask=kv_ok,
                other=0.0,
            )
        )
    else:
        k = tl.load(
            key_cache_ptr
            + block[None, :].to(tl.int64) * stride_kb
            + off[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=t_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_DIM_P, BLOCK_N]
    v = tl.load(
        value_cache_ptr
        + block[:, None].to(tl.int64) * stride_vb
        + off[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :] * stride_vd,
        mask=kv_ok,
        other=0.0,
    )  # [BLOCK_N, HEAD_DIM_P]
    if UPCAST:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale
    else:
        s = tl.dot(q, k) * scale
    if MASKED:
        visible = row_ok[:, None] & t_ok[None, :] & ((j < 0)[None, :] | (seen != 0))
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
    return acc, m_new, l_i


# Strides are int64, as in vLLM's `kernel_unified_attention_2d`: a head-major layout (LHBNC) has a
# KV-head stride of blocks x page x 2d, which times a head index passes 2**31 on a large cache.
# The mask strides and the split count change with every level and batch: not specialized on,
# so no forward compiles a new variant.
@triton.jit(do_not_specialize=["stride_mr", "stride_mq", "num_splits"])
def _tree_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    output_ptr,
    block_table_ptr,
    masks_ptr,
    tiles_ptr,
    requests_ptr,
    partial_ptr,
    stats_ptr,
    scale,
    num_splits,
    stride_qt: tl.int64,
    stride_qh: tl.int64,
    stride_kb: tl.int64,
    stride_ks: tl.int64,
    stride_kh: tl.int64,
    stride_kd: tl.int64,
    stride_vb: tl.int64,
    stride_vs: tl.int64,
    stride_vh: tl.int64,
    stride_vd: tl.int64,
    stride_ot: tl.int64,
    stride_oh: tl.int64,
    stride_bt: tl.int64,
    stride_mr: tl.int64,
    stride_mq: tl.int64,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
    K_ROWS: tl.constexpr,
    PREFIX_PHASE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
    q = tl.load(
        query_ptr
        + (q_start + row)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    # this program's split of the context: whole BLOCK_N tiles, the last split may be short
    total = prefix + tree_len
    per_split = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)
    # PREFIX_PHASE: whole tiles of prefix first (every row sees them: no mask read), then the
    # rest masked; else every tile masked. Padding rows (row_ok false) have q = 0 and are
    # never stored.
    mid = lo
    if PREFIX_PHASE:
        mid = lo + tl.maximum(tl.minimum(hi, prefix) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start,
            hi,
            prefix,
            row,
            row_ok,
            kv_head,
            table_row,
            req,
            offs_d,
            d_ok,
            scale,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            masks_ptr,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_bt,
            stride_mr,
            stride_mq,
            PAGE,
            BLOCK_N,
            UPCAST,
            False,
            K_ROWS,
        )
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start,
            hi,
            prefix,
            row,
            row_ok,
            kv_head,
            table_row,
            req,
            offs_d,
            d_ok,
            scale,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            masks_ptr,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_bt,
            stride_mr,
            stride_mq,
            PAGE,
            BLOCK_N,
            UPCAST,
            True,
            K_ROWS,
        )
    if SPLIT:  # unnormalized, with its max and sum: `_merge_splits_kernel` combines them
        at = (
            split * tl.num_programs(0) * tl.num_programs(1) + tile * tl.num_programs(1) + kv_head
        ).to(tl.int64) * BLOCK_M + offs_m
        tl.store(partial_ptr + at[:, None] * HEAD_DIM_P + offs_d[None, :], acc)
        tl.store(stats_ptr + 2 * at, m_i)
        tl.store(stats_ptr + 2 * at + 1, l_i)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            output_ptr
            + (q_start + row)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :],
            out.to(output_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    output_ptr,
    tiles_ptr,
    requests_ptr,
    partial_ptr,
    stats_ptr,
    num_splits,
    stride_ot: tl.int64,
    stride_oh: tl.int64,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One program per (tile, KV head): its rows' splits merged by their maxima and sums."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + 2 * tile)
    first = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(requests_ptr + 8 * req + 1)
    q_len = tl.load(requests_ptr + 8 * req + 2)
    offs_m = tl.arange(0, BLOCK_M)
    row = first + offs_m // GROUPS
    head = kv_head * GROUPS + offs_m % GROUPS
    row_ok = (offs_m // GROUPS < BLOCK_Q) & (row < q_len)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for split in range(0, num_splits):
        at = (
            split * tl.num_programs(0) * tl.num_programs(1) + tile * tl.num_programs(1) + kv_head
        ).to(tl.int64) * BLOCK_M + offs_m
        m_s = tl.load(stats_ptr + 2 * at)
        l_s = tl.load(stats_ptr + 2 * at + 1)
        a_s = tl.load(partial_ptr + at[:, None] * HEAD_DIM_P + offs_d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen in either yet
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        output_ptr
        + (q_start + row)[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_d[None, :],
        out.to(output_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@dataclass
class TritonTreeRows:
    """What the kernels read of a forward's tree rows, laid out once per forward (every layer
    has the same requests, rows and masks)."""

    tiles: torch.Tensor  # [tiles, 2] int32: (request, first tree row) per program
    # [R, 8] int32: block-table row, first query row, rows, L, m (padded to 8: `tiles`, packed
    # after it, stays 32-byte aligned, so Triton's alignment specialization never changes)
    requests: torch.Tensor
    masks: torch.Tensor  # [R, rows, m] int8: row r of request i sees tree slot L + j
    block_q: int
    num_splits: int = 1  # context splits per tile (`split_count`)
    config: KernelConfig = DEFAULT_CONFIG
    # the splits' partial results, made at the first layer and reused by the others
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


def split_count(
    tiles: int, kv_heads: int, capacity: int, sm_count: int, block_n: int = BLOCK_N
) -> int:
    """Context splits per tile: enough for tiles x KV heads x splits >= the GPU's SMs (one split
    where the tiles alone fill them), within a request's capacity in BLOCK_N tiles and
    MAX_SPLITS. Each request splits its own context evenly in the kernel."""
    programs = tiles * kv_heads
    if programs == 0 or programs >= sm_count:
        return 1
    return max(1, min(-(-sm_count // programs), -(-capacity // block_n), MAX_SPLITS))


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (a CPU stands in for an H100's 132 under the interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def tree_rows_layout(
    requests: list,
    device: torch.device,
    groups: int,
    kv_heads: int = 1,
    capacity: int = 0,
    sms: int | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
) -> TritonTreeRows:
    """The kernels' inputs for `requests` (`tree_attention.TreeRows`): their integers in one
    host-to-device copy (pinned and asynchronous on CUDA: no host sync), roots given as device
    tensors stacked on the device, masks padded into one tensor, and the split count for
    `kv_heads` and a block table of `capacity` tokens per request (`split_count`)."""
    block_q = max(1, config.block_m // groups)  # tree rows per program
    rows = [r.tree_mask.shape[0] for r in requests]
    on_device = [isinstance(r.prefix_len, torch.Tensor) for r in requests]
    ints = [
        [r.req_index, r.q_start, n, 0 if dev else r.prefix_len, r.tree_mask.shape[1], 0, 0, 0]
        for r, n, dev in zip(requests, rows, on_device)
    ]
    tiles = [v for i, n in enumerate(rows) for first in range(0, n, block_q) for v in (i, first)]
    packed = to_device(
        torch.tensor([v for r in ints for v in r] + tiles, dtype=torch.int32), device
    )
    split = 8 * len(ints)
    per_request = packed[:split].view(-1, 8)
    if any(on_device):
        per_request[:, 3] = torch.stack(
            [
                r.prefix_len.reshape(())
                if dev
                else torch.full(
                    (), r.prefix_len, dtype=torch.int64, device=device
                )  # a fill, no copy
                for r, dev in zip(requests, on_device)
            ]
        ).to(torch.int32)
    masks = [r.tree_mask for r in requests]
    if len({m.shape for m in masks}) == 1:  # a draft level: every request k rows over m slots
        padded = torch.stack(masks).to(device=device, dtype=torch.int8)
    else:
        padded = torch.zeros(
            len(masks), max(rows), max(m.shape[1] for m in masks), dtype=torch.int8, device=device
        )
        for out, m in zip(padded, masks):
            out[: m.shape[0], : m.shape[1]] = m
    if requests and not any(on_device):  # contexts known here: split what they hold
        capacity = min(capacity, max(r.prefix_len + r.tree_mask.shape[1] for r in requests))
    splits = split_count(
        len(tiles) // 2,
        kv_heads,
        capacity,
        sm_count(device) if sms is None else sms,
        config.block_n,
    )
    return TritonTreeRows(packed[split:].view(-1, 2), per_request, padded, block_q, splits, config)


def tree_attention_into(
    output: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    rows: TritonTreeRows,
    scale: float,
    upcast: bool = False,
) -> None:
    """Overwrite the tree rows of `output` [T, heads, d] with ancestor-only attention.

    query [T, heads, d]; keys/values [blocks, page, kv_heads, d], strided views of vLLM's
    cache in any of its physical orders (`paged_kv.FlashAttentionLayout`); block_table
    [batch, max_blocks] int32. One launch, two with context splits."""
    heads, d = query.shape[1], query.shape[2]
    kv_heads, page = keys.shape[2], keys.shape[1]
    groups = heads // kv_heads
    for t in (query, output, block_table, rows.masks):
        assert t.stride(-1) == 1, "the kernel assumes a contiguous last dimension"
    tiles, splits, config = rows.tiles.shape[0], rows.num_splits, rows.config
    block_m = max(config.block_m, triton.next_power_of_2(groups))
    head_dim_p = triton.next_power_of_2(d)
    workspace_rows = splits * tiles * kv_heads * block_m
    if splits > 1 and (
        rows.workspace is None
        or rows.workspace[0].shape[0] < workspace_rows
        or rows.workspace[0].shape[1] < head_dim_p
    ):
        # fp32: each split's sums and its (max, sum); made at the first layer, reused by the
        # others (made anew should a layer need more)
        rows.workspace = (
            torch.empty(workspace_rows, head_dim_p, dtype=torch.float32, device=query.device),
            torch.empty(workspace_rows, 2, dtype=torch.float32, device=query.device),
        )
    partial, stats = rows.workspace if splits > 1 else (output, output)  # (unused unsplit)
    warps = config.warps(d)
    stages = {"num_stages": config.num_stages} if config.num_stages else {}
    _tree_attention_kernel[(tiles, kv_heads, splits)](
        query,
        keys,
        values,
        output,
        block_table,
        rows.masks,
        rows.tiles,
        rows.requests,
        partial,
        stats,
        scale,
        splits,
        query.stride(0),
        query.stride(1),
        *keys.stride(),
        *values.stride(),
        output.stride(0),
        output.stride(1),
        block_table.stride(0),
        rows.masks.stride(0),
        rows.masks.stride(1),
        GROUPS=groups,
        HEAD_DIM=d,
        HEAD_DIM_P=head_dim_p,
        PAGE=page,
        BLOCK_Q=rows.block_q,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        UPCAST=upcast,
        SPLIT=splits > 1,
        K_ROWS=config.k_rows,
        PREFIX_PHASE=config.prefix_phase,
        num_warps=warps,
        **stages,
    )
    if splits > 1:
        _merge_splits_kernel[(tiles, kv_heads)](
            output,
            rows.tiles,
            rows.requests,
            partial,
            stats,
            splits,
            output.stride(0),
            output.stride(1),
            GROUPS=groups,
            HEAD_DIM=d,
            HEAD_DIM_P=head_dim_p,
            BLOCK_Q=rows.block_q,
            BLOCK_M=block_m,
            num_warps=warps,
        )
