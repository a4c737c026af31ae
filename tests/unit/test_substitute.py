"""Quantizer and kernels: the CPU int4 path equals the reference dequantize+matmul."""

import sys

import pytest
import torch
import torch.nn.functional as F
from decoder_stub import decoder_stub
from torch import nn

from vllm_subspec.config import SubSpecOptions
from vllm_subspec.draft_model import int4_dot_cpu
from vllm_subspec.draft_model.kernels import (
    Int4CpuKernel,
    Int4DotCpuKernel,
    ReferenceKernel,
    choose_kernel,
)
from vllm_subspec.draft_model.model import DraftModel, substitute_layer
from vllm_subspec.draft_model.quantize import quantize
from vllm_subspec.draft_model.row_buckets import draft_row_counts
from vllm_subspec.draft_model.substitute import SubstituteLinear
from vllm_subspec.draft_model.substitute_set import SubstituteSet, build_substitutes

CPU = torch.device("cpu")
# The CPU int4 kernels: tinygemm everywhere, the AVX512-BF16 one where this CPU runs it.
DOT = pytest.param(Int4DotCpuKernel, marks=pytest.mark.skipif(
    not int4_dot_cpu.available(), reason="no AVX512-BF16 on this CPU (or no compiler)"))
INT4_CPU_KERNELS = [Int4CpuKernel, DOT]
AUTO_CPU_KERNEL = Int4DotCpuKernel if int4_dot_cpu.available() else Int4CpuKernel


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return (torch.randn(192, 256) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("kernel_cls", INT4_CPU_KERNELS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_cpu_matches_reference(weight, group_size, kernel_cls):
    qw = quantize(weight, bits=4, group_size=group_size)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    ref = ReferenceKernel(qw, torch.bfloat16)(x)
    fast = kernel_cls(qw, torch.bfloat16)(x)
    assert fast.shape == ref.shape == (7, 192)
    assert rel_err(fast, ref) < 1e-2  # bf16 accumulation differences only
    # 3-D activations keep their leading dims
    assert kernel_cls(qw, torch.bfloat16)(x.view(1, 7, 256)).shape == (1, 7, 192)


@pytest.mark.skipif(not int4_dot_cpu.available(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_int4_dot_kernel_is_the_dequantized_matmul_at_every_row_count(group_size):
    """Every row count (rows go through the tile in blocks of at most 8, split evenly: 1..8 in
    one block, 9 = 5 + 4, 17 = 6 + 6 + 5), every group size, an output wider than one tile
    and a K spanning several groups: each output within bf16 rounding of the fp32 matmul of
    the dequantized weight, as close as tinygemm's (the same stored numbers: s and (8 - z)*s
    in bf16), and float32 or float16 activations drafted through bf16."""
    torch.manual_seed(1)
    n, k = 80, 4 * 256
    qw = quantize(torch.randn(n, k) * 0.05, bits=4, group_size=group_size)
    w = qw.dequantize(torch.float32)
    dot, tiny = Int4DotCpuKernel(qw, torch.bfloat16), Int4CpuKernel(qw, torch.bfloat16)
    for rows in (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        y = dot(x)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        if rows == 0:
            continue
        ref = x.float() @ w.T
        assert rel_err(y, ref) < 4e-3, rows
        assert rel_err(y, ref) < 1.25 * rel_err(tiny(x), ref) + 1e-4, rows
        # each row on its own: the same numbers up to the accumulation order
        alone = torch.cat([dot(x[i:i + 1]) for i in range(rows)])
        assert rel_err(y, alone) < 4e-3, rows
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3, k, dtype=dtype)
        y = Int4DotCpuKernel(qw, dtype)(x)
        assert y.dtype == dtype and rel_err(y, x.float() @ w.T) < 4e-3


def test_int4_dot_layout_puts_each_code_where_the_kernel_reads_it():
    """The packed layout, read back in plain torch the way csrc/int4_dot_cpu.cpp reads it
    (tile t, 64-byte block b: byte 16c + 8h + l is output 16t + 4c + l//2, input e = l % 2 of
    a pair; its low nibble q[., 8b + 2h + e], its high one q[., 8b + 4 + 2h + e]), gives back
    every code; meta holds s and (8 - z)*s per tile and group."""
    torch.manual_seed(2)
    n, k, g = 48, 128, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, zero = torch.rand(n, k // g), torch.rand(n, k // g) * 15
    packed, meta = int4_dot_cpu.pack(codes, scale, zero)
    assert packed.shape == (n // 16, k // 8, 64) and meta.shape == (n // 16, k // g, 32)
    back = torch.empty_like(codes)
    for t in range(n // 16):
        for b in range(k // 8):
            for byte in range(64):
                c, h, lane = byte // 16, byte % 16 // 8, byte % 8
                out, e = 16 * t + 4 * c + lane // 2, lane % 2
                v = int(packed[t, b, byte])
                back[out, 8 * b + 2 * h + e] = v & 15
                back[out, 8 * b + 4 + 2 * h + e] = v >> 4
    assert torch.equal(back, codes)
    assert torch.equal(meta[..., :16].float(), scale.view(3, 16, 2).transpose(1, 2)
                       .to(torch.bfloat16).float())
    assert torch.equal(meta[..., 16:], ((8 - zero) * scale).view(3, 16, 2).transpose(1, 2)
                       .to(torch.bfloat16))


@pytest.mark.parametrize("text, expected", [
    ("flags\t\t: fpu avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n", True),
    ("flags\t\t: fpu avx512f avx512bw avx512vl avx512_vnni\n", False),  # no bf16 dot
    ("processor\t: 0\nFeatures\t: fp asimd bf16\n", False),  # aarch64: no flags line
])
def test_int4_dot_kernel_only_on_cpus_with_its_flags(text, expected):
    assert int4_dot_cpu.cpu_has_flags(text) is expected


@pytest.mark.parametrize("kernel_cls", INT4_CPU_KERNELS)
def test_int4_cpu_runs_its_dense_twin_from_the_crossover_row_count(weight, monkeypatch,
                                                                   kernel_cls):
    """From `dense_from_rows` rows the kernel runs a plain matmul of the same HQQ weights
    ((q - z) * s in the activation dtype); below it, the int4 kernel. Both match the reference
    to bf16 rounding. Without a draft row bound or where dense never wins, no twin is kept."""
    import vllm_subspec.draft_model.dense_twin as dense_twin

    qw = quantize(weight, bits=4, group_size=64)
    int4_only = kernel_cls(qw, torch.bfloat16)
    assert int4_only.dense is None and len(int4_only.tensors()) == 2
    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *args: 4)
    twin = kernel_cls(qw, torch.bfloat16, max_rows=64)
    assert twin.dense_from_rows == 4 and twin.dense.dtype == torch.bfloat16
    assert torch.equal(twin.dense, qw.dequantize(torch.bfloat16))
    assert any(t is twin.dense for t in twin.tensors())  # counted in the memory used
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        y = twin(x)
        expected = F.linear(x, twin.dense) if rows >= 4 else int4_only(x)
        assert torch.equal(y, expected), rows
        assert rel_err(y, ReferenceKernel(qw, torch.bfloat16)(x)) < 1e-2
    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *args: None)
    assert kernel_cls(qw, torch.bfloat16, max_rows=64).dense is None


ROWS = [1, 2, 4, 8, 16, 32]




@pytest.mark.parametrize("kernel_cls", INT4_CPU_KERNELS)
def test_a_compiled_int4_kernel_chooses_its_path_per_call_not_at_trace_time(weight,
                                                                          monkeypatch,
                                                                          kernel_cls):
    """Inside a compiled draft forward (vLLM's compile mode: one graph for every row count, its
    guards dropped) the kernel is its opaque operator (`vllm_subspec::int4_cpu_linear`,
    `vllm_subspec::int4_dot_cpu_linear`): one trace at 9
    rows (dense path) still runs int4 at 1 row, bit for bit as eager, and a kernel without a twin
    traces to the same graph (an empty tensor stands in for the twin)."""
    import vllm_subspec.draft_model.dense_twin as dense_twin

    qw = quantize(weight, bits=4, group_size=64)
    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *args: 4)
    twin = kernel_cls(qw, torch.bfloat16, max_rows=64)
    no_twin = kernel_cls(qw, torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    for kernel in (twin, no_twin):
        sub = SubstituteLinear(kernel, None, "layers.0.o_proj", in_features=256)
        # a module's forward, guards dropped: as vLLM compiles (compilation/wrapper.py 0.32.0,
        # guard_filter_fn)
        compiled = torch.compile(sub, fullgraph=True, dynamic=True, backend=backend,
                                 options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        x9 = torch.randn(9, 256, dtype=torch.bfloat16)
        assert torch.equal(compiled(x9)[0], kernel(x9))  # traced here, at 9 rows
        for rows in (1, 3, 4, 9, 17):
            x = torch.randn(rows, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x)[0], kernel(x)), rows
    x1 = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not torch.equal(twin(x1), F.linear(x1, twin.dense))  # the two paths differ at 1 row
    # one graph, whatever the rows and the twin (dynamo traces 1 row apart: its 0/1
    # specialization, which vLLM's dropped guards never ask for)
    op = {Int4CpuKernel: "vllm_subspec.int4_cpu_linear",
          Int4DotCpuKernel: "vllm_subspec.int4_dot_cpu_linear"}[kernel_cls]
    assert graphs and all(g == [op] for g in graphs), graphs
@pytest.mark.parametrize("int4_ms, dense_ms, max_rows, expected", [
    # int4 0.1 + 0.1/row, dense 1.0 + 0.025/row: cross at 12 rows
    ([0.1 + 0.1 * m for m in ROWS], [1.0 + 0.025 * m for m in ROWS], 32, 12),
    ([0.1 + 0.1 * m for m in ROWS], [1.0 + 0.025 * m for m in ROWS], 8, None),  # past the max
    # one timing slowed by the machine (dense 5x at 32 rows) moves it by one row, not away
    ([0.1 + 0.1 * m for m in ROWS], [1.0 + 0.025 * m for m in ROWS[:-1]] + [8.0], 32, 13),
    ([0.1 + 0.1 * m for m in ROWS], [0.2 + 0.2 * m for m in ROWS], 32, None),  # int4 always
    ([1.0 + 0.1 * m for m in ROWS], [0.5 + 0.05 * m for m in ROWS], 32, 1),  # dense always
])
def test_crossover_is_where_the_fitted_times_cross(int4_ms, dense_ms, max_rows, expected):
    from vllm_subspec.draft_model.dense_twin import crossover_rows

    assert crossover_rows(ROWS, int4_ms, dense_ms, max_rows) == expected


def test_dense_crossover_is_timed_once_per_shape():
    from vllm_subspec.draft_model.dense_twin import dense_crossover

    dense_crossover.cache_clear()
    first = dense_crossover(Int4CpuKernel, 64, 128, 64, torch.bfloat16, 8)
    assert first is None or 1 <= first <= 8
    assert dense_crossover(Int4CpuKernel, 64, 128, 64, torch.bfloat16, 8) == first
    assert dense_crossover.cache_info().hits == 1


def test_only_the_auto_kernel_choice_keeps_a_dense_twin(weight, monkeypatch):
    import vllm_subspec.draft_model.dense_twin as dense_twin
    from vllm_subspec.draft_model.substitute import substitute_from_quantized

    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *args: 2)
    qw = quantize(weight, bits=4, group_size=64)
    linear = torch.nn.Linear(256, 192, bias=False).to(torch.bfloat16)
    auto = substitute_from_quantized(qw, linear, CPU, "auto", max_rows=32)
    forced = substitute_from_quantized(qw, linear, CPU, "int4_cpu", max_rows=32)
    unbounded = substitute_from_quantized(qw, linear, CPU, "auto")
    assert auto.kernel.dense is not None
    assert forced.kernel.dense is None and unbounded.kernel.dense is None
    assert auto.nbytes() > forced.nbytes()


@pytest.mark.parametrize("method", ["rtn", "hqq"])
def test_large_weights_are_quantized_in_row_blocks(weight, monkeypatch, method):
    """Row blocks bound the solver's memory: round-to-nearest is per group, so blocks give the
    very same codes; HQQ's solver stops per block, so its error must stay as small."""
    import vllm_subspec.draft_model.quantize as quantize_mod

    whole = quantize(weight, bits=4, group_size=64, method=method)
    monkeypatch.setattr(quantize_mod, "QUANTIZE_BLOCK_ELEMENTS", 50 * weight.shape[1])
    blocked = quantize(weight, bits=4, group_size=64, method=method)  # 192 rows: 4 blocks
    assert blocked.codes.shape == whole.codes.shape and blocked.scale.shape == whole.scale.shape
    if method == "rtn":
        for t in ("codes", "scale", "zero"):
            assert torch.equal(getattr(blocked, t), getattr(whole, t)), t
    else:
        ref = weight.float()
        err = (lambda q: rel_err(q.dequantize(torch.float32), ref))
        assert err(blocked) <= 1.05 * err(whole)


def test_quantization_is_accurate_and_codes_in_range(weight):
    qw = quantize(weight, bits=4, group_size=64)
    assert qw.codes.dtype == torch.uint8 and int(qw.codes.max()) <= 15
    assert qw.scale.shape == qw.zero.shape == (192, 256 // 64)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    err = rel_err(ReferenceKernel(qw, torch.bfloat16)(x), x @ weight.T)
    assert 0.0 < err < 0.15  # lossy, but a faithful 4-bit copy
    # HQQ's solver refines the zero point: fractional zeros, better than round-to-nearest.
    rtn = quantize(weight, bits=4, group_size=64, method="rtn")
    assert (qw.zero - qw.zero.round()).abs().mean() > 0.01
    assert err < rel_err(ReferenceKernel(rtn, torch.bfloat16)(x), x @ weight.T)


def test_lower_bits_use_reference_kernel(weight):
    qw = quantize(weight, bits=3, group_size=64)
    assert choose_kernel(qw, CPU) is ReferenceKernel
    assert choose_kernel(quantize(weight, bits=4, group_size=64), CPU) is AUTO_CPU_KERNEL
    for forced in ("int4_cpu", "int4_cpu_dot"):
        with pytest.raises(ValueError, match="cannot run"):
            choose_kernel(qw, CPU, forced)


def test_gemlite_never_imported_on_cpu(weight):
    qw = quantize(weight, bits=4, group_size=64)
    assert choose_kernel(qw, CPU, "auto") is AUTO_CPU_KERNEL
    assert "gemlite" not in sys.modules


def test_substitute_linear_call_convention(weight):
    bias = torch.randn(192, dtype=torch.bfloat16)
    qw = quantize(weight, bits=4, group_size=64)
    sub = SubstituteLinear(Int4CpuKernel(qw, torch.bfloat16), bias)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y, out_bias = sub(x)  # vLLM linears return (output, output_bias)
    assert out_bias is None
    assert rel_err(y, ReferenceKernel(qw, torch.bfloat16)(x) + bias) < 1e-2
    assert sub.bias.data_ptr() != bias.data_ptr()  # owns its bias


def _model(num_layers=3, h=256):
    return decoder_stub(num_layers, h)


def test_substitute_memory_is_28_percent_of_bf16():
    model = _model()
    opts = SubSpecOptions.from_dict({"quantizer": "rtn"})
    subs = build_substitutes(model, [0, 2], opts, CPU)
    assert sorted(subs.layers) == [0, 2]
    assert set(subs.layers[0]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    linear_bytes = sum(p.numel() * 2 for name, p in model.model.layers[0].named_parameters()
                       if "proj" in name) * 2
    assert subs.replaced_bytes == linear_bytes
    head_bytes = model.lm_head.weight.numel() * 2
    # 4 bits + one bf16 scale and one bf16 zero per 64 weights = 4.5 bits = 28.1% of bf16
    assert subs.share() == pytest.approx(4.5 / 16, rel=0.01)
    assert subs.nbytes() == subs.layer_nbytes() + subs.lm_head.nbytes()
    # the draft's own lm_head: the same 4.5 bits, held besides the target's
    assert subs.lm_head.nbytes() / head_bytes == pytest.approx(4.5 / 16, rel=0.01)
    # substitutes are not registered as submodules of the target
    assert not any("subspec" in n for n, _ in model.named_modules())

    assert subs.layout(kv_cache_bytes=2**30).startswith(
        "vllm-subspec layout: 3 layers; resident (shared) 1; substituted 0,2; substitutes ")
    assert subs.layout(kv_cache_bytes=2**30).endswith(
        "; draft lm_head quantized, 0.000 GiB; KV cache 1.000 GiB")
    target_head = build_substitutes(model, [0], SubSpecOptions.from_dict(
        {"quantizer": "rtn", "draft_lm_head": "target"}), CPU)
    assert target_head.lm_head is None
    assert "draft lm_head the target's" in target_head.layout(0)


def test_substitute_share_compares_like_with_like_when_the_head_is_large():
    """The GPU test's bound (tests/gpu/test_gpu_path.py: 0.25 < share < 0.32) on SmolLM2's
    proportions, where the lm_head (49152 x 576) has as many weights as 8 of its 30 layers:
    counting the draft's quantized head against the replaced layers reads above the bound."""
    model = decoder_stub(num_layers=2, h=128, vocab=2048, padded_vocab=2048)
    subs = build_substitutes(model, [0, 1], SubSpecOptions.from_dict({"quantizer": "rtn"}), CPU)
    assert subs.lm_head is not None
    assert 0.25 < subs.share() < 0.32
    assert subs.nbytes() / subs.replaced_bytes > 0.32  # the old, unlike comparison


@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_the_drafts_quantized_lm_head_finishes_logits_as_vllm_does(soft_cap):
    """DraftModel.compute_logits through the quantized lm_head: the vocabulary padding is cut,
    the soft cap applied, as vLLM's LogitsProcessor does for the target; and the 4-bit logits
    keep the target's top tokens (what the draft proposes from)."""
    model = decoder_stub(1, 128, seed=0, soft_cap=soft_cap)
    model.model.layers[0].self_attn.attn = nn.Module()  # stands for vLLM's Attention
    model.compute_logits = lambda h: model.logits_processor(_Head(model.lm_head), h)
    hidden = torch.randn(16, 128, dtype=torch.bfloat16)
    target_logits = model.compute_logits(hidden)
    both = DraftModel(model, build_substitutes(model, [0], SubSpecOptions.from_dict(
        {"quantizer": "hqq", "draft_lm_head": "auto"}), CPU), CPU)  # an auto shape: both
    for head, close in (("quantized", False), ("target", True)):
        opts = SubSpecOptions.from_dict({"quantizer": "hqq", "draft_lm_head": head})
        draft = DraftModel(model, build_substitutes(model, [0], opts, CPU), CPU)
        logits = draft.compute_logits(hidden)
        assert torch.equal(both.compute_logits(hidden, head), logits)  # either, on request
        if head == "target":
            with pytest.raises(ValueError, match="no quantized lm_head"):
                draft.compute_logits(hidden, "quantized")
        assert logits.shape == (16, 250) == target_logits.shape
        if close:
            assert torch.equal(logits, target_logits)
            continue
        assert not torch.equal(logits, target_logits)
        assert torch.allclose(logits.float(), target_logits.float(), atol=0.15 * float(
            target_logits.float().abs().max()))
        top_t = target_logits.float().topk(5, -1).indices
        assert (logits.float().argmax(-1)[:, None] == top_t).any(-1).float().mean() >= 0.9
        if soft_cap is not None:
            assert logits.float().abs().max() <= soft_cap


class _Head:
    """What vLLM's LogitsProcessor calls on an unquantized lm_head (quant_method.apply)."""

    tp_size = 1

    def __init__(self, linear):
        self.quant_method = self
        self.linear = linear

    def apply(self, layer, hidden, bias=None):
        return self.linear(hidden)


def test_substitute_layer_shares_attention_and_owns_the_rest():
    model = _model(num_layers=1)
    layer = model.model.layers[0]
    layer.self_attn.attn = nn.Module()  # stands for vLLM's Attention (owns the KV cache)
    layer.self_attn.attn.register_buffer("k_scale", torch.ones(1))
    layer.forward = lambda *a, **k: pytest.fail("the offloader's hook must not be called")
    subs = build_substitutes(model, [0], SubSpecOptions.from_dict({"quantizer": "rtn"}), CPU)
    # "meta" stands for the accelerator: an offloaded layer's norms sit in host memory
    clone = substitute_layer(layer, subs.layers[0], torch.device("meta"))
    assert clone.self_attn.attn is layer.self_attn.attn
    assert layer.self_attn.attn.k_scale.device == CPU  # shared modules are left alone
    assert clone.self_attn.qkv_proj is subs.layers[0]["qkv_proj"]
    assert clone.mlp.down_proj is subs.layers[0]["down_proj"]
    assert clone.input_layernorm.weight.device.type == "meta"  # its own copy, on the device
    assert layer.input_layernorm.weight.device == CPU  # the target's stays where it was
    assert "forward" not in clone.__dict__


def test_draft_row_counts_are_batch_and_tree_level_rows():
    # chain steps and a tree's root pass: b rows; tree levels past the root: k*b rows
    assert draft_row_counts(3, 4) == [1, 2, 3, 4, 8, 12]
    assert draft_row_counts(5, 1) == [1, 2, 3, 4, 5]
    # padded to CUDA-graph buckets too: 3 -> 4, 12 -> 16; past the largest size unpadded
    assert draft_row_counts(3, 4, capture_sizes=[1, 2, 4, 8, 16]) == [1, 2, 3, 4, 8, 12, 16]
    assert draft_row_counts(3, 6, capture_sizes=[1, 2, 4, 8]) == [1, 2, 3, 4, 6, 8, 12, 18]


def test_warm_up_runs_each_linear_shape_once_per_warm_up_key():
    model = _model(num_layers=2)
    subs = build_substitutes(model, [0, 1], SubSpecOptions.from_dict({"quantizer": "rtn"}), CPU)
    calls = []
    for name, sub in subs.layers[0].items():
        kernel = sub.kernel
        # a kernel without warm_up_key is warmed at every row count the drafter can send
        sub.kernel = lambda x, k=kernel, n=name: calls.append((n, x.shape[0])) or k(x)
    ran = subs.warm_up(max_num_seqs=3, tree_width=4, dtype=torch.bfloat16, device=CPU)
    # one representative per linear (every layer has the same shapes)
    assert sorted(calls) == sorted((n, m) for n in subs.layers[0] for m in (1, 2, 3, 4, 8, 12))
    assert ran == {**{n: [1, 2, 3, 4, 8, 12] for n in subs.layers[0]},
                   "lm_head": [1]}  # the unwrapped int4 aten op: one key for every row count

    # with a key, the first row count of each key runs (here: the bit length)
    calls.clear()
    for sub in subs.layers[0].values():
        sub.kernel.warm_up_key = lambda m: m.bit_length()
    subs.warm_up(max_num_seqs=3, tree_width=4, dtype=torch.bfloat16, device=CPU)
    assert sorted(calls) == sorted((n, m) for n in subs.layers[0] for m in (1, 2, 4, 8))
    # the CPU kernel compiles nothing per row count: one call per linear
    assert Int4CpuKernel.warm_up_key(7) is None and ReferenceKernel.warm_up_key(7) is None


def test_cpu_default_substitutes_every_layer_when_nothing_is_offloaded(vllm_caplog):
    """`{"method": "subspec"}` on vLLM's CPU backend (nothing offloaded): the draft is the 4-bit
    model, not the full-precision target; an explicit substitute_layers still wins."""
    from types import SimpleNamespace

    from vllm.config.offload import OffloadConfig

    from vllm_subspec.draft_model.substitute_set import build_substitute_set

    cfg = SimpleNamespace(offload_config=OffloadConfig(),
                          scheduler_config=SimpleNamespace(max_num_seqs=4))
    model = _model(num_layers=3, h=128)
    with vllm_caplog.at_level("INFO", logger="vllm.vllm_subspec.draft_model.substitute_set"):
        subs = build_substitute_set(model, SubSpecOptions(quantizer="rtn"), cfg, CPU)
    assert sorted(subs.layers) == [0, 1, 2]
    assert "every decoder layer gets a substitute" in vllm_caplog.text
    for layers, expected in (((), []), ((1,), [1])):
        model = _model(num_layers=3, h=128)
        subs = build_substitute_set(
            model, SubSpecOptions(quantizer="rtn", substitute_layers=layers), cfg, CPU)
        assert sorted(subs.layers) == expected


def test_gemlite_is_used_only_when_cuda_and_an_importable_gemlite_are_there(monkeypatch):
    import types

    from vllm_subspec.draft_model.kernels import gemlite_available

    assert not gemlite_available()  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "gemlite", None)  # `import gemlite` raises ImportError
    assert not gemlite_available()
    monkeypatch.setitem(sys.modules, "gemlite", types.ModuleType("gemlite"))
    assert gemlite_available()


def test_the_draft_structure_keys_vllm_compile_artifacts():
    """vLLM keys its on-disk compile artifacts on the config's hash and the traced sources only;
    the draft's own config and model tag carry a digest of its structure
    (vllm_hooks/draft_compile.py), which changes with a substitute's kernel class, the
    substituted layers and the draft's lm_head."""
    from vllm_subspec.vllm_hooks.draft_compile import draft_structure

    def subs(kernel_cls, layers=(0, 1), head=False):
        def linear(name):  # named as build_substitutes names them
            return SubstituteLinear(object.__new__(kernel_cls), None, name, in_features=8)

        return SubstituteSet(num_layers=2,
                             layers={i: {"o_proj": linear(f"layers.{i}.o_proj")} for i in layers},
                             lm_head=linear("lm_head") if head else None)

    base = draft_structure(subs(Int4CpuKernel))
    assert base == draft_structure(subs(Int4CpuKernel))  # a digest of structure, not identity
    assert len({base, draft_structure(subs(ReferenceKernel)), draft_structure(subs(
        Int4CpuKernel, layers=(1,))), draft_structure(subs(Int4CpuKernel, head=True))}) == 4


def test_the_draft_compiles_under_its_own_config_leaving_the_engines_alone():
    """build_draft_model gives the draft a config of its own (the engine's sub-configs, plus the
    structure digest): the engine's config, which keys the target's compile cache, is unchanged."""
    from vllm.config import VllmConfig

    from vllm_subspec.vllm_hooks.draft_compile import (
        STRUCTURE_KEY,
        build_draft_model,
        draft_structure,
    )

    model = decoder_stub(2, 128, seed=0)
    for layer in model.model.layers:
        layer.self_attn.attn = nn.Module()  # stands for vLLM's Attention
    subs = build_substitutes(model, [0], SubSpecOptions.from_dict({"quantizer": "rtn"}), CPU)
    engine = VllmConfig(additional_config={"subspec": {"tree_width": 2}})
    draft = build_draft_model(model, subs, CPU, engine)
    assert engine.additional_config == {"subspec": {"tree_width": 2}}
    assert draft.vllm_config is not engine
    assert draft.vllm_config.additional_config == {"subspec": {"tree_width": 2},
                                                   STRUCTURE_KEY: draft_structure(subs)}
    assert draft.vllm_config.compilation_config is engine.compilation_config  # shared, not copied


def test_a_failed_int4_dot_build_falls_back_to_tinygemm_with_one_warning(weight, monkeypatch):
    """No compiler, no ninja, an unwritable extension folder: the build's error is logged once
    and "auto" picks tinygemm; the kernel can't be forced then (one clear error)."""
    import logging

    import torch.utils.cpp_extension as cpp_extension

    calls = []

    def failing_load(*args, **kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setattr(int4_dot_cpu, "cpu_has_flags", lambda: True)
    records: list[logging.LogRecord] = []
    # a handler on the module's own logger: vLLM's logging config (once an engine ran in this
    # process) stops "vllm.*" records from propagating to pytest's capture
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    int4_dot_cpu.logger.addHandler(handler)
    int4_dot_cpu.extension.cache_clear()
    try:
        qw = quantize(weight, bits=4, group_size=64)
        assert choose_kernel(qw, CPU) is Int4CpuKernel
        assert choose_kernel(qw, CPU) is Int4CpuKernel
        assert len(calls) == 1 and calls[0].startswith("vllm_subspec_int4_dot_")
        warnings = [r for r in records if "could not be built" in r.getMessage()]
        assert len(warnings) == 1 and "Ninja is required" in warnings[0].getMessage()
        with pytest.raises(ValueError, match="cannot run"):
            choose_kernel(qw, CPU, "int4_cpu_dot")
    finally:
        int4_dot_cpu.logger.removeHandler(handler)
        int4_dot_cpu.extension.cache_clear()  # the real build (cached on disk) for later tests


def test_a_killed_int4_dot_build_leaves_no_lock_that_blocks_later_starts(tmp_path):
    """torch's cpp_extension waits forever on its lock file when the process that made it was
    killed. Loads and builds run one at a time under an flock (released by the kernel when its
    holder dies), and under it a leftover torch lock is a dead process's: removed."""
    import fcntl

    (tmp_path / "lock").touch()  # left by a killed build
    with int4_dot_cpu.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "vllm_subspec.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process must wait
    with open(tmp_path / "vllm_subspec.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block
