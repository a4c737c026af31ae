"""Tree builder and verifier on hand-made trees: growth, masks, positions, the walk, compaction."""

import math

import pytest
import torch

from subspec_testing.reference import accepted_path, move_kv, node_paths, tree_attention_rows
from vllm_subspec.step.tree import (
    StoredTree,
    TreeBatch,
    TreeShape,
    sharpened_log_probs,
)
from vllm_subspec.step.paged_kv import CpuVecLayout, check_cpu_layout
from vllm_subspec.step.tree_attention import TreeRows


def test_shape_levels_and_depths():
    s = TreeShape(width=3, depth=2)
    assert s.num_nodes == 7
    assert s.depths().tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert s.level(1) == slice(1, 4) and s.level(2) == slice(4, 7)


def log_q(rows):
    """Log-probabilities from explicit probability rows (vocabulary 5)."""
    return torch.tensor(rows, dtype=torch.float32).log()


def test_global_top_k_over_the_frontier():
    shape = TreeShape(width=2, depth=2)
    tree = TreeBatch(shape, torch.tensor([7]))
    tree.grow(log_q([[0.1, 0.5, 0.3, 0.05, 0.05]]))  # root -> tokens 1 (0.5), 2 (0.3)
    assert tree.tokens[0, 1:3].tolist() == [1, 2]
    assert tree.parents[0, 1:3].tolist() == [0, 0]
    # children of node 1 (score .5) and node 2 (score .3)
    tree.grow(log_q([[[0.2, 0.2, 0.2, 0.2, 0.2],        # best .5*.2 = .10
                      [0.01, 0.01, 0.01, 0.01, 0.96]]]))  # .3*.96 = .288, .3*.01
    # global top-2: (node 2, token 4) = .288, then one of node 1's .10 children
    assert tree.tokens[0, 3].item() == 4 and tree.parents[0, 3].item() == 2
    assert tree.parents[0, 4].item() == 1
    assert tree.scores[0, 3].item() == pytest.approx(math.log(0.3 * 0.96), rel=1e-5)
    # node 4 may have several children of one parent, node 1 none from node 2: not a beam
    mask = tree.mask[0].int().tolist()
    assert mask[3] == [1, 0, 1, 1, 0]  # node 3: root, its parent 2, itself
    assert mask[4] == [1, 1, 0, 0, 1]
    assert mask[0] == [1, 0, 0, 0, 0]


def test_a_stopped_request_keeps_its_depth_while_the_others_grow():
    """Growing a subset of the batch (the requests still drafting) gives those requests what
    growing them alone would; a stopped request's nodes at that depth stay parentless (never
    verified) with mass -inf, and its earlier levels are untouched."""
    shape = TreeShape(width=3, depth=3)
    torch.manual_seed(0)
    root_q = torch.randn(4, 11).log_softmax(-1)
    level_q = [torch.randn(4, 3, 11).log_softmax(-1) for _ in range(2)]
    batch = TreeBatch(shape, torch.arange(4))
    batch.grow(root_q)
    batch.grow(level_q[0])
    before = batch.tokens.clone(), batch.mask.clone()
    going = torch.tensor([1, 3])
    batch.grow(level_q[1][going], going)
    alone = TreeBatch(shape, torch.tensor([1, 3]))
    alone.grow(root_q[going])
    alone.grow(level_q[0][going])
    alone.grow(level_q[1][going])
    for name in ("tokens", "parents", "scores", "mask", "log_mass"):
        assert torch.equal(getattr(batch, name)[going], getattr(alone, name)), name
    last = shape.level(3)
    for stopped in (0, 2):
        assert (batch.parents[stopped, last] == -1).all()
        assert not batch.mask[stopped, last].any()
        assert batch.log_mass[stopped, 3] == -math.inf
        assert torch.equal(batch.tokens[stopped, : last.start], before[0][stopped, : last.start])
        assert torch.equal(batch.mask[stopped], before[1][stopped])
    assert torch.equal(batch.frontier_tokens(going), alone.frontier_tokens())


def test_scores_do_not_underflow_over_deep_trees():
    shape = TreeShape(width=2, depth=48)
    tree = TreeBatch(shape, torch.tensor([0, 0]))
    probs = torch.full((2, 5), 0.2)
    tree.grow(probs.log())
    for _ in range(47):
        tree.grow(torch.full((2, 2, 5), 0.2).log())
    assert torch.isfinite(tree.scores).all()
    assert tree.scores[0, -1].item() == pytest.approx(48 * math.log(0.2), rel=1e-4)


