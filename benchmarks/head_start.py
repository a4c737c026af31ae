"""Head starts (`head_start_levels` m) on vLLM's CPU backend: how often the walk confirms them
(the hit rate h), how many steps start from them, what they do to τ, and the GPU speed-up they
PROJECT (benchmarks/projection.py, the paper's setting, with the measured h and τ: a
projection, not a measurement). On CPU head starts run serially after the verify forward, so
their tokens/s here is a cost, printed beside plain's; their gain needs a GPU's transfers to
hide behind, and they have never run on one.

One engine per m (a fixed tree shape; m = 0: none) and a plain engine, greedy, the prompts one
at a time and then as one batch; outputs compared with plain's. Writes
benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.head_start --name head_start_smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from benchmarks.cpu_speed import mixed_prompts
from benchmarks.depth_sweep import RESULTS, environment, model_path

COUNTERS = ("draft_steps", "verified_trees", "head_starts", "head_start_hits",
            "head_start_steps")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="head_start_smollm2")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--levels", default="0,2,4", help="the m values, comma separated")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32",
                    help="fp32: output identical to plain's one at a time too (in bf16 plain's "
                         "own one-row and many-row steps round apart on CPU)")
    return ap.parse_args()


def measure(llm, prompts, params, one_at_a_time: bool) -> dict:
    from subspec_testing.harness import step_stats, timed_generate

    before = llm.collective_rpc(step_stats)[0]
    run = timed_generate(llm, prompts, params, one_at_a_time=one_at_a_time)
    after = llm.collective_rpc(step_stats)[0]
    counts = {k: after[k] - before[k] for k in COUNTERS}
    return {"tokens_per_second": run.num_tokens / run.seconds, "tau": run.stats.tau,
            "token_ids": run.token_ids,
            "hit_rate": counts["head_start_hits"] / counts["head_starts"]
            if counts["head_starts"] else 0.0,
            "resumed_share": counts["head_start_steps"] / counts["draft_steps"]
            if counts["draft_steps"] else 0.0, **counts}


def projected(tau: float, depth: int, levels: int, hit_rate: float) -> float:
    from benchmarks.projection import GpuSetting, projected_speedup

    gpu = dataclasses.replace(GpuSetting(), head_start_levels=levels,
                              head_start_hit_rate=hit_rate)
    return projected_speedup(tau, depth, gpu)


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import LLM, SamplingParams

    from subspec_testing.assets import chat_prompts
    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, timed_generate

    model = model_path(args.model)
    prompts = chat_prompts(model, mixed_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(CPU_ENGINE_KWARGS, enforce_eager=True, dtype=args.dtype,
              max_num_batched_tokens=16384)
    plain = LLM(model=model, **kw)
    try:
        ref = {mode: timed_generate(plain, prompts, params, spec=False,
                                    one_at_a_time=mode == "alone") for mode in ("alone", "batch")}
    finally:
        shutdown_engine(plain)
    rows = []
    for levels in [int(x) for x in args.levels.split(",")]:
        spec = {"method": "subspec", "tree_width": args.width, "tree_depth": args.depth,
                "substitute_layers": "all", "head_start_levels": levels}
        llm = LLM(model=model, speculative_config=spec, **kw)
        try:
            timed_generate(llm, prompts[:1], params)  # warm-up
            for mode in ("alone", "batch"):
                r = measure(llm, prompts, params, one_at_a_time=mode == "alone")
                plain_run = ref[mode]
                r.update(levels=levels, mode=mode,
                         plain_tokens_per_second=plain_run.num_tokens / plain_run.seconds,
                         identical=sum(a == b for a, b in zip(r.pop("token_ids"),
                                                              plain_run.token_ids)),
                         # the share of steps that start from head starts (batched: only
                         # when all of a step's requests hit)
                         projected_gpu_speedup=projected(r["tau"], args.depth, levels,
                                                         r["resumed_share"]))
                rows.append(r)
                print(json.dumps(r))
        finally:
            shutdown_engine(llm)
    report = {"args": vars(args), "environment": environment(), "rows": rows,
              "prompts": len(prompts)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(report))
    plot(report, RESULTS / f"{args.name}.png")


def markdown(report: dict) -> str:
    a, env = report["args"], report["environment"]
    lines = [
        f"# Head starts on CPU: {a['model']}, {a['dtype']}, a {a['width']} x {a['depth']} tree",
        "",
        f"`python -m benchmarks.head_start --name {a['name']}`; {env['date']}, {env['cpu']}, "
        f"{report['prompts']} prompts, {a['max_tokens']} tokens each, greedy.",
        "",
        "A fixed tree, so that every step drafts (the default auto shape decodes plainly on "
        "this CPU, where drafting does not pay: the ratio to plain here is the fixed shape's). "
        "On CPU head starts run serially after the verify forward: tokens/s is their cost, not "
        "their gain. The last column is a PROJECTION (benchmarks/projection.py, Qwen2.5-7B on "
        "8 GB at 25 GB/s, with this run's τ and share of steps started from head starts), not a "
        "measurement; head starts have "
        "never run on a GPU.",
        "",
        "| m | requests | plain tok/s | tok/s | ratio | τ | head starts | confirmed (h) | steps "
        "started from them | identical | projected GPU speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['levels']} | {'one at a time' if r['mode'] == 'alone' else 'one batch'} | "
            f"{r['plain_tokens_per_second']:.1f} | {r['tokens_per_second']:.1f} | "
            f"{r['tokens_per_second'] / r['plain_tokens_per_second']:.2f}x | {r['tau']:.2f} | "
            f"{r['head_starts']} | {r['head_start_hits']} ({r['hit_rate']:.2f}) | "
            f"{r['head_start_steps']} of {r['draft_steps']} | "
            f"{r['identical']}/{report['prompts']} | {r['projected_gpu_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    from benchmarks.plots import _pyplot, save

    plt = _pyplot()
    fig, (ax_hit, ax_proj) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("alone", "o"), ("batch", "s")):
        rows = [r for r in report["rows"] if r["mode"] == mode]
        m = [r["levels"] for r in rows]
        ax_hit.plot(m, [r["hit_rate"] for r in rows], marker=marker, label=f"h, {mode}")
        ax_hit.plot(m, [r["resumed_share"] for r in rows], marker=marker, linestyle="--",
                    label=f"steps started from one, {mode}")
        ax_proj.plot(m, [r["projected_gpu_speedup"] for r in rows], marker=marker, label=mode)
    ax_hit.set(xlabel="head_start_levels m", ylabel="share", title="measured on CPU")
    ax_proj.set(xlabel="head_start_levels m", ylabel="x plain offloading",
                title="PROJECTED GPU speed-up (not measured)")
    for ax in (ax_hit, ax_proj):
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
