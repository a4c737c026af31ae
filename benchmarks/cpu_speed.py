"""What a CPU user gets: plain, vLLM ngram/suffix, SubSpec fixed shapes and SubSpec auto on
vLLM's CPU backend, greedy, bf16, one request at a time and 8 concurrent requests.

Prompts: mixed chat, code and math (MT-Bench first turns, a round robin over its categories:
writing, roleplay, reasoning, math, coding, extraction, stem, humanities). Each method gets its
own engine, warmed up on one prompt; then the prompts one at a time (tokens/s, τ, draft passes
per emitted token), then the same prompts 8 at a time (total tokens/s). Every output is compared
with plain decoding's in the same mode. SubSpec configs are given exactly as a user types them
(`{"method": "subspec"}` is the auto default). Writes benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.cpu_speed --model smollm2 --name cpu_speed_smollm2
    python -m benchmarks.cpu_speed --model qwen-coder-1.5b --name cpu_speed_qwen --prompts 8
    python -m benchmarks.cpu_speed --model qwen-coder-1.5b --name cpu_speed_qwen --rescore
    python -m benchmarks.cpu_speed --model smollm2 --name cpu_speed_smollm2_compiled --compiled
    VLLM_CPU_OMP_THREADS_BIND="0|1" python -m benchmarks.cpu_speed --model qwen-coder-1.5b \
        --name cpu_speed_qwen_tp2 --tensor-parallel-size 2 --prompts 4 --max-tokens 64 \
        --kv-cache-gb 2 --methods plain "subspec chain:4" "subspec auto"
    python -m benchmarks.cpu_speed --model smollm2-moe --name cpu_speed_smollm2_moe \
        --methods plain "subspec chain:4" "subspec chain:8" "subspec tree:6x16" "subspec auto"

--compiled runs every engine in vLLM's default mode (no enforce_eager: the model compiled with
inductor, a profiling run at start-up), which is what `vllm serve` and `LLM()` users get; the
default is eager, as the earlier tables were measured.

--rescore proves (or not) each one-at-a-time difference from plain a numerical near-tie, with
the project's standard (subspec_testing/losslessness.py), in a plain fp32 engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


from benchmarks.depth_sweep import RESULTS, environment, kv_kwargs, model_path
from benchmarks.methods import METHODS as TABLE_METHODS
from benchmarks.methods import suffix_available

METHODS = {
    **{name: TABLE_METHODS[name] for name in ("plain", "ngram", "suffix")},  # as in methods.py
    "subspec chain:4": {"method": "subspec", "num_speculative_tokens": 4},
    "subspec chain:8": {"method": "subspec", "num_speculative_tokens": 8},
    "subspec tree:6x16": {"method": "subspec", "tree_width": 6, "tree_depth": 16},
    "subspec auto": {"method": "subspec"},
    # the draft's output projection the other way (issue 22: the head is a cost decision)
    "subspec chain:4 head:quantized": {"method": "subspec", "num_speculative_tokens": 4,
                                       "draft_lm_head": "quantized"},
    "subspec chain:4 head:target": {"method": "subspec", "num_speculative_tokens": 4,
                                    "draft_lm_head": "target"},
    "subspec chain:8 head:quantized": {"method": "subspec", "num_speculative_tokens": 8,
                                       "draft_lm_head": "quantized"},
    "subspec chain:8 head:target": {"method": "subspec", "num_speculative_tokens": 8,
                                    "draft_lm_head": "target"},
    # the auto shape with one head forced (its default, "auto", lets its tuner pick)
    "subspec auto head:quantized": {"method": "subspec", "draft_lm_head": "quantized"},
    "subspec auto head:target": {"method": "subspec", "draft_lm_head": "target"},
    # the substitutes on torch's tinygemm kernel instead of the AVX512-BF16 one (where "auto"
    # picks that): the kernel's before and after on the same machine
    "subspec auto kernel:tinygemm": {"method": "subspec", "kernel": "int4_cpu"},
    "subspec chain:4 kernel:tinygemm": {"method": "subspec", "num_speculative_tokens": 4,
                                        "kernel": "int4_cpu"},
}
DEFAULT_METHODS = [m for m in METHODS if "head:" not in m and "kernel:" not in m]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="cpu_speed")
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default mode (compiled with inductor) instead of eager")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks per engine (on CPU, one core each: set "
                    "VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1')")
    ap.add_argument("--append", action="store_true",
                    help="run --methods into an existing results/<name>.json (its plain run "
                    "is the identity baseline), replacing runs of the same name")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite results/<name>.{md,png} from results/<name>.json")
    ap.add_argument("--rescore", action="store_true",
                    help="re-score every one-at-a-time output that differs from plain's with "
                    "a plain fp32 engine at its first difference (is it a proven near-tie?), "
                    "into results/<name>.json")
    return ap.parse_args()


def mixed_prompts(n: int) -> list[str]:
    """First turns, one category after another (chat, code and math mixed)."""
    from subspec_testing.assets import mt_bench_questions

    by_category: dict[str, list[str]] = {}
    for q in mt_bench_questions():
        by_category.setdefault(q["category"], []).append(q["turns"][0])
    rounds = max(len(v) for v in by_category.values())
    mixed = [qs[i] for i in range(rounds) for qs in by_category.values() if i < len(qs)]
    return mixed[:n]


def drafter_counters(worker):
    """The SubSpec step session's statistics (`StepStats`) and its tuner's current shape and
    lm_head (a collective_rpc target)."""
    import dataclasses

    from vllm_subspec.vllm_hooks.runner import subspec_of

    session = subspec_of(worker).session
    tuner = session.tuner
    return {**dataclasses.asdict(session.stats),
            "shape": None if tuner is None else [tuner.width, tuner.depth],
            "head": None if tuner is None else tuner.lm_head}


def run_method(model: str, spec: dict | None, prompts: list[str], max_tokens: int,
               concurrency: int, engine_kwargs: dict, eager: bool = True) -> dict:
    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, timed_generate

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model=model, speculative_config=spec, enforce_eager=eager,
              max_num_batched_tokens=16384, **CPU_ENGINE_KWARGS, **engine_kwargs)
    start_s = time.perf_counter() - t0
    is_subspec = bool(spec) and spec["method"] == "subspec"
    counters = (lambda: llm.collective_rpc(drafter_counters)[0]) if is_subspec else \
        (lambda: {"draft_passes": 0, "draft_seconds": 0.0, "shape": None, "head": None})
    try:
        timed_generate(llm, prompts[:1], params, spec=bool(spec))  # warm-up
        before = counters()
        single = timed_generate(llm, prompts, params, spec=bool(spec), one_at_a_time=True)
        after = counters()
        concurrent = [timed_generate(llm, prompts[i: i + concurrency], params, spec=bool(spec))
                      for i in range(0, len(prompts), concurrency)]
        final = counters()
    finally:
        shutdown_engine(llm)
    emitted = single.num_tokens
    c_tokens = sum(r.num_tokens for r in concurrent)
    c_seconds = sum(r.seconds for r in concurrent)
    c_stats = concurrent[0].stats
    for r in concurrent[1:]:
        c_stats = c_stats + r.stats
    return {
        "start_seconds": start_s,
        "single": {"tokens": emitted, "seconds": single.seconds,
                   "tokens_per_second": single.tokens_per_second,
                   "tau": single.stats.tau if spec else 1.0,
                   "draft_passes_per_token": (after["draft_passes"] - before["draft_passes"])
                   / max(emitted, 1),
                   "draft_seconds": after["draft_seconds"] - before["draft_seconds"],
                   "token_ids": single.token_ids},
        "concurrent": {"tokens": c_tokens, "seconds": c_seconds,
                       "tokens_per_second": c_tokens / c_seconds,
                       "tau": c_stats.tau if spec else 1.0,
                       "token_ids": [t for r in concurrent for t in r.token_ids]},
        "final_shape": final["shape"],
        # the lm_head its tuner drafted with after the one-at-a-time phase, and at the end
        "heads": [after["head"], final["head"]],
    }


def rescore(report: dict, prompts: list[str], engine_kwargs: dict) -> None:
    """The project's losslessness standard (subspec_testing/losslessness.py) applied to the
    one-at-a-time and the concurrent outputs: each prompt that differs from plain's (in the
    same phase) is re-scored in fp32 at its first difference. Stored per method as
    `rescored_single` and `rescored_concurrent`."""
    import dataclasses

    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine
    from subspec_testing.losslessness import first_difference, rescore_differences

    modes = ("single", "concurrent")
    plain = {m: report["runs"]["plain"][m]["token_ids"] for m in modes}
    runs = {n: r for n, r in report["runs"].items() if n != "plain" and "single" in r}
    differing = sorted({i for r in runs.values() for m in modes
                        for i, (s, p) in enumerate(zip(r[m]["token_ids"], plain[m]))
                        if first_difference(s, p) is not None})
    llm = LLM(model=report["model"], dtype="float32", enforce_eager=True, **CPU_ENGINE_KWARGS,
              **engine_kwargs)
    try:
        outs = llm.generate([prompts[i] for i in differing], SamplingParams(max_tokens=1),
                            use_tqdm=False)  # the prompts' token ids, as the engine made them
        ids = {i: o.prompt_token_ids for i, o in zip(differing, outs)}
        prompt_ids = [ids.get(i, []) for i in range(len(prompts))]
        for r in runs.values():
            for m in modes:
                found = rescore_differences(llm, prompt_ids, r[m]["token_ids"], plain[m])
                r[f"rescored_{m}"] = [dict(dataclasses.asdict(d), near_tie=d.is_near_tie)
                                      for d in found]
    finally:
        shutdown_engine(llm)


def rescored(r: dict, mode: str = "single") -> str:
    found = r.get(f"rescored_{mode}")
    if found is None:
        return "not re-scored"
    if not found:
        return "none differ"
    from subspec_testing.losslessness import MAX_RANK, NEAR_TIE_NATS

    # by the standard in force (the stored flag is the one of the run's day)
    ties = sum(d["spec_rank"] <= MAX_RANK and d["gap_nats"] <= NEAR_TIE_NATS for d in found)
    return (f"{ties}/{len(found)} near-ties (max gap {max(d['gap_nats'] for d in found):.3f} "
            f"nats, max rank {max(d['spec_rank'] for d in found)})")


def markdown(report: dict) -> str:
    runs = report["runs"]
    plain = runs.get("plain")
    mode = report.get("mode", "eager")
    lines = [f"# CPU speed: {Path(report['model']).name} (vLLM CPU backend, greedy, "
             f"{report['dtype']}, {mode})", "",
             f"Command: `{report['command']}`", "",
             f"{report['prompts']} mixed MT-Bench first turns (chat, code, math), <= "
             f"{report['max_tokens']} new tokens each; one request at a time, then "
             f"{report['concurrency']} concurrent. SubSpec configs exactly as typed (every layer "
             "4-bit HQQ g64 by default on CPU; `{\"method\": \"subspec\"}` = auto shape). "
             + ("Engines in vLLM's default mode: the target compiled with inductor, as `vllm "
                "serve` runs it without --enforce-eager (SubSpec's draft forward compiled too)."
                if mode == "compiled" else "Engines in eager mode (enforce_eager=True).")
             + (f" Tensor parallel size {report['tensor_parallel_size']} (one core a rank)."
                if report.get("tensor_parallel_size", 1) > 1 else ""), "",
             "| method | tok/s (1 at a time) | vs plain | vs ngram | τ | draft passes / token "
             f"| ms / draft pass | identical | tok/s ({report['concurrency']} concurrent) | vs plain | identical "
             "| engine start s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ngram = runs.get("ngram")
    for name, r in runs.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |" + " |" * 10)
            continue
        s, c = r["single"], r["concurrent"]
        vs = (lambda x, base: f"{x / base:.2f}x" if base else "-")
        passes = s["draft_passes_per_token"] * s["tokens"]
        pass_ms = f"{1000 * s['draft_seconds'] / passes:.1f}" if passes else "-"
        lines.append(
            f"| {name} | {s['tokens_per_second']:.2f} | "
            f"{vs(s['tokens_per_second'], plain and plain['single']['tokens_per_second'])} | "
            f"{vs(s['tokens_per_second'], ngram and ngram['single']['tokens_per_second'])} | "
            f"{s['tau']:.2f} | {s['draft_passes_per_token']:.2f} | {pass_ms} | "
            f"{r.get('identical_single', '-')} | "
            f"{c['tokens_per_second']:.2f} | "
            f"{vs(c['tokens_per_second'], plain and plain['concurrent']['tokens_per_second'])} | "
            f"{r.get('identical_concurrent', '-')} | {r['start_seconds']:.0f} |")
    env = report["environment"]
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores (the engine's worker is bound to "
              f"one); torch {env['torch']}, vLLM {env['vllm']}; {env['date']}.", "",
              "- τ: tokens per verify step (vLLM's spec-decode metrics). Draft passes / token: "
              "SubSpec forward passes of the draft per emitted token.",
              "- identical: outputs equal to plain decoding's in the same mode. On CPU in bf16, a "
              "one-row decode (M=1) and a multi-row verify round differently, so a difference "
              "can be a numerical near-tie of the target (docs/losslessness.md); the fp32 "
              "tests assert exact identity.",
              ]
    scored = {n: rescored(r) for n, r in runs.items() if "rescored_single" in r}
    if scored:
        from subspec_testing.losslessness import MAX_RANK, NEAR_TIE_NATS

        lines.append("- One-at-a-time differences from plain, re-scored with the target in fp32 "
                     f"at the first differing token (near-tie: rank <= {MAX_RANK} and within "
                     f"{NEAR_TIE_NATS} nats): "
                     + "; ".join(f"{n}: {v}" for n, v in scored.items()) + ".")
        concurrent = {n: rescored(r, "concurrent") for n, r in runs.items()
                      if "rescored_concurrent" in r}
        if concurrent:
            lines.append(f"- {report['concurrency']}-concurrent differences from plain's "
                         "concurrent run, re-scored the same way: "
                         + "; ".join(f"{n}: {v}" for n, v in concurrent.items()) + ".")
    if report.get("auto_shapes"):
        lines.append(f"- Shape the auto tuner had chosen at the end (after the concurrent "
                     f"phase): {report['auto_shapes']} (width, max depth; depth 0: no draft, "
                     "plain decoding predicted faster). Its τ counts only the steps that "
                     "drafted.")
    if report.get("auto_heads"):
        lines.append("- lm_head the auto tuner drafted with (`draft_lm_head: \"auto\"`), after "
                     "the one-at-a-time phase and at the end: "
                     f"{', '.join(map(str, report['auto_heads']))}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    runs = {k: v for k, v in report["runs"].items() if "skipped" not in v}
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode, title in ((axes[0], "single", "one request at a time"),
                            (axes[1], "concurrent", f"{report['concurrency']} concurrent")):
        ax.bar(range(len(names)), [runs[n][mode]["tokens_per_second"] for n in names],
               color=["#888" if not n.startswith("subspec") else "#3a7" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{Path(report['model']).name}: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = parse_args()
    out = RESULTS / args.name
    if args.markdown_only or args.rescore:
        report = json.loads(out.with_suffix(".json").read_text())
        if args.rescore:
            from subspec_testing.assets import chat_prompts

            prompts = chat_prompts(report["model"], mixed_prompts(report["prompts"]))
            rescore(report, prompts, kv_kwargs(args))
            report["command"] += " && python " + " ".join(sys.argv)
            out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    else:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
        from subspec_testing.assets import chat_prompts
        from subspec_testing.harness import count_identical

        model = model_path(args.model)
        prompts = chat_prompts(model, mixed_prompts(args.prompts))
        report = {"command": "python " + " ".join(sys.argv), "model": model,
                  "dtype": "bfloat16", "prompts": len(prompts), "max_tokens": args.max_tokens,
                  "concurrency": args.concurrency, "environment": environment(), "runs": {},
                  "mode": "compiled" if args.compiled else "eager",
                  "tensor_parallel_size": args.tensor_parallel_size}
        if args.append:
            old = json.loads(out.with_suffix(".json").read_text())
            if (old["model"], old["prompts"], old["max_tokens"], old.get("mode", "eager")) \
                    != (model, len(prompts), args.max_tokens, report["mode"]):
                raise SystemExit(f"--append: {out}.json has another workload")
            old["command"] += " && " + report["command"]
            report = old
        for name in args.methods:
            if name == "suffix" and not suffix_available():
                report["runs"][name] = {"skipped": "arctic-inference is not installed"}
                continue
            print(f"[cpu_speed] {name}", flush=True)
            r = run_method(model, METHODS[name], prompts, args.max_tokens, args.concurrency,
                           {**kv_kwargs(args), "tensor_parallel_size": args.tensor_parallel_size},
                           eager=not args.compiled)
            report["runs"][name] = r
            base = report["runs"].get("plain")
            if base and name != "plain":
                for mode in ("single", "concurrent"):
                    same = count_identical(r[mode]["token_ids"], base[mode]["token_ids"])
                    r[f"identical_{mode}"] = f"{same}/{len(prompts)}"
            if name == "subspec auto":
                report["auto_shapes"] = r["final_shape"]
                report["auto_heads"] = r["heads"]
            out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report) + f"\n![speed]({out.name}.png)\n")
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
