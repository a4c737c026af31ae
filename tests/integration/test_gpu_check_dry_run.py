"""`scripts/gpu_check.sh --dry-run` and `scripts/gpu_components.py --dry-run` on a machine
without a GPU: every engine the GPU check would start, with its settings and memory plan, and
every component check run on CPU with tiny shapes (CI runs these, so neither rots before a GPU
is lent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_lists_engines_and_plans_without_a_gpu():
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    # tree and chain, each offload form (uva, auto, prefetch), eager and CUDA graphs
    assert out.stdout.count("test_greedy_lossless_with_offload[") == 12
    assert "'max_num_seqs': 64" in out.stdout
    assert "[gpu_offload] plain engine:" in out.stdout
    # the default config, what users run, is timed beside the fixed tree
    assert '[gpu_offload:default] the subspec engine below, with speculative_config=' \
        '{"method": "subspec"}' in out.stdout
    assert '"max_num_seqs": 4' in out.stdout and "profiling peak" in out.stdout
    # the KV cache is pinned, equal for both engines, and the plan leaves >= 1 GB of slack
    assert out.stdout.count('"kv_cache_memory_bytes": ') == 2
    slack = [float(line.rsplit("slack ", 1)[1].split(" GB")[0])
             for line in out.stdout.splitlines() if line.startswith("[gpu_offload]")]
    assert len(slack) == 2 and min(slack) >= 1.0


def test_the_benchmark_dry_run_fails_on_a_plan_under_a_gigabyte_of_slack():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_offload", "--dry-run",
                          "--reserved-gb", "2.0"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode != 0
    assert "under the 1.0 GB the CUDA context" in out.stderr


def test_gpu_components_dry_run_runs_every_section_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_components.py"),
                          "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_components_dry_run.json").read_text())
    assert (tmp_path / "gpu_components_dry_run.md").exists()
    assert not [name for name, sec in report.items() if "error" in sec]
    tree = report["tree_attention"]
    # the kernel ran (interpreted) against the dense fp32 reference, split and unsplit
    assert tree["ok"] and len(tree["cases"]) == 16
    assert any(c["split_splits"] > 1 for c in tree["cases"])
    configs = report["tree_attention_configs"]["configs"]
    assert len(configs) == 3 and all(c["correct"] for c in configs)
    passes = report["draft_pass"]["passes"]
    assert [p["rows"] for p in passes] == [1, 4] and all(p["eager_ms"] > 0 for p in passes)
    assert report["hqq_build"]["layer_solve_s"] > 0
    moe = report["moe_experts"]  # the routed experts' kernels (interpreted) vs fp32
    assert moe["ok"] and [c["rows"] for c in moe["cases"]] == [1, 5]
    assert report["projection"]["label"].startswith("DRY RUN")
    assert "skipped" in report["transfer"]  # needs CUDA
