"""Tree rows on the CPU backend are bit-identical to vLLM's own decode attention.

Caches are written with vLLM's writer (`cpu_attn_reshape_and_cache`) and the reference is vLLM's
CPU attention kernel (`cpu_attention_with_kv_cache`) run as plain decoding runs it: one decode row
per token over its causal context. A pure-torch emulation of the kernel's arithmetic pins down what
that arithmetic is (docs/tree_attention.md), so a vLLM upgrade that changes it is noticed.
"""

import platform
from types import SimpleNamespace

import pytest
import torch

from subspec_testing.reference import tree_attention_rows
from vllm_subspec.step.tree import TreeBatch, TreeShape
from vllm_subspec.step.paged_kv import CpuVecLayout, cpu_layout, logical_to_slots
from vllm_subspec.step.tree_attention import (
    SCRATCH_BLOCK,
    TreePlan,
    TreeRows,
    _torch_rows,
    apply_tree_attention,
    cpu_scratch,
    tree_plan,
)


def _ops():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the vec attention ISA is vLLM's x86 CPU kernel")
    try:
        from vllm import _custom_ops as ops

        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018
        torch.ops._C.get_scheduler_metadata  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        pytest.skip(f"vLLM's CPU attention op is not available: {e!r}")
    return ops


BS = 128  # the CPU backend's default block size


def has_amx() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and \
        torch.cpu._is_amx_tile_supported()


# vLLM's bf16 attention ISA on CPUs with AMX tiles ("amx", its own KV layout) besides "vec"
ISAS = [pytest.param("vec"), pytest.param("amx", marks=pytest.mark.skipif(
    not has_amx(), reason="this CPU has no AMX tiles: vLLM never picks the amx ISA here"))]


def isa_dtype(isa, dtype):
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM picks amx for bf16 only")
    if isa == "amx":
        torch.cpu._init_amx()  # the tile permission vLLM's CPU worker has (a fresh process not)
