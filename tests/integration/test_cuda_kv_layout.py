"""Tree attention, KV reads and KV compaction on vLLM's FlashAttention cache, executed on CPU.

The tree-attention Triton kernels (`step/tree_attention_triton.py`: one launch, or two when the
context is split over programs) run under the Triton interpreter, against a dense fp32
reference. The CUDA reader (`paged_kv.FlashAttentionLayout`) is run against caches that vLLM's own code
allocates (`allocate_kv_cache`) for every `KVCacheLayout` and that vLLM's own Triton writer fills
(under the Triton interpreter), in a subprocess (`cuda_kv_layout_probe.py`): TRITON_INTERPRET
must be set before Triton is imported, and this process imported it with vLLM.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # probes and shims

# bf16 tree rows vs the dense fp32 reference, in bf16 ulps at the reference: the rows are
# computed in fp32 and converted to bf16 once. A GPU rounds that conversion to nearest (half an
# ulp); the Triton interpreter truncates it (checked: about half of random fp32 values come out
# one step lower), so up to one ulp here, plus fp32 summation-order differences where an output
# is a near-cancelling average of V (seen: 1.017 ulps).
ATTENTION_ULPS = 1.1
# fp16 rows through the tensor-core branch: P (< 1) rounded to fp16 (2**-11 relative) before
# P.V over ~50 positions of unit-variance V, then the output rounded to fp16
FP16_BRANCH_TOL = 3e-3


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_kv") / "probes.json"
    # the probe imports subspec_testing from the repository root (pytest's pythonpath does not
    # reach a child process)
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(SUPPORT / "cuda_kv_layout_probe.py"),
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
def test_flash_attention_cache_reader(probes, layout):
    r = probes[layout]
    assert r["shape"] == [12, 2, 16, 128]  # the logical [blocks, kv_heads, block, 2*head_dim]
    assert r["gather_exact"], "tokens written by vLLM's writer read back from other slots"
    assert r["attention_ulps"] <= ATTENTION_ULPS
    assert r["hook_without_plan_untouched"]  # no active plan: the backend's output stands
    # slots no tree row sees are never loaded (a head start's rows beside the verify)
    assert r["unseen_slots_finite"] and r["unseen_slots_ulps"] <= ATTENTION_ULPS
    assert r["hook_rows_exact"] and r["hook_other_rows_untouched"]
    # every row a tree row: FlashAttention's causal pass is not run (it would be overwritten)
    assert r["flash_calls_tree_rows_only"] == 0 and r["flash_skipped_rows_exact"]
    assert r["flash_calls_with_a_plain_request"] == 1
    # every request's rows in one Triton launch per layer call (verify-like and draft-level
    # batches), each request's rows the same bits as computing it alone, other rows untouched
    assert r["verify_launches"] == 1 and r["level_launches"] == 1
    assert r["batched_ulps"] <= ATTENTION_ULPS
    assert r["batched_equals_one_request_at_a_time"]
    assert r["batched_other_rows_untouched"]
    # the context split: 1, 2 and 6 splits of a 189-token context, each within the reference's
    # bounds, and the same bits but for fp32 summation order
    assert r["split_counts"] == [1, 2, 6]
    assert r["split_ulps"] <= ATTENTION_ULPS
    assert r["split_max_diff"] <= 2 ** -7  # at most a bf16 step near 1, from summation order
    # the GPU's branch (fp16 products, P rounded to fp16 for P.V): fp16 rounding of P only
    assert r["fp16_tensor_core_branch_max_err"] < FP16_BRANCH_TOL
    assert r["move_exact"], "compaction moved the wrong bytes (overlapping src/dst included)"
    assert r["move_other_request_untouched"]
    # only destination slots change (a moved bf16 value may equal the old one by chance)
    assert 0 < r["move_changed_elements"] <= r["move_expected_max_elements"]


def test_every_layout_has_distinct_physical_strides(probes):
    # the probe really exercised different physical orders, not one layout six times
    assert len({tuple(r["stride"]) for r in probes.values()}) == len(KVCacheLayout)


def test_a_cache_of_another_shape_is_refused_clearly():
    # The pre-fix assumption ([2, blocks, block_size, heads, dim]) must fail with a message that
    # names the expected layout, not with an unpacking error deep in a forward.
    import torch

    from vllm_subspec.step.paged_kv import FlashAttentionLayout

    with pytest.raises(RuntimeError, match=r"expected \[blocks, kv_heads, block_size, 256\]"):
        FlashAttentionLayout(torch.zeros(2, 12, 16, 2, 128), head_size=128)
