"""Where a decoding step's time goes, plain engine against a SubSpec engine that does not draft
(its tuner told drafting never pays: `harness.predict_plain_faster`), one request at a time:
each engine in its own process with vLLM's engine core in-process, vLLM's step phases timed by
wrapping them (EngineCore.step, the runner's execute_model / _model_forward / _prepare_inputs /
sample_tokens / _sample, the scheduler's schedule / update_from_output). What a never-drafting
SubSpec step costs beyond plain's, phase by phase: issue 37's "never slower" at one request.

Engines alternate (plain, SubSpec, plain, ...) so drift in the machine's speed hits both;
processes of the same engine differ too, which the table shows (one row per process).
Writes benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.step_phases --model smollm2 --compiled --name step_phases_smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = {  # vLLM's class -> methods timed (qualified names in the report)
    "vllm.v1.engine.core:EngineCore": ("step", "post_step"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": (
        "execute_model", "_model_forward", "_prepare_inputs", "sample_tokens", "_sample",
        "_update_states", "_bookkeeping_sync"),
    "vllm.v1.core.sched.scheduler:Scheduler": ("schedule", "update_from_output"),
}
SUBSPEC_PHASES = {  # SubSpec's own parts of a plain step (SubSpec engines only)
    "vllm_subspec.vllm_hooks.runner:SubSpecRunner": ("propose_draft_token_ids",),
    "vllm_subspec.step.session:StepSession": ("plan_step",),
    "vllm_subspec.step.tuner.tuner:ShapeTuner": ("plan_step",),
    "vllm_subspec.step.tuner.policy:ShapePolicy": ("choose",),
    "vllm_subspec.vllm_hooks.proposer:SubSpecProposer": ("plain_step",),
    "vllm_subspec.vllm_hooks.verifier:SampleMatchVerifier": ("__call__", "prepare_verify"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="step_phases")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--processes", type=int, default=2, help="processes per engine")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode")
    ap.add_argument("--engine", choices=("plain", "subspec"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _timed(cls, name, totals, counts, key):
    original = getattr(cls, name)
    one_row = key == "GPUModelRunner._model_forward"  # also kept apart: one-row forwards

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            keys = [key]
            if one_row and getattr(kwargs.get("input_ids"), "shape", (0,))[0] == 1:
                keys.append(key + " (1 row)")
            for k in keys:
                totals[k] = totals.get(k, 0.0) + seconds
                counts[k] = counts.get(k, 0) + 1

    setattr(cls, name, timed)


def one_engine(args) -> dict:
    """In a child process: one engine, its phases timed over the prompts one at a time."""
    import importlib

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import LLM, SamplingParams

    from benchmarks.cpu_speed import mixed_prompts
    from benchmarks.depth_sweep import model_path
    from subspec_testing.assets import chat_prompts
    from subspec_testing.harness import CPU_ENGINE_KWARGS, predict_plain_faster

    totals, counts = {}, {}
    phases = {**PHASES, **(SUBSPEC_PHASES if args.engine == "subspec" else {})}
    for where, names in phases.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            _timed(cls, name, totals, counts, f"{cls_name}.{name}")
    model = model_path(args.model)
    prompts = chat_prompts(model, mixed_prompts(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {"method": "subspec"} if args.engine == "subspec" else None
    llm = LLM(model=model, speculative_config=spec, enforce_eager=not args.compiled,
              max_num_batched_tokens=16384, **CPU_ENGINE_KWARGS)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    if spec:
        llm.collective_rpc(predict_plain_faster)
    totals.clear()
    counts.clear()
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)
        tokens += len(out[0].outputs[0].token_ids)
    seconds = time.perf_counter() - start
    steps = counts.get("EngineCore.step", 1)
    return {"engine": args.engine, "tokens_per_second": tokens / seconds, "steps": steps,
            "ms_per_step": 1e3 * seconds / steps,
            "phase_ms_per_step": {k: 1e3 * v / steps for k, v in totals.items()},
            "phase_calls": counts}


def main(argv=None):
    args = parse_args(argv)
    if args.engine:  # the child
        Path(args.out).write_text(json.dumps(one_engine(args)))
        return
    from benchmarks.depth_sweep import RESULTS, environment

    runs = []
    for i in range(args.processes):
        for engine in ("plain", "subspec"):
            out = RESULTS / f".{args.name}_{engine}_{i}.json"
            cmd = [sys.executable, "-m", "benchmarks.step_phases", "--engine", engine,
                   "--out", str(out), "--model", args.model, "--prompts", str(args.prompts),
                   "--max-tokens", str(args.max_tokens)] + (["--compiled"] if args.compiled
                                                            else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
            out.unlink()
    report = {"command": "python -m benchmarks.step_phases " + " ".join(sys.argv[1:]),
              "model": args.model, "mode": "compiled" if args.compiled else "eager",
              "prompts": args.prompts, "max_tokens": args.max_tokens,
              "environment": environment(), "runs": runs}
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def _median(runs, engine, key):
    values = [r["phase_ms_per_step"].get(key, 0.0) if key else r["ms_per_step"]
              for r in runs if r["engine"] == engine]
    return statistics.median(values) if values else 0.0


def markdown(report: dict) -> str:
    runs = report["runs"]
    keys = sorted({k for r in runs for k in r["phase_ms_per_step"]},
                  key=lambda k: -_median(runs, "plain", k))
    lines = [f"# A decoding step's phases: plain vs SubSpec not drafting ({report['model']}, "
             f"{report['mode']})", "", f"`{report['command']}`", "",
             f"{report['prompts']} mixed prompts one at a time, {report['max_tokens']} tokens "
             f"each, greedy, bf16; {report['environment']['cpu']}, "
             f"{report['environment']['date']}. Each engine in its own process, vLLM's engine "
             "core in-process; ms per engine step (a phase's calls summed over the run, over "
             "the steps), one column per process, in the order they ran.", "",
             "| phase | " + " | ".join(f"{r['engine']} #{i // 2 + 1}"
                                       for i, r in enumerate(runs)) + " | SubSpec - plain "
             "(medians) |", "|---" * (len(runs) + 2) + "|"]
    lines.append("| **tok/s** | " + " | ".join(f"{r['tokens_per_second']:.1f}" for r in runs)
                 + " | |")
    lines.append("| **whole step** | " + " | ".join(f"{r['ms_per_step']:.3f}" for r in runs)
                 + f" | {_median(runs, 'subspec', None) - _median(runs, 'plain', None):+.3f} |")
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{r['phase_ms_per_step'].get(k, 0.0):.3f}"
                                              for r in runs)
                     + f" | {_median(runs, 'subspec', k) - _median(runs, 'plain', k):+.3f} |")
    lines.append("")
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    runs = report["runs"]
    keys = ["GPUModelRunner._model_forward", "GPUModelRunner._prepare_inputs",
            "GPUModelRunner.sample_tokens", "Scheduler.schedule",
            "Scheduler.update_from_output"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['engine']} #{i // 2 + 1}" for i, r in enumerate(runs)]
    bottom = [0.0] * len(runs)
    for k in keys:
        values = [r["phase_ms_per_step"].get(k, 0.0) for r in runs]
        ax.bar(labels, values, bottom=bottom, label=k.split(".")[-1])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(labels, [r["ms_per_step"] - b for r, b in zip(runs, bottom)], bottom=bottom,
           label="rest of the step", color="lightgrey")
    ax.set(ylabel="ms per step", title=f"Step phases, {report['model']} {report['mode']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
