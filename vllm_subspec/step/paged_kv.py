"""vLLM's paged KV cache as SubSpec reads, writes and moves it: logical positions to slots,
each backend's per-layer cache layout (`layout_for`; on CPU one per attention ISA), and the KV
compaction of accepted paths (`move_accepted_kv`, through `copy_kv`: every request's moves in
one gather and one write per layer).

A request's logical position p lives in slot block_table[p // block_size] * block_size +
p % block_size. The layouts are the backends' own (cited per class), read through views so
nothing is copied; the CPU backend's layout is checked against its own writer before first use
(`check_cpu_layout`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_subspec import refusals
from vllm_subspec.step.transfer import to_device

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

    def split_blocks(self, blocks: torch.Tensor, out: CpuVecLayout, first: int) -> None:
        """Copy cache blocks `blocks` into `out`'s consecutive smaller blocks from `first` on
        (keys stay transposed per block: [head_dim, block])."""
        n, per = blocks.numel(), self.block_size // out.block_size
        h, d, bs = self.kv_heads, self.kv_cache.shape[3] // 2, out.block_size
        keys = self.keys_t[blocks].view(n, h, d, per, bs).permute(0, 3, 1, 2, 4)
        values = self.values[blocks].view(n, h, per, bs, d).transpose(1, 2)
        out.keys_t[first : first + n * per] = keys.reshape(n * per, h, d, bs)
        out.values[first : first + n * per] = values.reshape(n * per, h, bs, d)


class CpuAmxLayout:
    """vLLM CPU backend, ISA amx (bf16 on CPUs with AMX tiles): the same per-layer cache
    [num_blocks, kv_heads, block, 2*head_dim], per block and head bs*d key elements then bs*d
    value elements (the backend views it as [nb, H, 2*bs, d] and chunks dim 2), each packed
    for AMX tiles as `cpu_attn_reshape_and_cache(isa="amx")` writes them (csrc/cpu/
    cpu_attn_amx.hpp `reshape_and_cache`; checked against the writer before first use):
    keys in groups of 16 tokens, head-dim pairs innermost (K[t, e] = keys[t // 16, e // 2,
    t % 16, e % 2]); values in groups of 16 head-dim elements, token pairs innermost
    (V[t, e] = values[e // 16, t // 2, e % 16, t % 2]). Needs block % 32 == 0 and
    head_dim % 32 == 0, which is when vLLM picks amx (`_get_attn_isa`)."""

    isa = "amx"

    def __init__(self, kv_cache: torch.Tensor):
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        parts = kv_cache.view(nb, h, 2, bs * d)
        self.keys = parts[:, :, 0].view(nb, h, bs // 16, d // 2, 16, 2)
        self.values = parts[:, :, 1].view(nb, h, d // 16, bs // 2, 16, 2)
        self.block_size, self.kv_heads, self.head_dim = bs, h, d
        self.kv_cache = kv_cache

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at absolute slots -> [T, kv_heads, head_dim] each."""
        blk, off = slots // self.block_size, slots % self.block_size
        shape = (slots.numel(), self.kv_heads, self.head_dim)
        k = self.keys[blk, :, off // 16, :, off % 16, :]  # [T, H, d/2, 2]
        v = self.values[blk, :, :, off // 2, :, off % 2]  # [T, H, d/16, 16]
        return k.reshape(shape), v.reshape(shape)

    def put(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V ([T, kv_heads, head_dim]) at absolute slots (the inverse of `gather`)."""
        blk, off = slots // self.block_size, slots % self.block_size
        t, h, d = slots.numel(), self.kv_heads, self.head_dim
        self.keys[blk, :, off // 16, :, off % 16, :] = k.reshape(t, h, d // 2, 2)
        self.values[blk, :, :, off // 2, :, off % 2] = v.reshape(t, h, d // 16, 16)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots src to slots dst (all sources read before any write)."""
        self.put(dst, *self.gather(src))

    def split_blocks(self, blocks: torch.Tensor, out: CpuAmxLayout, first: int) -> None:
        """Copy cache blocks `blocks` into `out`'s consecutive smaller blocks from `first` on
        (both layouts tile tokens in groups of 16 or 2, so a block splits without repacking)."""
        n, per = blocks.numel(), self.block_size // out.block_size
        h, d, bs = self.kv_heads, self.head_dim, out.block_size
        keys = self.keys[blocks].view(n, h, per, bs // 16, d // 2, 16, 2).transpose(1, 2)
        values = (
            self.values[blocks]
            .view(n, h, d // 16, per, bs // 2, 16, 2)
            .permute(0, 3, 1, 2, 4, 5, 6)
        )
        out.keys[first : first + n * per] = keys.reshape(n * per, h, bs // 16, d // 2, 16, 2)
        out.values[first : first + n * per] = values.reshape(n * per, h, d // 16, bs // 2, 16, 2)


def cpu_layout(kv_cache: torch.Tensor, isa: str | None = None):
    """The CPU backend's reader for a layer whose attention ISA is `isa` (`layer.isa`)."""
    return CpuAmxLayout(kv_cache) if isa == "amx" else CpuVecLayout(kv_cache, isa)


class FlashAttentionLayout:
    """vLLM FlashAttention, 0.32.0 and 0.33.0: the per-layer cache is the logical view
    [num_blocks, kv_heads, block_size, 2 * head_dim] that `allocate_kv_cache` builds over one
    backing buffer (`vllm.v1.worker.utils.allocate_kv_cache`,
    `vllm.v1.kv_cache_interface.create_kv_cache_views`), with a physical order given by the
    resolved `KVCacheLayout` (`vllm.v1.kv_cache_layout`; FlashAttention declares no preference,
    so any of the six). Keys and values are split exactly as `FlashAttentionImpl.forward` does:
    `kv_cache.transpose(1, 2).split(head_size, -1)` -> two strided
    [num_blocks, block_size, kv_heads, head_dim] views. Reads and writes go through those views,
    so every physical layout is handled by its strides."""

    def __init__(self, kv_cache: torch.Tensor, head_size: int):
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
            raise RuntimeError(
                f"vllm-subspec: unexpected FlashAttention KV cache shape {tuple(kv_cache.shape)} "
                f"for head_size {head_size}; expected [blocks, kv_heads, block_size, "
                f"{2 * head_size}]"
            )
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


def layout_for(impl, kv_cache: torch.Tensor, isa: str | None = None):
    """The paged-cache reader for the attention backend `impl` that owns `kv_cache` (`isa`: the
    CPU backend's attention ISA for the layer, `layer.isa`).

    Trees are only configured with the CPU backend or FlashAttention (pinned on CUDA by
    `engine_rules.apply_platform_rules`); anything else is refused here too rather than
    misread."""
    name = type(impl).__name__
    if name == "CPUAttentionBackendImpl":
        return cpu_layout(kv_cache, isa)
    if name == "FlashAttentionImpl":
        return FlashAttentionLayout(kv_cache, impl.head_size)
    raise RuntimeError(
        f"vllm-subspec: tree attention has no KV cache reader for {name}; "
        "use the FLASH_ATTN attention backend or tree_width=1"
    )


_CPU_LAYOUT_CHECKED: dict[str, bool] = {}


def check_cpu_layout(isa: str, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Write random K/V with the CPU backend's own kernel and read them back (the refusal:
    `refusals.refuse_cpu_kv_layout`)."""
    key = f"{isa}/{head_dim}/{block_size}/{dtype}"
    if key in _CPU_LAYOUT_CHECKED:
        return
    from vllm import _custom_ops as ops

    ok = False
    if isa in ("vec", "vec16", "amx"):
        h, t = 2, block_size + 3
        kv = torch.zeros(3, h, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = kv.view(3, h, 2 * block_size, head_dim).chunk(2, dim=2)
        k, v = torch.randn(t, h, head_dim, dtype=dtype), torch.randn(t, h, head_dim, dtype=dtype)
        slots = torch.arange(t, dtype=torch.int64) + 1
        ops.cpu_attn_reshape_and_cache(
            k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
        gk, gv = cpu_layout(kv, isa).gather(slots)
        ok = torch.equal(gk, k) and torch.equal(gv, v)
    _CPU_LAYOUT_CHECKED[key] = ok
    refusals.refuse_cpu_kv_layout(isa, ok)


@dataclass
class KvMove:
    """An accepted path to compact: its KV moves from slots L + path[j] to L + 1 + j."""

    req_index: int
    root: int  # L
    path: list[int]  # accepted node indices (root excluded), not already in place


@dataclass
class PagedKv:
    """Where a step's KV lives: each decoder layer's (attention impl, cache, CPU attention
    ISA), and the runner's block table ([B, blocks] of `block_size` tokens) this step's slots
    were computed from."""

    caches: list[tuple[object, torch.Tensor, str | None]]
    block_table: torch.Tensor
    block_size: int


def move_accepted_kv(moves: list[KvMove], kv: PagedKv) -> None:
    """Each accepted path's KV from slots L + a_j to L + j, j = 1..m, for every request at once
    (`copy_kv`)."""
    if not moves:
        return
    lengths = [len(m.path) for m in moves]
    root = np.repeat([m.root for m in moves], lengths)
    copy_kv(
        np.repeat([m.req_index for m in moves], lengths),
        root + np.concatenate([m.path for m in moves]),
        root + np.concatenate([np.arange(1, n + 1) for n in lengths]),
        kv,
    )


def copy_kv(requests: np.ndarray, src: np.ndarray, dst: np.ndarray, kv: PagedKv) -> None:
    """Copy K/V from logical positions `src` to `dst` of the requests `requests` (batch rows;
    [T] each, host int64), in every layer: one host-to-device copy of the positions, then one
    gather and one write per layer (every source is read before any write, so a position may
    be both a source and a destination)."""
    if len(src) == 0:
        return
    table = kv.block_table
    host = torch.from_numpy(np.stack([requests, src, dst]).astype(np.int64))
    idx = to_device(host, table.device)
    bs = kv.block_size
    src_slots = table[idx[0], idx[1] // bs].to(torch.int64) * bs + idx[1] % bs
    dst_slots = table[idx[0], idx[2] // bs].to(torch.int64) * bs + idx[2] % bs
    seen = set()
    for impl, cache, isa in kv.caches:
        key = (cache.data_ptr(), tuple(cache.shape), cache.stride())
        if key in seen:
            continue
        seen.add(key)
        layout_for(impl, cache, isa).move(src_slots, dst_slots)
