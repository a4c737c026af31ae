"""Never slower than plain: the default config (`{"method": "subspec"}`) against plain decoding
on vLLM's CPU backend, one request at a time and at 8 and 32 concurrent requests, the first
batch after the engines start and the later ones; greedy, bf16, held-out mixed prompts.

Both engines start before anything is timed and stay up; each round times plain, then SubSpec,
on the same prompts (alternating, so drift in the machine's speed hits both). For each
concurrency the first round is "first batch" (for the first concurrency measured, the first
batch after start-up: compilation, exploration and the tuner's first measurements included),
the median of the later rounds is "steady". The machine's single-core memory bandwidth (a
copy, bytes read + written) is measured in the same run and printed beside every ratio, as is
plain's tokens/s. Writes benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.never_slower --model smollm2 --control --rounds 4 \
        --name never_slower_smollm2
    python -m benchmarks.never_slower --model smollm2 --compiled --control --rounds 4 \
        --name never_slower_smollm2_compiled
    python -m benchmarks.never_slower --model qwen-coder-1.5b --kv-cache-gb 2 \
        --name never_slower_qwen
    python -m benchmarks.never_slower --model qwen-coder-1.5b --kv-cache-gb 2 --compiled \
        --name never_slower_qwen_compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.cpu_speed import mixed_prompts
from benchmarks.depth_sweep import RESULTS, environment, kv_kwargs, model_path, stream_gbps


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="never_slower")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--single-prompts", type=int, default=4,
                    help="prompts run one at a time for concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default mode (compiled with inductor) instead of eager")
    ap.add_argument("--control", action="store_true",
                    help="also run a second plain engine, timed like SubSpec's: its ratio to "
                         "the first (an A/A ratio) is this run's noise between two engines "
                         "(three Qwen-1.5B engines with 2 GB KV caches do not fit 24 GiB)")
    return ap.parse_args()


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import LLM, SamplingParams

    from subspec_testing.assets import chat_prompts
    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, step_stats, \
        timed_generate

    model = model_path(args.model)
    prompts = chat_prompts(model, mixed_prompts(max(max(args.concurrency),
                                                    args.single_prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    bandwidth_before = stream_gbps()
    kw = dict(enforce_eager=not args.compiled, max_num_batched_tokens=16384,
              **CPU_ENGINE_KWARGS, **kv_kwargs(args))
    kw["max_num_seqs"] = max(args.concurrency)
    engines = {"plain": LLM(model=model, **kw),
               "subspec": LLM(model=model, speculative_config={"method": "subspec"}, **kw)}
    if args.control:
        engines["control"] = LLM(model=model, **kw)
    results = {}
    try:
        for c in args.concurrency:
            batch = prompts[: args.single_prompts] if c == 1 else prompts[:c]
            rounds = {name: [] for name in engines}
            outputs = {}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    run = timed_generate(llm, batch, params, spec=False, one_at_a_time=c == 1)
                    rounds[name].append(run.num_tokens / run.seconds)
                    outputs.setdefault(name, run.token_ids)
            results[c] = {
                "tokens_per_second": rounds,
                "first_ratio": rounds["subspec"][0] / rounds["plain"][0],
                "steady_ratio": statistics.median(
                    s / p for s, p in zip(rounds["subspec"][1:], rounds["plain"][1:])),
                "identical": sum(a == b for a, b in zip(outputs["subspec"], outputs["plain"])),
                "requests": len(batch),
            }
            if args.control:
                results[c]["control_ratios"] = [x / p for x, p in zip(rounds["control"],
                                                                       rounds["plain"])]
            print(f"[never_slower] {c} concurrent: {json.dumps(results[c])}", flush=True)
        stats = engines["subspec"].collective_rpc(step_stats)[0]
    finally:
        for llm in engines.values():
            shutdown_engine(llm)
    report = {
        "command": "python -m benchmarks.never_slower " + " ".join(sys.argv[1:]),
        "model": model, "dtype": "bfloat16", "max_tokens": args.max_tokens,
        "mode": "compiled" if args.compiled else "eager", "environment": environment(),
        "memory_gbps": {"before": bandwidth_before, "after": stream_gbps()},
        "results": {str(c): r for c, r in results.items()}, "subspec_steps": stats,
    }
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def markdown(report: dict) -> str:
    bw = report["memory_gbps"]
    lines = [f"# Never slower than plain: {os.path.basename(report['model'])}, {report['mode']}",
             "", f"`{report['command']}`", "",
             f"The default config vs plain decoding, greedy, bf16, {report['max_tokens']} "
             f"tokens a request, held-out mixed prompts; {report['environment']['cpu']}, "
             f"single-core memory bandwidth {bw['before']:.1f} GB/s before the run and "
             f"{bw['after']:.1f} after (a copy, read + written). Each concurrency: rounds of "
             "plain then SubSpec; \"first\" is its first round (for the first concurrency, "
             "the first batch after start-up), \"steady\" the median of the later ones.", ""]
    control = any("control_ratios" in r for r in report["results"].values())
    if control:
        lines += ["A/A control: a second plain engine, started after SubSpec's and timed after "
                  "it in each round; its ratios to the first plain engine are what two "
                  "identical engines differ by in this run.", ""]
    lines += ["| concurrent | plain tok/s (first, later) | SubSpec tok/s (first, later) | "
              "first | steady | identical |" + (" A/A control, each round |" if control else ""),
              "|---|---|---|---|---|---|" + ("---|" if control else "")]
    for c, r in report["results"].items():
        t = r["tokens_per_second"]
        aa = f" {', '.join(f'{x:.2f}' for x in r['control_ratios'])} |" if control else ""
        lines.append(f"| {c} | {', '.join(f'{x:.1f}' for x in t['plain'])} | "
                     f"{', '.join(f'{x:.1f}' for x in t['subspec'])} | "
                     f"**{r['first_ratio']:.2f}x** | **{r['steady_ratio']:.2f}x** | "
                     f"{r['identical']}/{r['requests']} |{aa}")
    s = report["subspec_steps"]
    lines += ["", f"SubSpec's steps over the run: {s.get('draft_steps')} proposals, "
              f"{s.get('plain_steps')} of them plain.", ""]
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    cs = list(report["results"])
    for i, (key, label) in enumerate((("first_ratio", "first batch"),
                                      ("steady_ratio", "steady"))):
        ax.bar([j + 0.4 * i for j in range(len(cs))],
               [report["results"][c][key] for c in cs], 0.4, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.97, color="r", lw=0.8, ls="--", label="0.97x")
    ax.set_xticks([j + 0.2 for j in range(len(cs))], [f"{c} concurrent" for c in cs])
    ax.set_ylabel("SubSpec / plain tokens/s")
    ax.set_title(f"{os.path.basename(report['model'])}, {report['mode']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
