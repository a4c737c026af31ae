"""GPU benchmark in the paper's setting: plain offloading vs SubSpec under a memory limit.

The memory limit is emulated the way vLLM users meet it: weights beyond the limit go to host
memory (`--cpu-offload-gb`, or the prefetch backend), and the engine's GPU memory share is set to
the limit. Without `--model`, a Qwen2.5-7B-shaped model with random weights is used (vLLM's
`load_format="dummy"`: speeds are real, τ is meaningless); pass a real checkpoint path for τ.
Writes benchmarks/results/gpu_offload.{json,md}, with a PROJECTION (benchmarks/projection.py)
from the measured τ, draft time and host-to-device bandwidth beside the measured speed-up.

    python -m benchmarks.gpu_offload                                  # random 7B, 9 GB limit
    python -m benchmarks.gpu_offload --model /models/Qwen2.5-7B-Instruct --memory-gb 9
    python -m benchmarks.gpu_offload --dry-run      # no GPU needed: the engines and their plan

Memory plan: both engines get the same limit. SubSpec's resident bytes include its substitutes
and its quantized lm_head. The KV cache is pinned (`kv_cache_memory_bytes`: vLLM then sizes no
cache from what its profile leaves, so neither the CUDA-graph pool it subtracts by default,
`Worker.determine_available_memory`, nor non-torch memory can leave it too small at start) and
equal for both engines. The reserve (`--reserved-gb`, by default what the plan needs) must hold
vLLM's profiling peak (`profiling_peak_gb`: the forward over max_num_batched_tokens, the sampler
warm-up over max_num_seqs rows, and SubSpec's tree-step warm-up and widest draft pass), the
pinned KV cache, the CUDA-graph pool (`CUDA_GRAPH_POOL_GB`, an allowance: vLLM measures the
real one at start) and at least `MIN_SLACK_GB` for the CUDA context and other non-torch memory;
`max_num_seqs` is set explicitly (vLLM's default on a >= 70 GiB GPU is 1024, whose sampler
warm-up alone outgrows the reserve). A plan that does not fit is an error before any engine
starts. Without `--model` the weights are random: τ ≈ 1, so the run measures kernel costs only
and its tokens/s ratio is labelled so, never as a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.depth_sweep import RESULTS, environment
from benchmarks.projection import SUBSTITUTE_FRACTION, GpuSetting, projected_speedup

QWEN25_7B = dict(  # Qwen/Qwen2.5-7B-Instruct config.json
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    hidden_act="silu", bos_token_id=151643, eos_token_id=151645)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint path (default: Qwen2.5-7B shape, random weights)")
    # 9, not the paper's 8: SubSpec's resident part of Qwen2.5-7B (embeddings, every layer's
    # substitute, the quantized lm_head: 6.15 GB) and the reserve a running engine needs with
    # 1 GB of slack (2.1 GB at the defaults below) do not fit 8 GB
    ap.add_argument("--memory-gb", type=float, default=9.0, help="GPU memory limit")
    ap.add_argument("--reserved-gb", type=float, default=None,
                    help="part of the limit kept for the KV cache, activations, CUDA graphs "
                    "and the CUDA context (default: what the plan needs, with "
                    f"{MIN_SLACK_GB:g} GB of slack)")
    ap.add_argument("--offload-backend", choices=["auto", "uva", "prefetch"], default="auto",
                    help="auto: --cpu-offload-gb as a user passes it (plain runs it on UVA, "
                    "SubSpec translates it to the prefetch offloader: prefetch_plan.py); uva, "
                    "prefetch: that backend for both engines")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tree", default="6x48", help="KxD")
    ap.add_argument("--skip-default", action="store_true",
                    help="skip the default config's engine (`{\"method\": \"subspec\"}`, what "
                         "users run), timed beside the fixed tree")
    ap.add_argument("--max-num-seqs", type=int, default=4,
                    help="requests in flight at most (the prompts are run one at a time, then "
                    "as one batch); SubSpec's profile holds a verify's logits for this many "
                    "whole trees (4 x 289 rows of Qwen's 152k vocabulary: 0.35 GB)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the step's token budget (the profiling forward's peak grows with it)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each engine's settings and memory plan; start nothing")
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="the GPU's total memory (default: read from the device; 80 in a dry "
                    "run without one)")
    return ap.parse_args()


# CUDA runtime calls counted per engine step in a profiled window (torch.profiler's CPU-side
# runtime events): graph replays, and the calls that block the host until the GPU has caught up
GRAPH_REPLAY_CALLS = ("cudaGraphLaunch",)
HOST_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def call_counts(events, names: tuple[str, ...]) -> dict[str, int]:
    """How many of `events` (a torch.profiler `events()` list) have each of `names`."""
    counts = dict.fromkeys(names, 0)
    for event in events:
        if event.name in counts:
            counts[event.name] += 1
    return counts


_CALL_PROFILE: dict = {}  # this worker process's profiler between the two calls below


def start_call_profile(worker) -> None:
    """Start counting CUDA runtime calls in the worker (a collective_rpc target)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    from vllm_subspec.vllm_hooks.runner import subspec_of

    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    stats = subspec_of(worker).session.stats
    _CALL_PROFILE["started"] = (profiler, stats.draft_steps, stats.draft_passes,
                                stats.draft_seconds)


