"""τ, tokens/s and draft/verify time of SubSpec chains and trees vs depth (vLLM CPU backend).

SmolLM2-135M-Instruct with every decoder layer substituted (4-bit HQQ g64), the first N MT-Bench
first turns in the reference's sample order, greedy. Configs are `chain:D` or `tree:KxD`.
Writes benchmarks/results/<name>.{json,md}.

    # issue 2: chains, 20 prompts x 128 tokens, one request at a time
    python -m benchmarks.depth_sweep --name chain_depth --configs chain:4 chain:8 chain:16
    # issue 3: chains vs k=6 trees, 20 prompts x 256 tokens, all prompts as one batch
    python -m benchmarks.depth_sweep --name tree_depth --max-tokens 256 --batched \\
        --configs chain:8 chain:16 chain:48 tree:6x8 tree:6x16 tree:6x32 tree:6x48
    # PROJECTED GPU speed-ups from a finished sweep's τ (runs no engine)
    python -m benchmarks.depth_sweep --name tree_depth --projection
    # Qwen2.5-Coder-1.5B-Instruct (28 layers), paper-like residency: the first 17 substituted
    python -m benchmarks.depth_sweep --model qwen-coder-1.5b --substitute-layers first:17 ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["chain:4", "chain:8", "chain:16"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batched", action="store_true",
                    help="time all prompts as one batch (default: one request at a time)")
    ap.add_argument("--dtype", default="bfloat16",
                    help="float32 for trees on AMX CPUs: vLLM's bf16 KV layout there ('amx') is "
                    "one tree attention cannot read")
    ap.add_argument("--skip-identity", action="store_true",
                    help="skip the batched token-identity run (halves the time)")
    ap.add_argument("--name", default="chain_depth")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (SmolLM2-135M-Instruct), qwen-coder-1.5b "
                    "(Qwen2.5-Coder-1.5B-Instruct, fetched on first use) or a model folder")
    ap.add_argument("--substitute-layers", default="all",
                    help="all, first:N (layers 0..N-1; the rest stay full precision, like the "
                    "paper's resident layers) or comma-separated indices")
    ap.add_argument("--quantizer", default="hqq", choices=["hqq", "rtn"],
                    help="how substitutes are built (rtn: round-to-nearest, a weaker draft that "
                    "builds in seconds)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="fixed KV cache size (default: vLLM's share of RAM, which a 1.5B fp32 "
                    "model on a small machine can exceed)")
    ap.add_argument("--append", action="store_true",
                    help="add the configs' runs to an existing results/<name>.json (same "
                    "workload; its plain run is reused), e.g. to run configs in priority order")
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the plain engine (no identity check, no tokens/s baseline)")
    ap.add_argument("--projection", action="store_true",
                    help="run nothing: turn results/<name>.json's measured τ into PROJECTED GPU "
                    "speed-ups (benchmarks/projection.py) -> results/<name>_projection.*")
    ap.add_argument("--bandwidths", type=float, nargs="+", default=[25.0, 12.0, 50.0],
                    help="--projection: host-to-device GB/s to project for")
    ap.add_argument("--memory-gb", type=float, nargs="+", default=[8.0, 12.0],
                    help="--projection: GPU memory limits to project for (7B model)")
    ap.add_argument("--draft-pass-ms", type=float, default=11.0,
                    help="--projection: GPU time of one draft pass (paper: ~11 ms for 7B)")
    return ap.parse_args()


def substitute_layers(spec: str):
    """"all" | "first:N" | "0,1,5" -> the speculative_config value."""
    if spec == "all":
        return "all"
    if spec.startswith("first:"):
        return list(range(int(spec.split(":")[1])))
    return [int(i) for i in spec.split(",")]


def spec_config(config: str, layers="all", quantizer: str = "hqq") -> dict:
    kind, _, size = config.partition(":")
    if kind == "chain":
        return {"method": "subspec", "num_speculative_tokens": int(size),
                "substitute_layers": layers, "quantizer": quantizer}
    width, depth = (int(x) for x in size.split("x"))
    return {"method": "subspec", "tree_width": width, "tree_depth": depth,
            "substitute_layers": layers, "quantizer": quantizer}


def model_path(name: str) -> str:
    from subspec_testing import assets

    if name == "smollm2":
        return assets.smollm2_path()
    if name == "qwen-coder-1.5b":
        return assets.qwen_coder_1p5b_path()
    if name == "smollm2-moe":  # SmolLM2 upcycled into a 4-expert Mixtral (assets.py)
        return assets.smollm2_moe_path()
    return name


def environment() -> dict:
    import torch
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "vllm": vllm.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run(model, prompts, params, spec, args) -> dict:
    from subspec_testing.harness import run_engine

    # a batch big enough that vLLM never trims a request's tree to fit its token budget
    r = run_engine(model, prompts, params, spec, one_at_a_time=not args.batched,
                   identity_run=not args.skip_identity, dtype=args.dtype,
                   max_num_batched_tokens=16384, **kv_kwargs(args))
    t, steps = r.timed, r.draft_steps
    return {
        "tau": t.stats.tau, "tokens": t.num_tokens, "seconds": t.seconds,
        # vLLM counts a step's accepted drafts before max_tokens/EOS truncate them; tokens
        # actually emitted per verify step (the first token of each request comes from prefill)
        # is a lower bound that matters when max_tokens is not much larger than the depth.
        "num_drafts": t.stats.num_drafts,
        "tau_emitted": ((t.num_tokens - len(prompts)) / t.stats.num_drafts
                        if t.stats.num_drafts else 1.0),
        "tokens_per_second": t.tokens_per_second,
        "acceptance_per_depth": t.stats.acceptance_rate_per_position,
        "steps": steps, "draft_seconds_per_step": r.draft_seconds / steps if steps else 0.0,
        "other_seconds_per_step": (t.seconds - r.draft_seconds) / steps if steps else 0.0,
        "batched_token_ids": r.batched.token_ids if r.batched else None,
    }


def stream_gbps(megabytes: int = 512, reps: int = 5) -> float:
    """This core's memory bandwidth: one thread copying a buffer far larger than the caches,
    bytes read + written per second (the best of `reps`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(megabytes << 18, dtype=torch.float32)  # megabytes MB
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.nbytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


def bf16_peak_gflops(n: int = 2048, rows: int = 256, reps: int = 3) -> float:
    """This core's bf16 matmul rate: [rows, n] @ [n, n] on one thread, GFLOP/s (best of
    `reps`; the weight stays in cache, so this is the compute roof)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(rows, n).to(torch.bfloat16)
        w = torch.randn(n, n).to(torch.bfloat16)
        torch.nn.functional.linear(x, w)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
        return 2 * rows * n * n / best / 1e9
    finally:
        torch.set_num_threads(threads)


def kv_kwargs(args) -> dict:
    gb = getattr(args, "kv_cache_gb", None)
    return {"kv_cache_memory_bytes": int(gb * 2**30)} if gb else {}


def identical(run: dict, workload: dict) -> str:
    return "-" if run["identical"] == "-" else f"{run['identical']}/{workload['prompts']}"


def emitted(r: dict) -> str:
    return f" (emitted {r['tau_emitted']:.2f})" if "tau_emitted" in r else ""


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"# SubSpec depth sweep: `{report['name']}` (vLLM CPU backend)", "",
        f"`{Path(w['model']).name}`, {w.get('substituted', 'all layers')} substituted (4-bit "
        f"{w.get('quantizer', 'hqq').upper()} g64, the rest full precision), {w['prompts']} "
        f"MT-Bench first turns, greedy, <= {w['max_tokens']} new tokens, dtype {w['dtype']}, "
        f"{'all prompts as one batch' if w['batched'] else 'one request at a time'}, "
        "enforce_eager.", "",
        f"Command: `{report['command']}`", "",
        "| config | τ | tokens/s | vs plain | draft s/step | verify+rest s/step | identical "
        "| acceptance by depth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = (report.get("plain") or {}).get("tokens_per_second")
    if base:
        lines.append(f"| plain | 1.00 | {base:.1f} | 1.00x | - | - | - | - |")
    for r in report["runs"]:
        depth = r["depth"]
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_per_depth"][:depth])
        vs_plain = f"{r['tokens_per_second'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['config']} | {r['tau']:.2f}{emitted(r)} | {r['tokens_per_second']:.1f} | "
            f"{vs_plain} | "
            f"{r['draft_seconds_per_step']:.3f} | "
            f"{r['other_seconds_per_step']:.3f} | {identical(r, w)} | {rates} |")
    env = report["environment"]
    lines += [
        "", f"Machine: {env['cpu']}, {env['cores']} cores, OMP_NUM_THREADS={env['omp_threads']}; "
        f"torch {env['torch']}, vLLM {env['vllm']}; {env['date']}.", "",
        "- τ = accepted draft tokens per verify step + 1, from vLLM's metrics (which count a "
        "step's accepted drafts before max_tokens/EOS cut them); 'emitted': tokens actually "
        "output per verify step, a lower bound (the last step of each request is cut short). "
        "They differ when max_tokens is not much larger than the depth.",
        "- draft s/step: SubSpecProposer time per step; verify+rest: the remainder of the step "
        "(target forward, sampling, scheduling).",
        "- identical ('-': not checked, --skip-identity): token ids equal to the plain engine "
        "when all prompts run as one batch to "
        "max tokens. On the CPU backend a chain is bit-exact in bf16, and so is a tree: its "
        "rows run vLLM's CPU attention kernel as the decode rows plain decoding computes "
        "(docs/losslessness.md; the tests check token identity in fp32).",
        "- On CPU nothing is offloaded, so tokens/s shows drafting cost, not the PCIe savings "
        "SubSpec exists for; τ carries over to the GPU setting.",
    ]
    return "\n".join(lines) + "\n"


def write_projection(args) -> None:
    from benchmarks.plots import plot_projection
    from benchmarks.projection import adaptive_markdown, projection_markdown, projection_rows, settings_grid

    settings = settings_grid(args.bandwidths, args.memory_gb, draft_pass_ms=args.draft_pass_ms)
    report = json.loads((RESULTS / args.name).with_suffix(".json").read_text())
    rows = projection_rows(report["runs"], settings)
    out = RESULTS / f"{args.name}_projection"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    md = projection_markdown(rows, f"`{report['command']}`", settings)
    deepest = max((r for r in report["runs"] if r["config"].startswith("tree")),
                  key=lambda r: r["depth"], default=None)
    if deepest is not None:
        md += "\n" + adaptive_markdown(deepest, settings)
    md += f"\nCommand: `python {' '.join(sys.argv)}`\n"
    out.with_suffix(".md").write_text(md + f"\n![projection]({out.name}.png)\n")
    plot_projection(rows, out.with_suffix(".png"))
    print(md)


def main():
    args = parse_args()
    if args.projection:
        return write_projection(args)
    from vllm import SamplingParams

    from subspec_testing.assets import chat_prompts, mt_bench_prompts

    model = model_path(args.model)
    prompts = chat_prompts(model, mt_bench_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    layers = substitute_layers(args.substitute_layers)
    substituted = ("all layers" if layers == "all" else
                   f"layers {args.substitute_layers.replace('first:', 'first ')}")
    previous = RESULTS / f"{args.name}.json"
    if args.append and previous.exists():
        report = json.loads(previous.read_text())
        w = report["workload"]
        if (w["model"], w["prompts"], w["max_tokens"], w["batched"], w["dtype"],
                w.get("substituted", "all layers"), w.get("quantizer", "hqq")) != (
                model, args.prompts, args.max_tokens, args.batched, args.dtype, substituted,
                args.quantizer):
            raise SystemExit(f"--append: {previous} has a different workload: {w}")
        report["command"] += " && python " + " ".join(sys.argv)
        return sweep(report, model, prompts, params, layers, None, args)
    plain = None if args.no_plain else run(model, prompts, params, None, args)
    report = {
        "name": args.name, "command": "python " + " ".join(sys.argv),
        "workload": {"model": model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                     "batched": args.batched, "dtype": args.dtype,
                     "substituted": substituted, "quantizer": args.quantizer},
        "environment": environment(),
        "plain": plain and {k: v for k, v in plain.items() if k != "batched_token_ids"},
        "identity_checked": not args.skip_identity and plain is not None,
        "runs": [],
    }
    return sweep(report, model, prompts, params, layers, plain, args)


def sweep(report, model, prompts, params, layers, plain, args):
    from subspec_testing.harness import count_identical

    for config in args.configs:
        r = run(model, prompts, params, spec_config(config, layers, args.quantizer), args)
        ids = r.pop("batched_token_ids")
        r["identical"] = ("-" if ids is None or plain is None
                          else count_identical(ids, plain["batched_token_ids"]))
        r["config"] = config
        r["depth"] = int(config.split("x")[-1].split(":")[-1])
        report["runs"].append(r)
        print(f"{config}: τ={r['tau']:.2f} {r['tokens_per_second']:.1f} tok/s, identical "
              f"{identical(r, report['workload'])}", flush=True)
        write(report)  # after every config, so a long sweep keeps what it measured
    print(markdown(report))


def write(report: dict) -> None:
    from benchmarks.plots import plot_depth

    out = RESULTS / report["name"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report) + f"\n![depth]({out.name}.png)\n")
    plot_depth(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
