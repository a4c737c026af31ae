"""The front-end patch: {"method": "subspec"} becomes a valid vLLM config, bad input fails early.

These build vLLM's engine config only (EngineArgs.create_engine_config): no engine starts.
"""

import os
import re
import shutil
import subprocess

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_subspec.config import SubSpecConfigError


def engine_config(model, spec, **kw):
    return EngineArgs(model=model, speculative_config=spec, max_model_len=512, **kw) \
        .create_engine_config()


def test_subspec_becomes_draft_model_with_target_as_draft(tiny_llama):
    cfg = engine_config(tiny_llama, {"method": "subspec", "num_speculative_tokens": 5,
                                     "bits": 4, "substitute_layers": [0, 2]})
    assert cfg.speculative_config.method == "draft_model"
    assert cfg.speculative_config.model == tiny_llama
    assert cfg.speculative_config.num_speculative_tokens == 5
    sub = cfg.additional_config["subspec"]
    assert sub["substitute_layers"] == [0, 2]
    assert (sub["tree_width"], sub["tree_depth"]) == (1, 5)  # chain shorthand
    # V1 runner is forced, and k lookahead slots are reserved for the draft's KV.
    assert "speculative method 'subspec' (V1 runner only)" in \
        cfg._get_v2_model_runner_unsupported_features()
    assert cfg.use_v2_model_runner is False
    assert cfg.num_lookahead_tokens == 5


def test_tree_drafts_count_as_nodes(tiny_llama):
    cfg = engine_config(tiny_llama, {"method": "subspec", "tree_width": 3, "tree_depth": 4})
    # vLLM verifies the tree's 4 * 3 nodes (plus the root) and reserves their KV slots
    assert cfg.speculative_config.num_speculative_tokens == 12
    assert cfg.num_lookahead_tokens == 12
    sub = cfg.additional_config["subspec"]
    assert (sub["tree_width"], sub["tree_depth"]) == (3, 4)


def test_plain_draft_model_is_untouched(tiny_llama):
    cfg = engine_config(tiny_llama, {"method": "draft_model", "model": tiny_llama,
                                     "num_speculative_tokens": 2})
    assert "subspec" not in (cfg.additional_config or {})


@pytest.mark.parametrize("spec, fragment", [
    ({"method": "subspec", "depth": 3}, "unknown speculative_config key(s) ['depth']"),
    ({"method": "subspec", "group_size": 100}, "group_size must be one of"),
    ({"method": "subspec", "model": "other/model"}, "'model' must be omitted"),
])
def test_bad_config_fails_before_engine(tiny_llama, spec, fragment):
    with pytest.raises(SubSpecConfigError, match=re.escape(fragment)):
        engine_config(tiny_llama, spec)


@pytest.mark.parametrize("spec", [{"method": "subspec"},
                                  {"method": "subspec", "num_speculative_tokens": 4}])
def test_processed_logprobs_mode_rejected(tiny_llama, spec):
    with pytest.raises(SubSpecConfigError, match="logprobs_mode 'processed_logprobs'"):
        engine_config(tiny_llama, spec, logprobs_mode="processed_logprobs")
    engine_config(tiny_llama, spec, logprobs_mode="raw_logits")  # raw modes are reported


def test_quantized_target_rejected_before_loading(tiny_llama):
    """A quantized linear has no full-precision `weight` to build a substitute from: one clear
    message at config time (vLLM resolves `quantization` before our hook runs)."""
    assert engine_config(tiny_llama, None, quantization="fp8").model_config.quantization == "fp8"
    with pytest.raises(SubSpecConfigError, match=r"the target is quantized \('fp8'\)"):
        engine_config(tiny_llama, {"method": "subspec"}, quantization="fp8")


def test_unsupported_moe_architecture_rejected_supported_one_accepted(tmp_path, moe_model):
    from transformers import MixtralConfig

    MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                  architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    config = engine_config(str(tmp_path), {"method": "subspec"}, skip_tokenizer_init=True)
    assert config.speculative_config is not None  # on this CPU backend: SubSpec is on
    with pytest.raises(SubSpecConfigError, match=r"unsupported architecture "
                       r"\['OlmoeForCausalLM'\].*mixture-of-experts models"):
        engine_config(moe_model, {"method": "subspec"}, skip_tokenizer_init=True)