def stop_call_profile(worker) -> dict:
    """Stop it: per drafting step, graph replays and host syncs, draft passes and seconds."""
    from vllm_subspec.vllm_hooks.runner import subspec_of

    profiler, calls, passes, seconds = _CALL_PROFILE.pop("started")
    profiler.stop()
    stats = subspec_of(worker).session.stats
    steps = max(stats.draft_steps - calls, 1)
    counts = call_counts(profiler.events(), GRAPH_REPLAY_CALLS + HOST_SYNC_CALLS)
    return {"steps": stats.draft_steps - calls,
            "graph_replays_per_step": sum(counts[n] for n in GRAPH_REPLAY_CALLS) / steps,
            "host_syncs_per_step": sum(counts[n] for n in HOST_SYNC_CALLS) / steps,
            "draft_passes_per_step": (stats.draft_passes - passes) / steps,
            "draft_seconds_per_step": (stats.draft_seconds - seconds) / steps,
            "calls": counts}


def profiled_steps(llm, prompts, params) -> dict:
    """Graph replays and host syncs per engine step over one more generation (after the timed
    runs, so the profiler's overhead is not in their timings)."""
    llm.collective_rpc(start_call_profile)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        counts = llm.collective_rpc(stop_call_profile)[0]
    return counts


def random_qwen_7b() -> str:
    path = Path(tempfile.gettempdir()) / "vllm-subspec-qwen2.5-7b-shape"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return str(path)


def h2d_bandwidth_gbps(gib: float = 1.0) -> float:
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * src.numel() / (time.perf_counter() - start) / 1e9


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_layers: int
    vocab: int
    kv_dim: int  # key/value heads x head size
    tied_embeddings: bool

    @staticmethod
    def of(model: str) -> "ModelShape":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model)
        return ModelShape(c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                          c.vocab_size, c.hidden_size // c.num_attention_heads
                          * c.num_key_value_heads, bool(c.tie_word_embeddings))

    @property
    def layer_gb(self) -> float:
        """bf16 GB of one decoder layer's linears."""
        h, kv = self.hidden, self.kv_dim
        return 2 * (h * (h + 2 * kv) + h * h + 3 * h * self.intermediate) / 1e9

    @property
    def lm_head_gb(self) -> float:
        return 2 * self.vocab * self.hidden / 1e9

    @property
    def weights_gb(self) -> float:
        embeds = self.lm_head_gb * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_gb + embeds

    def kv_gb(self, tokens: int) -> float:
        return 2 * 2 * self.kv_dim * self.num_layers * tokens / 1e9  # K and V, bf16


