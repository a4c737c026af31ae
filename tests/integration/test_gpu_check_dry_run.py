"""`scripts/gpu_check.sh --dry-run` on a machine without a GPU: every engine the GPU check would
start, with its settings and memory plan (CI runs this)."""

import subprocess
from pathlib import Path


def test_gpu_check_dry_run_lists_engines_and_plans_without_a_gpu():
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    # tree and chain, each offload form (uva, auto, prefetch), eager and CUDA graphs
    assert out.stdout.count("test_greedy_lossless_with_offload[") == 12
    assert "'max_num_seqs': 64" in out.stdout
    assert "[gpu_offload] plain engine:" in out.stdout
    assert '"max_num_seqs": 8' in out.stdout and "profiling peak" in out.stdout
