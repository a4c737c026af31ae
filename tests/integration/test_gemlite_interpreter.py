"""GemLite's real Triton kernels, run on CPU under the Triton interpreter, against the reference.

The project's `GemliteKernel` (gemlite 0.6.0.post2, A16W4 HQQ, fma mode) is built from the same
`quantize()` output as `ReferenceKernel` and called at M = 1 (GEMV), 6 and 60 (split-K) and 300
(GEMM) rows, fp16 and bf16. gemlite comes from a `pip install --no-deps --target` copy that
scripts/setup.sh makes (never a normal install: its vLLM plugin would load in every engine
test); the child process (gemlite_interpreter_probe.py) puts it on sys.path with
TRITON_INTERPRET=1 set before triton is imported (this process imported triton through vLLM).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from subspec_testing.assets import cache_dir

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # probes and shims

GEMLITE = "gemlite-0.6.0.post2"
N, K, GROUP = 1536, 576, 64
FAMILY = {1: "GEMV_REVSPLITK", 6: "GEMM_SPLITK", 60: "GEMM_SPLITK", 300: "GEMM"}
# Measured (1536x576, HQQ, these seeds): fp16 5.2e-4..8.5e-4, bf16 4.5e-3..4.9e-3. bf16 is ~6x
# worse because GemLite keeps scales and the fma offset -z*s in bf16 (kernels.py,
# GemliteKernel); the reference dequantizes in fp32. Bounds: ~1.7x the largest measurement.
MAX_REL_ERR = {"torch.float16": 1.5e-3, "torch.bfloat16": 8e-3}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    target = cache_dir() / GEMLITE
    if not (target / "gemlite" / "__init__.py").exists():
        pytest.skip(f"{GEMLITE} is not installed in {target}: run scripts/setup.sh")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    tmp = tmp_path_factory.mktemp("gemlite")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo),
                                                        os.environ.get("PYTHONPATH")])))
    script = str(SUPPORT / "gemlite_interpreter_probe.py")
    parts = ("fp16", "bf16")  # two single-threaded children: the interpreter is CPU-bound
    procs = {part: subprocess.Popen(
        [sys.executable, script, str(target), str(tmp / f"{part}.json"), part, str(tmp)],
        env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for part in parts}
    result = {"kernels": {}}
    try:
        for part, proc in procs.items():
            output, _ = proc.communicate(timeout=1200)
            assert proc.returncode == 0, f"{part} probe failed:\n{output[-8000:]}"
            found = json.loads((tmp / f"{part}.json").read_text())
            result["kernels"].update(found.pop("kernels"))
            result[f"seconds_{part}"] = found.pop("seconds")
            result.update(found)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return result


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
@pytest.mark.parametrize("m", sorted(FAMILY))
def test_gemlite_matches_reference_in_each_kernel_family(probe, dtype, m):
    row = probe["kernels"][dtype]["rows"][str(m)]
    # gemlite's own choice (core.get_matmul_type) is the kernel that ran
    assert row["families_run"] == [row["matmul_type"]] == [FAMILY[m]]
    if FAMILY[m] == "GEMM_SPLITK":  # the split-K accumulation ran, not only the plain store
        assert row["split_k"] == 2
    assert row["shape"] == [m, N] and row["dtype"] == dtype
    assert row["finite"]
    assert row["rel_err"] < MAX_REL_ERR[dtype]


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
def test_gemlite_packing_matches_the_codes(probe, dtype):
    res = probe["kernels"][dtype]
    # W_q is [K/8, N] int32: unpacked independently of gemlite, it is quantize()'s codes
    assert res["w_q"] == ["torch.int32", [K // 8, N]]
    assert res["unpacked_equals_codes"]


def test_gemlite_triton_packer_is_bit_identical_to_torch_packer(probe):
    # pack() uses the Triton packer on CUDA and the torch one on CPU (gemlite/core.py:624)
    packing = probe["packing"]
    assert packing["triton_equals_torch"] and packing["triton_unpacks_to_codes"]
    assert packing["shape"] == [128 // 8, 96] and packing["dtype"] == "torch.int32"


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
def test_gemlite_kernel_tensors_are_its_packed_weights(probe, dtype):
    res = probe["kernels"][dtype]
    # W_q (4 bits a weight), scales and zeros (2 bytes a group), metadata (12 x int32),
    # orig_shape (2 x int32), meta_scale (fp32): what build_substitutes checks for placement
    groups = N * K // GROUP
    assert res["tensor_bytes"] == [N * K // 2, 2 * groups, 2 * groups, 48, 8, 4]
    assert res["tensor_devices"] == ["cpu"]


def test_gemlite_keeps_metadata_in_the_activation_dtype(probe):
    for dtype, max_steps in (("torch.float16", 0.01), ("torch.bfloat16", 0.05)):
        res = probe["kernels"][dtype]
        assert res["meta_dtypes"] == [dtype, dtype]
        # zeros holds (-z*s) rounded to the dtype (gemlite/core.py:674), not HQQ's zeros
        assert res["zeros_are_rounded_fma_offset"]
        # measured 0.0044 (fp16) and 0.036 (bf16) quantization steps off HQQ's fp32 offset
        assert 0 < res["zero_offset_max_steps"] < max_steps


def test_split_k_reads_past_k_land_on_zero_rows(probe):
    res = probe["kernels"]["torch.float16"]["split_k_reads_past_k"]
    # K=576 has 9 groups; GemliteKernel backs scales/zeros with 16 rows, the extra ones zero
    assert res["backing_rows"] == [16, 16] and res["padding_is_zero"]
    # GEMM_SPLITK with SPLIT_K=2 does read them: NaN there reaches the output
    assert not res["finite_with_nan_padding"]
    assert res["finite_with_zero_padding"]


@pytest.mark.parametrize("shape", ["64x4", "16x1"])
def test_warm_up_covers_every_compile_signature_the_drafter_can_hit(probe, shape):
    res = probe["warm_up"][shape]
    max_num_seqs, tree_width = map(int, shape.split("x"))
    assert res["rows"] == sorted(set(range(1, max_num_seqs + 1))
                                 | {b * tree_width for b in range(1, max_num_seqs + 1)})
    # every row count maps to a (family, autotune key, Triton specialization, EVEN_M) that
    # warm_up ran, computed from gemlite's and Triton's own code; one call per signature
    assert res["uncovered"] == []
    assert len(res["ran"]) == res["distinct_signatures"] < len(res["rows"])
    # the old powers-of-two warm-up missed some (e.g. M=3: GEMV autotunes on M itself)
    assert 3 in res["uncovered_by_powers_of_two"]
    if max_num_seqs * tree_width >= 256:  # get_closest_m's in-between buckets were run too
        assert {24, 48, 96, 192} <= set(res["buckets_ran"])


def test_shim_bf16_rounding_matches_torch():
    """The shim's bf16 emulation (fp32 compute, round to nearest even) against torch's."""
    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location(
        "gemlite_shim", SUPPORT / "gemlite_shim.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)  # numpy only at import: nothing is patched
    torch.manual_seed(0)
    values = torch.cat([torch.randn(10000) * 10.0 ** torch.randint(-30, 30, (10000,)),
                        # exact ties between two bf16 values, both parities, and specials
                        (torch.arange(-512, 512).float() * 2.0 + 1) * 2.0 ** -8 + 1.0,
                        torch.tensor([float("inf"), -float("inf"), 3.4e38, 0.0, -0.0])])
    ours = shim._f32_to_bf16(values.numpy())
    assert np.array_equal(ours, values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    back = shim._bf16_to_f32(ours)
    assert np.array_equal(back, values.to(torch.bfloat16).float().numpy())


def test_gemlite_substitute_traces_into_one_graph_without_a_break(probe):
    """vLLM's compile mode traces the whole draft forward with fullgraph=True
    (vllm_hooks/draft_compile.py): a GemLite substitute is one custom op in that graph
    (gemlite's `forward_functional`), and the traced call gives the eager call's output."""
    dynamo = probe["dynamo"]
    assert dynamo["error"] is None, dynamo["error"]
    assert dynamo["traced_calls"] == ["gemlite.forward_functional.default"]
    assert dynamo["equal_to_eager"]


def test_gemlite_autotuning_is_kept_across_starts(probe):
    """With gemlite's default autotuning, a first start benchmarks several configs for an untuned
    shape and keeps the winners (`gemlite_tuning.gemlite_autotune_kept`); a second start, from fresh
    kernel modules, benchmarks none and computes the same output."""
    kept = probe["autotune_kept"]
    first, second = kept["benchmarked"]
    assert first > 1 and second == 0, kept
    assert kept["same_output"]
    assert kept["stored_families"] == ["GEMV_REVSPLITK"]  # the 1-row call's family
    assert kept["files"] == ["autotune.json"]  # written aside and renamed: nothing left over