# Bytes per logits element that each phase of vLLM's profiling pass holds at once (upper
# estimates from the code): vLLM's sampler (gpu_model_runner.py 0.32.0 `_dummy_sampler_run`
# :5927): bf16 logits, their fp32 copy, top-k/top-p's sorted fp32 values and int64 indices,
# fp32 probabilities; the tree step's warm-up (verify.draw_target_tokens on the same call): the
# bf16 logits, fp32 copy, temperature-scaled fp32, then the sampler's sort; the draft's widest
# pass (draft_startup.allocate_peak_temporaries): bf16 logits, the fp32 copy, its /T and
# log-softmax, a tree level's fp32 candidates. test_gpu_offload_plan.py measures the live bytes
# of the real functions on CPU against these.
SAMPLER_BYTES_PER_LOGIT = 2 + 4 + 4 + 8 + 4
# The CUDA-graph pool's allowance (vLLM captures the target's decode graphs, SubSpec its draft's
# pieces; vLLM measures the pool at start, `GPUModelRunner.profile_cudagraph_memory`), and the
# least room a plan leaves beyond everything it counts: the CUDA context (~0.5 GB), cuBLAS and
# NCCL workspaces, allocator fragmentation.
CUDA_GRAPH_POOL_GB = 0.5
MIN_SLACK_GB = 1.0
TREE_STEP_BYTES_PER_LOGIT = 2 + 4 + 4 + SAMPLER_BYTES_PER_LOGIT
DRAFT_BYTES_PER_LOGIT = 2 + 4 + 4 + 4 + 4


def profiling_peak_gb(shape: ModelShape, max_num_seqs: int, max_num_batched_tokens: int,
                      tree_width: int, tree_depth: int, subspec: bool) -> float:
    """Estimated peak of the temporaries vLLM's profiling pass allocates before it sizes the KV
    cache (what must fit in the reserve): the largest of the forward over
    max_num_batched_tokens (bf16 activations: hidden x 4, gate-up and its product), vLLM's
    sampler warm-up over max_num_seqs rows and, for SubSpec, the tree step's warm-up (2 rows
    per request), the draft's widest pass (max_num_seqs x tree_width rows) and a tree verify
    (the bf16 logits of every node of max_num_seqs trees, within max_num_batched_tokens, with
    one chunk of max_num_seqs rows drawn: `draft_startup.allocate_peak_temporaries`)."""
    t, v = max_num_batched_tokens, shape.vocab
    forward = 2 * t * (4 * shape.hidden + 3 * shape.intermediate)
    phases = [forward, max_num_seqs * v * SAMPLER_BYTES_PER_LOGIT]
    if subspec:
        verify_rows = min(t, max_num_seqs * (tree_width * tree_depth + 1))
        phases += [2 * max_num_seqs * v * TREE_STEP_BYTES_PER_LOGIT,
                   max_num_seqs * tree_width * v * DRAFT_BYTES_PER_LOGIT,
                   verify_rows * v * 2 + max_num_seqs * v * TREE_STEP_BYTES_PER_LOGIT]
    return max(phases) / 1e9


def kv_tokens(max_model_len: int, max_num_seqs: int) -> int:
    """The pinned KV cache's tokens: one full-length request, or max_num_seqs requests of
    1024 tokens (a prompt, its answer and a tree), whichever is more."""
    return max(max_model_len, max_num_seqs * 1024)


KV_BLOCK = 16  # vLLM's CUDA block size (FlashAttention's default)


