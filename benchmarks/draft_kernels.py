"""Draft-pass matmul time per row count on one CPU core: the 4-bit substitute kernels against
the bf16 weights the target multiplies with, over a whole pass's linears (every layer's four,
then the lm_head), each layer its own weights, so a pass streams them from memory as a draft
pass does (a single linear timed in a loop stays in the last-level cache).

Kernels: 'bf16': the target's weights (F.linear); 'tinygemm': `Int4CpuKernel`
(`aten._weight_int4pack_mm_for_cpu`); 'dot': `Int4DotCpuKernel` (the AVX512-BF16 kernel,
draft_model/int4_dot_cpu.py); 'default': the kernel "auto" picks on this CPU, with a dense twin
from the row count where a plain matmul of the same HQQ weights is faster (timed per shape at
construction, as the draft does). Every draft column has a 4-bit lm_head (the draft's own); the
target's bf16 head costs what the 'bf16' column's head costs.

Random weights of the model's shapes (time does not depend on values); torch on one thread, as
vLLM's CPU worker runs. Row counts: what a draft pass sends for B requests (B for a chain step or
a tree's root, B*k for tree levels). Writes benchmarks/results/<name>.{json,md}.

    python -m benchmarks.draft_kernels --model qwen-coder-1.5b --name draft_kernels_qwen
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.depth_sweep import RESULTS, bf16_peak_gflops, environment, stream_gbps

SHAPES = {  # name -> (hidden, intermediate, q heads, kv heads, head dim, vocab, layers)
    "qwen-coder-1.5b": (1536, 8960, 12, 2, 128, 151936, 28),
    "smollm2": (576, 1536, 9, 3, 64, 49152, 30),
}


def linears(model: str) -> dict[str, tuple[int, int]]:
    h, inter, qh, kvh, hd, vocab, _ = SHAPES[model]
    return {"qkv_proj": ((qh + 2 * kvh) * hd, h), "o_proj": (h, qh * hd),
            "gate_up_proj": (2 * inter, h), "down_proj": (h, inter), "lm_head": (vocab, h)}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    import torch

    from vllm_subspec.draft_model import int4_dot_cpu
    from vllm_subspec.draft_model.substitute import (
        Int4CpuKernel,
        Int4DotCpuKernel,
        choose_kernel,
        quantize,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-coder-1.5b", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 24, 48])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="draft_kernels")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = SHAPES[args.model][-1]
    shapes = linears(args.model)
    kinds = ["bf16", "tinygemm"] + (["dot"] if int4_dot_cpu.available() else []) + ["default"]
    passes: dict[str, list] = {kind: [] for kind in kinds}  # kind -> [(name, fn)] in pass order
    dense_from: dict[str, int | None] = {}
    for name, (n, k) in shapes.items():
        for layer in range(1 if name == "lm_head" else layers):
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            qw = quantize(w, 4, 64, "rtn")
            default_cls = choose_kernel(qw, torch.device("cpu"))
            built = {"bf16": lambda x, w=w: torch.nn.functional.linear(x, w),
                     "tinygemm": Int4CpuKernel(qw, torch.bfloat16),
                     "default": default_cls(qw, torch.bfloat16, max_rows=max(args.rows))}
            if "dot" in kinds:
                built["dot"] = Int4DotCpuKernel(qw, torch.bfloat16)
            dense_from[name] = built["default"].dense_from_rows
            for kind in kinds:
                passes[kind].append((name, built[kind]))
            del w
    # the roofline: what one core can stream and compute (measured in this run)
    roof = {"stream_gbps": stream_gbps(), "bf16_gflops": bf16_peak_gflops()}
    params = sum(n * k * (1 if name == "lm_head" else layers)
                 for name, (n, k) in shapes.items())
    # bytes a pass streams: bf16 weights, or 4-bit codes + bf16 scale and zero per 64
    pass_bytes = {kind: params * (2 if kind == "bf16" else 4.5 / 8) for kind in kinds}
    print(f"roofline: {roof['stream_gbps']:.1f} GB/s, {roof['bf16_gflops']:.0f} GFLOP/s",
          flush=True)
    per_pass: dict[int, dict[str, float]] = {}
    for m in args.rows:
        x = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in shapes.values()}}
        per_pass[m] = {}
        for kind in kinds:
            body = [fn for name, fn in passes[kind] if name != "lm_head"]
            head = [fn for name, fn in passes[kind] if name == "lm_head"][0]
            ins = [x[shapes[name][1]] for name, _ in passes[kind] if name != "lm_head"]
            per_pass[m][kind] = best_of(lambda: [f(v) for f, v in zip(body, ins)],  # noqa: B023
                                        args.repeats)
            per_pass[m][kind + "_lm_head"] = best_of(
                lambda: head(x[shapes["lm_head"][1]]), args.repeats)  # noqa: B023
        print(m, {k: round(1e3 * v, 1) for k, v in per_pass[m].items()}, flush=True)
    report = {"command": "python -m benchmarks.draft_kernels " + " ".join(sys.argv[1:]),
              "model": args.model, "environment": environment(), "kinds": kinds,
              "default_kernel": type(passes["default"][0][1]).__name__,
              "dense_from_rows": dense_from, "per_pass": per_pass, "roofline": roof,
              "params": params}
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    ms = lambda p, kind: 1e3 * (p[kind] + p[kind + "_lm_head"])  # noqa: E731
    draft = [kind for kind in kinds if kind != "bf16"]
    lines = [f"# Draft-pass matmuls on one CPU core: {args.model}", "",
             f"Command: `{report['command']}`", "",
             "Best of repeats, ms per pass: every layer's four linears (each layer its own "
             "weights, streamed from memory), then the lm_head (in brackets: the head alone). "
             "bf16: the target's weights; tinygemm: torch's int4 CPU kernel; dot: the "
             "AVX512-BF16 kernel; default: what `kernel: \"auto\"` runs on this CPU "
             f"(`{report['default_kernel']}`, with a dense twin from the row counts listed "
             "below). Draft kernels with a 4-bit lm_head.", "",
             "| rows | " + " | ".join(kinds) + " | "
             + " | ".join(f"{kind} / bf16" for kind in draft) + " |",
             "|---|" + "---|" * (len(kinds) + len(draft))]
    for m, p in per_pass.items():
        lines.append(f"| {m} | " + " | ".join(
            f"{ms(p, kind):.1f} ({1e3 * p[kind + '_lm_head']:.1f})" for kind in kinds) + " | "
            + " | ".join(f"{ms(p, kind) / ms(p, 'bf16'):.2f}" for kind in draft) + " |")
    # each kind's achieved rates beside the roofline: a pass that streams at about the core's
    # bandwidth is memory-bound; one whose GFLOP/s nears the bf16 rate is compute-bound (more
    # rows then cost in proportion: the shapes the tuner should not explore)
    lines += ["", f"Roofline (this run, one core): memory {roof['stream_gbps']:.1f} GB/s "
              f"(a copy, read + written), bf16 matmul {roof['bf16_gflops']:.0f} GFLOP/s. "
              "Per pass, each kind's GB/s of weights streamed and GFLOP/s:", "",
              "| rows | " + " | ".join(f"{kind} GB/s, GFLOP/s" for kind in kinds)
              + " | bound (default) |", "|---|" + "---|" * (len(kinds) + 1)]
    for m, p in per_pass.items():
        cells, bound = [], ""
        for kind in kinds:
            seconds = p[kind] + p[kind + "_lm_head"]
            gbps, gflops = pass_bytes[kind] / seconds / 1e9, 2 * m * params / seconds / 1e9
            cells.append(f"{gbps:.1f}, {gflops:.0f}")
            if kind == "default":
                bound = ("compute" if gflops > 0.5 * roof["bf16_gflops"] else
                         "memory" if gbps > 0.5 * roof["stream_gbps"] else "neither (overhead)")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {bound} |")
    if "dot" in kinds:
        lines += ["", "dot / tinygemm per pass: " + ", ".join(
            f"{m} rows {ms(p, 'dot') / ms(p, 'tinygemm'):.2f}" for m, p in per_pass.items())]
    lines += ["", "Dense twin from (rows, `default`): " + ", ".join(
        f"{name} {dense_from[name]}" for name in shapes)]
    env = report["environment"]
    lines += ["", f"Machine: {env['cpu']}; torch {env['torch']}; {env['date']}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