CONFIGS = [(9, 3, 64), (12, 2, 128)]  # heads, kv heads, head dim


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write(ops, kv, keys, values, slots, isa="vec"):
    nb, kvh, bs, d2 = kv.shape
    kc, vc = kv.view(nb, kvh, 2 * bs, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def decode(ops, q, kv, block_table, seq_len, scale, isa="vec"):
    """vLLM's kernel for one decode row (q [heads, d]) at the end of a causal context."""
    nb, kvh, bs, d2 = kv.shape
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=q.shape[0], num_kv_heads=kvh, head_dim=d2 // 2,
        seq_lens=i32([seq_len]), dtype=q.dtype, query_start_loc=i32([0, 1]), causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False)
    kc, vc = kv.view(nb, kvh, 2 * bs, d2 // 2).chunk(2, dim=2)
    out = torch.empty(1, *q.shape, dtype=q.dtype)
    ops.cpu_attention_with_kv_cache(
        query=q[None], key_cache=kc, value_cache=vc, output=out, query_start_loc=i32([0, 1]),
        seq_lens=i32([seq_len]), scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table[None].to(torch.int32), softcap=0.0, scheduler_metadata=md,
        s_aux=None)
    return out[0]


def paged_cache(ops, n, kvh, d, dtype, seed, isa="vec"):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // BS)
    kv = torch.zeros(blocks + 2, kvh, BS, 2 * d, dtype=dtype)
    block_table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)
    keys = (2 * torch.randn(n, kvh, d, generator=g)).to(dtype)
    values = torch.randn(n, kvh, d, generator=g).to(dtype)
    logical = torch.arange(n)
    write(ops, kv, keys, values, block_table[logical // BS].long() * BS + logical % BS, isa)
    return kv, block_table, keys, values


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, d", CONFIGS)
@pytest.mark.parametrize("prefix, m", [(0, 5), (125, 6), (300, 4)])
def test_chain_rows_equal_the_kernel_decode(isa, dtype, heads, kv_heads, d, prefix, m):
    """A chain-shaped mask is causal: row r must be the kernel's decode at length L + r + 1
    (contexts cross the 128-token block boundary for prefix 125), in the cache layout and
    kernels of each attention ISA."""
    ops = _ops()
    isa_dtype(isa, dtype)
    kv, block_table, _, _ = paged_cache(ops, prefix + m + 3, kv_heads, d, dtype, prefix + d, isa)
    q = (2 * torch.randn(m, heads, d, generator=torch.Generator().manual_seed(m))).to(dtype)
    chain = torch.tril(torch.ones(m, m, dtype=torch.bool))
    scale = d ** -0.5
    layout = cpu_layout(kv, isa)
    out = tree_attention_rows(q, layout, block_table, TreeRows(0, 0, prefix, chain), scale)
    ref = torch.stack([decode(ops, q[r], kv, block_table, prefix + r + 1, scale, isa)
                       for r in range(m)])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads, kv_heads, d", CONFIGS)
def test_tree_rows_equal_decoding_their_own_path(isa, heads, kv_heads, d):
    """Each node's row equals plain decoding of that node: a fresh cache holding only the prefix,
    the node's ancestors and itself, contiguously, decoded by the kernel (bf16)."""
    ops = _ops()
    dtype, prefix = torch.bfloat16, 122
    isa_dtype(isa, dtype)
    g = torch.Generator().manual_seed(d)
    tree = TreeBatch(TreeShape(3, 3), torch.tensor([0]))
    tree.grow(torch.randn(1, 11, generator=g).log_softmax(-1))
    for _ in range(2):
        tree.grow(torch.randn(1, 3, 11, generator=g).log_softmax(-1))
    mask = tree.mask[0]
    m = mask.shape[0]
    kv, block_table, keys, values = paged_cache(ops, prefix + m, kv_heads, d, dtype, d, isa)
    q = (2 * torch.randn(m, heads, d, generator=g)).to(dtype)
    scale = d ** -0.5
    out = tree_attention_rows(q, cpu_layout(kv, isa), block_table,
                              TreeRows(0, 0, prefix, mask), scale)
    for r in range(m):
        visible = list(range(prefix)) + [prefix + j for j in range(m) if mask[r, j]]
        n = len(visible)
        own = torch.zeros(-(-n // BS) + 1, kv_heads, BS, 2 * d, dtype=dtype)
        table = torch.arange(own.shape[0] - 1, dtype=torch.int32).flip(0)
        logical = torch.arange(n)
        write(ops, own, keys[visible], values[visible],
              table[logical // BS].long() * BS + logical % BS, isa)
        assert torch.equal(out[r], decode(ops, q[r], own, table, n, scale, isa)), f"row {r}"


# ---- the kernel's arithmetic, emulated in torch (vec ISA, x86 AVX-512 build) -----------------

def fma32(a, b, c):
    """fp32 fused multiply-add: the exact product in fp64, one fp64 sum made round-to-odd when it
    is inexact and sits on an fp32 tie, then one rounding to fp32."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bits = s.view(torch.int64)
    tie = (bits & 0x1FFFFFFF) == 0x10000000
    if bool(tie.any()):
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        step = torch.where((err > 0) == (s > 0), 1, -1)
        s = torch.where(tie & (err != 0), bits + step, bits).view(torch.float64)
    return s.float()


def _f32(bits):
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


def fast_exp(x):
    """cpu_attn_macros.h DEFINE_FAST_EXP (AVX-512): range reduction plus a degree-5 polynomial."""
    lo, hi = _f32(0xC2AEAC50), _f32(0x42B17218)
    src = torch.maximum(torch.minimum(x, hi), lo)
    fx = torch.floor(fma32(src, _f32(0x3FB8AA3B).expand_as(src), torch.full_like(src, 0.5)))
    r = fma32(-fx, _f32(0x3F317218).expand_as(src), src)
    res = torch.full_like(src, 0.00828929059)
    for c in (0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0):
        res = fma32(r, res, torch.full_like(src, c))
    two_n = (((fx - 1).to(torch.int32) + 127) << 23).view(torch.float32)
    two_n = torch.where(x < lo, torch.zeros_like(two_n), two_n)
    return res * two_n * 2.0


def emulate_decode(q, k, v, scale):
    """q [heads, d]; k, v [T, kv_heads, d]: one decode row as the vec kernel computes it."""
    heads, d = q.shape
    T, kvh, _ = k.shape
    k = k.float().repeat_interleave(heads // kvh, 1)
    v = v.float().repeat_interleave(heads // kvh, 1)
    qs = q.float() * scale  # scale folded into q, rounded to fp32
    logits = torch.zeros(heads, T)
    for i in range(d):  # fp32 FMA chain over the head dim, per key
        logits = fma32(qs[:, i:i + 1].expand(heads, T), k[:, :, i].t(), logits)
    p = fast_exp(logits - logits.max(-1, keepdim=True).values)
    padded = torch.zeros(heads, -(-T // 32) * 32)  # keys in groups of 32, masked ones give 0
    padded[:, :T] = p
    lanes = torch.zeros(heads, 16)
    for j in range(padded.shape[1] // 16):  # 16 fp32 lanes, each summed in order
        lanes = lanes + padded[:, 16 * j: 16 * j + 16]
    for w in (8, 4, 2, 1):  # _mm512_reduce_add_ps
        lanes = lanes[:, :w] + lanes[:, w:2 * w]
    out = torch.zeros(heads, d)
    for t in range(T):  # P·V: fp32 FMA chain over the keys, P kept in fp32
        out = fma32(p[:, t:t + 1].expand(heads, d), v[t], out)
    inv = (1.0 / lanes[:, 0].double()).float()
    return (inv[:, None] * out).to(q.dtype)  # normalise once, round once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [5, 130])
def test_kernel_arithmetic_is_the_documented_one(dtype, seq_len):
    ops = _ops()
    if not torch.cpu._is_avx512_supported():
        pytest.skip("the emulated exp is the AVX-512 build's")
    heads, kv_heads, d = 4, 2, 64
    kv, block_table, keys, values = paged_cache(ops, seq_len, kv_heads, d, dtype, seq_len)
    q = (2 * torch.randn(heads, d, generator=torch.Generator().manual_seed(1))).to(dtype)
    ref = decode(ops, q, kv, block_table, seq_len, 0.1)
    assert torch.equal(emulate_decode(q, keys, values, 0.1), ref)
    # the plain torch formula (still used off the CPU backend) is not bit-exact in fp32
    if dtype == torch.float32:
        chain = torch.ones(1, 1, dtype=torch.bool)
        plain = _torch_rows(q[None], CpuVecLayout(kv), block_table,
                            TreeRows(0, 0, seq_len - 1, chain), 0.1)[0]
        assert not torch.equal(plain, ref)


@pytest.mark.parametrize("heads, kv_heads", [(12, 2), (8, 8), (6, 1)])
def test_torch_rows_group_query_heads_like_one_head_at_a_time(heads, kv_heads):
    """The torch tree rows (the path off the CPU kernel: FlashAttention caches) compute grouped
    query attention per KV head; the reference loops over query heads, each reading KV head
    h // (heads / kv_heads), with the tree's ancestor-only mask over the tree slots."""
    d, prefix, scale = 16, 7, 0.25
    shape = TreeShape(2, 3)
    m = shape.num_nodes
    gen = torch.Generator().manual_seed(heads)
    keys = torch.randn(prefix + m, kv_heads, d, generator=gen)
    values = torch.randn(prefix + m, kv_heads, d, generator=gen)

    class Dense:  # a cache read through slots = logical positions (block table 0..n)
        block_size = 4

        def __init__(self):
            self.kv_heads = kv_heads

        def gather(self, slots):
            return keys[slots], values[slots]

    tree = TreeBatch(shape, torch.tensor([3]))
    for _ in range(shape.depth):
        tree.grow(torch.randn(1, *([2] if tree.grown else []), 11, generator=gen).log_softmax(-1))
    mask = tree.mask[0]
    q = torch.randn(m, heads, d, generator=gen)
    block_table = torch.arange(8)
    out = _torch_rows(q, Dense(), block_table, TreeRows(0, 0, prefix, mask), scale)
    groups = heads // kv_heads
    ref = torch.empty_like(out)
    for h in range(heads):
        kh, vh = keys[:, h // groups], values[:, h // groups]
        scores = q[:, h] @ kh.T * scale  # [m, prefix + m]
        scores[:, prefix:] = scores[:, prefix:].masked_fill(~mask, float("-inf"))
        ref[:, h] = scores.softmax(-1) @ vh
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# (isa, cache block size): vLLM's default 128-token blocks; 32, one scratch block per cache
# block; 16 with vec16, blocks smaller than the scratch's (the prefix copied token-wise)
ISA_BLOCKS = [pytest.param("vec", BS, id="vec-128"), pytest.param("vec", 32, id="vec-32"),
              pytest.param("vec16", 16, id="vec16-16"),
              pytest.param("amx", BS, id="amx-128", marks=ISAS[1].marks)]
# requests of one forward: (prefix L, rows): a whole tree (width, depth) verified, a draft
# level ("level", width, depth: its k deepest nodes over every slot up to them), one row
BATCHES = {
    # no shared block, a cache block boundary, several cache blocks
    "blocks": [(0, "tree", 3, 3), (130, "tree", 2, 4), (300, "tree", 4, 2)],
    # prefixes at exact multiples of 32 and of the cache block, one of them a lone row
    "multiples": [(64, "tree", 3, 3), (256, "one"), (32, "level", 2, 3), (128, "tree", 2, 2)],
    # prefixes under 32 tokens, draft levels and lone rows between trees
    "short": [(17, "tree", 2, 3), (96, "one"), (5, "level", 3, 2), (31, "level", 2, 4),
              (161, "one")],
}


def request_mask(g, rows, width=1, depth=1):
    """[q_len, m] ancestor-or-self mask of a grown tree's rows (`rows`: as in BATCHES)."""
    if rows == "one":
        return torch.ones(1, 1, dtype=torch.bool)
    shape = TreeShape(width, depth)
    tree = TreeBatch(shape, torch.tensor([0]))
    tree.grow(torch.randn(1, 11, generator=g).log_softmax(-1))
    for _ in range(depth - 1):
        tree.grow(torch.randn(1, width, 11, generator=g).log_softmax(-1))
    level = shape.level(depth)
    return tree.mask[0] if rows == "tree" else tree.mask[0, level, : level.stop]


def own_path_decode(ops, q, keys, values, visible, scale, isa, block):
    """vLLM's kernel decoding q at the end of exactly `visible` positions' K/V, contiguous in a
    fresh cache: what plain decoding of that node computes."""
    n, (_, kv_heads, d) = len(visible), keys.shape
    own = torch.zeros(-(-n // block) + 1, kv_heads, block, 2 * d, dtype=keys.dtype)
    table = torch.arange(own.shape[0] - 1, dtype=torch.int32).flip(0)
    logical = torch.arange(n)
    write(ops, own, keys[visible], values[visible],
          table[logical // block].long() * block + logical % block, isa)
    return decode(ops, q, own, table, n, scale, isa)


@pytest.mark.parametrize("isa, block", ISA_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_requests_rows_in_one_kernel_call_equal_each_alone(isa, block, dtype, batch):
    """`apply_tree_attention` runs the rows of every tree request of a forward in one kernel
    call; each request's rows must be bit-identical to its own call and to vLLM's kernel
    decoding that row's own path (prefix then ancestors then itself), for requests of different
    prefix lengths (under 32 tokens, at multiples of 32 and of the cache block, across cache
    blocks), rows and tree slots in one batch, and the layer's output rows of other requests
    untouched."""
    ops = _ops()
    isa_dtype(isa, dtype)
    specs = BATCHES[batch]
    heads, kv_heads, d = 9, 3, 64
    g = torch.Generator().manual_seed(5)
    n = 512  # tokens per request's cache
    per = n // block
    kv = torch.zeros(len(specs) * per + 2, kv_heads, block, 2 * d, dtype=dtype)
    tables = torch.randperm(kv.shape[0], generator=g)[: len(specs) * per].view(-1, per) \
        .to(torch.int32)
    keys, values = [], []
    for table in tables:
        logical = torch.arange(n)
        keys.append((2 * torch.randn(n, kv_heads, d, generator=g)).to(dtype))
        values.append(torch.randn(n, kv_heads, d, generator=g).to(dtype))
        write(ops, kv, keys[-1], values[-1],
              table[logical // block].long() * block + logical % block, isa)
    masks = [request_mask(g, *spec[1:]) for spec in specs]
    # query rows: request 0's tree, a plain decode row, then the other requests'
    starts, at = [], 0
    for i, m in enumerate(masks):
        at += 1 if i == 1 else 0
        starts.append(at)
        at += m.shape[0]
    query = (2 * torch.randn(at, heads, d, generator=g)).to(dtype)
    rows = [TreeRows(i, s, spec[0], m) for i, (s, spec, m) in enumerate(zip(starts, specs,
                                                                           masks))]
    scale = d ** -0.5
    alone = [tree_attention_rows(query, cpu_layout(kv, isa), tables[r.req_index], r, scale)
             for r in rows]
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = object.__new__(CPUAttentionBackendImpl)  # the real class picks the CPU reader
    impl.scale = scale
    output = torch.full((at, heads * d), 7.0, dtype=dtype)
    with tree_plan(TreePlan(rows)):
        apply_tree_attention(impl, SimpleNamespace(isa=isa), query, kv,
                             SimpleNamespace(block_table=tables), output)
    out = output.view(at, heads, d)
    for r, ref in zip(rows, alone):
        assert torch.equal(out[r.q_start: r.q_start + ref.shape[0]], ref)
        for i, seen in enumerate(r.tree_mask.tolist()):
            visible = list(range(r.prefix_len)) + [r.prefix_len + j for j, s in enumerate(seen)
                                                   if s]
            expected = own_path_decode(ops, query[r.q_start + i], keys[r.req_index],
                                       values[r.req_index], visible, scale, isa, block)
            assert torch.equal(out[r.q_start + i], expected), f"request {r.req_index} row {i}"
    assert (out[masks[0].shape[0]] == 7.0).all()  # the plain row is the backend's


@pytest.mark.parametrize("plain_row", [False, True], ids=["only-tree-rows", "a-plain-row"])
def test_the_backends_causal_pass_runs_only_for_rows_outside_the_plan(plain_row,
                                                                      monkeypatch):
    """vLLM's CPU backend `forward` wrapped as the engine wraps it
    (`patches.tree_attention_forward`), on real backend objects: when every row of the call is a
    tree row, vLLM's causal pass (which would be overwritten whole) does not run, and the rows
    are bit-identical to running it then recomputing them; a plain request's row in the call
    runs it, and keeps the backend's result."""
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata)

    from vllm_subspec.vllm_hooks.patches import tree_attention_forward

    ops = _ops()
    isa, dtype, heads, kv_heads, d = "vec", torch.bfloat16, 9, 3, 64
    assert not CPUAttentionBackend.forward_includes_kv_cache_update  # the layer writes KV
    g = torch.Generator().manual_seed(11)
    specs = BATCHES["blocks"] + ([(200, "one")] if plain_row else [])
    per = 512 // BS
    kv = torch.zeros(len(specs) * per + 2, kv_heads, BS, 2 * d, dtype=dtype)
    tables = torch.randperm(kv.shape[0], generator=g)[: len(specs) * per].view(-1, per) \
        .to(torch.int32)
    for table in tables:
        logical = torch.arange(512)
        write(ops, kv, (2 * torch.randn(512, kv_heads, d, generator=g)).to(dtype),
              torch.randn(512, kv_heads, d, generator=g).to(dtype),
              table[logical // BS].long() * BS + logical % BS, isa)
    masks = [request_mask(g, *spec[1:]) for spec in specs]
    q_lens = [m.shape[0] for m in masks]
    starts = [sum(q_lens[:i]) for i in range(len(masks))]
    query = (2 * torch.randn(sum(q_lens), heads, d, generator=g)).to(dtype)
    # each request's rows end its context: the verify's, a level pass's or a decode's
    seq_lens = i32([spec[0] + m.shape[1] for spec, m in zip(specs, masks)])
    query_start_loc = i32(starts + [sum(q_lens)])
    metadata = CPUAttentionMetadata(
        num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
        query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=tables, slot_mapping=torch.empty(0, dtype=torch.int64),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(specs), num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False))
    # the backend reads the model's dtype from the engine's config at construction
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
    impl = CPUAttentionBackendImpl(heads, d, d ** -0.5, kv_heads, None, None, "auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    vllm_forward = getattr(CPUAttentionBackendImpl.forward, "__subspec_original__",
                           CPUAttentionBackendImpl.forward)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return vllm_forward(*args, **kwargs)

    trees = len(BATCHES["blocks"])  # the plain row, when there is one, comes last
    plan = TreePlan([TreeRows(i, s, spec[0], m) for i, (s, spec, m)
                     in enumerate(zip(starts[:trees], specs, masks))])
    outputs = {}
    for skip in (True, False):
        output = torch.full((query.shape[0], heads * d), 7.0, dtype=dtype)
        with tree_plan(plan):
            tree_attention_forward(counted, kv_written_apart=skip)(
                impl, layer, query, None, None, kv, metadata, output)
        outputs[skip] = output
    # the backend ran in the reference call, and in the wrapped one only for the plain row
    assert len(calls) == 1 + plain_row
    assert torch.equal(outputs[True], outputs[False])
    assert not (outputs[True] == 7.0).all(-1).any()  # every row written
    if plain_row:  # the plain row is the backend's causal decode of it
        assert torch.equal(outputs[True].view(-1, heads, d)[-1],
                           decode(ops, query[-1], kv, tables[-1], int(seq_lens[-1]),
                                  d ** -0.5, isa))


def scratch_contexts(plan, cache_block):
    """Each kernel row's context as the cache slots its scratch positions are copied from
    (`_cpu_kernel_rows`: `whole` split block-wise from scratch block 0 on, then `src` ->
    `dst`), and every scratch slot written token-wise."""
    per = cache_block // SCRATCH_BLOCK
    source = {k * per * SCRATCH_BLOCK + t: block * cache_block + t
              for k, block in enumerate(plan.whole.tolist()) for t in range(cache_block)}
    for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
        assert d not in source, f"scratch slot {d} written twice"
        source[d] = s
    rows = [[row[p // SCRATCH_BLOCK] * SCRATCH_BLOCK + p % SCRATCH_BLOCK for p in range(n)]
            for row, n in zip(plan.block_table.tolist(), plan.seq_lens.tolist())]
    return [[source[slot] for slot in row] for row in rows], rows


@pytest.mark.parametrize("isa, block", [("vec", BS), ("vec", 32), ("vec", 64),
                                        ("vec", 256), ("vec16", 16), ("vec16", 48)])
def test_each_rows_scratch_context_is_its_prefix_then_its_path(isa, block):
    """The layout itself, for many requests of every kind in one forward: each kernel row
    reads, position by position, the cache slots of the prefix [0, L) then of the tree slots
    its mask shows, in order; positions past the whole prefix blocks are in that row's own
    tail blocks (zeroed every layer: past its length they stay zeros), and nothing else is
    written there."""
    _ops()
    g = torch.Generator().manual_seed(block)
    specs = [spec for batch in BATCHES.values() for spec in batch]
    specs += [(L, "tree", 3, 2) for L in (1, 33, 255, 257, 383, 384, 1000)]
    per = -(-1100 // block)
    kv = torch.zeros(len(specs) * per, 1, block, 2 * 32, dtype=torch.bfloat16)
    tables = torch.randperm(kv.shape[0], generator=g).view(len(specs), per).to(torch.int32)
    # some prefix lengths as 0-d tensors, as a draft pass may give its roots
    requests = [TreeRows(i, 3 * i, torch.tensor(spec[0]) if i % 4 == 3 else spec[0],
                         request_mask(g, *spec[1:])) for i, spec in enumerate(specs)]
    plan = cpu_scratch(cpu_layout(kv, isa), tables, requests, 2, torch.bfloat16)
    contexts, slots = scratch_contexts(plan, block)
    row = 0
    for r in requests:
        L = int(r.prefix_len)
        for i, seen in enumerate(r.tree_mask.tolist()):
            logical = torch.tensor(list(range(L)) + [L + j for j, s in enumerate(seen) if s])
            assert contexts[row] == logical_to_slots(tables[r.req_index], logical,
                                                     block).tolist(), f"row {row}"
            assert plan.query_rows[row] == r.q_start + i
            row += 1
    assert row == plan.block_table.shape[0]
    full_blocks = [int(r.prefix_len) // SCRATCH_BLOCK for r in requests
                   for _ in range(r.tree_mask.shape[0])]
    tails, read_slots = {}, set()
    for row, (read, full) in enumerate(zip(slots, full_blocks)):
        read_slots.update(read)
        for p, slot in enumerate(read):
            block_id = slot // SCRATCH_BLOCK
            if p < full * SCRATCH_BLOCK:
                assert block_id < plan.num_prefix
            else:
                assert plan.num_prefix <= block_id < plan.num_blocks
                assert tails.setdefault(block_id, row) == row, "a tail block shared"
    assert set(plan.dst.tolist()) <= read_slots  # no write past a row's length


def test_the_layout_runs_as_many_torch_operations_for_8_requests_as_for_2():
    """`cpu_scratch` lays out every request of a forward at once: the torch operations it
    dispatches do not grow with the number of requests (a loop over them ran ~20 each, every
    forward), for a verify's trees (every request its own prefix, rows and slots) and a draft
    level's (one shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _ops()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(72, 2, BS, 2 * 64, dtype=torch.bfloat16)
    layout = cpu_layout(kv, "vec")
    prefixes = (0, 45, 130, 300, 64, 17, 256, 900)
    trees = [request_mask(g, "tree", 2 + i % 3, 1 + i % 4) for i in range(8)]
    level = [request_mask(g, "level", 3, 3) for _ in range(8)]
    counts = {}
    for kind, masks in (("verify", trees), ("draft level", level)):
        for n in (2, 8):
            requests = [TreeRows(i, 20 * i, prefixes[i], masks[i]) for i in range(n)]
            tables = torch.randperm(72, generator=g)[: 9 * n].view(n, 9).to(torch.int32)
            with Count() as c:
                cpu_scratch(layout, tables, requests, 4, torch.bfloat16)
            counts[kind, n] = len(c.ops)
    assert counts["verify", 2] == counts["verify", 8], counts
    assert counts["draft level", 2] == counts["draft level", 8], counts


@pytest.mark.parametrize("isa", ISAS)
def test_the_scratch_layout_is_computed_once_per_forward(isa, monkeypatch):
    """Every attention layer of a forward has the same tree rows and block tables: the scratch
    layout is computed by the first layer's call and reused by the next (another layer's
    cache), whose rows still equal that layer's own computation; a new plan computes anew."""
    import vllm_subspec.step.tree_attention as ta
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    ops, dtype = _ops(), torch.float32 if isa != "amx" else torch.bfloat16
    isa_dtype(isa, dtype)
    heads, kv_heads, d = 4, 2, 64
    g = torch.Generator().manual_seed(7)
    table = torch.randperm(6, generator=g)[:3].view(1, 3).to(torch.int32)
    layers = []
    for _ in range(2):  # two layers' caches, same shape, different K/V
        kv = torch.zeros(6, kv_heads, BS, 2 * d, dtype=dtype)
        logical = torch.arange(3 * BS)
        write(ops, kv, torch.randn(3 * BS, kv_heads, d, generator=g).to(dtype),
              torch.randn(3 * BS, kv_heads, d, generator=g).to(dtype),
              table[0][logical // BS].long() * BS + logical % BS, isa)
        layers.append(kv)
    tree = TreeBatch(TreeShape(3, 3), torch.tensor([0]))
    tree.grow(torch.randn(1, 11, generator=g).log_softmax(-1))
    for _ in range(2):
        tree.grow(torch.randn(1, 3, 11, generator=g).log_softmax(-1))
    rows = TreeRows(0, 0, 70, tree.mask[0])
    query = torch.randn(rows.tree_mask.shape[0], heads, d, generator=g).to(dtype)
    own = [tree_attention_rows(query, cpu_layout(kv, isa), table[0], rows, d ** -0.5)
           for kv in layers]
    assert not torch.equal(own[0], own[1])
    built = []
    monkeypatch.setattr(ta, "cpu_scratch", lambda *a: built.append(1) or cpu_scratch(*a))
    impl = object.__new__(CPUAttentionBackendImpl)
    impl.scale = d ** -0.5
    for plans in ([TreePlan([rows])] * 2, [TreePlan([rows]), TreePlan([rows])]):
        built.clear()
        for kv, plan, expected in zip(layers, plans, own):
            output = torch.zeros(query.shape[0], heads * d, dtype=dtype)
            with tree_plan(plan):
                apply_tree_attention(impl, SimpleNamespace(isa=isa), query, kv,
                                     SimpleNamespace(block_table=table), output)
            assert torch.equal(output.view(-1, heads, d), expected)
        assert len(built) == (1 if plans[0] is plans[1] else 2)


def test_the_triton_layout_takes_device_roots_as_given_integers():
    """`tree_rows_layout` (the CUDA kernel's inputs): a draft pass's roots arrive as 0-d device
    tensors (never read on the host) and a verify's as integers; both land in the per-request
    table's L column, the same table either way (CPU tensors stand in for the device)."""
    pytest.importorskip("triton")
    from vllm_subspec.step.tree_attention_triton import tree_rows_layout

    masks = [torch.ones(3, 4, dtype=torch.bool).tril(1), torch.ones(3, 4, dtype=torch.bool)]
    as_ints = [TreeRows(0, 0, 17, masks[0]), TreeRows(1, 3, 40, masks[1])]
    mixed = [TreeRows(0, 0, torch.tensor(17), masks[0]), TreeRows(1, 3, 40, masks[1])]
    cpu = torch.device("cpu")
    a, b = tree_rows_layout(as_ints, cpu, groups=2), tree_rows_layout(mixed, cpu, groups=2)
    assert a.requests[:, 3].tolist() == [17, 40]
    assert torch.equal(a.requests, b.requests) and torch.equal(a.tiles, b.tiles)
    assert torch.equal(a.masks, b.masks) and a.masks.dtype == torch.int8


@pytest.mark.parametrize("context, rows, expect_splits", [
    (2048, 6, 33), (8192, 6, 33), (32768, 6, 33),  # a draft level of one request
    (2048, 289, 1), (32768, 289, 1),  # a whole 6x48 tree: its 33 tiles fill the SMs alone
    (512, 6, 16),  # a short context: no split under one BLOCK_N tile
])
def test_one_request_launches_at_least_an_h100s_programs_from_2k_context(context, rows,
                                                                          expect_splits):
    """Qwen2.5-7B's attention (28 query heads, 4 KV heads: 7 per KV head), one request, an
    H100's 132 SMs: the CUDA kernel's grid (tiles x KV heads x context splits) reaches the SM
    count for contexts from 2k on, whatever the rows."""
    pytest.importorskip("triton")
    from vllm_subspec.step import tree_attention_triton as tat

    block_q = max(1, tat.BLOCK_M // 7)
    tiles = -(-rows // block_q)
    splits = tat.split_count(tiles, 4, context, 132)
    assert splits == expect_splits
    if context >= 2048:
        assert tiles * 4 * splits >= 132
    assert splits <= tat.MAX_SPLITS and (splits - 1) * tat.BLOCK_N < max(context, tat.BLOCK_N)


def test_the_split_follows_the_context_the_requests_hold_not_the_block_table():
    """vLLM's block table is as wide as max_model_len; where the layout knows the contexts (a
    verify's prefix lengths are host integers) it splits what they hold, so a short context in
    a wide table launches no empty splits. Draft levels (roots on the device) use the table."""
    pytest.importorskip("triton")
    from vllm_subspec.step.tree_attention_triton import BLOCK_N, split_count, tree_rows_layout

    cpu, mask = torch.device("cpu"), torch.ones(1, 1, dtype=torch.bool)
    wide = 32768  # the block table's capacity (max_model_len)
    short = tree_rows_layout([TreeRows(0, 0, 100, mask)], cpu, 7, 4, wide, sms=132)
    long = tree_rows_layout([TreeRows(0, 0, 8000, mask)], cpu, 7, 4, wide, sms=132)
    on_device = tree_rows_layout([TreeRows(0, 0, torch.tensor(100), mask)], cpu, 7, 4, wide,
                                 sms=132)
    assert short.num_splits == -(-101 // BLOCK_N) == 4
    assert long.num_splits == on_device.num_splits == 33
    # no program at all: one split, no division by zero
    assert split_count(0, 4, wide, 132) == 1