def test_sharpening_keeps_order_and_concentrates_mass():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    plain, sharp = sharpened_log_probs(logits, 1.0).exp(), sharpened_log_probs(logits, 0.2).exp()
    assert sharp.argmax() == plain.argmax() == 2
    assert sharp[0, 2] > plain[0, 2]


def test_best_path_is_the_chain_to_the_best_deepest_node():
    # depth 1: nodes 1 (tok 5), 2 (tok 6); depth 2: 3 (tok 8, parent 2), 4 (tok 7, parent 1):
    # node 3 is the best at depth 2 (levels are kept best first), so the chain is 6, 8
    tree = StoredTree([9, 5, 6, 8, 7], [-1, 0, 0, 2, 1], torch.ones(5, 5, dtype=torch.bool),
                      width=2)
    chain = tree.best_path(2)
    assert (chain.tokens, chain.parents, chain.width) == ([9, 6, 8], [-1, 0, 1], 1)
    assert torch.equal(chain.mask, torch.ones(3, 3, dtype=torch.bool).tril())
    assert tree.best_path(1).tokens == [9, 5]
    assert tree.best_path(0).tokens == [9]


# root 0; depth 1: nodes 1 (tok 5), 2 (tok 6); depth 2: 3 (tok 7, parent 1), 4 (tok 8, parent 1)
TOKENS = [9, 5, 6, 7, 8]
PARENTS = [-1, 0, 0, 1, 1]


@pytest.mark.parametrize("target, path", [
    ([6, 0, 0, 0, 0], [2]),          # root draw 6 -> node 2, a leaf: bonus drawn there
    ([5, 8, 0, 0, 0], [1, 4]),       # 5 -> node 1, 8 -> node 4 (leaf)
    ([5, 3, 0, 0, 0], [1]),          # 5 -> node 1; draw 3 is no child: bonus 3
    ([4, 0, 0, 0, 0], []),           # no match at the root
])
def test_sample_then_match_walk(target, path):
    assert accepted_path(TOKENS, PARENTS, target) == path
    emitted = [target[0]] + [target[a] for a in path]
    assert len(emitted) == len(path) + 1


def test_node_paths_follow_parents_from_the_root():
    tree = StoredTree(TOKENS, PARENTS, torch.ones(len(TOKENS), len(TOKENS), dtype=torch.bool))
    paths = node_paths(tree, len(TOKENS))
    assert paths[0] == []
    assert paths[4] == [TOKENS[1], TOKENS[4]]
    assert paths[2] == [TOKENS[2]]
    assert node_paths(StoredTree([9, 5, 7], [-1, 0, -1], torch.eye(3, dtype=torch.bool)), 3) \
        == [[], [5], []]  # a dead node has no path


def test_walk_ignores_dead_nodes():
    assert accepted_path([9, 5, 0], [-1, 0, -1], [5, 0, 0]) == [1]


# ---- tree attention and KV compaction on vLLM's CPU cache layout -------------------------
BS, HEADS, KV_HEADS, D = 16, 4, 2, 64


