"""The routed experts' CUDA kernels (`draft_model/experts_triton.py`), executed on CPU under the
Triton interpreter in a subprocess (`experts_triton_probe.py`: TRITON_INTERPRET must be set
before Triton is imported, and this process imported it with vLLM), through the draft's
operator (`experts.routed_experts`), against the same 4-bit experts computed densely in fp32.
Cases: one row, a tree level, a skewed routing (one expert over several blocks, one expert
without rows, top-3, groups of 32), top-4 with groups of 128; fp16 and bf16.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("experts_triton") / "probe.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SUPPORT / "experts_triton_probe.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


CASES = ["one_row", "tree_level", "skewed_top3_g32", "top4_g128"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_experts_match_the_dequantized_experts(probe, case, dtype):
    r = probe[f"{case}/{dtype}"]
    assert r["finite"] and r["out_dtype"] == f"torch.{dtype}"
    # the kernel rounds the dequantized weights and the activations to `dtype` and sums in
    # fp32: as close to the fp32 truth as the CPU reference path, which runs in `dtype`
    assert r["rel_err"] <= 1.25 * r["reference_rel_err"]
    assert r["rel_err"] < (1e-3 if dtype == "float16" else 6e-3)