def kv_cache_bytes(shape: ModelShape, tokens: int) -> int:
    """`kv_cache_memory_bytes` that holds `tokens` tokens: whole blocks, plus the one block
    vLLM keeps back (the null block) before it checks that one full-length request fits
    (`get_kv_cache_configs`)."""
    per_token = 2 * 2 * shape.kv_dim * shape.num_layers  # K and V, bf16, every layer
    return (-(-tokens // KV_BLOCK) + 1) * KV_BLOCK * per_token


def needed_reserve_gb(shape: ModelShape, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int, tree_width: int, tree_depth: int) -> float:
    """The reserve the larger of the two engines' plans needs, with MIN_SLACK_GB to spare
    (rounded up to 0.1 GB): the default of --reserved-gb."""
    need = max(profiling_peak_gb(shape, max_num_seqs, max_num_batched_tokens, tree_width,
                                 tree_depth, subspec) for subspec in (False, True))
    need += kv_cache_bytes(shape, kv_tokens(max_model_len, max_num_seqs)) / 1e9 \
        + CUDA_GRAPH_POOL_GB
    return math.ceil(10 * (need + MIN_SLACK_GB)) / 10


def check_memory_plan(shape: ModelShape, reserved_gb: float, max_num_seqs: int,
                      max_num_batched_tokens: int, max_model_len: int, tree_width: int,
                      tree_depth: int, subspec: bool) -> dict:
    """The reserve must hold the profiling peak, the pinned KV cache (`kv_tokens`) and the
    CUDA-graph pool with at least MIN_SLACK_GB to spare; returns the plan's numbers, raises
    SystemExit with them where it does not fit."""
    peak = profiling_peak_gb(shape, max_num_seqs, max_num_batched_tokens, tree_width,
                             tree_depth, subspec)
    tokens = kv_tokens(max_model_len, max_num_seqs)
    kv = kv_cache_bytes(shape, tokens) / 1e9
    slack = reserved_gb - peak - kv - CUDA_GRAPH_POOL_GB
    plan = {"profiling_peak_gb": peak, "kv_cache_gb": kv, "kv_tokens": tokens,
            "cuda_graph_pool_gb": CUDA_GRAPH_POOL_GB, "slack_gb": slack,
            "reserved_gb": reserved_gb, "max_num_seqs": max_num_seqs}
    if slack < MIN_SLACK_GB:
        raise SystemExit(
            f"{'SubSpec' if subspec else 'plain'} engine: the profiling peak ({peak:.2f} GB at "
            f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}), "
            f"a {tokens}-token KV cache ({kv:.2f} GB) and the CUDA-graph pool "
            f"({CUDA_GRAPH_POOL_GB:.2f} GB) leave {slack:.2f} GB of the {reserved_gb:.2f} GB "
            f"reserve, under the {MIN_SLACK_GB:.1f} GB the CUDA context and other non-torch "
            "memory need: lower --max-num-seqs or raise --reserved-gb")
    return plan


def layers_to_offload(weights_gb: float, layer_gb: float, num_layers: int, budget_gb: float,
                      subspec: bool, substitute_fraction: float = SUBSTITUTE_FRACTION,
                      lm_head_gb: float = 0.0) -> int:
    """Fewest decoder layers to put in host memory so that what stays on the GPU fits the
    budget: resident weights, plus, for SubSpec, the substitutes of the offloaded layers
    (`substitute_fraction` of each) and the draft's quantized lm_head (the same fraction of
    `lm_head_gb`, held besides the target's). Like for like: both engines get the same budget,
    so SubSpec offloads more layers than plain offloading does."""
    head = substitute_fraction * lm_head_gb if subspec else 0.0
    for n in range(num_layers + 1):
        resident = weights_gb - n * layer_gb + head + (n * substitute_fraction * layer_gb
                                                       if subspec else 0.0)
        if resident <= budget_gb + 1e-9:
            return n
    raise ValueError(f"{weights_gb:.2f} GB of weights cannot fit a {budget_gb:.2f} GB budget "
                     "even with every decoder layer offloaded")


def prefetch_groups(num_layers: int, num_offload: int) -> tuple[int, int]:
    """(offload_group_size, offload_num_in_group) for vLLM's prefetch backend that offloads the
    fewest layers >= num_offload (it offloads layer i when i % group >= group - num_in_group:
    `model_executor/offloader/prefetch.py`), spreading them out (largest group first)."""
    if num_offload <= 0:
        return 0, 0
    best = None
    for group in range(num_layers, 0, -1):
        for in_group in range(1, group + 1):
            count = sum(1 for i in range(num_layers) if i % group >= group - in_group)
            if count >= num_offload:
                if best is None or count < best[0]:
                    best = (count, group, in_group)
                break
    return best[1], best[2]


def offload_kwargs(backend: str, num_layers: int, num_offload: int, layer_gb: float) -> dict:
    """vLLM engine arguments that put `num_offload` decoder layers in host memory ("auto": the
    bytes of that many layers as `--cpu-offload-gb`, the backend left to the engine)."""
    if backend == "auto":
        return dict(cpu_offload_gb=num_offload * layer_gb * 1e9 / 2**30)
    if backend == "uva":  # uva offloads layer by layer, in order, up to the byte budget
        return dict(cpu_offload_gb=num_offload * layer_gb * 1e9 / 2**30, offload_backend="uva")
    group, in_group = prefetch_groups(num_layers, num_offload)
    return dict(offload_backend="prefetch", offload_group_size=group,
                offload_num_in_group=in_group, offload_prefetch_step=1)


