"""Which decoder layers get a substitute: the ones vLLM's weight offloader keeps in CPU memory,
read from the live offloader (CUDA), or on the CPU backend, where vLLM's offloaders move
nothing, planned by the same rules (vLLM 0.32's `UVAOffloader._maybe_offload_to_cpu` and
`PrefetchOffloader.wrap_modules`).

Design: docs/substitutes.md, "Which layers get a substitute".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def offloaded_layer_indices(
    layers: Sequence[nn.Module], offload_config, device: torch.device, offloader=None
) -> list[int]:
    """Indices of decoder layers with weights in CPU memory (actual or, on CPU, planned)."""
    module_offloaders = getattr(offloader, "module_offloaders", None)
    if module_offloaders:  # prefetch backend: one offloader per offloaded layer
        offloaded = {id(m.module) for m in module_offloaders}
        return [i for i, layer in enumerate(layers) if id(layer) in offloaded]
    actual = [
        i
        for i, layer in enumerate(layers)
        if any(_in_host_memory(p, device) for p in layer.parameters())
    ]
    if actual or device.type != "cpu":
        return actual
    return planned_offload(layers, offload_config)


def _in_host_memory(p: torch.Tensor, device: torch.device) -> bool:
    return bool(getattr(p, "_vllm_is_uva_offloaded", False)) or (
        device.type != "cpu" and p.device.type == "cpu"
    )


def planned_offload(layers: Sequence[nn.Module], offload_config) -> list[int]:
    """The layers vLLM's configured offloader would place in CPU memory."""
    if offload_config is None:
        return []
    backend = offload_config.offload_backend
    uva, prefetch = offload_config.uva, offload_config.prefetch
    if backend == "prefetch" or (backend == "auto" and prefetch.offload_group_size > 0):
        g, n = prefetch.offload_group_size, prefetch.offload_num_in_group
        return [
            i
            for i, layer in enumerate(layers)
            if g > 0 and i % g >= g - n and _has_matching_param(layer, prefetch.offload_params)
        ]
    if backend in ("uva", "auto") and uva.cpu_offload_gb > 0:
        return _uva_plan(layers, int(uva.cpu_offload_gb * 1024**3), uva.cpu_offload_params)
    return []


def _uva_plan(layers: Sequence[nn.Module], budget: int, only_params: set[str]) -> list[int]:
    # UVA walks layers in order and offloads parameter by parameter until the byte budget is
    # reached; a layer counts as offloaded if any of its parameters went.
    used, picked = 0, []
    for i, layer in enumerate(layers):
        took = False
        for name, p in layer.named_parameters():
            if used >= budget:
                break
            if only_params and not _matches(name, only_params):
                continue
            used += p.numel() * p.element_size()
            took = True
        if took:
            picked.append(i)
        if used >= budget:
            break
    return picked


def _matches(param_name: str, only_params: set[str]) -> bool:
    # vLLM matches whole dotted segments: "mlp.down_proj" matches "layers.3.mlp.down_proj.weight"
    return any(f".{s}." in f".{param_name}." for s in only_params)


def _has_matching_param(layer: nn.Module, only_params: set[str]) -> bool:
    return not only_params or any(_matches(n, only_params) for n, _ in layer.named_parameters())
