"""benchmarks/gpu_offload.py compares plain offloading and SubSpec under the same memory limit,
with a memory plan checked before any engine starts (printed by `gpu_check.sh --dry-run`:
tests/integration/test_gpu_check_dry_run.py)."""

import dataclasses

import pytest
import torch

from benchmarks.gpu_offload import (
    DRAFT_BYTES_PER_LOGIT,
    call_counts,
    start_call_profile,
    stop_call_profile,
    QWEN25_7B,
    ModelShape,
    MIN_SLACK_GB,
    check_memory_plan,
    layers_to_offload,
    needed_reserve_gb,
    offload_kwargs,
    prefetch_groups,
    profiling_peak_gb,
)
from benchmarks.projection import SUBSTITUTE_FRACTION, GpuSetting
from subspec_testing.live_bytes import LiveBytes

# Qwen2.5-7B: 28 layers of 0.466 GB bf16, 15.23 GB in all; the paper's 8 GB card
W, LAYER, N, BUDGET = 15.23, 0.466, 28, 8.0 - 1.5


def resident_gb(n, subspec):
    return W - n * LAYER + (n * SUBSTITUTE_FRACTION * LAYER if subspec else 0.0)


@pytest.mark.parametrize("subspec", [False, True])
def test_fewest_layers_that_fit_the_same_budget(subspec):
    n = layers_to_offload(W, LAYER, N, BUDGET, subspec)
    assert resident_gb(n, subspec) <= BUDGET < resident_gb(n - 1, subspec)


def test_subspec_offloads_more_than_plain_like_the_projection():
    plain = layers_to_offload(W, LAYER, N, BUDGET, subspec=False)
    spec = layers_to_offload(W, LAYER, N, BUDGET, subspec=True)
    assert spec > plain
    # the projection's offloaded bytes, rounded up to whole layers; with the prefetch
    # offloader (SubSpec's default) its GPU slots are as many more layers offloaded
    uva = GpuSetting(weight_gb=W, memory_gb=8.0, reserved_gb=1.5, backend="uva")
    assert plain == pytest.approx(uva.offloaded_gb(False) / LAYER, abs=1)
    assert spec == pytest.approx(uva.offloaded_gb(True) / LAYER, abs=1)
    # at 8 GB SubSpec offloads 26 of 28 layers: the prefetch plan's 3 more do not exist
    prefetch = dataclasses.replace(uva, backend="prefetch")
    assert not prefetch.uses_prefetch() and prefetch.offloaded_gb(True) == uva.offloaded_gb(True)
    # at 12 GB they do: its slots and their substitutes cost 2 / (1 - 0.281) layers more
    roomy = dataclasses.replace(prefetch, memory_gb=12.0)
    assert roomy.uses_prefetch()
    assert roomy.offloaded_gb(True) == pytest.approx(
        dataclasses.replace(roomy, backend="uva").offloaded_gb(True)
        + roomy.slots * roomy.layer_gb / (1 - SUBSTITUTE_FRACTION))
    assert roomy.offloaded_gb(False) == uva.offloaded_gb(False) - 4.0  # plain: vLLM's UVA


def test_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="cannot fit"):
        layers_to_offload(W, LAYER, N, 0.5, subspec=True)


def vllm_prefetch_count(group: int, in_group: int) -> int:
    """Layers vLLM's prefetch backend offloads for this grouping, by `planned_offload`, which
    test_layer_selection checks against PrefetchOffloader.wrap_modules run for real."""
    from torch import nn
    from vllm.config import OffloadConfig, PrefetchOffloadConfig

    from vllm_subspec.draft_model.layer_selection import planned_offload

    layers = [nn.Linear(2, 2) for _ in range(N)]
    cfg = OffloadConfig(prefetch=PrefetchOffloadConfig(
        offload_group_size=group, offload_num_in_group=in_group))
    return len(planned_offload(layers, cfg))


@pytest.mark.parametrize("want", [1, 5, 14, 19, 27, 28])
def test_prefetch_groups_offload_the_fewest_layers_needed(want):
    kwargs = offload_kwargs("prefetch", N, want, LAYER)
    group, in_group = kwargs["offload_group_size"], kwargs["offload_num_in_group"]
    assert (group, in_group) == prefetch_groups(N, want)
    got = vllm_prefetch_count(group, in_group)
    assert got >= want
    # no grouping vLLM accepts offloads fewer layers while still covering `want`
    assert not any(want <= vllm_prefetch_count(g, k) < got
                   for g in range(1, N + 1) for k in range(1, g + 1))


