"""The KV cache the draft plans against (vllm_hooks/cpu_memory.py), on vLLM's own config and
vLLM's own rule for "enough KV cache for max_model_len" (kv_cache_utils.py
`check_enough_kv_cache_memory`): exactly the bytes it accepts, one byte less it refuses."""

import pytest
from vllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("max_model_len", [512, 1000])
def test_one_max_model_len_request_is_what_vllm_checks(tiny_llama, max_model_len):
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import check_enough_kv_cache_memory
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_subspec.vllm_hooks.cpu_memory import kv_room_and_need

    cfg = EngineArgs(model=tiny_llama, max_model_len=max_model_len,
                     kv_cache_memory_bytes=2**26).create_engine_config()
    room, need = kv_room_and_need(cfg)
    assert room is None  # an explicit KV size: vLLM checks it against what is free
    mc, pc, cc = cfg.model_config, cfg.parallel_config, cfg.cache_config
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(), dtype=mc.dtype) for i in range(mc.get_num_layers(pc))}
    # the layout the engine core resolves for the CPU backend ("Using LBHNC KV cache layout")
    record_kv_cache_layout(cc, "LBHNC")
    check_enough_kv_cache_memory(cfg, specs, need)
    with pytest.raises(ValueError, match="max_model_len|maximum model length"):
        check_enough_kv_cache_memory(cfg, specs, need - 1)

