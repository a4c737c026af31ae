"""Engine start-up time with the substitute cache cold and warm (vLLM CPU backend).

For each model: a plain engine, then a SubSpec engine (every layer substituted, 4-bit HQQ g64)
with this model's cache entries removed (cold: every substitute is quantized and stored), then
the same SubSpec engine again (warm: every substitute is loaded). Time = `LLM(...)` construction,
from the call to a ready engine. Writes benchmarks/results/startup.{json,md}.

    python -m benchmarks.startup --models smollm2 qwen-coder-1.5b

The cache root is the default one (`$VLLM_SUBSPEC_CACHE_DIR`, else ~/.cache/vllm-subspec/...)
unless --cache-dir is given; only the entries of the measured models' cold runs are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


from benchmarks.depth_sweep import RESULTS, environment, model_path


def _counts(worker):
    import os

    import psutil

    from vllm_subspec.vllm_hooks.runner import SubSpecRunner

    runner = worker.model_runner  # a plain engine's too: no substitutes there
    subs = runner.drafter.substitutes if isinstance(runner, SubSpecRunner) else None
    rss = psutil.Process(os.getpid()).memory_info().rss
    kv = sum(t.numel() * t.element_size() for t in worker.model_runner.kv_caches)
    if subs is None:
        return 0, 0, 0.0, rss, kv, 0
    return subs.built, subs.cache_hits, subs.build_seconds, rss, kv, subs.nbytes()


def start(model: str, spec: dict | None, dtype: str, memory_utilization: float) -> dict:
    from vllm import LLM

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine

    t = time.perf_counter()
    llm = LLM(model=model, speculative_config=spec, enforce_eager=True, dtype=dtype,
              **{**CPU_ENGINE_KWARGS, "gpu_memory_utilization": memory_utilization})
    seconds = time.perf_counter() - t
    try:
        built, hits, build_s, rss, kv, draft = llm.collective_rpc(_counts)[0]
    finally:
        shutdown_engine(llm)
    return {"seconds": seconds, "built": built, "loaded": hits, "substitute_seconds": build_s,
            "worker_rss_gib": rss / 2**30, "kv_cache_gib": kv / 2**30,
            "draft_gib": draft / 2**30}


def model_path_name(name: str) -> str:
    return {"smollm2": "SmolLM2-135M-Instruct-bf16",
            "qwen-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct-bf16"}.get(name, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--memory-utilization", type=float, default=0.3,
                    help="gpu_memory_utilization: on CPU, the RAM share of the engine")
    ap.add_argument("--warm-only", action="store_true",
                    help="keep the cache (no cold run): plain and a warm SubSpec start only")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    from vllm_subspec.config import SubSpecOptions
    from vllm_subspec.draft_model.substitute_cache import SubstituteCache

    spec = {"method": "subspec"}  # the default: on CPU, every layer substituted, auto shape
    if args.cache_dir:
        spec["substitute_cache"] = args.cache_dir
    out = RESULTS / "startup"
    report = {"command": "python -m benchmarks.startup " + " ".join(sys.argv[1:]),
              "environment": environment(), "dtype": args.dtype,
              "memory_utilization": args.memory_utilization, "models": {}}
    if out.with_suffix(".json").exists():  # keep other models' rows from earlier runs
        old = json.loads(out.with_suffix(".json").read_text())
        keep = {k: v for k, v in old["models"].items()
                if not any(k == Path(model_path_name(m)).name for m in args.models)}
        if keep:
            report["models"] = keep
            report["command"] = old["command"] + " && " + report["command"]
    for name in args.models:
        model = model_path(name)
        cache = SubstituteCache.create(model, args.cache_dir, SubSpecOptions())
        if cache is None:
            raise SystemExit(f"no substitute cache for {model}")
        mem = args.memory_utilization
        rows = {"plain": start(model, None, args.dtype, mem)}
        if not args.warm_only:
            shutil.rmtree(cache.folder, ignore_errors=True)
            rows["subspec, cache cold"] = start(model, spec, args.dtype, mem)
        rows["subspec, cache warm"] = start(model, spec, args.dtype, mem)
        report["models"][Path(model).name] = {"cache_folder": str(cache.folder), "runs": rows}

        print(name, json.dumps(rows), flush=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Engine start-up time, substitute cache cold vs warm (vLLM CPU backend)", "",
             f"Command: `{report['command']}`. `LLM(...)` construction time (load, substitutes, "
             f"KV cache, warm-up), dtype {report['dtype']}, enforce_eager, "
             f"gpu_memory_utilization {report.get('memory_utilization', 0.3)}, SubSpec's default "
             "configuration (`{\"method\": \"subspec\"}`: on CPU every layer substituted, "
             "4-bit HQQ g64, and the draft's own 4-bit lm_head).", "",
             "| model | engine | start-up s | of which substitutes s | substitutes built "
             "| loaded from cache | worker RSS GiB | of which draft GiB | KV cache GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, m in report["models"].items():
        for engine, r in m["runs"].items():
            subs = ("-", "-", "-", "-") if engine == "plain" else (
                f"{r['substitute_seconds']:.1f}", r["built"], r["loaded"],
                f"{r['draft_gib']:.2f}")
            lines.append(f"| {model} | {engine} | {r['seconds']:.1f} | {subs[0]} | {subs[1]} "
                         f"| {subs[2]} | {r['worker_rss_gib']:.2f} | {subs[3]} "
                         f"| {r['kv_cache_gib']:.2f} |")
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores, OMP_NUM_THREADS="
              f"{env['omp_threads']}; torch {env['torch']}, vLLM {env['vllm']}; {env['date']}. "
              "Worker RSS: the worker process's resident memory once the engine is up (the KV "
              "cache included). The substitutes column is the worker's own build/load time."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