def test_uva_bytes_cover_the_layers():
    kwargs = offload_kwargs("uva", N, 10, LAYER)
    assert kwargs["cpu_offload_gb"] * 2**30 == pytest.approx(10 * LAYER * 1e9)


QWEN_SHAPE = ModelShape(QWEN25_7B["hidden_size"], QWEN25_7B["intermediate_size"],
                        QWEN25_7B["num_hidden_layers"], QWEN25_7B["vocab_size"],
                        QWEN25_7B["hidden_size"] // QWEN25_7B["num_attention_heads"]
                        * QWEN25_7B["num_key_value_heads"], False)


def test_qwen_shape_matches_the_published_sizes():
    assert QWEN_SHAPE.weights_gb == pytest.approx(15.23, abs=0.01)
    assert QWEN_SHAPE.layer_gb == pytest.approx(LAYER, abs=0.001)


@pytest.mark.parametrize("subspec", [False, True])
def test_the_default_benchmark_plan_leaves_a_gigabyte_of_slack(subspec):
    """The benchmark's defaults (max_num_seqs 4, 2048 tokens a step, 4096-token requests, 6x48
    trees): the reserve the plan picks holds the profiling peak, the pinned KV cache and the
    CUDA-graph allowance with >= 1 GB to spare, for both engines."""
    reserve = needed_reserve_gb(QWEN_SHAPE, 4, 2048, 4096, 6, 48)
    plan = check_memory_plan(QWEN_SHAPE, reserve, 4, 2048, 4096, 6, 48, subspec)
    assert plan["slack_gb"] >= MIN_SLACK_GB
    assert plan["profiling_peak_gb"] + plan["kv_cache_gb"] + plan["cuda_graph_pool_gb"] \
        + plan["slack_gb"] == pytest.approx(reserve)
    assert plan["kv_tokens"] >= 4096  # vLLM refuses a cache under one full-length request
    # 0.1 GB less and the plan is refused: the slack is what it says
    with pytest.raises(SystemExit, match="non-torch memory"):
        check_memory_plan(QWEN_SHAPE, reserve - (plan["slack_gb"] - MIN_SLACK_GB) - 0.1, 4,
                          2048, 4096, 6, 48, subspec)


def test_the_papers_8_gb_leaves_subspecs_resident_bytes_no_room():
    """SubSpec keeps the embeddings, every layer's substitute and its quantized lm_head on
    the GPU (6.15 GB for Qwen2.5-7B): with the default plan's reserve that fits 9 GB, not 8."""
    reserve = needed_reserve_gb(QWEN_SHAPE, 4, 2048, 4096, 6, 48)
    head = QWEN_SHAPE.lm_head_gb
    assert layers_to_offload(QWEN_SHAPE.weights_gb, QWEN_SHAPE.layer_gb, N, 9.0 - reserve,
                             subspec=True, lm_head_gb=head) == N - 1
    with pytest.raises(ValueError, match="cannot fit"):
        layers_to_offload(QWEN_SHAPE.weights_gb, QWEN_SHAPE.layer_gb, N, 8.0 - reserve,
                          subspec=True, lm_head_gb=head)


def test_a_tree_verifys_logits_are_in_the_plan():
    """The verify over whole trees holds bf16 logits for every node of max_num_seqs trees
    (within max_num_batched_tokens): 16 x 289 rows of a 152k vocabulary (1.4 GB) outgrow the
    forward over 8192 tokens and the reserve; 8 x 289 stay under that forward; a step budget of
    2048 tokens caps the rows."""
    forward = profiling_peak_gb(QWEN_SHAPE, 16, 8192, 6, 48, subspec=False)
    assert profiling_peak_gb(QWEN_SHAPE, 16, 8192, 6, 48, subspec=True) > forward + 0.3
    assert profiling_peak_gb(QWEN_SHAPE, 8, 8192, 6, 48, subspec=True) == forward
    assert profiling_peak_gb(QWEN_SHAPE, 16, 2048, 6, 48, subspec=True) < 0.75
    with pytest.raises(SystemExit, match="lower --max-num-seqs"):
        check_memory_plan(QWEN_SHAPE, 1.5, 16, 8192, 4096, 6, 48, subspec=True)


def test_vllms_default_max_num_seqs_on_a_large_gpu_outgrows_the_reserve():
    """vLLM defaults max_num_seqs to 1024 on a >= 70 GiB GPU: the sampler's warm-up over 1024
    rows of a 152k vocabulary alone is 3.4 GB, and SubSpec's widest draft pass (x6 rows) more."""
    assert profiling_peak_gb(QWEN_SHAPE, 1024, 8192, 6, 8, subspec=False) > 1.5
    assert profiling_peak_gb(QWEN_SHAPE, 1024, 8192, 6, 8, subspec=True) > \
        profiling_peak_gb(QWEN_SHAPE, 1024, 8192, 6, 8, subspec=False)
    with pytest.raises(SystemExit, match="lower --max-num-seqs or raise --reserved-gb"):
        check_memory_plan(QWEN_SHAPE, 1.5, 1024, 8192, 4096, 6, 8, subspec=True)


