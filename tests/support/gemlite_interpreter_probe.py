"""Runs gemlite's real Triton kernels under the Triton interpreter (see test_gemlite_interpreter).

Usage: TRITON_INTERPRET=1 python gemlite_interpreter_probe.py GEMLITE_DIR OUT_JSON PART TMP_DIR
GEMLITE_DIR holds a `pip install --no-deps --target` copy of gemlite==0.6.0.post2. PART is
"fp16" (fp16 kernels, packing, warm-up coverage) or "bf16" (bf16 kernels): the two run in
parallel. Writes measurements as JSON; the test asserts on them.
"""

import json
import sys
import time

sys.path.insert(0, sys.argv[1])  # before gemlite is imported; this file's folder is on sys.path

import gemlite_shim  # noqa: E402

gemlite = gemlite_shim.install()

import torch  # noqa: E402
from gemlite import bitpack, core  # noqa: E402
from gemlite.triton_kernels import utils as gemlite_utils  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.autotuner import Heuristics  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from vllm_subspec.draft_model.kernels import GemliteKernel, ReferenceKernel  # noqa: E402
from vllm_subspec.draft_model.quantize import quantize  # noqa: E402
from vllm_subspec.draft_model.row_buckets import draft_row_counts  # noqa: E402
from vllm_subspec.draft_model.substitute import SubstituteLinear  # noqa: E402
from vllm_subspec.draft_model.substitute_set import SubstituteSet  # noqa: E402

N, K, GROUP = 1536, 576, 64
# each family's kernel module, taken before record_families() wraps the forwards
KERNEL_MODULES = {name: sys.modules[family.forward.__module__]
                  for name, family in core.GEMLITE_TRITON_MAPPING.items()}
ROWS = (1, 6, 60, 300)  # GEMV, split-K (twice: M < 32 and M >= 32 prune differently), GEMM


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def unpack_torch(w_q: torch.Tensor, k: int) -> torch.Tensor:
    """Independent of gemlite: W_q is [K/8, N] int32, nibble j of word r holds code k=8r+j."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    nibbles = (w_q.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return nibbles.reshape(k, -1).t().to(torch.uint8)


def record_families():
    """Wrap each kernel family's forward (core.py:57-65) to record which one ran."""
    ran = []
    for name, family in core.GEMLITE_TRITON_MAPPING.items():
        def forward(*args, _f=family.forward, _name=name, **kwargs):
            ran.append(_name)
            return _f(*args, **kwargs)
        family.forward = forward
    return ran


def int_kernel(family_name: str):
    """The live autotuner of a family's INT kernel. set_autotune() reloads the kernel modules
    (triton_kernels/config.py:34-48), so the family classes core.py holds list stale ones."""
    module = KERNEL_MODULES[family_name]
    name = core.GEMLITE_TRITON_MAPPING[family_name].kernel[0].base_fn.__name__
    return getattr(module, name), module


def kernel_results(qw, dtypes):
    families = record_families()
    out = {}
    for dtype in dtypes:
        fast, ref = GemliteKernel(qw, dtype), ReferenceKernel(qw, dtype)
        layer = fast.layer
        tensors = fast.tensors()
        # the fma offset GemLite stores, against HQQ's fp32 one, in quantization steps
        stored = layer.zeros.t().float()  # [N, K/g]
        hqq = -qw.zero * qw.scale
        s_d, z_d = qw.scale.to(dtype).float(), qw.zero.to(dtype).float()
        res = {
            "tensor_bytes": [t.numel() * t.element_size() for t in tensors],
            "tensor_devices": sorted({t.device.type for t in tensors}),
            "w_q": [str(layer.W_q.dtype), list(layer.W_q.shape)],
            "unpacked_equals_codes": bool(torch.equal(unpack_torch(layer.W_q, K), qw.codes)),
            "meta_dtypes": [str(layer.scales.dtype), str(layer.zeros.dtype)],
            "zeros_are_rounded_fma_offset": bool(torch.equal(
                layer.zeros.t(), (-z_d * s_d).to(dtype))),
            "zero_offset_max_steps": ((stored - hqq).abs() / qw.scale).max().item(),
            "rows": {},
        }
        for m in ROWS:
            torch.manual_seed(m)
            x = torch.randn(m, K).to(dtype)
            families.clear()
            start = time.perf_counter()
            y = fast(x)
            seconds = time.perf_counter() - start
            best = int_kernel(families[0])[0].best_config.kwargs
            res["rows"][m] = {
                "rel_err": rel_err(y, ref(x)),
                "finite": bool(torch.isfinite(y).all()),
                "shape": list(y.shape),
                "dtype": str(y.dtype),
                "families_run": list(families),
                "matmul_type": core.get_matmul_type(m, 4),
                "split_k": best.get("SPLIT_K"),
                "seconds": seconds,
            }
        if dtype == torch.float16:
            res["split_k_reads_past_k"] = split_k_reads_past_k(fast)
        out[str(dtype)] = res
    return out