def engine_plans(args, shape: ModelShape, total_gb: float) -> dict[str, dict]:
    """Each engine's arguments and memory plan (no GPU needed); sets args.reserved_gb where it
    was left to the plan."""
    width, depth = (int(x) for x in args.tree.split("x"))
    if args.reserved_gb is None:
        args.reserved_gb = needed_reserve_gb(shape, args.max_num_seqs,
                                             args.max_num_batched_tokens, args.max_model_len,
                                             width, depth)
    budget_gb = args.memory_gb - args.reserved_gb
    plans = {}
    for name in ("plain", "subspec"):
        subspec = name == "subspec"
        n = layers_to_offload(shape.weights_gb, shape.layer_gb, shape.num_layers, budget_gb,
                              subspec=subspec, lm_head_gb=shape.lm_head_gb)
        engine = dict(gpu_memory_utilization=min(0.95, args.memory_gb / total_gb),
                      enforce_eager=False, max_model_len=args.max_model_len, dtype="bfloat16",
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs,
                      kv_cache_memory_bytes=kv_cache_bytes(shape, kv_tokens(
                          args.max_model_len, args.max_num_seqs)),
                      **offload_kwargs(args.offload_backend, shape.num_layers, n,
                                       shape.layer_gb))
        if subspec and args.offload_backend == "auto":  # SubSpec's engine rule: prefetch
            from vllm_subspec.vllm_hooks.prefetch_plan import plan_prefetch, substitute_share

            plan = plan_prefetch(shape.num_layers, int(shape.layer_gb * 1e9),
                                 engine["cpu_offload_gb"], substitute_share(4, 64))
            n = n if plan is None else len(plan.offloaded)  # its slots: more layers, same net
        plans[name] = {
            "engine": engine, "offloaded_layers": n,
            "speculative_config": {"method": "subspec", "tree_width": width,
                                   "tree_depth": depth} if subspec else None,
            "memory": check_memory_plan(shape, args.reserved_gb, args.max_num_seqs,
                                        args.max_num_batched_tokens, args.max_model_len,
                                        width, depth, subspec)}
    return plans


