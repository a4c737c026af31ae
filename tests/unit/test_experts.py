"""Routed-expert substitutes on vLLM's own sparse MoE blocks (Qwen2-MoE with its shared expert,
Qwen3-MoE whose runner applies the gate, Mixtral): the draft's block computes what the target's
block computes with the experts' 4-bit weights, routed by the target's router."""

import itertools
import tempfile
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from subspec_testing.reference import substitute_experts_from_quantized
from vllm_subspec.config import SubSpecOptions
from vllm_subspec.draft_model import int4_dot_cpu
from vllm_subspec.draft_model.experts import expert_weights, moe_runner
from vllm_subspec.draft_model.model import layer_linear_names, substitute_layer
from vllm_subspec.draft_model.quantize import quantize
from vllm_subspec.draft_model.substitute_set import build_substitutes

CPU = torch.device("cpu")
_BLOCKS = itertools.count()
H, I_MOE, E = 128, 128, 4
KERNELS = ["reference", "int4_cpu", pytest.param("int4_cpu_dot", marks=pytest.mark.skipif(
    not int4_dot_cpu.available(), reason="no AVX512-BF16 on this CPU (or no compiler)"))]


@pytest.fixture(scope="module")
def vllm_context():
    """vLLM's config and a one-process model-parallel group: what a MoE block is built in."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  ensure_model_parallel_initialized,
                                  init_distributed_environment)

    config = VllmConfig()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        ensure_model_parallel_initialized(1, 1)
        yield config
        destroy_model_parallel()
        destroy_distributed_environment()


def _block(arch: str, seed: int = 0) -> nn.Module:
    """vLLM's sparse MoE block of `arch` with random bf16 weights, not yet processed."""
    from vllm.config import get_current_vllm_config

    n = next(_BLOCKS)  # vLLM registers each MoE layer by its (unique) name
    common = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, intermediate_size=2 * H)
    if arch == "qwen2_moe":
        from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock as cls
        config = transformers.Qwen2MoeConfig(moe_intermediate_size=I_MOE, num_experts=E,
                                             shared_expert_intermediate_size=2 * H,
                                             norm_topk_prob=False, **common)
        make = lambda: cls(config, prefix=f"model.layers.{n}.mlp")  # noqa: E731
    elif arch == "qwen3_moe":
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock as cls
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=I_MOE, num_experts=E,
                                             norm_topk_prob=True, head_dim=32, **common)
        parts = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=config),
                                parallel_config=get_current_vllm_config().parallel_config,
                                quant_config=None)  # what the block reads of a VllmConfig
        make = lambda: cls(parts, prefix=f"model.layers.{n}.mlp")  # noqa: E731
    else:
        from vllm.model_executor.models.mixtral import MixtralMoE as cls
        make = lambda: cls(num_experts=E, top_k=2, hidden_size=H,  # noqa: E731
                           intermediate_size=I_MOE, prefix=f"model.layers.{n}.block_sparse_moe")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        block = make()
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return block


def _process(block: nn.Module) -> None:
    """vLLM's weight processing (the CPU backend repacks the gate and the experts)."""
    for m in block.modules():
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)


def _layer(arch: str, block: nn.Module) -> nn.Module:
    """A decoder layer around `block`: attention linears and a stand-in for vLLM's
    Attention (what `substitute_layer` shares)."""
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = nn.Linear(H, 3 * H, bias=False, dtype=torch.bfloat16)
    layer.self_attn.o_proj = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
    layer.self_attn.attn = nn.Module()
    setattr(layer, "block_sparse_moe" if arch == "mixtral" else "mlp", block)
    return layer


def _quantized_experts(runner):
    w13, w2 = expert_weights(runner)
    return ([quantize(w13[e].detach(), bits=4, group_size=64) for e in range(E)],
            [quantize(w2[e].detach(), bits=4, group_size=64) for e in range(E)])


def _target_with(block: nn.Module, q13, q2) -> nn.Module:
    """The target block with its experts' weights replaced by the 4-bit ones dequantized, then
    processed as vLLM processes them: the output the draft's block must reproduce."""
    runner = moe_runner(_layer("x", block))[2]
    w13, w2 = expert_weights(runner)
    with torch.no_grad():
        for e in range(E):
            w13[e].copy_(q13[e].dequantize(w13.dtype))
            w2[e].copy_(q2[e].dequantize(w2.dtype))
    _process(block)
    return block


