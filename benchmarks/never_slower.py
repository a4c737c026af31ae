"""Never slower than plain: the default config (`{"method": "subspec"}`) against plain decoding
on vLLM's CPU backend, one request at a time and at 8 and 32 concurrent requests, the first
batch after an engine starts and the later ones; greedy, bf16, held-out mixed prompts.

One engine is up at a time, as a user runs one: engines that stay up side by side share the
worker's core (each idle worker polls it) and disturbed each other by more than the 3% this
measures. Engines alternate, plain, SubSpec, plain, SubSpec, ... (`--engines` of each), so
drift in the machine's speed hits both; each runs the whole sequence (every concurrency,
`--rounds` rounds each, the same prompts). For a concurrency, "first" is the first round of
each engine (for the first concurrency: the first batch after start-up, compilation,
exploration and the tuner's first measurements included), "steady" the later rounds; a ratio
pairs SubSpec's engine i with plain's engine i, round by round, and the table gives the
median. Two plain engines' ratio, round by round, is this run's A/A: what two identical
engines differ by. The machine's single-core memory bandwidth (a copy, bytes read + written)
and plain's tokens/s are printed beside every ratio. Writes
benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.never_slower --model smollm2 --name never_slower_smollm2
    python -m benchmarks.never_slower --model smollm2 --compiled \
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

KINDS = ("plain", "subspec")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="never_slower")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--single-prompts", type=int, default=4,
                    help="prompts run one at a time for concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2,
                    help="engines of each kind, started one at a time, alternating")
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default mode (compiled with inductor) instead of eager")
    return ap.parse_args()


def run_engine(kind: str, args, model: str, prompts: list, params) -> dict:
    """Start one engine, time the whole sequence on it, shut it down."""
    from vllm import LLM

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, step_stats, \
        timed_generate

    kw = dict(enforce_eager=not args.compiled, max_num_batched_tokens=16384,
              **CPU_ENGINE_KWARGS, **kv_kwargs(args))
    kw["max_num_seqs"] = max(args.concurrency)
    spec = {"method": "subspec"} if kind == "subspec" else None
    llm = LLM(model=model, speculative_config=spec, **kw)
    stats = (lambda: llm.collective_rpc(step_stats)[0]) if spec else (lambda: None)
    runs = {}
    try:
        for c in args.concurrency:
            batch = prompts[: args.single_prompts] if c == 1 else prompts[:c]
            rates, steps, token_ids = [], [], None
            for _ in range(args.rounds):
                before = stats()
                run = timed_generate(llm, batch, params, spec=False, one_at_a_time=c == 1)
                rates.append(run.num_tokens / run.seconds)
                token_ids = token_ids or run.token_ids
                if before is not None:  # what SubSpec's steps did in this round
                    steps.append(round_steps(before, stats()))
            runs[c] = {"tokens_per_second": rates, "token_ids": token_ids,
                       "subspec_rounds": steps}
            print(f"[never_slower] {kind} {c} concurrent: "
                  f"{', '.join(f'{r:.1f}' for r in rates)} tok/s", flush=True)
        totals = stats()
    finally:
        shutdown_engine(llm)
    return {"kind": kind, "runs": runs, "subspec_steps": totals}


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import SamplingParams

    from subspec_testing.assets import chat_prompts

    model = model_path(args.model)
    prompts = chat_prompts(model, mixed_prompts(max(max(args.concurrency),
                                                    args.single_prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    bandwidth_before = stream_gbps()
    engines = {kind: [] for kind in KINDS}
    for _ in range(args.engines):
        for kind in KINDS:
            engines[kind].append(run_engine(kind, args, model, prompts, params))
    results = {c: compare(engines, c) for c in args.concurrency}
    report = {
        "command": "python -m benchmarks.never_slower " + " ".join(sys.argv[1:]),
        "model": model, "dtype": "bfloat16", "max_tokens": args.max_tokens,
        "mode": "compiled" if args.compiled else "eager", "environment": environment(),
        "memory_gbps": {"before": bandwidth_before, "after": stream_gbps()},
        "results": {str(c): r for c, r in results.items()},
        "subspec_steps": [e["subspec_steps"] for e in engines["subspec"]],
    }
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def compare(engines: dict, c: int) -> dict:
    """One concurrency's rates (engine by engine, round by round) and their ratios."""
    plain = [e["runs"][c] for e in engines["plain"]]
    subspec = [e["runs"][c] for e in engines["subspec"]]
    pairs = [[s / p for s, p in zip(sub["tokens_per_second"], pl["tokens_per_second"])]
             for sub, pl in zip(subspec, plain)]
    first = plain[0]["token_ids"]
    return {
        "tokens_per_second": {"plain": [r["tokens_per_second"] for r in plain],
                              "subspec": [r["tokens_per_second"] for r in subspec]},
        "first_ratio": statistics.median(p[0] for p in pairs),
        "steady_ratio": statistics.median(x for p in pairs for x in p[1:]),
        "first_ratios": [p[0] for p in pairs],
        "steady_ratios": [x for p in pairs for x in p[1:]],
        "aa_ratios": [b / a for other in plain[1:]
                      for a, b in zip(plain[0]["tokens_per_second"],
                                      other["tokens_per_second"])],
        "identical": [sum(a == b for a, b in zip(r["token_ids"], first)) for r in subspec],
        "requests": len(first),
        "subspec_rounds": [r["subspec_rounds"] for r in subspec],
    }


