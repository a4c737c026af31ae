"""How much of vllm_subspec's CUDA-only code the CPU test suite executes (coverage.py).

Runs the suite's unit tests (no engine: `-m "not e2e"`; an engine on CPU never reaches CUDA-only
code) under coverage, child processes included (the FlashAttention layout probe and the GemLite
interpreter probe run in subprocesses), then reports, for each CUDA-only function or class, the
statements executed. Writes benchmarks/results/cuda_coverage.{json,md}.

    python scripts/cuda_coverage.py            # ~5 min on 2 cores
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# module -> the functions/classes only a CUDA engine runs (and why a CPU engine does not)
CUDA_ONLY = {
    "step/paged_kv.py": ["FlashAttentionLayout"],
    "step/tree_attention.py": ["_triton_rows"],
    "step/tree_attention_triton.py": ["_tree_attention_kernel", "tree_rows_layout",
                                      "tree_attention_into"],
    "vllm_hooks/engine_rules.py": ["_require_offload", "_no_async_scheduling",
                                   "_pin_flash_attention", "check_final_config",
                                   "tree_cudagraph_mode"],
    "vllm_hooks/prefetch_overlap.py": ["_capturing", "_current_forward_context",
                                       "OverlappingPrefetchOffloader"],
    "vllm_hooks/runner.py": ["SubSpecGPUWorker"],
    "draft_model/kernels.py": ["GemliteKernel", "gemlite_available"],
    "draft_model/gemlite_tuning.py": ["gemlite_warm_up_key"],
    "draft_model/substitute_set.py": ["SubstituteSet.warm_up"],
    "draft_model/row_buckets.py": ["draft_row_counts", "capture_bucket"],
    "draft_model/layer_selection.py": ["offloaded_layer_indices", "_in_host_memory"],
    # engine code with CUDA-only branches (prefetch overlap, warm-up, stream sync): the CPU
    # unit tests do not start an engine, so these show what runs only inside one
    "vllm_hooks/proposer.py": ["SubSpecProposer.load_model", "SubSpecProposer.propose",
                               "SubSpecProposer.draft_bucket",
                               "SubSpecProposer.initialize_cudagraph_keys"],
    "vllm_hooks/draft_passes.py": ["VllmDraftPasses.synchronize", "VllmDraftPasses.copy_to_host"],
    "vllm_hooks/draft_startup.py": ["warm_up_kernels"],
    "step/draft.py": ["HostCopy"],
}

# why the statements a row lists as not run cannot run in this pass
NOT_RUN_BECAUSE = {
    ("vllm_hooks/proposer.py", "SubSpecProposer.load_model"):
        "engine code: every CPU e2e test runs it (this pass runs unit tests only); its CUDA-only "
        "call cannot run on CPU: the GemLite warm-up needs `device.type == 'cuda'` (what it does "
        "is covered above: `SubstituteSet.warm_up`)",
    ("vllm_hooks/proposer.py", "SubSpecProposer.propose"):
        "engine code, as above; on CPU its `start_before_draft()` call (no prefetch offloader: "
        "vLLM's refuses to start on CPU) is skipped",
    ("vllm_hooks/draft_startup.py", "warm_up_kernels"):
        "called by `SubSpecProposer.load_model` on CUDA only (what it runs is covered above: "
        "`SubstituteSet.warm_up`)",
    ("vllm_hooks/draft_passes.py", "VllmDraftPasses.copy_to_host"):
        "engine code, as above; called only on a device (a CPU step reads the masses at once)",
    ("step/draft.py", "HostCopy"):
        "pinned memory and a CUDA event: needs a CUDA device (the meta-device test stands in "
        "for it with `LandsLater`)",
    ("vllm_hooks/runner.py", "SubSpecGPUWorker"):
        "vLLM's GPU worker builds it in `Worker.init_device` on a CUDA device; the unit test "
        "calls `_make_model_runner` with the runner class's construction stubbed out",
    ("vllm_hooks/draft_passes.py", "VllmDraftPasses.synchronize"):
        "engine code, as above; on CPU the compute-stream `synchronize()` is skipped (no CUDA "
        "tensors)",
}


def definitions(path: Path) -> dict[str, ast.AST]:
    """qualname -> def/class node (top level and one class level down)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub
    return out


def main() -> None:
    import coverage

    work = Path(tempfile.mkdtemp(prefix="subspec-cov-"))
    rc = work / "coveragerc"
    rc.write_text(f"[run]\nsource = vllm_subspec\nparallel = true\npatch = subprocess\n"
                  f"data_file = {work / '.coverage'}\n")
    start = time.time()
    cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-m", "not e2e and not qwen and not soak", "tests"]
    proc = subprocess.run(cmd, cwd=REPO)
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}"], cwd=REPO,
                   check=True, capture_output=True)
    cov = coverage.Coverage(config_file=str(rc), data_file=str(work / ".coverage"))
    cov.load()
    rows = []
    for module, names in CUDA_ONLY.items():
        path = REPO / "vllm_subspec" / module
        _, statements, _, missing, _ = cov.analysis2(str(path))
        defs = definitions(path)
        for name in names:
            node = defs[name]
            body = set(range(node.lineno, node.end_lineno + 1))
            stmts = sorted(body & set(statements))
            missed = sorted(body & set(missing))
            rows.append({"module": module, "name": name, "statements": len(stmts),
                         "executed": len(stmts) - len(missed), "missed_lines": missed,
                         "why_not_run": NOT_RUN_BECAUSE.get((module, name)) if missed else None})
    out = {"command": "python scripts/cuda_coverage.py", "pytest_exit": proc.returncode,
           "seconds": round(time.time() - start), "rows": rows,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cuda_coverage.json").write_text(json.dumps(out, indent=1))
    total = sum(r["statements"] for r in rows)
    done = sum(r["executed"] for r in rows)
    lines = ["# CUDA-only code executed by the CPU suite (coverage.py)", "",
             f"Command: `{out['command']}` (unit tests, `-m \"not e2e\"`, child processes "
             f"included; pytest exit {proc.returncode}, {out['seconds']} s, {out['date']}).", "",
             f"**{done}/{total} statements ({100 * done / max(total, 1):.0f}%)** of the "
             "functions below ran on CPU.", "",
             "| module | function / class | statements run | not run (lines) | why not run |",
             "|---|---|---|---|---|"]
    for r in rows:
        missed = ", ".join(map(str, r["missed_lines"])) or "-"
        why = NOT_RUN_BECAUSE.get((r["module"], r["name"]), "-") if r["missed_lines"] else "-"
        lines.append(f"| {r['module']} | `{r['name']}` | {r['executed']}/{r['statements']} "
                     f"| {missed} | {why} |")
    (RESULTS / "cuda_coverage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