def _run_target(block, x, vllm_context):
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vllm_context):
        return block(x)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_draft_block_is_the_target_block_with_4bit_experts(vllm_context, arch, kernel):
    block = _block(arch)
    runner = moe_runner(_layer(arch, block))[2]
    q13, q2 = _quantized_experts(runner)
    experts = substitute_experts_from_quantized(runner, q13, q2, torch.bfloat16, CPU, kernel)
    assert experts.kernel_name == kernel
    if getattr(block, "shared_expert", None) is not None:
        experts.__dict__["shared_expert"] = block.shared_expert  # the target's, to compare
    x = torch.randn(9, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    target = _target_with(block, q13, q2)
    expected = _run_target(target, x, vllm_context)
    # the draft's block: the target's forward with the runner swapped for the substitute
    draft = _layer(arch, block)
    name = "block_sparse_moe" if arch == "mixtral" else "mlp"
    clone = substitute_layer(draft, {}, CPU, experts)
    got = getattr(clone, name)(x)
    assert getattr(clone, name).experts is experts
    assert got.shape == expected.shape == (9, H)
    # the same routing and sums; the int4 kernels run bf16 activations
    assert rel_err(got, expected) < (2e-2 if kernel == "reference" else 4e-2)


def test_only_routed_experts_run_each_on_its_rows(vllm_context, monkeypatch):
    from vllm_subspec.draft_model import experts as experts_module

    block = _block("mixtral", seed=2)
    runner = moe_runner(_layer("mixtral", block))[2]
    experts = substitute_experts_from_quantized(runner, *_quantized_experts(runner),
                                                torch.bfloat16, CPU, "reference")
    # route every row to experts 1 and 3 (the gate's other rows far below)
    with torch.no_grad():
        block.gate.weight.zero_()
    logits = torch.full((5, E), -10.0, dtype=torch.bfloat16)
    logits[:, 1], logits[:, 3] = 2.0, 1.0
    seen = []
    real = experts_module._expert_linear

    def spy(kernel, group_size, bits):
        run = real(kernel, group_size, bits)

        def counted(x, tensors):
            seen.append(x.shape[0])
            return run(x, tensors)
        return counted

    monkeypatch.setattr(experts_module, "_expert_linear", spy)
    out = experts(torch.randn(5, H, dtype=torch.bfloat16), logits)
    assert out.shape == (5, H)
    assert seen == [5, 5, 5, 5]  # two experts x (gate/up, down), all 5 rows each


def test_compiled_draft_block_equals_eager_in_one_graph(vllm_context):
    block = _block("qwen2_moe", seed=3)
    model = _model("qwen2_moe", block)
    subs = build_substitutes(model, [0], SubSpecOptions.from_dict(
        {"quantizer": "rtn", "draft_lm_head": "target", "kernel": "int4_cpu"}), CPU, cache=None)
    clone = substitute_layer(model.model.layers[0], subs.layers[0], CPU, subs.experts[0])
    x = torch.randn(6, H, dtype=torch.bfloat16)
    _process(block)  # the shared gate runs processed, as in the engine
    eager = clone.mlp(x)
    torch._dynamo.reset()
    compiled = torch.compile(clone.mlp, fullgraph=True, dynamic=True)  # a break would raise
    assert rel_err(compiled(x), eager) < 1e-2  # inductor fuses the bf16 glue: rounding only
    assert compiled(x[:2]).shape == (2, H)  # another row count, the same graph


def _model(arch: str, block: nn.Module) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([_layer(arch, block)])
    return model


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_substitute_set_covers_attention_shared_expert_and_every_routed_expert(vllm_context,
                                                                               arch):
    block = _block(arch, seed=4)
    model = _model(arch, block)
    subs = build_substitutes(model, [0], SubSpecOptions.from_dict(
        {"quantizer": "rtn", "draft_lm_head": "target"}), CPU, cache=None)
    names = layer_linear_names(model.model.layers[0])
    shared = ["shared_expert.gate_up_proj", "shared_expert.down_proj"] \
        if arch == "qwen2_moe" else []
    assert names == ["qkv_proj", "o_proj", *shared]
    assert sorted(subs.layers[0]) == sorted(names)
    experts = subs.experts[0]
    assert experts.num_experts == E and experts.source_name == "layers.0.experts"
    w13, w2 = expert_weights(moe_runner(model.model.layers[0])[2])
    linears = [model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].self_attn.o_proj]
    if shared:
        linears += [block.shared_expert.gate_up_proj, block.shared_expert.down_proj]
    replaced = sum(t.numel() * t.element_size() for t in [w13, w2] + [m.weight for m in linears])
    assert subs.replaced_bytes == replaced
    # 4-bit codes, group 64: about 28% of bf16 (codes + a scale and zero per group)
    assert 0.25 < subs.share() < 0.32
    assert subs.memory_parts()["substitute_bytes"] >= experts.nbytes()
    clone = substitute_layer(model.model.layers[0], subs.layers[0], CPU, experts)
    moe_block = getattr(clone, "block_sparse_moe" if arch == "mixtral" else "mlp")
    assert moe_block.gate is block.gate  # the router is the target's
    assert moe_block.experts is experts
    if shared:
        assert moe_block.shared_expert is experts.shared_expert  # the copy's, substituted
        assert moe_block.shared_expert.down_proj is subs.layers[0]["shared_expert.down_proj"]
        assert moe_block.shared_expert.expert_gate is block.shared_expert_gate


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp16_and_empty_batches(vllm_context, kernel):
    """fp16 activations reach each kernel in the dtype its tensors were packed for (tinygemm
    keeps fp16 scales; the AVX512-BF16 kernel bf16), and a pass with no rows returns none."""
    block = _block("mixtral", seed=5)
    runner = moe_runner(_layer("mixtral", block))[2]
    q13, q2 = _quantized_experts(runner)
    fp16 = substitute_experts_from_quantized(runner, q13, q2, torch.float16, CPU, kernel)
    ref = substitute_experts_from_quantized(runner, q13, q2, torch.float16, CPU, "reference")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    got = fp16(x, logits)
    assert got.dtype == torch.float16 and rel_err(got, ref(x, logits)) < 4e-2
    empty = fp16(x[:0], logits[:0])
    assert empty.shape == (0, H)


