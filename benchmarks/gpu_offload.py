"""GPU benchmark in the paper's setting: plain offloading vs SubSpec under a memory limit.

The memory limit is emulated the way vLLM users meet it: weights beyond the limit go to host
memory (`--cpu-offload-gb`, or the prefetch backend), and the engine's GPU memory share is set to
the limit. Without `--model`, a Qwen2.5-7B-shaped model with random weights is used (vLLM's
`load_format="dummy"`: speeds are real, τ is meaningless); pass a real checkpoint path for τ.
Writes benchmarks/results/gpu_offload.{json,md}, with a PROJECTION (benchmarks/projection.py)
from the measured τ, draft time and host-to-device bandwidth beside the measured speed-up.

    python benchmarks/gpu_offload.py                                  # random 7B, 8 GB limit
    python benchmarks/gpu_offload.py --model /models/Qwen2.5-7B-Instruct --memory-gb 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # subspec_testing (repo root)

from depth_sweep import RESULTS, environment  # noqa: E402
from projection import SUBSTITUTE_FRACTION, GpuSetting, projected_speedup  # noqa: E402

QWEN25_7B = dict(  # Qwen/Qwen2.5-7B-Instruct config.json
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    hidden_act="silu", bos_token_id=151643, eos_token_id=151645)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint path (default: Qwen2.5-7B shape, random weights)")
    ap.add_argument("--memory-gb", type=float, default=8.0, help="GPU memory limit")
    ap.add_argument("--reserved-gb", type=float, default=1.5,
                    help="part of the limit kept for KV cache, activations and CUDA graphs")
    ap.add_argument("--offload-backend", choices=["uva", "prefetch"], default="uva")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tree", default="6x48", help="KxD")
    return ap.parse_args()


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


def model_size(model: str) -> tuple[float, int, float]:
    """(bf16 weight GB, decoder layers, bf16 GB of one decoder layer) from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    h, i, n, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = h // c.num_attention_heads * c.num_key_value_heads
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    embeds = v * h * (1 if c.tie_word_embeddings else 2)
    return 2 * (n * per_layer + embeds) / 1e9, n, 2 * per_layer / 1e9


def layers_to_offload(weights_gb: float, layer_gb: float, num_layers: int, budget_gb: float,
                      subspec: bool, substitute_fraction: float = SUBSTITUTE_FRACTION) -> int:
    """Fewest decoder layers to put in host memory so that what stays on the GPU fits the
    budget: resident weights, plus, for SubSpec, the substitutes of the offloaded layers
    (`substitute_fraction` of each). Like for like: both engines get the same budget, so SubSpec
    offloads more layers than plain offloading does."""
    for n in range(num_layers + 1):
        resident = weights_gb - n * layer_gb + (n * substitute_fraction * layer_gb if subspec
                                                else 0.0)
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
    """vLLM engine arguments that put `num_offload` decoder layers in host memory."""
    if backend == "uva":  # uva offloads layer by layer, in order, up to the byte budget
        return dict(cpu_offload_gb=num_offload * layer_gb * 1e9 / 2**30)
    group, in_group = prefetch_groups(num_layers, num_offload)
    return dict(offload_backend="prefetch", offload_group_size=group,
                offload_num_in_group=in_group, offload_prefetch_step=1)


def main():
    args = parse_args()
    import torch
    from vllm import SamplingParams

    from subspec_testing.harness import count_identical, run_engine

    dummy = args.model is None
    model = args.model or random_qwen_7b()
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    w_gb, n_layers, layer_gb = model_size(model)
    budget_gb = args.memory_gb - args.reserved_gb
    # Same memory limit for both engines: SubSpec's substitutes live in it, so it offloads more.
    offload = {name: offload_kwargs(args.offload_backend, n_layers,
                                    layers_to_offload(w_gb, layer_gb, n_layers, budget_gb,
                                                      subspec=name == "subspec"), layer_gb)
               for name in ("plain", "subspec")}
    engine = dict(gpu_memory_utilization=min(0.95, args.memory_gb / total_gb),
                  enforce_eager=False, max_model_len=4096, dtype="bfloat16",
                  max_num_batched_tokens=8192)
    if dummy:
        engine.update(load_format="dummy", skip_tokenizer_init=True)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (128,), generator=g).tolist()}
                   for _ in range(args.prompts)]
    else:
        from subspec_testing.assets import chat_prompts, mt_bench_prompts

        prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    width, depth = (int(x) for x in args.tree.split("x"))
    bandwidth = h2d_bandwidth_gbps()

    plain = run_engine(model, prompts, params, None, **engine, **offload["plain"])
    spec = run_engine(model, prompts, params,
                      {"method": "subspec", "tree_width": width, "tree_depth": depth},
                      **engine, **offload["subspec"])
    steps = max(spec.draft_steps, 1)
    draft_pass_ms = 1e3 * spec.draft_seconds / steps / depth
    setting = GpuSetting(name="this GPU", weight_gb=w_gb, memory_gb=args.memory_gb,
                         reserved_gb=args.reserved_gb, bandwidth_gbps=bandwidth,
                         draft_pass_ms=draft_pass_ms)
    tau = spec.timed.stats.tau
    report = {
        "command": "python " + " ".join(sys.argv),
        "model": "Qwen2.5-7B shape, random weights (tau meaningless)" if dummy else model,
        "gpu": torch.cuda.get_device_name(0), "environment": environment(),
        "weights_gb": w_gb, "memory_limit_gb": args.memory_gb, "offload": offload,
        "h2d_bandwidth_gbps": bandwidth,
        "plain_tokens_per_second": plain.timed.tokens_per_second,
        "subspec_tokens_per_second": spec.timed.tokens_per_second,
        "measured_speedup": spec.timed.tokens_per_second / plain.timed.tokens_per_second,
        "tau": tau, "draft_seconds_per_step": spec.draft_seconds / steps,
        "draft_pass_ms": draft_pass_ms,
        "identical": f"{count_identical(plain.batched.token_ids, spec.batched.token_ids)}"
                     f"/{len(prompts)}",
        "PROJECTED_speedup": projected_speedup(tau, depth, setting),
    }
    out = RESULTS / "gpu_offload"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = ["# GPU offload benchmark", "", f"Command: `{report['command']}`", "",
          "| quantity | value |", "|---|---|"]
    md += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
           for k, v in report.items() if k not in ("command", "environment")]
    md += ["", "PROJECTED_speedup is the cost model of benchmarks/projection.py fed with this "
           "run's τ, draft pass time and bandwidth; it is not a measurement."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
