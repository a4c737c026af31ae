"""The structure of a SubSpec step as it runs: which of the package's modules a step's calls go
through, how deep its call chains get, how often they cross between the package's folders, and
from how many vLLM call sites it is entered.

An in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager, SmolLM2-135M) generates a few
requests with a profiler hook (`sys.setprofile`) on; at every call into a `vllm_subspec` frame
the stack's `vllm_subspec` frames are read (frames of vLLM or torch between them are skipped):

* modules: the package's modules with a frame in the traced steps;
* deepest chain: the most `vllm_subspec` frames on one stack (comprehensions and lambdas not
  counted);
* crossings: on that stack, how often two consecutive `vllm_subspec` frames sit in different
  folders (`vllm_hooks/`, `step/`, `draft_model/`, the package's top);
* entries: the distinct (vLLM caller, SubSpec callee) pairs where a stack enters the package.

Each configuration runs after a warm-up request; results go to
benchmarks/results/<name>.json.

    python -m benchmarks.step_anatomy --name step_anatomy_after
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGE = "vllm_subspec"
CONFIGS = {
    "auto": {"method": "subspec"},
    "tree 4x4": {"method": "subspec", "tree_width": 4, "tree_depth": 4},
    "chain 4": {"method": "subspec", "num_speculative_tokens": 4},
}


def _module_of(filename: str) -> str | None:
    """`vllm_subspec/step/draft.py` -> "step/draft", None outside the package."""
    parts = Path(filename).parts
    if PACKAGE not in parts:
        return None
    rel = parts[len(parts) - 1 - parts[::-1].index(PACKAGE) + 1:]
    return "/".join(rel)[: -len(".py")] if rel and rel[-1].endswith(".py") else None


def _folder(module: str) -> str:
    return module.split("/")[0] if "/" in module else "(top)"


class Anatomy:
    """The profiler hook and what it has seen."""

    def __init__(self):
        self.modules: set[str] = set()
        self.deepest: list[str] = []
        self.most_crossings: list[str] = []
        self.entries: set[tuple[str, str]] = set()

    def hook(self, frame, event, arg) -> None:
        if event != "call":
            return
        module = _module_of(frame.f_code.co_filename)
        if module is None:
            return
        chain, entry = [], None
        f = frame
        while f is not None:
            m = _module_of(f.f_code.co_filename)
            if m is not None and not f.f_code.co_name.startswith("<"):  # not comprehensions
                chain.append(f"{m}:{f.f_code.co_qualname}")
                caller = f.f_back
                if caller is not None and _module_of(caller.f_code.co_filename) is None:
                    entry = (caller.f_code.co_qualname, chain[-1])  # the outermost wins
            f = f.f_back
        chain.reverse()
        self.modules.add(module)
        if entry is not None:
            self.entries.add(entry)
        if len(chain) > len(self.deepest):
            self.deepest = chain
        if crossings(chain) > crossings(self.most_crossings):
            self.most_crossings = chain

    def report(self) -> dict:
        return {"modules": sorted(self.modules), "num_modules": len(self.modules),
                "deepest_chain": len(self.deepest), "deepest": self.deepest,
                "crossings": crossings(self.most_crossings),
                "most_crossings": self.most_crossings,
                "entries": sorted(f"{a} -> {b}" for a, b in self.entries),
                "num_entries": len(self.entries)}


def crossings(chain: list[str]) -> int:
    folders = [_folder(c.split(":")[0]) for c in chain]
    return sum(a != b for a, b in zip(folders, folders[1:]))


def trace(model: str, spec: dict, prompts: list[str], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.3, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=max_tokens,
                             repetition_penalty=1.05)]
    try:
        llm.generate(prompts[:1], params[0], use_tqdm=False)  # warm-up
        anatomy = Anatomy()
        sys.setprofile(anatomy.hook)
        try:
            llm.generate(prompts, [params[i % 2] for i in range(len(prompts))],
                         use_tqdm=False)
        finally:
            sys.setprofile(None)
        return anatomy.report()
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="step_anatomy")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    from subspec_testing.assets import mt_bench_prompts, smollm2_path

    prompts = mt_bench_prompts(3)
    out = {"command": "python -m benchmarks.step_anatomy " + " ".join(sys.argv[1:]),
           "configs": {}}
    for name in args.configs:
        out["configs"][name] = trace(smollm2_path(), CONFIGS[name], prompts, args.max_tokens)
        r = out["configs"][name]
        print(f"{name}: {r['num_modules']} modules, deepest chain {r['deepest_chain']}, "
              f"{r['crossings']} crossings, {r['num_entries']} entries", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
