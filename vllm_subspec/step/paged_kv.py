"""vLLM's paged KV cache as SubSpec reads, writes and moves it: logical positions to slots,
each backend's per-layer cache layout (`layout_for`), and the KV compaction of accepted paths
(`move_kv`).

A request's logical position p lives in slot block_table[p // block_size] * block_size +
p % block_size. The layouts are the backends' own (cited per class), read through views so
nothing is copied; the CPU backend's layout is checked against its own writer before first use
(`check_cpu_layout`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def logical_to_slots(block_table: torch.Tensor, logical: torch.Tensor, block_size: int):
    """Absolute KV slots of a request's logical positions (block_table: its row, or [B, blocks]
    with logical [B, ...])."""
    blocks = block_table.gather(-1, (logical // block_size).to(torch.int64))
    return blocks.to(torch.int64) * block_size + logical % block_size


class CpuVecLayout:
    """vLLM CPU backend, ISA vec/vec16: kv_cache [num_blocks, kv_heads, block, 2*head_dim]
    holding per block and head the keys transposed ([head_dim, block]) then the values
    ([block, head_dim]). `isa` is the attention ISA the backend chose for the layer (`layer.isa`;
    by default the one `_get_attn_isa` picks on a CPU without AMX)."""

    def __init__(self, kv_cache: torch.Tensor, isa: str | None = None):
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        parts = kv_cache.view(nb, h, 2, bs * d)
        self.keys_t = parts[:, :, 0].view(nb, h, d, bs)
        self.values = parts[:, :, 1].view(nb, h, bs, d)
        self.block_size, self.kv_heads = bs, h
        self.kv_cache = kv_cache
        self.isa = isa or ("vec" if bs % 32 == 0 and d % 32 == 0 else "vec16")

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at absolute slots -> [T, kv_heads, head_dim] each."""
        blk, off = slots // self.block_size, slots % self.block_size
        k = self.keys_t[blk, :, :, off]  # [T, H, d]
        v = self.values[blk, :, off, :]
        return k, v

    def put(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V ([T, kv_heads, head_dim]) at absolute slots (the inverse of `gather`)."""
        blk, off = slots // self.block_size, slots % self.block_size
        self.keys_t[blk, :, :, off] = k
        self.values[blk, :, off, :] = v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src to slots dst (all sources read before any write)."""
        self.put(dst, *self.gather(src))


class FlashAttentionLayout:
    """vLLM FlashAttention, 0.32.0 and 0.33.0: the per-layer cache is the logical view
    [num_blocks, kv_heads, block_size, 2 * head_dim] that `allocate_kv_cache` builds over one
    backing buffer (`v1/worker/utils.py` :564, `v1/kv_cache_interface.py` :377
    `create_kv_cache_views`), with a physical order given by the resolved `KVCacheLayout`
    (`v1/kv_cache_layout.py`; FlashAttention declares no preference, so any of the six). Keys and
    values are split exactly as `FlashAttentionImpl.forward` does (`flash_attn.py` 0.32.0 :1252,
    0.33.0 :1257): `kv_cache.transpose(1, 2).split(head_size, -1)` -> two strided
    [num_blocks, block_size, kv_heads, head_dim] views. Reads and writes go through those views,
    so every physical layout is handled by its strides."""

    def __init__(self, kv_cache: torch.Tensor, head_size: int):
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
            raise RuntimeError(
                f"vllm-subspec: unexpected FlashAttention KV cache shape {tuple(kv_cache.shape)} "
                f"for head_size {head_size}; expected [blocks, kv_heads, block_size, "
                f"{2 * head_size}]")
        self.keys, self.values = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        self.block_size, self.kv_heads = kv_cache.shape[2], kv_cache.shape[1]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at absolute slots -> [T, kv_heads, head_dim] each."""
        blk, off = slots // self.block_size, slots % self.block_size
        return self.keys[blk, off], self.values[blk, off]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src to slots dst (all sources read before any write); the
        index writes land in the shared backing buffer through the strided views."""
        k, v = self.gather(src)
        blk, off = dst // self.block_size, dst % self.block_size
        self.keys[blk, off] = k
        self.values[blk, off] = v


def layout_for(impl, kv_cache: torch.Tensor):
    """The paged-cache reader for the attention backend `impl` that owns `kv_cache`.

    Trees are only configured with the CPU backend or FlashAttention (pinned on CUDA by
    `engine_rules.apply_platform_rules`); anything else is refused here too rather than
    misread."""
    name = type(impl).__name__
    if name == "CPUAttentionBackendImpl":
        return CpuVecLayout(kv_cache)
    if name == "FlashAttentionImpl":
        return FlashAttentionLayout(kv_cache, impl.head_size)
    raise RuntimeError(f"vllm-subspec: tree attention has no KV cache reader for {name}; "
                       "use the FLASH_ATTN attention backend or tree_width=1")


def tree_cpu_attn_isa(isa: str) -> str:
    """The CPU attention ISA to run when SubSpec drafts trees. vLLM picks "amx" for bf16 on CPUs
    with AMX tiles; its KV layout is one tree attention cannot read, so those engines run the
    "vec" kernels (AVX-512, present on every AMX CPU) instead: same results, a slower kernel."""
    if isa == "amx":
        logger.info("vllm-subspec: CPU attention ISA amx -> vec for tree drafting (tree "
                    "attention reads the vec KV layout)")
        return "vec"
    return isa


_CPU_LAYOUT_CHECKED: dict[str, bool] = {}


def check_cpu_layout(isa: str, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Write random K/V with the CPU backend's own kernel and read them back."""
    key = f"{isa}/{head_dim}/{block_size}/{dtype}"
    if key in _CPU_LAYOUT_CHECKED:
        return
    from vllm import _custom_ops as ops

    ok = False
    if isa in ("vec", "vec16"):
        h, t = 2, block_size + 3
        kv = torch.zeros(3, h, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = kv.view(3, h, 2 * block_size, head_dim).chunk(2, dim=2)
        k, v = torch.randn(t, h, head_dim, dtype=dtype), torch.randn(t, h, head_dim, dtype=dtype)
        slots = torch.arange(t, dtype=torch.int64) + 1
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        gk, gv = CpuVecLayout(kv).gather(slots)
        ok = torch.equal(gk, k) and torch.equal(gv, v)
    _CPU_LAYOUT_CHECKED[key] = ok
    if not ok:
        raise RuntimeError(
            f"vllm-subspec: tree attention cannot read the CPU KV cache layout of ISA {isa!r} "
            "(supported: vec, vec16); use tree_width=1 (chain drafting) on this CPU")


def move_kv(kv_caches: list[tuple[object, torch.Tensor]], block_table_row: torch.Tensor,
            table_block_size: int, src_logical: torch.Tensor, dst_logical: torch.Tensor) -> None:
    """Move K/V between logical positions of one request, in every layer (KV compaction).

    kv_caches: (attention impl, per-layer cache) pairs. Layers whose views alias the same bytes
    (same data pointer, shape and strides) are moved once. block_table_row holds blocks of
    `table_block_size` tokens (the runner's table: KV-manager blocks); a cache may be viewed in
    smaller kernel blocks (vLLM splits a manager block into `ratio` kernel blocks,
    kv_cache_interface.py 0.32.0 :396-414), and a flat slot number is the same in both views,
    so slots are computed at the table's block size and each layout splits them at its own."""
    if src_logical.numel() == 0:
        return
    src = logical_to_slots(block_table_row, src_logical, table_block_size)
    dst = logical_to_slots(block_table_row, dst_logical, table_block_size)
    seen = set()
    for impl, kv in kv_caches:
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride())
        if key in seen:
            continue
        seen.add(key)
        layout_for(impl, kv).move(src, dst)
