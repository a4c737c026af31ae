"""bf16 fidelity: how often SubSpec's greedy output is token-identical to plain decoding in bf16,
and proof that every difference is a numerical near-tie (vLLM CPU backend).

All prompts run as one batch to max_tokens (ignore_eos) in a plain bf16 engine and in one SubSpec
engine per config; a prompt whose token ids differ is re-scored with a plain fp32 engine at the
first difference (`subspec_testing.losslessness`: SubSpec's token must be ranked <= 2 and within
0.25 nats of the fp32 argmax). Writes benchmarks/results/<name>.{json,md}.

    python -m benchmarks.bf16_identity --name bf16_identity --configs chain:8 tree:6x16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["chain:8", "tree:6x16"])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="bf16_identity")
    ap.add_argument("--label", default="",
                    help="a note stored with the run (e.g. which tree-attention arithmetic)")
    return ap.parse_args()


def main():
    args = parse_args()
    from benchmarks.depth_sweep import environment, model_path, spec_config
    from vllm import SamplingParams

    from subspec_testing.assets import chat_prompts, mt_bench_prompts
    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine
    from subspec_testing.losslessness import rescore_differences

    model = model_path(args.model)
    prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def generate(spec, dtype):
        from vllm import LLM

        llm = LLM(model=model, speculative_config=spec, dtype=dtype, enforce_eager=True,
                  **CPU_ENGINE_KWARGS)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [list(o.prompt_token_ids) for o in outs], \
                [list(o.outputs[0].token_ids) for o in outs]
        finally:
            shutdown_engine(llm)

    prompt_ids, plain = generate(None, "bfloat16")
    spec_runs = {c: generate(spec_config(c), "bfloat16")[1] for c in args.configs}

    from vllm import LLM

    fp32 = LLM(model=model, dtype="float32", enforce_eager=True, **CPU_ENGINE_KWARGS)
    rows = []
    try:
        for config, ids in spec_runs.items():
            found = rescore_differences(fp32, prompt_ids, ids, plain)
            rows.append({
                "config": config,
                "identical": sum(a == b for a, b in zip(ids, plain)),
                "prompts": len(prompts),
                "near_ties": sum(d.is_near_tie for d in found),
                "differences": [vars(d) | {"is_near_tie": d.is_near_tie} for d in found],
            })
    finally:
        shutdown_engine(fp32)

    out = {"command": "python " + " ".join(sys.argv), "label": args.label,
           "model": Path(model).name, "max_tokens": args.max_tokens,
           "environment": environment(), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    lines = [f"# bf16 identity vs plain decoding: `{args.name}`", "",
             f"`{out['model']}`, {len(prompts)} MT-Bench first turns, greedy, {args.max_tokens} "
             "tokens, one batch, bf16. " + (args.label or ""), "",
             f"Command: `{out['command']}`", "",
             "| config | identical prompts | differing | proven near-ties | largest gap (nats) "
             "| worst rank | earliest difference |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["differences"]
        lines.append(
            f"| {r['config']} | {r['identical']}/{r['prompts']} "
            f"({100 * r['identical'] / r['prompts']:.0f}%) | {len(d)} | {r['near_ties']}/{len(d)} "
            f"| {max((x['gap_nats'] for x in d), default=0):.3f} "
            f"| {max((x['spec_rank'] for x in d), default=0)} "
            f"| {min((x['position'] for x in d), default='-')} |")
    env = out["environment"]
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores, OMP_NUM_THREADS="
              f"{env['omp_threads']}; torch {env['torch']}, vLLM {env['vllm']}; {env['date']}."]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
