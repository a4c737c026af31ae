"""The CUDA production path: GemLite substitutes, offload-aware layer choice, CUDA graphs.

Skipped without CUDA. Run on a GPU machine with `python -m pytest -v tests/gpu`.
SmolLM2-135M-Instruct is small, so the offload budgets below are small too: what is checked is
that the substituted layers are exactly the offloaded ones and that greedy output is lossless by
the project's standard (`subspec_testing.losslessness`): the runs are bf16 (FlashAttention has no
fp32), so every difference from plain decoding must be a proven near-tie, re-scored by an fp32
plain engine at the first difference. Raw bf16 equality would fail a correct run: the tree rows'
attention rounds differently from FlashAttention's kernel.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc

NUM_PROMPTS, NEW_TOKENS = 8, 96
# the default config's warm-up where weights stream (docs/shape_tuner.md, "Priced before the
# first step"): two plain steps measure plain's rate, the third is priced and drafts; a few
# steps' margin for a batch that forms over the first steps (prompts join a step or two apart)
AUTO_FIRST_DRAFT_WITHIN = 8
# every engine's settings (scripts/gpu_check.sh --dry-run prints them): max_num_seqs explicit,
# since vLLM's default on a large GPU (1024) makes the profiling pass, the sampler's and the
# tree's warm-ups over that many rows, take gigabytes
ENGINE = dict(gpu_memory_utilization=0.3, max_model_len=2048, seed=0, max_num_seqs=64)
RESCORER = dict(dtype="float32", gpu_memory_utilization=0.2, max_model_len=2048, seed=0,
                enforce_eager=True, max_num_seqs=64)
# uva: the first layers up to 0.1 GiB (SmolLM2 layers are ~8.6 MiB bf16); prefetch: 2 of every 4
OFFLOAD = {
    "uva": dict(cpu_offload_gb=0.1, offload_backend="uva"),
    # the README's form: SubSpec runs it through the prefetch offloader (prefetch_plan.py)
    "auto": dict(cpu_offload_gb=0.1),
    "prefetch": dict(offload_backend="prefetch", offload_group_size=4, offload_num_in_group=2,
                     offload_prefetch_step=2),
}


@pytest.fixture(scope="module")
def prompts():
    from subspec_testing.assets import chat_prompts, mt_bench_prompts, smollm2_path

    return chat_prompts(smollm2_path(), mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def fp32_rescorer():
    """A plain fp32 engine (no offload) that re-scores bf16 differences."""
    from vllm import LLM

    from subspec_testing.assets import smollm2_path
    from subspec_testing.harness import shutdown_engine

    llm = LLM(model=smollm2_path(), **RESCORER)
    yield llm
    shutdown_engine(llm)
    torch.cuda.empty_cache()


def _layout(worker):
    from vllm_subspec.draft_model.layer_selection import offloaded_layer_indices
    from vllm_subspec.draft_model.model import decoder_layers
    from vllm_subspec.vllm_hooks.runner import subspec_of

    # get_model(): under CUDA graphs `model_runner.model` is vLLM's CUDAGraphWrapper
    model = worker.model_runner.get_model()
    subs = subspec_of(worker).drafter.substitutes
    tensors = [t for layer in subs.layers.values() for s in layer.values() for t in s.tensors()]
    from vllm.model_executor.offloader.base import get_offloader

    offloaded = offloaded_layer_indices(decoder_layers(model), None, torch.device("cuda"),
                                        get_offloader())
    stats = subspec_of(worker).session.stats
    return {
        "draft_steps": stats.draft_steps,
        "plain_steps": stats.plain_steps,
        "first_drafting_step": stats.first_drafting_step,
        "draft_graph_passes": stats.draft_graph_passes,
        "draft_graph_steps": stats.draft_graph_steps,
        "substituted": sorted(subs.layers),
        "offloaded": offloaded,
        "kernels": sorted({s.kernel.name for layer in subs.layers.values()
                           for s in layer.values()}),
        "substitutes_on_gpu": bool(tensors) and all(t.is_cuda for t in tensors),
        "substitute_share": subs.share(),  # layer substitutes per replaced byte
    }


def _generate(prompts, spec, offload, enforce_eager):
    from vllm import LLM, SamplingParams

    from subspec_testing.assets import smollm2_path
    from subspec_testing.harness import shutdown_engine

    from subspec_testing.metrics import acceptance_stats

    # a SubSpec engine keeps vLLM's metrics (τ); a plain one logs none (its Prometheus logger
    # would unregister a SubSpec engine's metrics)
    llm = LLM(model=smollm2_path(), speculative_config=spec, enforce_eager=enforce_eager,
              disable_log_stats=spec is None, **ENGINE, **OFFLOAD[offload])
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate(prompts, greedy, use_tqdm=False)
        layout = llm.collective_rpc(_layout)[0] if spec else None
        if spec:
            layout["tau"] = acceptance_stats(llm).tau
        return ([list(o.outputs[0].token_ids) for o in out], layout,
                [list(o.prompt_token_ids) for o in out])
    finally:
        shutdown_engine(llm)
        torch.cuda.empty_cache()


def test_gemlite_substitute_matches_reference():
    from vllm_subspec.draft_model.kernels import GemliteKernel, ReferenceKernel, choose_kernel
    from vllm_subspec.draft_model.quantize import quantize

    torch.manual_seed(0)
    w = (torch.randn(1536, 576, device="cuda") * 0.05).to(torch.float16)
    qw = quantize(w, bits=4, group_size=64)
    assert choose_kernel(qw, torch.device("cuda")) is GemliteKernel
    fast, ref = GemliteKernel(qw, torch.float16), ReferenceKernel(qw, torch.float16)
    for m in (1, 6, 60, 300):
        x = torch.randn(m, 576, device="cuda", dtype=torch.float16)
        err = ((fast(x).float() - ref(x).float()).norm() / ref(x).float().norm()).item()
        assert err < 1e-2, (m, err)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("offload", sorted(OFFLOAD))
@pytest.mark.parametrize("method", [{"method": "subspec"},
                                    {"method": "subspec", "num_speculative_tokens": 8}],
                         ids=["tree", "chain"])
def test_greedy_lossless_with_offload(prompts, fp32_rescorer, offload, enforce_eager, method):
    from subspec_testing.losslessness import assert_lossless

    plain, _, prompt_ids = _generate(prompts, None, offload, enforce_eager)
    spec, layout, _ = _generate(prompts, method, offload, enforce_eager)
    assert layout["offloaded"], "the offload budget moved no layer to host memory"
    assert layout["substituted"] == layout["offloaded"]  # offload-aware, no flag needed
    assert layout["kernels"] == ["gemlite"]
    assert layout["substitutes_on_gpu"]  # no host memory beyond plain offloading
    # 4-bit codes + 16-bit scale and zero per 64 weights: 4.5/16 of the bf16 bytes (the
    # draft's quantized lm_head is an extra copy, not counted: test_substitute.py on CPU)
    assert 0.25 < layout["substitute_share"] < 0.32
    # the default config (an auto shape) drafts from its documented warm-up on, not after the
    # ~150 plain steps an unpriced first look waited for (a fixed chain from its first step)
    assert 0 < layout["first_drafting_step"] <= AUTO_FIRST_DRAFT_WITHIN, layout
    # drafts were accepted (random-looking drafts would give τ = 1) ...
    assert layout["tau"] > 1.0, layout
    # ... and with CUDA graphs every step that drafted dispatched at least one draft pass to a
    # captured graph (vLLM's CUDAGraphWrapper replays it; gpu_check's benchmark counts the
    # replays themselves, cudaGraphLaunch, with torch.profiler)
    drafting_steps = layout["draft_steps"] - layout["plain_steps"]
    assert drafting_steps > 0
    if not enforce_eager:
        assert layout["draft_graph_steps"] == drafting_steps, layout
    near_ties = assert_lossless(spec, plain, "bfloat16", fp32_rescorer, prompt_ids)
    print(f"{offload}/{method}: {len(prompts) - len(near_ties)}/{len(prompts)} identical, "
          f"near-ties {near_ties}, τ {layout['tau']:.2f}, draft graph passes "
          f"{layout['draft_graph_passes']} in {layout['draft_graph_steps']} of {drafting_steps} "
          "drafting steps")
