"""The draft's host memory on vLLM's CPU backend, planned before any substitute is built: the
substitutes (its quantized lm_head included) must leave the KV cache room for one
`max_model_len` request; dense twins are kept only within that room and `cpu_draft_memory`
(`plan_host_memory`, then `fit_kv_cache` once vLLM has processed the weights).

Design: docs/substitutes.md, "Host memory on the CPU backend".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from vllm_subspec import refusals
from vllm_subspec.draft_model.kernels import Int4CpuKernel

GiB = 2**30


def substitute_bytes(n: int, k: int, bits: int, group_size: int) -> int:
    """Bytes of one substitute as the CPU kernels store it: `Int4CpuKernel` packs two codes per
    byte and keeps scale and zero in bf16 ([G, N, 2]), and so does `Int4DotCpuKernel` in its
    own layout (its shapes are a subset of tinygemm's: N % 16 == 0, groups of 32-256);
    `ReferenceKernel` (other bit widths) keeps uint8 codes and fp32 scale and zero."""
    groups = n * (k // group_size)
    if Int4CpuKernel.packs(n, bits, group_size):
        return n * k // 2 + groups * 2 * 2
    return n * k + groups * 2 * 4


def twin_bytes(n: int, k: int) -> int:
    return n * k * 2  # bf16 (the int4 kernel's activation dtype)


@dataclasses.dataclass
class HostMemoryPlan:
    target_bytes: int  # the target's parameters
    substitute_bytes: int  # every planned substitute (layers and lm_head), twins not counted
    twin_budget: int  # bytes dense twins may take
    twins_bytes: int = 0  # taken so far

    def take_twin(self, nbytes: int) -> bool:
        """Whether a twin of nbytes fits what is left (and, if so, count it)."""
        if self.twins_bytes + nbytes > self.twin_budget:
            return False
        self.twins_bytes += nbytes
        return True

    def summary(self) -> str:
        share = (self.substitute_bytes + self.twins_bytes) / max(self.target_bytes, 1)
        return (
            f"draft host memory: substitutes {self.substitute_bytes / GiB:.2f} GiB + dense "
            f"twins {self.twins_bytes / GiB:.2f} GiB = {100 * share:.0f}%"
            f" of the target's {self.target_bytes / GiB:.2f} GiB of weights"
        )


def plan_host_memory(
    shapes: list[tuple[int, int]],
    fraction: float,
    bits: int,
    group_size: int,
    target_bytes: int,
    kv_room: int | None,
    kv_needed: int,
) -> HostMemoryPlan:
    """shapes: [N, K] of every linear to substitute. kv_room: the RAM share vLLM will leave for
    the KV cache if the draft adds nothing (None: unknown, e.g. an explicit KV size);
    kv_needed: the least KV cache an engine can start with (one max_model_len request)."""
    subs = sum(substitute_bytes(n, k, bits, group_size) for n, k in shapes)
    refusals.refuse_cpu_draft_memory(kv_room, subs, kv_needed, bits)
    budget = int(fraction * target_bytes) - subs
    if kv_room is not None:
        budget = min(budget, kv_room - subs - kv_needed)
    return HostMemoryPlan(
        target_bytes=target_bytes, substitute_bytes=subs, twin_budget=max(budget, 0)
    )


def fit_kv_cache(substitutes, kv_room: Callable[[], tuple[int | None, int]]) -> None:
    """After vLLM's weight processing, with the draft built: when what vLLM's CPU worker will
    give the KV cache cannot hold one max_model_len request, drop dense twins (the last layers'
    first) until it can, else raise one clear error. kv_room: () -> (bytes the KV cache would
    get now, or None if set explicitly; bytes of one max_model_len request),
    vllm_hooks/cpu_memory.py."""
    room, need = kv_room()
    if room is None or room >= need:
        return
    freed = substitutes.drop_twins(need - room)
    if freed:
        return_freed_memory()
        room, need = kv_room()
    refusals.refuse_cpu_kv_memory(room, need, substitutes.target_bytes, substitutes.nbytes())


def vllm_cpu_weight_growth(model: torch.nn.Module) -> int:
    """Bytes vLLM's CPU backend adds when it processes the loaded weights: each vocabulary
    embedding (embed_tokens, and the lm_head when it is not tied) gets a packed copy and keeps
    its weight (`remove_weight=False` in vLLM's
    `UnquantizedEmbeddingMethod.process_weights_after_loading`; linears drop theirs,
    `UnquantizedLinearMethod.process_weights_after_loading`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and m.weight.dim() == 2
    )


def resident_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def return_freed_memory() -> None:
    """Hand memory malloc keeps after frees back to the system (glibc `malloc_trim`): vLLM's CPU
    worker sizes the KV cache from its RSS, which otherwise still counts the solver's freed
    fp32 temporaries. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