def write_cache(kv, keys, values, slots):
    from vllm import _custom_ops as ops

    kc, vc = kv.view(kv.shape[0], KV_HEADS, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, "vec16", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")


@pytest.fixture
def cache():
    torch.manual_seed(0)
    kv = torch.zeros(6, KV_HEADS, BS, 2 * D, dtype=torch.bfloat16)
    block_table = torch.tensor([4, 1, 5, 0], dtype=torch.int32)  # logical block -> physical
    n = 40
    keys = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    values = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    logical = torch.arange(n)
    slots = block_table[logical // BS].long() * BS + logical % BS
    write_cache(kv, keys, values, slots)
    return kv, block_table, keys, values


def test_cpu_layout_matches_vllm_writer():
    check_cpu_layout("vec16", D, BS, torch.bfloat16)
    check_cpu_layout("amx", D, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot read the CPU KV cache layout"):
        check_cpu_layout("neon", D, BS, torch.bfloat16)


@pytest.mark.parametrize("head_dim, block", [(64, 32), (128, 128), (96, 64)])
def test_amx_layout_reads_writes_and_splits_what_vllms_writer_wrote(head_dim, block):
    """The amx layout (vLLM's bf16 KV on CPUs with AMX tiles): `put` writes the bytes vLLM's
    writer writes, `gather` reads them back, `move` compacts, and whole blocks split into
    32-token scratch blocks hold the same tokens."""
    from vllm import _custom_ops as ops

    from vllm_subspec.step.paged_kv import CpuAmxLayout

    g = torch.Generator().manual_seed(head_dim)
    nb, h, n = 5, 3, 3 * block + 7
    keys = torch.randn(n, h, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(n, h, head_dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * block, generator=g)[:n]
    theirs = torch.zeros(nb, h, block, 2 * head_dim, dtype=torch.bfloat16)
    kc, vc = theirs.view(nb, h, 2 * block, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, "amx", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    ours = torch.zeros_like(theirs)
    CpuAmxLayout(ours).put(slots, keys, values)
    assert torch.equal(ours, theirs)
    layout = CpuAmxLayout(theirs)
    k, v = layout.gather(slots)
    assert torch.equal(k, keys) and torch.equal(v, values)
    scratch = CpuAmxLayout(torch.zeros(2 * block // 32, h, 32, 2 * head_dim,
                                       dtype=torch.bfloat16))
    blocks = torch.tensor([3, 1])
    layout.split_blocks(blocks, scratch, 0)
    token = torch.arange(2 * block)
    k, v = scratch.gather(token)
    k_ref, v_ref = layout.gather(blocks[token // block] * block + token % block)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    layout.move(slots[:4], slots[4:8])
    k, v = layout.gather(slots[4:8])
    assert torch.equal(k, keys[:4]) and torch.equal(v, values[:4])


def test_tree_attention_equals_dense_masked_attention(cache):
    kv, block_table, keys, values = cache
    prefix, m = 30, 7  # tree slots 30..36: root + nodes 1..6 of a k=3, D=2 tree
    tree = TreeBatch(TreeShape(3, 2), torch.tensor([0]))
    tree.grow(torch.randn(1, 11).log_softmax(-1))
    tree.grow(torch.randn(1, 3, 11).log_softmax(-1))
    mask = tree.mask[0]
    q = torch.randn(m, HEADS, D, dtype=torch.bfloat16)
    out = tree_attention_rows(q, CpuVecLayout(kv), block_table, TreeRows(0, 0, prefix, mask), 0.125)
    # reference: plain softmax attention over the visible positions of each row
    k_all = keys[: prefix + m].float().repeat_interleave(2, dim=1)
    v_all = values[: prefix + m].float().repeat_interleave(2, dim=1)
    for row in range(m):
        visible = list(range(prefix)) + [prefix + j for j in range(m) if mask[row, j]]
        s = torch.einsum("hd,thd->ht", q[row].float(), k_all[visible]) * 0.125
        ref = torch.einsum("ht,thd->hd", s.softmax(-1), v_all[visible])
        torch.testing.assert_close(out[row].float(), ref, atol=2e-2, rtol=2e-2)
    # a node only sees its ancestors: changing a non-ancestor's KV leaves its row unchanged
    other = [j for j in range(m) if not mask[5, j]][0]
    kv2 = kv.clone()
    write_cache(kv2, torch.randn(1, KV_HEADS, D, dtype=torch.bfloat16),
                torch.randn(1, KV_HEADS, D, dtype=torch.bfloat16),
                torch.tensor([int(block_table[(prefix + other) // BS]) * BS
                              + (prefix + other) % BS]))
    out2 = tree_attention_rows(q, CpuVecLayout(kv2), block_table, TreeRows(0, 0, prefix, mask),
                               0.125)
    assert torch.equal(out2[5], out[5])


def test_kv_compaction_moves_the_accepted_path(cache):
    kv, block_table, keys, values = cache
    root = 20
    path = [2, 5, 11]  # accepted nodes at logical 22, 25, 31 (across a block boundary)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = object.__new__(CPUAttentionBackendImpl)  # the real class picks the reader
    move_kv([(impl, kv, None)], block_table, BS, root + torch.tensor(path), root + torch.arange(1, 4))
    layout = CpuVecLayout(kv)
    logical = torch.arange(root, root + 4)
    k, v = layout.gather(block_table[logical // BS].long() * BS + logical % BS)
    src = [root] + [root + a for a in path]
    assert torch.equal(k, keys[src]) and torch.equal(v, values[src])
    # untouched prefix
    k0, _ = layout.gather(block_table[torch.arange(5) // BS].long() * BS + torch.arange(5) % BS)
    assert torch.equal(k0, keys[:5])


def test_kv_compaction_reads_a_manager_table_over_kernel_blocks():
    """vLLM may view a cache in kernel blocks smaller than the KV manager's (ratio 2 here:
    manager block m = kernel blocks 2m, 2m+1) while the runner's block table holds manager
    blocks: compaction computes slots at the table's block size."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = object.__new__(CPUAttentionBackendImpl)
    manager_table = torch.tensor([2, 0, 1], dtype=torch.int32)  # 2 * BS tokens per block
    kernel_table = torch.tensor([4, 5, 0, 1, 2, 3], dtype=torch.int32)
    n, root, path = 60, 20, [2, 5, 13]  # accepted nodes at 22, 25, 33 (across manager blocks)
    keys = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    values = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    logical = torch.arange(n)
    kv = torch.zeros(6, KV_HEADS, BS, 2 * D, dtype=torch.bfloat16)
    write_cache(kv, keys, values, kernel_table[logical // BS].long() * BS + logical % BS)
    wrong = kv.clone()
    src, dst = root + torch.tensor(path), root + torch.arange(1, 4)
    move_kv([(impl, kv, None)], manager_table, 2 * BS, src, dst)
    k, v = CpuVecLayout(kv).gather(kernel_table[logical // BS].long() * BS + logical % BS)
    expect = [*range(root + 1)] + [root + a for a in path]
    assert torch.equal(k[: root + 4], keys[expect]) and torch.equal(v[: root + 4], values[expect])
    move_kv([(impl, wrong, None)], manager_table, BS, src, dst)  # the kernel size with that table
    k, _ = CpuVecLayout(wrong).gather(kernel_table[logical // BS].long() * BS + logical % BS)
    assert not torch.equal(k[: root + 4], keys[expect])


def test_a_subset_pass_slices_every_per_request_field_vllm_slices():
    """A draft pass over the requests still drafting (draft_passes.tree_pass_metadata) must slice
    every per-request field of vLLM's CommonAttentionMetadata; vLLM's own `unpadded` names
    them (it slices each to num_actual_reqs). The fields the pass sets itself are excluded."""
    import inspect
    import re

    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_subspec.vllm_hooks.draft_passes import PER_REQUEST_FIELDS

    source = inspect.getsource(CommonAttentionMetadata.unpadded)
    sliced = set(re.findall(r"maybe_slice_reqs\(self\.(\w+)\)", source))
    sliced |= set(re.findall(r"self\.(\w+)\[:\s*num_actual_reqs\]", source))
    sliced |= set(re.findall(r"self\.(\w+)\[:num_actual_reqs\]", source))
    if "self.causal[:num_actual_reqs]" in source:
        sliced.add("causal")
    set_by_the_pass = {"query_start_loc", "query_start_loc_cpu", "seq_lens",
                       "block_table_tensor", "seq_lens_cpu_upper_bound"}
    assert len(sliced) >= 10  # the pattern still finds vLLM's slicing
    assert sliced - set_by_the_pass <= set(PER_REQUEST_FIELDS), sliced - set(PER_REQUEST_FIELDS)


def test_growing_a_tree_creates_no_tensor_on_another_device():
    """Every tensor an operation of `TreeBatch.grow` reads lives on the tree's device: an index
    made on the host would be a blocking host-to-device copy on CUDA (issue 22). Run on the
    meta device, where any host tensor among an op's inputs shows (0-dim scalars aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.foreign = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat, _ = torch.utils._pytree.tree_flatten((args, kwargs or {}))
            for t in flat:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() > 0:
                    self.foreign.append((str(func), t.device.type))
            return func(*args, **(kwargs or {}))

    shape, b, v = TreeShape(3, 4), 2, 11
    with torch.device("meta"):
        tree = TreeBatch(shape, torch.zeros(b, dtype=torch.int64))
        first, later = torch.randn(b, v), torch.randn(b, shape.width, v)
    with Devices() as seen:
        tree.grow(first.log_softmax(-1))
        tree.grow(later.log_softmax(-1))
        tree.grow(later[:1].log_softmax(-1), rows=torch.tensor([1], device="meta"))
    assert seen.foreign == []