def split_k_reads_past_k(fast) -> dict:
    """Fill the zero rows GemliteKernel puts behind scales/zeros with NaN: if GEMM_SPLITK with
    SPLIT_K=2 reads them (K=576: 9 groups, 10 K blocks visited), its output turns NaN."""
    layer, groups = fast.layer, K // GROUP
    backing = [torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).view(-1, N)
               for t in (layer.scales, layer.zeros)]
    x = torch.randn(6, K).to(torch.float16)
    result = {"backing_rows": [b.shape[0] for b in backing],
              "padding_is_zero": all(bool((b[groups:] == 0).all()) for b in backing)}
    for b in backing:
        b[groups:] = float("nan")
    result["finite_with_nan_padding"] = bool(torch.isfinite(fast(x)).all())
    for b in backing:
        b[groups:] = 0
    result["finite_with_zero_padding"] = bool(torch.isfinite(fast(x)).all())
    return result


def packing_results(qw):
    # On CUDA, pack() packs with the Triton kernel (core.py:624); on CPU with the torch loop.
    # 96 rows x 128 codes keeps the interpreted grid small; 96 rows make the packer unroll by
    # 32, not 64 (highest_divisor, bitpack.py:66)
    codes = qw.codes[:96, :128].contiguous()
    start = time.perf_counter()
    tri, e_tri = bitpack.pack_weights_over_cols_triton(codes, 4, 32, transpose=True)
    seconds = time.perf_counter() - start
    ref, e_ref = bitpack.pack_weights_over_cols_torch(codes, 4, 32, transpose=True)
    return {"triton_equals_torch": bool(torch.equal(tri, ref)) and e_tri == e_ref == 8,
            "triton_unpacks_to_codes": bool(torch.equal(unpack_torch(tri, 128), codes)),
            "shape": list(tri.shape), "dtype": str(tri.dtype), "seconds": seconds}


def compile_signature(m: int) -> tuple:
    """What gemlite + Triton key compilation/autotuning on for m rows, from their own code:
    the family (core.get_matmul_type), the autotuner's key args, Triton's specialization of the
    int args, and the heuristics that depend on M (EVEN_M for every BLOCK_SIZE_M the pruners
    allow, gemm_kernels.py:77-82)."""
    family = core.get_matmul_type(m, 4)
    tuner, module = int_kernel(family)
    args = {"M": m, "M_CLOSEST": module.get_closest_m(m)}
    tuned = tuple((k, args[k]) for k in tuner.keys if k in args)
    special = tuple(native_specialize_impl(BaseBackend, args[k], False, True, True)
                    for k, _ in tuned) + (native_specialize_impl(BaseBackend, m, False, True,
                                                                 True),)
    heur, fn = (), tuner.fn
    while fn is not None:
        if isinstance(fn, Heuristics) and "EVEN_M" in fn.values:
            heur = tuple(fn.values["EVEN_M"]({"M": m, "BLOCK_SIZE_M": bm})
                         for bm in (16, 32, 64, 128, 256))
        fn = getattr(fn, "fn", None)
    return family, tuned, special, heur


