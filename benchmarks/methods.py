"""Speculative methods side by side on SmolLM2-135M-Instruct, vLLM CPU backend, greedy.

Methods: plain decoding, vLLM's `ngram` and `suffix` (needs `pip install arctic-inference`;
skipped with a note when missing), SubSpec chain and SubSpec tree. Workloads:
- `mt_bench`: one question per MT-Bench category, both turns (the second turn continues the
  conversation with the engine's own first answer);
- held-out-style categories, first turns, drawn from MT-Bench's categories that match the
  paper's extra benchmarks (no dataset downloads here): code (coding), math (math),
  summarization (extraction: condense/extract from a given text), instruction (writing).
Each (workload, turn) runs as one batch. Writes benchmarks/results/methods.{json,md,png}.

    python -m benchmarks.methods
    python -m benchmarks.methods --model qwen-coder-1.5b --name methods_qwen --workloads mt_bench
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from benchmarks.depth_sweep import RESULTS, environment, kv_kwargs, model_path

METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
    "subspec chain:8": {"method": "subspec", "num_speculative_tokens": 8,
                        "substitute_layers": "all"},
    "subspec tree:6x16": {"method": "subspec", "tree_width": 6, "tree_depth": 16,
                          "substitute_layers": "all"},
}
# draft passes per step and whether the drafter holds substitutes (for the projection)
DRAFT_COST = {"plain": (0, False), "ngram": (0, False), "suffix": (0, False),
              "subspec chain:8": (8, True), "subspec tree:6x16": (16, True)}
HELD_OUT = {"code": "coding", "math": "math", "summarization": "extraction",
            "instruction": "writing"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, qwen-coder-1.5b or a model folder (see depth_sweep.py)")
    ap.add_argument("--name", default="methods", help="results/<name>.{json,md,png}")
    ap.add_argument("--workloads", nargs="+", default=None,
                    help="subset of mt_bench code math summarization instruction")
    ap.add_argument("--quantizer", default="hqq", choices=["hqq", "rtn"],
                    help="how SubSpec's substitutes are built")
    ap.add_argument("--dtype", default="bfloat16",
                    help="float32 for trees on AMX CPUs (see depth_sweep.py --dtype)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="fixed KV cache size (see depth_sweep.py)")
    ap.add_argument("--first-turn-only", action="store_true",
                    help="mt_bench: first turns only (halves the time)")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite results/methods.{md,png} from results/methods.json")
    return ap.parse_args()


def workloads(per_category: int) -> dict[str, list[list[str]]]:
    """name -> questions, each a list of user turns (the reference's MT-Bench order)."""
    from subspec_testing.assets import mt_bench_questions

    questions = mt_bench_questions()
    first_of = {}
    for q in questions:
        first_of.setdefault(q["category"], q)
    out = {"mt_bench": [q["turns"] for q in first_of.values()]}
    used = {id(q) for q in first_of.values()}
    for name, category in HELD_OUT.items():
        pool = [q for q in questions if q["category"] == category and id(q) not in used]
        out[name] = [q["turns"][:1] for q in pool[:per_category]]
    return out


def run_method(model: str, spec: dict | None, loads: dict, max_tokens: int,
               **engine_kwargs) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, timed_generate
    from subspec_testing.metrics import AcceptanceStats

    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, speculative_config=spec, enforce_eager=True,
              max_num_batched_tokens=16384, **CPU_ENGINE_KWARGS, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        timed_generate(llm, [tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                     tokenize=False)], params, spec=bool(spec))
        results = {}
        for name, questions in loads.items():
            history = [[] for _ in questions]
            tokens, seconds, stats = 0, 0.0, AcceptanceStats()
            for turn in range(max(len(q) for q in questions)):
                active = [i for i, q in enumerate(questions) if turn < len(q)]
                for i in active:
                    history[i].append({"role": "user", "content": questions[i][turn]})
                prompts = [tok.apply_chat_template(history[i], tokenize=False,
                                                   add_generation_prompt=True) for i in active]
                r = timed_generate(llm, prompts, params, spec=bool(spec))
                for i, text in zip(active, r.texts):
                    history[i].append({"role": "assistant", "content": text})
                tokens, seconds, stats = tokens + r.num_tokens, seconds + r.seconds, stats + r.stats
            results[name] = {"tau": stats.tau if spec else 1.0, "tokens": tokens,
                             "seconds": seconds, "tokens_per_second": tokens / seconds,
                             "acceptance_per_position": stats.acceptance_rate_per_position}
        return results
    finally:
        shutdown_engine(llm)


