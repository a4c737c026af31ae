"""What vLLM's CPU worker will give the KV cache, computed as the worker computes it: the draft
plans its host memory against it (draft_model/host_memory.py) before building anything."""

from __future__ import annotations

import math

from vllm_subspec.draft_model.host_memory import resident_bytes


def kv_room_and_need(vllm_config) -> tuple[int | None, int]:
    """(the bytes vLLM's CPU worker would give the KV cache now, or None when the KV size is
    set explicitly; the bytes of one max_model_len request's KV cache)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    # vLLM's own measure of one max_model_len request (what its KV sizing checks it against)
    spec = FullAttentionSpec(
        block_size=cc.block_size,
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc),
    )
    # plus the null block the block pool holds back
    # (vllm.v1.core.kv_cache_utils.check_enough_kv_cache_memory)
    need = mc.get_num_layers(pc) * (spec.max_memory_usage_bytes(vllm_config) + spec.page_size_bytes)
    if cc.kv_cache_memory_bytes is not None:
        return None, need
    # the worker's own formula (vllm.v1.worker.cpu_worker.CPUWorker: requested_cpu_memory in
    # __init__, the node and the RSS subtracted in determine_available_memory)
    node = get_allowed_cpu_list()[0].numa_node
    requested = math.ceil(get_memory_node_info(node).total_memory * cc.gpu_memory_utilization)
    return requested - resident_bytes(), need
