"""What one draft pass costs on vLLM's CPU backend: operators dispatched and CPU time per pass,
eager (`enforce_eager`) and in vLLM's default compile mode, for a fixed tree of width 6 at
B in {1, 4, 8} requests and contexts of 512 and 4096 tokens.

One engine per mode, SubSpec with `tree_width` 6; per (context, B): B requests with the same
random-token prompt (prefix caching prefills it once), greedy, `--max-tokens` new tokens. The
worker's step statistics give the drafting time per pass (`StepStats.draft_seconds /
draft_passes`: the forwards and the tree's bookkeeping between them). A second, short run per
(context, B) counts the operators the draft passes dispatch, with a torch dispatch mode around
the session's `propose`: every aten or custom operator called from Python, or from the
compiled graph's wrapper (its extern kernels, custom ops); the kernels inductor generated and
fused are not dispatched, so not counted, and an attention layer is one operator (vLLM's
`unified_attention_with_output`, tree rows included). Writes
benchmarks/results/<name>.{json,md}.

    python -m benchmarks.draft_pass --model qwen-coder-1.5b --name draft_pass_qwen
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections import Counter

from benchmarks.depth_sweep import RESULTS, environment, model_path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc callables


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--name", default="draft_pass")
    ap.add_argument("--modes", nargs="+", default=["eager", "compile"],
                    choices=["eager", "compile"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--width", type=int, default=6)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--label", default="", help="a name for this code (e.g. 'before')")
    return ap.parse_args()


# ---- worker side (collective_rpc targets) ---------------------------------------------------
_COUNTING: dict = {}  # this worker process's operator count (`count_operators`)


def count_operators(worker, on: bool) -> dict:
    """Count the operators dispatched inside the step session's `propose` from now (on) or
    stop (off); returns the counts so far: {"passes": draft passes, "ops": {name: calls}}.
    A dispatch mode on the worker's thread counts the operators whose Python stack holds
    `StepSession.propose` (nothing of SubSpec's is replaced)."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_subspec.step.session import StepSession
    from vllm_subspec.vllm_hooks.runner import subspec_of

    propose = StepSession.propose.__code__
    stats = subspec_of(worker).session.stats

    def drafting() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is propose:
                return True
            frame = frame.f_back
        return False

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if drafting():
                _COUNTING["ops"][str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    if on and "mode" not in _COUNTING:
        _COUNTING.update(mode=Count(), ops=Counter(), passes=stats.draft_passes)
        _COUNTING["mode"].__enter__()
    elif not on and "mode" in _COUNTING:
        _COUNTING.pop("mode").__exit__(None, None, None)
        _COUNTING["passes"] = stats.draft_passes - _COUNTING["passes"]
    return {"passes": _COUNTING["passes"], "ops": dict(_COUNTING["ops"])}


# ---- driver ---------------------------------------------------------------------------------
def run_mode(model: str, mode: str, args) -> dict:
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine, step_stats

    kwargs = dict(CPU_ENGINE_KWARGS, dtype="bfloat16", enforce_eager=mode == "eager",
                  max_model_len=max(args.contexts) + args.max_tokens + 64,
                  kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30))
    spec = {"method": "subspec", "tree_width": args.width, "tree_depth": args.depth}
    start = time.perf_counter()
    llm = LLM(model, speculative_config=spec, **kwargs)
    startup = time.perf_counter() - start
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows = []
    try:
        for context in args.contexts:
            rng = random.Random(context)
            prompt = TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab - 100)
                                                    for _ in range(context)])
            llm.generate([prompt], short, use_tqdm=False)  # prefill once (prefix caching)
            for b in args.batches:
                before = llm.collective_rpc(step_stats)[0]
                t = time.perf_counter()
                llm.generate([prompt] * b, params, use_tqdm=False)
                seconds = time.perf_counter() - t
                after = llm.collective_rpc(step_stats)[0]
                stats = {k: after[k] - before[k] for k in ("draft_passes", "draft_seconds")}
                llm.collective_rpc(count_operators, args=(True,))
                llm.generate([prompt] * b, short, use_tqdm=False)
                ops = llm.collective_rpc(count_operators, args=(False,))[0]
                passes = max(stats["draft_passes"], 1)
                per_pass = sum(ops["ops"].values()) / max(ops["passes"], 1)
                top = sorted(ops["ops"].items(), key=lambda kv: -kv[1])[:8]
                rows.append({"context": context, "batch": b, "seconds": seconds,
                             "draft_passes": stats["draft_passes"],
                             "ms_per_pass": 1000 * stats["draft_seconds"] / passes,
                             "draft_share": stats["draft_seconds"] / seconds,
                             "ops_per_pass": per_pass,
                             "top_ops_per_pass": {k: v / max(ops["passes"], 1) for k, v in top}})
                print(f"{mode} ctx {context} B {b}: {rows[-1]['ms_per_pass']:.1f} ms/pass, "
                      f"{per_pass:.0f} ops/pass", flush=True)
    finally:
        shutdown_engine(llm)
    return {"mode": mode, "startup_seconds": startup, "rows": rows}


def markdown(report: dict) -> str:
    layers = report["layers"]
    out = [f"# Draft passes on vLLM's CPU backend: {report['model']}", "",
           f"Command: `{report['command']}`", "",
           f"Fixed tree, width {report['width']}, depth {report['depth']}; bf16; one core. "
           "ms/pass: drafting time per draft forward (the forward and the tree's bookkeeping); "
           "ops/pass: operators dispatched per draft forward (see the script's docstring for "
           "what is and is not counted); per layer: ops/pass over the "
           f"{layers} decoder layers.", ""]
    for run in report["runs"]:
        out += [f"## {run['mode']}{' (' + report['label'] + ')' if report['label'] else ''}"
                f", start-up {run['startup_seconds']:.0f} s", "",
                "| context | B | ms/pass | ops/pass | ops/layer | draft share of time |",
                "|---|---|---|---|---|---|"]
        for r in run["rows"]:
            out.append(f"| {r['context']} | {r['batch']} | {r['ms_per_pass']:.1f} | "
                       f"{r['ops_per_pass']:.0f} | {r['ops_per_pass'] / layers:.1f} | "
                       f"{r['draft_share']:.2f} |")
        first = run["rows"][0]
        out += ["", f"Most dispatched at context {first['context']}, B {first['batch']} "
                "(per pass): " + ", ".join(f"`{k}` {v:.0f}"
                                           for k, v in first["top_ops_per_pass"].items()), ""]
    out.append(f"Machine: {report['env'].get('cpu', '?')}; torch {report['env'].get('torch')}; "
               f"{report['env'].get('date', '')}.")
    return "\n".join(out) + "\n"


def main():
    args = parse_args()
    from transformers import AutoConfig

    model = model_path(args.model)
    report = {"model": args.model, "command": "python -m benchmarks.draft_pass " +
              shlex.join(sys.argv[1:]), "width": args.width, "depth": args.depth,
              "label": args.label, "layers": AutoConfig.from_pretrained(model).num_hidden_layers,
              "env": environment(), "runs": [run_mode(model, m, args) for m in args.modes]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