def suffix_available() -> bool:
    try:
        import arctic_inference  # noqa: F401
    except ImportError:
        return False
    return True


def markdown(report: dict) -> str:
    loads = list(report["workloads"])
    lines = [
        f"# Speculative methods on {report.get('model', 'SmolLM2-135M-Instruct')} "
        "(vLLM CPU backend, greedy)", "",
        f"Command: `{report['command']}`; {report['max_tokens']} new tokens per turn, each "
        f"(workload, turn) as one batch, enforce_eager, {report.get('dtype', 'bfloat16')}; "
        "SubSpec substitutes 4-bit "
        f"{report.get('quantizer', 'hqq').upper()} g64, every layer.", "",
        "τ (tokens per verify step) / tokens per second:", "",
        "| method | " + " | ".join(loads) + " |", "|---|" + "---|" * len(loads),
    ]
    for method, res in report["results"].items():
        if "skipped" in res:
            lines.append(f"| {method} | " + " | ".join(["skipped"] * len(loads)) + " |")
            continue
        lines.append(f"| {method} | " + " | ".join(
            f"{res[w]['tau']:.2f} / {res[w]['tokens_per_second']:.1f}" for w in loads) + " |")
    lines += ["", "Acceptance by position on mt_bench:", ""]
    for method, res in report["results"].items():
        rates = res.get("mt_bench", {}).get("acceptance_per_position", [])
        while rates and rates[-1] == 0:  # a tree's counter has D*k slots, only D can be used
            rates = rates[:-1]
        if rates:
            rates = " ".join(f"{x:.2f}" for x in rates)
            lines.append(f"- {method}: {rates}")
    from benchmarks.projection import SETTINGS, projection_markdown, projection_rows

    runs = [{"config": m, "tau": r["mt_bench"]["tau"], "depth": DRAFT_COST[m][0],
             "substitutes": DRAFT_COST[m][1]}
            for m, r in report["results"].items() if "skipped" not in r]
    projection = projection_markdown(projection_rows(runs, SETTINGS[:3]), "mt_bench column",
                                     SETTINGS[:3])
    skipped = {m: r["skipped"] for m, r in report["results"].items() if "skipped" in r}
    lines += [f"- {m}: skipped ({why})" for m, why in skipped.items()]
    env = report["environment"]
    lines += ["", "Workloads: " + "; ".join(f"{w}: {n} questions" for w, n in
                                            report["workloads"].items()),
              f"Machine: {env['cpu']}, {env['cores']} cores, OMP_NUM_THREADS="
              f"{env['omp_threads']}; torch {env['torch']}, vLLM {env['vllm']}; {env['date']}.",
              "On CPU nothing is offloaded and a verify pass costs in proportion to its tokens, "
              "so tokens/s here rewards cheap drafts; the offloaded GPU setting SubSpec is built "
              "for rewards τ (see docs/results.md for the projection).", "",
              f"![methods]({report['name']}.png)", "", projection]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    from benchmarks.plots import plot_methods


    out = RESULTS / args.name
    if args.markdown_only:
        report = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(markdown(report))
        return plot_methods(report, out.with_suffix(".png"))
    model = model_path(args.model)
    loads = workloads(args.per_category)
    if args.workloads:
        loads = {w: q for w, q in loads.items() if w in args.workloads}
    if args.first_turn_only:
        loads = {w: [q[:1] for q in qs] for w, qs in loads.items()}
    report = {"name": args.name, "command": "python " + " ".join(sys.argv),
              "model": Path(model).name, "quantizer": args.quantizer, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "environment": environment(),
              "workloads": {w: len(q) for w, q in loads.items()}, "results": {}}
    for method in args.methods:
        if method == "suffix" and not suffix_available():
            report["results"][method] = {"skipped": "arctic-inference not installed"}
            continue
        spec = METHODS[method]
        if spec and spec["method"] == "subspec":
            spec = dict(spec, quantizer=args.quantizer)
        report["results"][method] = run_method(
            model, spec, loads, args.max_tokens,
            dtype=args.dtype, **kv_kwargs(args))
        print(method, {w: round(r["tau"], 2) for w, r in report["results"][method].items()},
              flush=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
        plot_methods(report, out.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
