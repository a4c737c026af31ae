"""Adaptive depth on the engine: k=6 trees drafted to a fixed D=48 vs stopped where more depth
stops paying (`"tree_width": 6, "max_tree_depth": 48`), one MT-Bench request at a time, greedy.

Three runs per model (vLLM CPU backend, every layer 4-bit HQQ, as `{"method": "subspec"}` does):
- fixed 6x48: every step drafts all 48 depths;
- adaptive, CPU costs: the tuner decides from what it measures here (a draft pass costs a large
  share of a target pass on CPU, so it stops early and τ falls: a speed trade, not the goal's);
- adaptive, PROJECTED GPU costs: the same engine and trees, but the tuner is given the costs of
  the projection's GPU setting (benchmarks/projection.py, 7B at 8 GB, 25 GB/s: a draft pass
  11 ms, a verify streaming the offloaded weights ~0.48 s, flat in rows) instead of measuring
  them. τ and the draft passes are measured on the engine; only the costs that decide where to
  stop are projected.
Draft passes per emitted token count every draft forward (the step session's `StepStats.draft_passes`).

    python -m benchmarks.adaptive_depth --model smollm2 --prompts 8
    python -m benchmarks.adaptive_depth --model qwen-coder-1.5b --prompts 4 --kv-cache-gb 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

WIDTH, DEPTH = 6, 48
RUNS = {
    "fixed 6x48": ({"tree_width": WIDTH, "tree_depth": DEPTH}, None),
    "adaptive 6x<=48, CPU costs": ({"tree_width": WIDTH, "max_tree_depth": DEPTH}, None),
    "adaptive 6x<=48, PROJECTED GPU costs": ({"tree_width": WIDTH, "max_tree_depth": DEPTH},
                                             "gpu"),
}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, qwen-coder-1.5b or a folder")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--name", default=None, help="results/<name>.* (default adaptive_<model>)")
    return ap.parse_args()


def run(model: str, spec: dict, costs: str | None, prompts, params, engine_kwargs) -> dict:
    from benchmarks.cpu_speed import drafter_counters
    from benchmarks.projection import GpuSetting, give_gpu_costs
    from vllm import LLM

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, timed_generate

    llm = LLM(model=model, speculative_config={"method": "subspec", **spec}, enforce_eager=True,
              max_num_batched_tokens=16384, **CPU_ENGINE_KWARGS, **engine_kwargs)
    gpu = GpuSetting()
    try:
        if costs == "gpu":
            llm.collective_rpc(give_gpu_costs,
                               args=(gpu.draft_pass_ms / 1e3, gpu.target_ms(True) / 1e3))
        timed_generate(llm, prompts[:1], params)  # warm-up: the width's first full-depth tree
        before = llm.collective_rpc(drafter_counters)[0]
        r = timed_generate(llm, prompts, params, one_at_a_time=True)
        after = llm.collective_rpc(drafter_counters)[0]
    finally:
        shutdown_engine(llm)
    passes = after["draft_passes"] - before["draft_passes"]
    # decode steps: the drafter is called once per step, also where it drafts nothing (then
    # vLLM counts no verify step: its τ is over the steps that drafted)
    steps = after["draft_steps"] - before["draft_steps"]
    emitted = r.num_tokens - len(prompts)  # the first token of each request comes from prefill
    return {"spec": spec, "costs": costs, "tau": r.stats.tau, "steps": steps,
            "drafting_steps": r.stats.num_drafts, "tokens_per_step": emitted / max(steps, 1),
            "tokens": r.num_tokens, "seconds": r.seconds,
            "tokens_per_second": r.tokens_per_second,
            "draft_passes": passes, "draft_passes_per_step": passes / max(steps, 1),
            "draft_passes_per_token": passes / max(emitted, 1),
            "acceptance_per_depth": r.stats.acceptance_rate_per_position,
            "gpu_setting": gpu.name if costs == "gpu" else None}


def markdown(report: dict) -> str:
    from benchmarks.projection import GpuSetting, projected_speedup

    fixed = report["runs"].get("fixed 6x48")
    lines = [f"# Adaptive depth vs fixed D=48 (k=6): {report['model']}", "",
             f"Command: `{report['command']}`", "",
             f"{report['prompts']} MT-Bench first turns, one at a time, ≤{report['max_tokens']} "
             "tokens, greedy, bf16, every layer HQQ 4-bit (vLLM CPU backend). τ: vLLM's "
             "accepted + 1 per verify step that drafted; tokens / step: emitted tokens per "
             "drafter call (one per decode step, drafting or not, and one after each "
             "request's prefill; a step's drafts that max_tokens cuts are not emitted). Draft "
             "passes: every draft forward, also of a request's last step. Steps: drafter "
             "calls (vLLM verify steps that had drafts). "
             "PROJECTED speed-up: benchmarks/projection.py from the row's tokens / step and "
             "draft passes / step, for " + report["gpu_costs"].split(":")[0] + ".", "",
             "| run | steps | τ | tokens / step | draft passes / step | draft passes / token | "
             "tokens / step vs fixed | passes / token vs fixed | tok/s (CPU) | PROJECTED "
             "speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        rel = (f"{r['tokens_per_step'] / fixed['tokens_per_step']:.1%} | "
               f"{r['draft_passes_per_token'] / fixed['draft_passes_per_token'] - 1:+.0%}"
               if fixed else "- | -")
        speedup = projected_speedup(r["tokens_per_step"], r["draft_passes_per_step"],
                                    GpuSetting())
        lines.append(f"| {name} | {r['steps']} ({r['drafting_steps']}) | {r['tau']:.2f} | "
                     f"{r['tokens_per_step']:.2f} | "
                     f"{r['draft_passes_per_step']:.1f} | {r['draft_passes_per_token']:.2f} | "
                     f"{rel} | {r['tokens_per_second']:.2f} | {speedup:.1f}x |")
    lines += ["", "PROJECTED GPU costs: the tuner was given, not measured, "
              f"{report['gpu_costs']}; everything else in that row ran on the CPU engine. "
              "Its tok/s is the CPU engine's, not a GPU's.", "",
              f"Machine: {report['environment']['cpu']}; torch {report['environment']['torch']}; "
              f"vLLM {report['environment']['vllm']}; {report['environment']['date']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    names = list(report["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "tokens_per_step", "emitted tokens per step"),
                           (axes[1], "draft_passes_per_token", "draft passes per emitted token")):
        ax.bar(range(len(names)), [report["runs"][n][key] for n in names])
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
        ax.set(title=title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"k=6: fixed D=48 vs adaptive depth ({report['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    from benchmarks.depth_sweep import environment, kv_kwargs, model_path
    from benchmarks.projection import GpuSetting
    from vllm import SamplingParams

    from subspec_testing.assets import chat_prompts, mt_bench_prompts

    model = model_path(args.model)
    prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    name = args.name or f"adaptive_{args.model.replace('.', 'p').replace('-', '_')}"
    out = RESULTS / name
    gpu = GpuSetting()
    report = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "command": "python -m benchmarks.adaptive_depth " + " ".join(sys.argv[1:]),
              "gpu_costs": f"{gpu.name}: draft pass {gpu.draft_pass_ms:g} ms, verify "
                           f"{gpu.target_ms(True):.0f} ms, flat in rows",
              "environment": environment(), "runs": {}}
    for run_name in args.runs:
        spec, costs = RUNS[run_name]
        t0 = time.time()
        report["runs"][run_name] = run(model, spec, costs, prompts, params, kv_kwargs(args))
        r = report["runs"][run_name]
        print(f"{run_name}: τ {r['tau']:.2f}, {r['draft_passes_per_token']:.2f} passes/token, "
              f"{r['tokens_per_second']:.2f} tok/s ({time.time() - t0:.0f} s)", flush=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, out)


def write_report(report: dict, out: Path) -> None:
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