# ---- the CUDA path's routing layout (experts_triton.align_by_expert) and packing -------------

def _check_alignment(topk_ids, num_experts, block_m):
    from vllm_subspec.draft_model.experts_triton import align_by_expert

    pair_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    assert pair_ids.shape[0] == block_expert.shape[0] * block_m
    assert pair_ids.shape[0] >= pairs + min(pairs, num_experts) * (block_m - 1)
    real = pair_ids[pair_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (pair_ids[pair_ids >= pairs] == pairs).all()  # the rest is padding
    blocks = pair_ids.view(-1, block_m)
    used = block_expert >= 0
    assert not used[used.int().argmin():].any() or used.all()  # used blocks come first
    for b, e in enumerate(block_expert.tolist()):
        in_block = blocks[b][blocks[b] < pairs]
        if e < 0:
            assert in_block.numel() == 0
            continue
        assert in_block.numel() > 0 and (flat[in_block] == e).all()  # one expert per block
    # each expert's pairs fill whole blocks of its own: ceil(count / block_m) of them
    counts = torch.bincount(flat, minlength=num_experts)
    per_expert = torch.bincount(block_expert[used], minlength=num_experts)
    assert per_expert.tolist() == ((counts + block_m - 1) // block_m).tolist()
    # within an expert, pairs keep their order (a stable sort)
    for e in range(num_experts):
        mine = [p for p in pair_ids.tolist() if p < pairs and flat[p] == e]
        assert mine == sorted(mine)


@pytest.mark.parametrize("rows,num_experts,top_k,block_m", [
    (1, 4, 2, 16), (6, 8, 2, 16), (37, 8, 3, 16), (5, 128, 8, 16), (64, 4, 2, 4)])
def test_pairs_are_grouped_by_expert_in_whole_blocks(rows, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(rows)]).to(torch.int32)
    _check_alignment(ids, num_experts, block_m)
    ids[:, 0] = 0  # skewed: expert 0 holds every row's first slot (several blocks)
    _check_alignment(ids, num_experts, block_m)


def test_alignment_reads_nothing_on_the_host_and_its_operators_do_not_grow_with_rows():
    """A CUDA graph captures the routing layout: no host read (it runs on the meta device,
    where any read of a value raises), and the same operators at 1 row as at 64."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_subspec.draft_model.experts_triton import align_by_expert

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    pair_ids, block_expert = align_by_expert(
        torch.zeros(9, 8, dtype=torch.int32, device="meta"), 128)
    assert pair_ids.device.type == "meta" and pair_ids.shape == (9 * 8 + 72 * 15,)
    counted = []
    for rows in (1, 64):
        ids = torch.randint(0, 16, (rows, 4), dtype=torch.int32)
        with Ops() as ops:
            align_by_expert(ids, 16)
        counted.append(ops.ops)
    assert counted[0] == counted[1] and len(counted[0]) <= 28  # docs/moe.md counts them


def test_triton_expert_packing_and_choice():
    from vllm_subspec.draft_model.experts import (
        TritonExpertKernel,
        expert_kernel,
        expert_tensors,
    )

    gen = torch.Generator().manual_seed(0)
    qw = quantize(torch.randn(96, 128, generator=gen), bits=4, group_size=64)
    packed, scale, zero = expert_tensors(TritonExpertKernel, qw, torch.bfloat16)
    assert packed.shape == (96, 64) and packed.dtype == torch.uint8
    unpacked = torch.stack([packed & 0xF, packed >> 4], -1).view(96, 128)
    assert torch.equal(unpacked, qw.codes) and torch.equal(scale, qw.scale)
    assert torch.equal(zero, qw.zero)
    cuda = torch.device("cuda")
    assert expert_kernel(qw, qw, cuda) is TritonExpertKernel
    assert expert_kernel(qw, qw, cuda, "reference") is TritonExpertKernel  # graphs need it
    assert expert_kernel(qw, qw, CPU, "reference").name == "reference"
    three = quantize(torch.randn(96, 128, generator=gen), bits=3, group_size=64)
    with pytest.raises(ValueError, match="routed experts on CUDA run 4-bit"):
        expert_kernel(three, three, cuda)


def test_padded_expert_weights_are_read_without_their_padding(vllm_context):
    """A backend that pads the intermediate size (FlashInfer on Blackwell: gate rows at [0, u),
    up rows at [p, p + u), padding zeroed only when vLLM processes the weights) still gives
    the substitutes the checkpoint's weights: the padding, uninitialized then, is left out."""
    from vllm_subspec.draft_model.experts import ExpertWeight, checkpoint_part

    block = _block("mixtral")
    runner = moe_runner(_layer("mixtral", block))[2]
    w13, w2 = (w.detach().clone() for w in expert_weights(runner))
    for e in range(E):  # unpadded: views of the runner's tensors
        assert torch.equal(checkpoint_part(runner, e, "w13"), w13[e])
        assert torch.equal(checkpoint_part(runner, e, "w2"), w2[e])
    p = I_MOE + 64  # as allocated: padded, the padding uninitialized (NaN here)
    padded13 = torch.full((E, 2 * p, H), float("nan"), dtype=w13.dtype)
    padded13[:, :I_MOE], padded13[:, p: p + I_MOE] = w13[:, :I_MOE], w13[:, I_MOE:]
    padded2 = torch.full((E, H, p), float("nan"), dtype=w2.dtype)
    padded2[:, :, :I_MOE] = w2
    runner.routed_experts.w13_weight = nn.Parameter(padded13, requires_grad=False)
    runner.routed_experts.w2_weight = nn.Parameter(padded2, requires_grad=False)
    runner.moe_config.intermediate_size_per_partition = p
    runner.moe_config.intermediate_size_per_partition_unpadded = I_MOE
    for e in range(E):
        assert torch.equal(ExpertWeight(runner, e, "w13").weight, w13[e])
        assert torch.equal(ExpertWeight(runner, e, "w2").weight, w2[e])