def main():
    args = parse_args()
    dummy = args.model is None
    model = args.model or random_qwen_7b()
    if args.dry_run:
        total_gb = args.gpu_memory_gb or 80.0
        for name, plan in engine_plans(args, ModelShape.of(model), total_gb).items():
            mem = plan["memory"]
            if name == "subspec" and not args.skip_default:
                print('[gpu_offload:default] the subspec engine below, with '
                      'speculative_config={"method": "subspec"} (auto, 6x48 at most)')
            print(f"[gpu_offload] {name} engine: {plan['offloaded_layers']} layers offloaded; "
                  f"speculative_config={json.dumps(plan['speculative_config'])}; "
                  f"{json.dumps(plan['engine'])}; limit {args.memory_gb:.1f} GB, reserve "
                  f"{mem['reserved_gb']:.2f} GB = profiling peak "
                  f"{mem['profiling_peak_gb']:.2f} GB + pinned {mem['kv_tokens']}-token KV "
                  f"{mem['kv_cache_gb']:.2f} GB + CUDA graphs {mem['cuda_graph_pool_gb']:.2f} "
                  f"GB + slack {mem['slack_gb']:.2f} GB")
        return
    import torch
    from vllm import SamplingParams

    from subspec_testing.harness import count_identical, run_engine

    total_gb = args.gpu_memory_gb or torch.cuda.get_device_properties(0).total_memory / 1e9
    shape = ModelShape.of(model)
    plans = engine_plans(args, shape, total_gb)
    w_gb = shape.weights_gb
    offload = {name: plan["offloaded_layers"] for name, plan in plans.items()}
    if dummy:
        for plan in plans.values():
            plan["engine"].update(load_format="dummy", skip_tokenizer_init=True)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (128,), generator=g).tolist()}
                   for _ in range(args.prompts)]
    else:
        from subspec_testing.assets import chat_prompts, mt_bench_prompts

        prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    width, depth = (int(x) for x in args.tree.split("x"))
    bandwidth = h2d_bandwidth_gbps()

    plain = run_engine(model, prompts, params, None, **plans["plain"]["engine"])
    spec = run_engine(model, prompts, params, plans["subspec"]["speculative_config"],
                      probe=lambda llm: profiled_steps(llm, prompts[:2], params),
                      **plans["subspec"]["engine"])
    default = None
    if not args.skip_default:  # what users run: the auto shape, within the same memory plan
        from subspec_testing.harness import step_stats

        default = run_engine(model, prompts, params, {"method": "subspec"},
                             probe=lambda llm: llm.collective_rpc(step_stats)[0],
                             **plans["subspec"]["engine"])
    steps = max(spec.draft_steps, 1)
    draft_pass_ms = 1e3 * spec.draft_seconds / steps / depth
    # the projection's overlap applies only where SubSpec runs the prefetch offloader
    setting = GpuSetting(name="this GPU", weight_gb=w_gb, memory_gb=args.memory_gb,
                         reserved_gb=args.reserved_gb, bandwidth_gbps=bandwidth,
                         draft_pass_ms=draft_pass_ms, layer_gb=shape.layer_gb,
                         num_layers=shape.num_layers,
                         backend="uva" if args.offload_backend == "uva" else "prefetch")
    tau = spec.timed.stats.tau
    ratio = spec.timed.tokens_per_second / plain.timed.tokens_per_second
    report = {
        "command": "python " + " ".join(sys.argv),
        "model": "Qwen2.5-7B shape, random weights (tau meaningless)" if dummy else model,
        "gpu": torch.cuda.get_device_name(0), "environment": environment(),
        "weights_gb": w_gb, "memory_limit_gb": args.memory_gb, "offloaded_layers": offload,
        "memory_plan": {name: plan["memory"] for name, plan in plans.items()},
        "h2d_bandwidth_gbps": bandwidth,
        "plain_tokens_per_second": plain.timed.tokens_per_second,
        "subspec_tokens_per_second": spec.timed.tokens_per_second,
        # random weights: τ ≈ 1, so the ratio is what the kernels cost, not a speed-up
        ("tokens_per_second_ratio_kernel_costs_only" if dummy else "measured_speedup"): ratio,
        "tau": tau, "draft_seconds_per_step": spec.draft_seconds / steps,
        "draft_pass_ms": draft_pass_ms,
        # a profiled generation of 2 prompts after the timed runs (torch.profiler's counts)
        "graph_replays_per_step": spec.probed["graph_replays_per_step"],
        "host_syncs_per_step": spec.probed["host_syncs_per_step"],
        "profiled_steps": spec.probed,
        "identical": f"{count_identical(plain.batched.token_ids, spec.batched.token_ids)}"
                     f"/{len(prompts)}",
    }
    if default is not None:
        stats = default.probed
        report.update({
            "default_config_tokens_per_second": default.timed.tokens_per_second,
            "default_config_ratio_to_plain":
                default.timed.tokens_per_second / plain.timed.tokens_per_second,
            "default_config_tau": default.timed.stats.tau,
            # counted from engine start (its warm-up request included)
            "default_config_first_drafting_step": stats["first_drafting_step"],
            "default_config_plain_step_share": stats["plain_steps"] / max(stats["draft_steps"], 1),
            "default_config_identical":
                f"{count_identical(plain.batched.token_ids, default.batched.token_ids)}"
                f"/{len(prompts)}",
        })
    if dummy:  # τ from random weights says nothing: the paper's, with this GPU's costs
        report["PROJECTED_speedup_at_the_papers_tau_27.08_D48"] = projected_speedup(
            27.08, 48, setting)
    else:
        report["PROJECTED_speedup"] = projected_speedup(tau, depth, setting)
    out = RESULTS / "gpu_offload"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = ["# GPU offload benchmark", "", f"Command: `{report['command']}`", "",
          "| quantity | value |", "|---|---|"]
    md += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
           for k, v in report.items() if k not in ("command", "environment")]
    md += ["", "PROJECTED_speedup is the cost model of benchmarks/projection.py fed with this "
           "run's τ (the paper's with random weights), draft pass time and bandwidth; it is "
           "not a measurement."]
    if dummy:
        md += ["", "Random weights (no --model): τ ≈ 1, so no speed-up is measured; the tokens/s "
               "ratio shows what the kernels cost."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
