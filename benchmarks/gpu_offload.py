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

from depth_sweep import RESULTS, environment  # noqa: E402
from projection import GpuSetting, projected_speedup  # noqa: E402

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


def model_size(model: str) -> tuple[float, int]:
    """(bf16 weight GB, decoder layers) from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    h, i, n, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = h // c.num_attention_heads * c.num_key_value_heads
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    embeds = v * h * (1 if c.tie_word_embeddings else 2)
    return 2 * (n * per_layer + embeds) / 1e9, n


def main():
    args = parse_args()
    import torch
    from vllm import SamplingParams

    from vllm_subspec.harness import count_identical, run_engine

    dummy = args.model is None
    model = args.model or random_qwen_7b()
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    w_gb, n_layers = model_size(model)
    offload_gb = max(0.0, w_gb - (args.memory_gb - args.reserved_gb))
    if args.offload_backend == "uva":
        offload = dict(cpu_offload_gb=offload_gb * 1e9 / 2**30)
    else:  # prefetch: offload 1 of every `group` layers, as many as the limit needs
        group = max(1, round(n_layers / max(1, round(n_layers * offload_gb / w_gb))))
        offload = dict(offload_backend="prefetch", offload_group_size=group,
                       offload_num_in_group=1, offload_prefetch_step=1)
    engine = dict(offload, gpu_memory_utilization=min(0.95, args.memory_gb / total_gb),
                  enforce_eager=False, max_model_len=4096, dtype="bfloat16",
                  max_num_batched_tokens=8192)
    if dummy:
        engine.update(load_format="dummy", skip_tokenizer_init=True)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (128,), generator=g).tolist()}
                   for _ in range(args.prompts)]
    else:
        from vllm_subspec.assets import chat_prompts, mt_bench_prompts

        prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    width, depth = (int(x) for x in args.tree.split("x"))
    bandwidth = h2d_bandwidth_gbps()

    plain = run_engine(model, prompts, params, None, **engine)
    spec = run_engine(model, prompts, params,
                      {"method": "subspec", "tree_width": width, "tree_depth": depth}, **engine)
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