@pytest.mark.parametrize("extra, flag", [
    (dict(enable_lora=True), "--enable-lora"),
    (dict(enable_return_routed_experts=True), "--enable-return-routed-experts"),
], ids=["lora", "routed_experts"])
def test_moe_target_refuses_what_rewires_its_routing(tmp_path, extra, flag):
    from transformers import MixtralConfig

    MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                  architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(SubSpecConfigError, match=rf"without {flag}"):
        engine_config(str(tmp_path), {"method": "subspec"}, skip_tokenizer_init=True, **extra)


def test_v2_runner_env_rejected(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(SubSpecConfigError, match="V1 model runner"):
        engine_config(tiny_llama, {"method": "subspec"})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A mixture-of-experts architecture SubSpec does not serve (OLMoE)."""
    from transformers import OlmoeConfig

    path = tmp_path_factory.mktemp("moe")
    OlmoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                num_experts_per_tok=1, architectures=["OlmoeForCausalLM"]).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model, spec, message", [
    ("tiny", '{"method": "subspec", "tree_widht": 6}',
     "vllm-subspec: unknown speculative_config key(s) ['tree_widht']"),
    ("tiny", '{"method": "subspec", "tree_width": 0}',
     "vllm-subspec: invalid speculative_config: tree_width must be an integer"),
    ("tiny", '{"method": "subspec", tree', "argument --speculative-config/-sc: Value"),
    ("moe", '{"method": "subspec"}', "vllm-subspec: unsupported architecture"),
], ids=["unknown_key", "impossible_value", "bad_json", "moe"])
def test_vllm_serve_misconfiguration_exits_before_loading(tiny_llama, moe_model, model, spec,
                                                          message):
    model = tiny_llama if model == "tiny" else moe_model
    proc = subprocess.run(
        [shutil.which("vllm") or "vllm", "serve", model, "--skip-tokenizer-init",
         "--speculative-config", spec, "--port", "0"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert message in out
    assert out.count("vllm-subspec:") <= 1  # one message, not one per process or retry
    assert "Loading weights" not in out and "Starting to load model" not in out


def test_context_parallelism_refused(tiny_llama):
    from vllm_subspec.vllm_hooks.engine_rules import _refuse_context_parallel
    from vllm.config import ParallelConfig

    _refuse_context_parallel(ParallelConfig())  # the default: no context parallelism
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        config = ParallelConfig()
        object.__setattr__(config, field, 2)
        with pytest.raises(SubSpecConfigError, match="context parallelism"):
            _refuse_context_parallel(config)


def test_no_placeholder_drafts_for_a_new_request_of_one_token(tiny_llama):
    """vLLM's scheduler pads a new request with one token to run (a one-token prompt, or a
    prompt cached but for its last token) with num_speculative_tokens placeholder drafts, for
    uniform decode batches; a SubSpec engine would verify them as 1 + 192 rows for nothing
    (default budget). Its config carries a one-range batch-size schedule of the same budget,
    which turns that padding off: checked on vLLM's real `Scheduler`, against the same config
    without the schedule (padded)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    try:  # 0.32.0; 0.33.0 moved it
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    cfg = engine_config(tiny_llama, {"method": "subspec"}, skip_tokenizer_init=True)
    budget = cfg.speculative_config.num_speculative_tokens
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size == [(1, 1, budget)]

    def one_token_request_drafts(config) -> dict[str, int]:
        config.cache_config.kv_cache_layout = KVCacheLayout.LBNHC.name
        block = config.cache_config.block_size
        spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                                 dtype=torch.float32)
        kv = get_kv_cache_config_from_groups(
            config, [KVCacheGroupSpec(["layer"], spec)], spec.page_size_bytes * 16)
        config.cache_config.num_gpu_blocks = kv.num_blocks
        scheduler = Scheduler(config, kv, StructuredOutputManager(config), block)
        params = SamplingParams(max_tokens=4)
        scheduler.add_request(Request("running", [1, 2, 3, 4, 5], params, None, None))
        first = scheduler.schedule()  # its prefill
        scheduler.update_from_output(first, ModelRunnerOutput(
            req_ids=["running"], req_id_to_index={"running": 0}, sampled_token_ids=[[7]]))
        scheduler.add_request(Request("new", [9], params, None, None))
        step = scheduler.schedule()  # "running" decodes; "new" has one token to run
        assert step.num_scheduled_tokens["running"] == 1
        return {r: len(d) for r, d in step.scheduled_spec_decode_tokens.items()}

    assert one_token_request_drafts(cfg) == {}
    unscheduled = engine_config(tiny_llama, {"method": "subspec"}, skip_tokenizer_init=True)
    unscheduled.speculative_config.num_speculative_tokens_per_batch_size = None
    assert one_token_request_drafts(unscheduled) == {"new": budget}
