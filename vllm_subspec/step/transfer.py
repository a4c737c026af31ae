"""Host arrays to the device without a host sync."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`. On CUDA through pinned memory, non-blocking: a
    pageable copy would make the host wait for every kernel queued before it, and the pinned
    block stays allocated until the copy has run (PyTorch's caching host allocator records
    the stream that reads it)."""
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
