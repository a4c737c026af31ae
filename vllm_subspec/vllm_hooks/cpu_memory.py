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
    spec = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(),
                             dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
    # plus the null block the block pool holds back (kv_cache_utils.py:1122-1128)
    need = mc.get_num_layers(pc) * (spec.max_memory_usage_bytes(vllm_config)
                                    + spec.page_size_bytes)
    if cc.kv_cache_memory_bytes is not None:
        return None, need
    # the worker's own formula (cpu_worker.py:72-75, 208-212, 235-236)
    node = get_allowed_cpu_list()[0].numa_node
    requested = math.ceil(get_memory_node_info(node).total_memory * cc.gpu_memory_utilization)
    return requested - resident_bytes(), need
