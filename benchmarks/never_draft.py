"""What SubSpec costs when it does not draft: a plain engine against a SubSpec engine with the
default configuration (`{"method": "subspec"}`, auto shape) whose shape tuner is told that
drafting never pays, so it runs plain decoding steps but for its backing-off probe steps; vLLM's
CPU backend, bf16, greedy, one request at a time and 8 concurrent.

Both engines stay up; each round times plain then SubSpec on the same prompts (alternating, so
drift in the machine's speed hits both), and the report gives each round's tokens/s and the
median ratio. Outputs are compared with plain's (identical, or a near-tie difference counted).
Writes benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.never_draft --model smollm2 --name never_draft_smollm2
    python -m benchmarks.never_draft --model qwen-coder-1.5b --name never_draft_qwen \
        --prompts 4 --max-tokens 64 --kv-cache-gb 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.cpu_speed import mixed_prompts
from benchmarks.depth_sweep import RESULTS, environment, kv_kwargs, model_path


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="never_draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default mode (compiled with inductor) instead of eager")
    return ap.parse_args()


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import LLM, SamplingParams

    from subspec_testing.assets import chat_prompts
    from subspec_testing.harness import (
        CPU_ENGINE_KWARGS,
        predict_plain_faster,
        shutdown_engine,
        step_stats,
        timed_generate,
    )

    model = model_path(args.model)
    prompts = chat_prompts(model, mixed_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kw = dict(enforce_eager=not args.compiled, max_num_batched_tokens=16384,
              **CPU_ENGINE_KWARGS, **kv_kwargs(args))
    engines = {"plain": LLM(model=model, **kw),
               "subspec": LLM(model=model, speculative_config={"method": "subspec"}, **kw)}
    rounds = {"plain": {"single": [], "concurrent": []},
              "subspec": {"single": [], "concurrent": []}}
    outputs = {}
    try:
        for llm in engines.values():
            timed_generate(llm, prompts[:1], params, spec=False)  # warm-up
        before = engines["subspec"].collective_rpc(predict_plain_faster)[0]
        for _ in range(args.rounds):
            for mode in ("single", "concurrent"):
                for name, llm in engines.items():
                    if mode == "single":
                        run = timed_generate(llm, prompts, params, spec=False,
                                             one_at_a_time=True)
                    else:
                        run = timed_generate(llm, prompts[: args.concurrency], params,
                                             spec=False)
                    rounds[name][mode].append(run.num_tokens / run.seconds)
                    outputs.setdefault((name, mode), run.token_ids)
        after = engines["subspec"].collective_rpc(step_stats)[0]
    finally:
        for llm in engines.values():
            shutdown_engine(llm)
    proposals = after["draft_steps"] - before["draft_steps"]
    plain_steps = after["plain_steps"] - before["plain_steps"]
    report = {
        "command": "python -m benchmarks.never_draft " + " ".join(sys.argv[1:]),
        "model": model, "dtype": "bfloat16", "prompts": len(prompts),
        "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "mode": "compiled" if args.compiled else "eager", "environment": environment(),
        "tokens_per_second": rounds,
        "ratio": {m: statistics.median(s / p for s, p in zip(rounds["subspec"][m],
                                                              rounds["plain"][m]))
                  for m in ("single", "concurrent")},
        "subspec_steps": {"proposals": proposals, "plain_steps": plain_steps,
                          "drafted_steps": proposals - plain_steps},
        "identical": {m: sum(a == b for a, b in zip(outputs["subspec", m],
                                                    outputs["plain", m]))
                      for m in ("single", "concurrent")},
    }
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def markdown(report: dict) -> str:
    r, c = report["tokens_per_second"], report["concurrency"]
    steps = report["subspec_steps"]
    lines = [f"# SubSpec that does not draft vs plain: {os.path.basename(report['model'])}, "
             f"{report['mode']}", "",
             f"`{report['command']}`", "",
             f"{report['prompts']} mixed prompts, {report['max_tokens']} tokens each, greedy, "
             f"bf16; one request at a time and {c} concurrent; tokens/s per round (plain, then "
             f"SubSpec, alternating).", "",
             "| mode | plain tokens/s | SubSpec tokens/s | SubSpec / plain (median) | "
             "identical |", "|---|---|---|---|---|"]
    for mode, label in (("single", "one at a time"), ("concurrent", f"{c} concurrent")):
        lines.append(
            f"| {label} | {', '.join(f'{x:.1f}' for x in r['plain'][mode])} | "
            f"{', '.join(f'{x:.1f}' for x in r['subspec'][mode])} | "
            f"**{report['ratio'][mode]:.3f}** | {report['identical'][mode]}"
            f"/{report['prompts'] if mode == 'single' else min(c, report['prompts'])} |")
    lines += ["", f"SubSpec's steps in the timed rounds: {steps['proposals']} proposals, "
              f"{steps['plain_steps']} drafted nothing, {steps['drafted_steps']} probe steps "
              "drafted.", ""]
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    modes = ("single", "concurrent")
    for i, name in enumerate(("plain", "subspec")):
        ax.bar([j + 0.4 * i for j in range(2)],
               [statistics.median(report["tokens_per_second"][name][m]) for m in modes], 0.4,
               label=name, color="#888" if name == "plain" else "#3a7")
    ax.set_xticks([0.2, 1.2], ["one at a time", f"{report['concurrency']} concurrent"])
    ax.set_ylabel("tokens/s (median of rounds)")
    ax.set_title(f"{os.path.basename(report['model'])}: SubSpec not drafting vs plain",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