def round_steps(before: dict, after: dict) -> dict:
    """SubSpec's steps in one round (the difference of two `StepStats`): proposals, those
    that drafted, and the seconds its drafts and verifies took."""
    keys = ("draft_steps", "plain_steps", "draft_seconds", "verify_seconds")
    d = {k: after[k] - before[k] for k in keys}
    return {"steps": d["draft_steps"], "drafting": d["draft_steps"] - d["plain_steps"],
            "draft_seconds": round(d["draft_seconds"], 3),
            "verify_seconds": round(d["verify_seconds"], 3)}


def _rates(per_engine: list[list[float]]) -> str:
    return "; ".join(", ".join(f"{x:.1f}" for x in rounds) for rounds in per_engine)


def markdown(report: dict) -> str:
    bw = report["memory_gbps"]
    lines = [f"# Never slower than plain: {os.path.basename(report['model'])}, {report['mode']}",
             "", f"`{report['command']}`", "",
             f"The default config vs plain decoding, greedy, bf16, {report['max_tokens']} "
             f"tokens a request, held-out mixed prompts; {report['environment']['cpu']}, "
             f"{report['environment']['date']}, single-core memory bandwidth "
             f"{bw['before']:.1f} GB/s before the run and {bw['after']:.1f} after (a copy, read "
             "+ written). One engine up at a time, alternating plain, SubSpec, plain, SubSpec; "
             "each runs every concurrency in turn. Rates: each engine's rounds (engines "
             "separated by ';'). \"first\": the median over engine pairs of SubSpec's first "
             "round over plain's (for the first concurrency, the first batch after start-up); "
             "\"steady\": the median of the later rounds' ratios. A/A: the second plain "
             "engine over the first, round by round.", "",
             "| concurrent | plain tok/s | SubSpec tok/s | first | steady | A/A | identical | "
             "SubSpec steps drafting, each round |",
             "|---|---|---|---|---|---|---|---|"]
    for c, r in report["results"].items():
        t = r["tokens_per_second"]
        aa = ", ".join(f"{x:.2f}" for x in r["aa_ratios"])
        same = ", ".join(f"{n}/{r['requests']}" for n in r["identical"])
        drafting = "; ".join(", ".join(f"{s['drafting']}/{s['steps']}" for s in rounds)
                             for rounds in r["subspec_rounds"])
        lines.append(f"| {c} | {_rates(t['plain'])} | {_rates(t['subspec'])} | "
                     f"**{r['first_ratio']:.2f}x** | **{r['steady_ratio']:.2f}x** | {aa} | "
                     f"{same} | {drafting} |")
    steps = report["subspec_steps"]
    lines += ["", "SubSpec's steps over each engine's run: " + "; ".join(
        f"{s.get('draft_steps')} proposals, {s.get('plain_steps')} of them plain"
        for s in steps if s) + ".", ""]
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
