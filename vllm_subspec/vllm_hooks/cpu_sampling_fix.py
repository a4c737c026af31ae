"""A workaround for a vLLM CPU-backend bug in the chain rejection sampler's helper.

`vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` (0.32.0 :581, 0.33 :648): on CPU its
kernel (`vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`) writes into an int64 *copy* of a
float/int32 output and never copies back, so per-token temperature/top-k/top-p are
uninitialised memory and every T>0 speculative step samples from garbage (upstream #55005).
patches.py installs this torch version in its place on the CPU platform.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    out = x.new_zeros(num_tokens)
    expanded = torch.repeat_interleave(x, counts)
    out[: expanded.numel()] = expanded[:num_tokens]
    return out