def test_subspec_budget_holds_the_quantized_lm_head():
    head = QWEN_SHAPE.lm_head_gb
    n = layers_to_offload(W, LAYER, N, BUDGET, subspec=True, lm_head_gb=head)
    resident = resident_gb(n, subspec=True) + SUBSTITUTE_FRACTION * head
    assert resident <= BUDGET < resident_gb(n - 1, subspec=True) + SUBSTITUTE_FRACTION * head
    assert n >= layers_to_offload(W, LAYER, N, BUDGET, subspec=True)


def test_draft_temporaries_fit_the_plans_bytes_per_logit():
    """The draft's widest pass past its logits (`tree.widest_level`, which
    `draft_startup.allocate_peak_temporaries` runs), measured on CPU: the plan's
    DRAFT_BYTES_PER_LOGIT covers it, and is not wildly loose."""
    from vllm_subspec.step.tree import widest_level

    batch, k, vocab = 4, 6, 5000
    with torch.inference_mode(), LiveBytes() as mode:
        logits = torch.randn(batch * k, vocab, dtype=torch.bfloat16)
        widest_level(logits, batch, k, 0.2)
    elements = batch * k * vocab
    assert elements * 2 * 4 < mode.peak <= elements * DRAFT_BYTES_PER_LOGIT


def test_call_profile_counts_per_drafting_step():
    """gpu_check's graph replays and host syncs per step come from torch.profiler's events in
    the worker, divided by the drafter's steps in the window: checked with CPU operators standing
    in for the CUDA runtime calls (which a CPU run has none of)."""
    from types import SimpleNamespace

    from vllm_subspec.step.session import StepStats
    from vllm_subspec.vllm_hooks.runner import SubSpecGPUModelRunner

    stats = StepStats(draft_steps=5, draft_passes=40, draft_seconds=1.0)
    runner = object.__new__(SubSpecGPUModelRunner)  # only its session is read
    runner.session = SimpleNamespace(stats=stats)
    worker = SimpleNamespace(model_runner=runner)
    start_call_profile(worker)
    x = torch.ones(4)
    for _ in range(6):
        x = torch.add(x, 1)
    x = torch.mul(x, 2)
    stats.draft_steps, stats.draft_passes, stats.draft_seconds = 8, 64, 1.6
    out = stop_call_profile(worker)
    assert out["steps"] == 3 and out["draft_passes_per_step"] == 8
    assert out["draft_seconds_per_step"] == pytest.approx(0.2)
    assert out["graph_replays_per_step"] == 0 and out["host_syncs_per_step"] == 0  # no CUDA
    assert not hasattr(worker, "subspec_call_profile")  # nothing kept on vLLM's worker
    with torch.profiler.profile() as prof:
        for _ in range(6):
            x = torch.add(x, 1)
        torch.mul(x, 2)
    assert call_counts(prof.events(), ("aten::add", "aten::mul", "aten::sub")) == \
        {"aten::add": 6, "aten::mul": 1, "aten::sub": 0}


def test_the_pinned_kv_cache_passes_vllms_own_full_length_check():
    """vLLM keeps one block back before it checks that a full-length request fits
    (`get_kv_cache_configs`, run here on the benchmark's Qwen2.5-7B shape): exactly
    max_model_len tokens of cache is refused, the benchmark's pinned bytes are not."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from benchmarks.gpu_offload import kv_cache_bytes, kv_tokens, random_qwen_7b

    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    except ImportError:  # 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs
    model = random_qwen_7b()
    shape = ModelShape.of(model)
    pinned = kv_cache_bytes(shape, kv_tokens(4096, 4))
    config = EngineArgs(model=model, max_model_len=4096, max_num_seqs=4,
                        max_num_batched_tokens=2048, skip_tokenizer_init=True,
                        load_format="dummy", dtype="bfloat16",
                        kv_cache_memory_bytes=pinned).create_engine_config()
    config.cache_config.kv_cache_layout = "NHD"  # what the engine core resolves (any will do)
    spec = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16) for i in range(28)}
    assert get_kv_cache_configs(config, [spec], [pinned])[0].num_blocks >= 4096 // 16 + 1
    with pytest.raises(ValueError, match="max seq len"):
        get_kv_cache_configs(config, [spec], [int(shape.kv_gb(4096) * 1e9)])