def warm_up_results(qw, max_num_seqs, tree_width):
    kernel = GemliteKernel(qw, torch.float16)
    ran = []
    # record the row counts instead of interpreting ~100 kernel calls; warm_up_key is real
    kernel.layer = lambda x: ran.append(x.shape[0]) or torch.zeros(x.shape[0], N)
    subs = SubstituteSet(num_layers=1, layers={0: {"o_proj": SubstituteLinear(
        kernel, None, "layers.0.o_proj", in_features=K)}})
    subs.warm_up(max_num_seqs, tree_width, torch.float16, torch.device("cpu"))
    rows = draft_row_counts(max_num_seqs, tree_width)
    warmed = {compile_signature(m) for m in ran}
    powers = [1 << i for i in range((max_num_seqs * tree_width).bit_length())]  # the old rule
    by_powers = {compile_signature(m) for m in powers}
    return {
        "rows": rows, "ran": ran,
        "uncovered": [m for m in rows if compile_signature(m) not in warmed],
        "uncovered_by_powers_of_two": [m for m in rows if compile_signature(m) not in by_powers],
        "buckets_ran": sorted({gemlite_utils.get_closest_m(m) for m in ran}),
        "distinct_signatures": len({compile_signature(m) for m in rows}),
    }


def dynamo_results(qw) -> dict:
    """In vLLM's compile mode the draft forward is one fullgraph dynamo trace
    (vllm_hooks/draft_compile.py): a GemLite substitute must trace without a graph break, and
    the traced call must give the eager call's output."""
    sub = SubstituteLinear(GemliteKernel(qw, torch.float16), None, "layers.0.o_proj",
                           in_features=K)
    x = torch.randn(1, K).to(torch.float16)
    traced = []

    def backend(gm, example_inputs):  # records the graph's calls; runs it as traced
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(lambda x: sub(x)[0], fullgraph=True, dynamic=True, backend=backend)
    try:
        y, error = compiled(x), None
    except Exception as e:  # a graph break under fullgraph, or anything dynamo cannot trace
        y, error = None, f"{type(e).__name__}: {str(e)[:2000]}"
    return {"error": error, "traced_calls": traced,
            "equal_to_eager": y is not None and bool(torch.equal(y, sub(x)[0]))}


def autotune_kept_results(qw, folder: str) -> dict:
    """A first and a second engine start, as far as GemLite's autotuning goes: gemlite's own
    default ("fast": several candidate configs per call signature), its bundled configs dropped
    so the shape is untuned; each start makes new kernels from fresh kernel modules
    (`set_autotune` reloads them) and runs them inside `gemlite_autotune_kept`. Counts the
    candidate configs Triton's autotuner benchmarks (the shim's benchmarker)."""
    from pathlib import Path

    from triton.runtime import driver

    from vllm_subspec.draft_model.gemlite_tuning import gemlite_autotune_kept

    benched = []
    fake = driver.active
    plain_benchmarker = type(fake).get_benchmarker

    def counting(self):
        bench = plain_benchmarker(self)
        return lambda *a, **k: benched.append(1) or bench(*a, **k)

    type(fake).get_benchmarker = counting
    path = Path(folder) / "autotune.json"
    x = torch.randn(1, K).to(torch.float16)
    starts = []
    for _ in range(2):
        gemlite.reset_config()
        gemlite.set_autotune("fast")
        benched.clear()
        with gemlite_autotune_kept(path):
            y = GemliteKernel(qw, torch.float16)(x)
        starts.append({"benchmarked": len(benched), "output": y})
    stored = json.loads(path.read_text())
    return {"benchmarked": [s["benchmarked"] for s in starts],
            "same_output": bool(torch.equal(starts[0]["output"], starts[1]["output"])),
            "stored_families": sorted(name for name, cfg in stored.items() if cfg),
            "files": sorted(p.name for p in Path(folder).iterdir() if "autotune" in p.name)}


def main():
    torch.manual_seed(0)
    weight = (torch.randn(N, K) * 0.05).to(torch.bfloat16)
    qw = quantize(weight, bits=4, group_size=GROUP, method="hqq")
    start = time.perf_counter()
    if sys.argv[3] == "bf16":
        result = {"kernels": kernel_results(qw, [torch.bfloat16]),
                  # last: it switches gemlite to its default autotuning for this process
                  "autotune_kept": autotune_kept_results(qw, sys.argv[4])}
    else:
        result = {
            "kernels": kernel_results(qw, [torch.float16]),
            "packing": packing_results(qw),
            "dynamo": dynamo_results(qw),
            "warm_up": {f"{s}x{k}": warm_up_results(qw, s, k) for s, k in ((64, 4), (16, 1))},
        }
    result["seconds"] = time.perf_counter() - start
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
