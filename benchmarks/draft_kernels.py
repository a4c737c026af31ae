"""Draft-pass matmul time per row count on one CPU core: the int4 substitute kernel vs the bf16
weights the target multiplies with, for every linear of a model's draft pass, and the draft's
lm_head bf16 (the target's, shared: before) vs 4-bit (its own: after), and the kernel as the
draft runs it by default: int4 with a dense twin from the row count where a plain matmul of the
same HQQ weights is faster (`Int4CpuKernel(..., max_rows)`, the per-row-count choice).

Random weights of the model's shapes (time does not depend on values); torch on one thread, as
vLLM's CPU worker runs. Row counts: what a draft pass sends for B requests (B for a chain step
or a tree's root, B*k for tree levels). Writes benchmarks/results/<name>.{json,md}.

    python -m benchmarks.draft_kernels --model qwen-coder-1.5b --name draft_kernels_qwen
"""

from __future__ import annotations

import argparse
import json
import sys
import time


from benchmarks.depth_sweep import RESULTS, environment

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

    from vllm_subspec.draft_model.substitute import Int4CpuKernel, quantize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-coder-1.5b", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 24, 48])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="draft_kernels")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = SHAPES[args.model][-1]
    times: dict[str, dict[int, dict[str, float]]] = {}
    for name, (n, k) in linears(args.model).items():
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        qw = quantize(w, 4, 64, "rtn")
        kernel = Int4CpuKernel(qw, torch.bfloat16)
        chosen = Int4CpuKernel(qw, torch.bfloat16, max_rows=max(args.rows))  # times its own
        times[name] = {}
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            times[name][m] = {
                "bf16": best_of(lambda: torch.nn.functional.linear(x, w), args.repeats),  # noqa: B023
                "int4": best_of(lambda: kernel(x), args.repeats),  # noqa: B023
                "per_row_choice": best_of(lambda: chosen(x), args.repeats)}  # noqa: B023
        times[name]["dense_from_rows"] = chosen.dense_from_rows
    per_pass = {}
    for m in args.rows:
        body = {kind: layers * sum(times[n][m][kind] for n in times if n != "lm_head")
                for kind in ("bf16", "int4", "per_row_choice")}
        per_pass[m] = {"target_linears_bf16": body["bf16"], "substitutes_int4": body["int4"],
                       "lm_head_bf16": times["lm_head"][m]["bf16"],
                       "lm_head_int4": times["lm_head"][m]["int4"],
                       "draft_per_row_choice": body["per_row_choice"]
                       + times["lm_head"][m]["per_row_choice"]}
    report = {"command": "python " + " ".join(sys.argv), "model": args.model,
              "environment": environment(), "per_linear": times, "per_pass": per_pass}
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Draft-pass matmuls on one CPU core: {args.model}", "",
             f"Command: `{report['command']}`", "",
             "Best of repeats, ms. A draft pass's linears: every layer's four, then the lm_head. "
             "'before': substitutes int4 + the target's bf16 lm_head; 'int4': substitutes "
             "int4 + the draft's own int4 lm_head; 'per row count': the same, each linear "
             "switching to its dense twin (same HQQ weights, bf16) from the row count timed "
             "faster, as the draft runs by default.", "",
             "| rows | target linears bf16 | substitutes int4 | lm_head bf16 | lm_head int4 "
             "| draft before | draft int4 | draft per row count | per row count / before |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, p in per_pass.items():
        before = p["substitutes_int4"] + p["lm_head_bf16"]
        after = p["substitutes_int4"] + p["lm_head_int4"]
        lines.append(f"| {m} | {1e3 * p['target_linears_bf16']:.1f} | "
                     f"{1e3 * p['substitutes_int4']:.1f} | {1e3 * p['lm_head_bf16']:.1f} | "
                     f"{1e3 * p['lm_head_int4']:.1f} | {1e3 * before:.1f} | {1e3 * after:.1f} | "
                     f"{1e3 * p['draft_per_row_choice']:.1f} | "
                     f"{p['draft_per_row_choice'] / before:.2f} |")
    lines += ["", "Per linear (ms, bf16 / int4 / per row count; the dense twin from the rows "
              "in the last column):", "",
              "| linear | " + " | ".join(str(m) for m in args.rows) + " | dense from |",
              "|---|" + "---|" * (len(args.rows) + 1)]
    for name, row in times.items():
        lines.append(f"| {name} {linears(args.model)[name]} | " + " | ".join(
            f"{1e3 * row[m]['bf16']:.2f} / {1e3 * row[m]['int4']:.2f} / "
            f"{1e3 * row[m]['per_row_choice']:.2f}" for m in args.rows)
            + f" | {row['dense_from_rows']} |")
    env = report["environment"]
    lines += ["", f"Machine: {env['cpu']}; torch {env['torch']}; {env['date']}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
