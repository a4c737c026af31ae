"""τ and tokens/s of SubSpec chain drafting vs chain depth, against plain decoding (vLLM CPU).

Workload (issue #2): SmolLM2-135M-Instruct, all decoder layers substituted (4-bit HQQ g64), the
first 20 MT-Bench first turns in the reference's sample order, greedy, 128 new tokens, one
sequence at a time. Writes benchmarks/results/chain_depth.{json,md}.

    python benchmarks/chain_depth.py                # depths 4 8 16
    python benchmarks/chain_depth.py --depths 4 --prompts 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--substitute-layers", default="all")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "chain_depth"))
    return ap.parse_args()


def environment() -> dict:
    import torch
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "vllm": vllm.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        "# SubSpec chain depth sweep (vLLM CPU backend)", "",
        f"Model `{Path(w['model']).name}`, substitute_layers={w['substitute_layers']!r}, "
        f"{w['prompts']} MT-Bench first turns, greedy, <= {w['max_tokens']} new tokens, "
        f"max_num_seqs={w['max_num_seqs']}, enforce_eager.", "",
        f"Command: `{report['command']}`", "",
        "| config | τ | tokens/s | vs plain | identical | acceptance by position |",
        "|---|---|---|---|---|---|",
    ]
    base = report["plain"]["tokens_per_second"]
    lines.append(f"| plain | 1.00 | {base:.1f} | 1.00x | - | - |")
    for r in report["subspec"]:
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"])
        lines.append(f"| chain k={r['depth']} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['tokens_per_second'] / base:.2f}x | {r['identical']}/{w['prompts']} | "
                     f"{rates} |")
    env = report["environment"]
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores, OMP_NUM_THREADS="
              f"{env['omp_threads']}; torch {env['torch']}, vLLM {env['vllm']}; {env['date']}.",
              "", "On CPU nothing is offloaded: the target costs the same per token with or "
              "without speculation, so tokens/s measures drafting overhead, not the PCIe "
              "savings SubSpec is built for. τ carries over to the GPU setting."]
    return "\n".join(lines) + "\n"


def main():
    import sys

    args = parse_args()
    from vllm import SamplingParams

    from vllm_subspec.assets import chat_prompts, mt_bench_prompts, smollm2_path
    from vllm_subspec.harness import count_identical, run_engine

    model = smollm2_path()
    prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    layers = (args.substitute_layers if args.substitute_layers in ("all", "offloaded")
              else [int(i) for i in args.substitute_layers.split(",")])
    plain = run_engine(model, prompts, params, None, max_num_seqs=args.max_num_seqs)
    report = {
        "command": "python " + " ".join(sys.argv),
        "workload": {"model": model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                     "substitute_layers": layers, "max_num_seqs": args.max_num_seqs},
        "environment": environment(),
        "plain": {"tokens": plain.num_tokens, "seconds": plain.seconds,
                  "tokens_per_second": plain.tokens_per_second},
        "subspec": [],
    }
    for depth in args.depths:
        spec = {"method": "subspec", "num_speculative_tokens": depth, "substitute_layers": layers}
        r = run_engine(model, prompts, params, spec, max_num_seqs=args.max_num_seqs)
        report["subspec"].append({
            "depth": depth, "tau": r.stats.tau, "tokens": r.num_tokens, "seconds": r.seconds,
            "tokens_per_second": r.tokens_per_second,
            "acceptance_per_position": r.stats.acceptance_rate_per_position,
            "identical": count_identical(r.token_ids, plain.token_ids),
        })
        print(f"depth {depth}: τ={r.stats.tau:.2f} {r.tokens_per_second:.1f} tok/s "
              f"(plain {plain.tokens_per_second:.1f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
