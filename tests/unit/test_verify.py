"""The verify side of a step (`StepSession.prepare_verify` .. `sample_and_walk` and the KV moves
after it, through the runner's `SampleMatchVerifier`) on synthetic logits and metadata: no
engine, seconds.

In the style of vLLM's tests/v1/sample/test_rejection_sampler.py: hand-made trees, logits whose
argmax is chosen per node, vLLM's own SamplingMetadata and Sampler (for logprobs).
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from subspec_testing.stub_verify import scheduler_output
from vllm_subspec.config import SubSpecOptions
from vllm_subspec.step.paged_kv import CpuVecLayout, logical_to_slots
from vllm_subspec.step.session import StepSession
from vllm_subspec.step.tree import StoredTree
from vllm_subspec.step.tree_attention import active_tree_plan
from vllm_subspec.step.verify import (PLACEHOLDER, VerifiedTree, chain_tree, draw_target_tokens,
                                      sample_then_match)
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream
from vllm_subspec.vllm_hooks.verifier import SampleMatchVerifier

V = 16
# k = 2, D = 2. Node tokens / parents (root token is never matched):
#        0
#      /   \
#   1:5     2:6
#   /  \      \
# 3:7  4:8    (none)   node 4 is a second child of node 1
TOKENS = [0, 5, 6, 7, 8]
PARENTS = [-1, 0, 0, 1, 1]


def tree(tokens=TOKENS, parents=PARENTS) -> StoredTree:
    n = len(tokens)
    return StoredTree(list(tokens), list(parents), torch.ones(n, n, dtype=torch.bool), width=2)


def logits_for(draws: list[int], margin: float = 4.0) -> torch.Tensor:
    """One row per node whose argmax is `draws[row]`, by `margin` nats-ish."""
    torch.manual_seed(len(draws))
    out = torch.randn(len(draws), V) * 0.1
    out[torch.arange(len(draws)), torch.tensor(draws)] += margin
    return out


def sampling(batch: int, greedy=True, temperature=1.0, generators=None, max_logprobs=None,
             output_token_ids=None, repetition=None, allowed=None) -> SamplingMetadata:
    penalties = repetition is not None
    return SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), temperature),
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators=generators or {}, max_num_logprobs=max_logprobs, no_penalties=not penalties,
        prompt_token_ids=torch.full((batch, 1), V - 1) if penalties else None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.full((batch,), repetition if penalties else 1.0),
        output_token_ids=output_token_ids or [[] for _ in range(batch)],
        allowed_token_ids_mask=allowed, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def session() -> StepSession:
    return StepSession(SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": 2}))


def verifier(runner, kv_caches) -> SampleMatchVerifier:
    """The verifier with what the runner hands it: the KV caches, the head-start stream and
    the draft's lm_head logits."""
    return SampleMatchVerifier(
        runner, session(), kv_caches, HeadStartStream(torch.device("cpu")),
        lambda hidden, head: pytest.fail("no lm_head comparison expected"))


def step_with(trees: dict[str, VerifiedTree], kv=None, block_table=None,
              max_num_reqs: int = 8) -> SampleMatchVerifier:
    req_ids = list(trees)
    batch = SimpleNamespace(
        req_ids=req_ids, num_reqs=len(req_ids),
        block_table=[SimpleNamespace(get_device_tensor=lambda n: block_table[:n],
                                     block_size=BS)])
    runner = SimpleNamespace(input_batch=batch, sampler=Sampler(), max_num_reqs=max_num_reqs)
    kv_caches = lambda: pytest.fail("no KV cache given")  # noqa: E731
    if kv is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        impl = object.__new__(CPUAttentionBackendImpl)  # the real class picks the reader
        kv_caches = lambda: [(impl, kv, "vec")]  # noqa: E731
    step = verifier(runner, kv_caches)
    step.session.verifying = dict(trees)
    return step


def verify(step, num_draft, logits, meta):
    return step(SimpleNamespace(num_draft_tokens=num_draft), None, logits, meta)


@pytest.mark.parametrize("draws, path", [
    ([5, 7, 0, 0, 0], [1, 3]),   # 5 -> node 1, 7 -> node 3 (leaf): bonus drawn at node 3
    ([5, 8, 0, 0, 0], [1, 4]),   # the second child of node 1
    ([6, 0, 9, 0, 0], [2]),      # 6 -> node 2; its draw 9 is no child: bonus 9
    ([3, 0, 0, 0, 0], []),       # mismatch at the root: only the root's draw is emitted
])
def test_greedy_walk_emits_the_targets_draws(draws, path):
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    out = verify(step, [4], logits_for(draws), sampling(1)).sampled_token_ids
    nodes = [0] + path
    emitted = [draws[n] for n in nodes]
    assert out[0, : len(emitted)].tolist() == emitted
    assert (out[0, len(emitted):] == PLACEHOLDER).all()
    assert step.session.verifying == {}  # the step's trees are released after the walk


def test_duplicate_sibling_tokens_follow_the_first_node():
    t = tree(tokens=[0, 5, 5, 7, 9], parents=[-1, 0, 0, 1, 2])  # nodes 1 and 2 both say 5
    step = step_with({"a": VerifiedTree(t, 10, 0, compact=False)})
    # node 1 draws 7 (its child 3), node 2 would draw 9 (its child 4): the walk takes node 1
    out = verify(step, [4], logits_for([5, 7, 9, 1, 1]), sampling(1)).sampled_token_ids
    assert out[0, :3].tolist() == [5, 7, 1]


def test_batch_with_a_request_without_drafts():
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False), "b": None})
    logits = torch.cat([logits_for([5, 7, 2, 2, 2]), logits_for([11])])
    out = verify(step, [4, 0], logits, sampling(2)).sampled_token_ids
    assert out[0].tolist() == [5, 7, 2, PLACEHOLDER, PLACEHOLDER]
    assert out[1].tolist() == [11] + [PLACEHOLDER] * 4


def test_seeded_sampling_is_reproducible_and_greedy_rows_stay_argmax():
    logits = torch.randn(5, V)

    def draws(seed):
        step = step_with({"a": VerifiedTree(tree(tokens=[0] * 5), 40, 0, compact=False)})
        gen = torch.Generator().manual_seed(seed)
        meta = sampling(1, greedy=False, temperature=1.0, generators={0: gen})
        return verify(step, [4], logits, meta).sampled_token_ids[0, 0].item()

    samples = {seed: draws(seed) for seed in range(12)}
    assert all(draws(seed) == tok for seed, tok in samples.items())  # same seed, same token
    assert len(set(samples.values())) > 1  # really sampled (T = 1 over 16 tokens)
    # temperature ~0 for a request is greedy, whatever the noise
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    meta = sampling(1, greedy=False, temperature=0.0, generators={})
    out = verify(step, [4], logits_for([5, 7, 1, 1, 1]), meta).sampled_token_ids
    assert out[0, :3].tolist() == [5, 7, 1]


def test_repetition_penalty_sees_each_nodes_own_path():
    # Token 7 leads 9 by a little at every node but the root. At node 1 (path [5]) 7 is not in
    # the history and is drawn; at node 3 (path [5, 7]) it is, and the runner-up 9 wins.
    logits = logits_for([5, 7, 7, 7, 7], margin=1.0)
    logits[:, 9] = logits[:, 7] - 0.2
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    out = verify(step, [4], logits, sampling(1, repetition=2.0)).sampled_token_ids
    assert out[0, :3].tolist() == [5, 7, 9]
    # the same logits without penalties would draw 7 at node 3
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    assert verify(step, [4], logits, sampling(1)).sampled_token_ids[0, :3].tolist() == [5, 7, 7]
    # the request's earlier output counts too: with 5 already generated, the root draws 6
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    logits = logits_for([5, 0, 0, 0, 0], margin=1.0)
    logits[0, 6] = logits[0, 5] - 0.2
    meta = sampling(1, repetition=2.0, output_token_ids=[[5]])
    assert verify(step, [4], logits, meta).sampled_token_ids[0, 0].item() == 6


def test_allowed_token_ids_restrict_every_node():
    allowed_mask = torch.ones(1, V, dtype=torch.bool)  # True = masked out (vLLM's convention)
    allowed_mask[0, [6, 9]] = False
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    logits = logits_for([5, 7, 0, 0, 0])
    logits[:, 6] += 2.0  # the best allowed token at the root
    logits[:, 9] += 1.0
    out = verify(step, [4], logits, sampling(1, allowed=allowed_mask)).sampled_token_ids
    assert out[0, 0].item() == 6  # 5 is not allowed
    assert set(out[0][out[0] >= 0].tolist()) <= {6, 9}


def test_logprob_rows_are_the_targets_where_each_token_was_drawn():
    step = step_with({"a": VerifiedTree(tree(), 40, 0, compact=False)})
    logits = logits_for([5, 7, 0, 0, 0])
    result = verify(step, [4], logits, sampling(1, max_logprobs=2))
    lp = result.logprobs_tensors
    emitted = result.sampled_token_ids[0, :3].tolist()
    assert emitted == [5, 7, 0]
    ref = logits.log_softmax(-1)
    for j, node in enumerate([0, 1, 3]):  # emitted token j was drawn at these nodes
        assert lp.logprob_token_ids[j, 0].item() == emitted[j]
        assert lp.logprobs[j, 0].item() == pytest.approx(ref[node, emitted[j]].item(), abs=1e-5)
        assert lp.selected_token_ranks[j].item() == 1


# ---- a verify's fp32 work in chunks of max_num_seqs rows ------------------------------------
MIXED = ["greedy", "seeded", "greedy", "seeded", "seeded"]


def mixed_batch(max_num_reqs: int, max_logprobs=None):
    """Five requests (greedy and seeded sampling, temperature 1, top-k 12, a repetition
    penalty, one with a banned word) verifying trees of 5 nodes or none; returns the step and
    the tensors of one call."""
    torch.manual_seed(3)
    trees = {f"r{i}": VerifiedTree(tree(), 40, i, compact=False) if i != 2 else None
             for i in range(len(MIXED))}
    num_draft = [4 if t is not None else 2 for t in trees.values()]
    logits = torch.randn(sum(num_draft) + len(num_draft), V)
    meta = sampling(len(MIXED), greedy=False, max_logprobs=max_logprobs, repetition=1.3,
                    generators={i: torch.Generator().manual_seed(i)
                                for i, kind in enumerate(MIXED) if kind == "seeded"})
    meta.temperature[[i for i, kind in enumerate(MIXED) if kind == "greedy"]] = 0.0
    meta.top_k = torch.full((len(MIXED),), 12)
    meta.bad_words_token_ids = {3: [[5, 7]]}
    step = step_with(trees, max_num_reqs=max_num_reqs)
    return step, num_draft, logits, meta


@pytest.mark.parametrize("max_num_reqs", [1, 3, 7, 64])
def test_chunked_draws_equal_one_pass(max_num_reqs):
    """Drawing max_num_seqs rows at a time (chunks that split trees, too) changes no token,
    no logprob, no generator state: every row's draw reads its own row (seeded rows their own
    generator states)."""
    results = []
    for chunk in (max_num_reqs, 10_000):
        step, num_draft, logits, meta = mixed_batch(chunk, max_logprobs=3)
        out = verify(step, num_draft, logits, meta)
        states = [g.get_state() for g in meta.generators.values()]
        results.append((out, states))
    (chunked, chunked_states), (whole, whole_states) = results
    assert torch.equal(chunked.sampled_token_ids, whole.sampled_token_ids)
    for a, b in zip(chunked.logprobs_tensors[:3], whole.logprobs_tensors[:3]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(chunked_states, whole_states))
    # sampled for real: the seeded rows did not all draw their argmax
    emitted = whole.sampled_token_ids
    assert (emitted[[1, 3, 4], 0] != logits[[5, 15, 20]].argmax(-1)).any()


def test_chunks_bound_the_verifys_fp32_temporaries():
    """The fp32 copies of a verify over whole trees hold one chunk of rows, not the verify's
    every row: with 8 requests of 33 nodes each and a 50k vocabulary (sampled, top-k, a
    repetition penalty), the peak of live tensors the walk makes is above one fp32 copy of all
    the rows in one pass, and a fraction of it drawn 8 rows at a time (the penalties' step-level
    counts, one int64 row of V + 1 per request as vLLM's plain step makes them, included)."""
    from subspec_testing.live_bytes import LiveBytes

    batch, nodes, vocab = 8, 33, 50_000
    parents = [-1] + list(range(nodes - 1))  # chains: 33 nodes each
    trees = [VerifiedTree(StoredTree([0] * nodes, parents, torch.ones(nodes, nodes,
                                                                       dtype=torch.bool)),
                          40, i, compact=False) for i in range(batch)]
    logits = torch.randn(batch * nodes, vocab, dtype=torch.bfloat16)
    whole_fp32 = logits.numel() * 4
    peaks = {}
    for max_rows in (None, batch):
        meta = sampling(batch, greedy=False, repetition=1.2)
        meta.top_k = torch.full((batch,), 50)
        with torch.inference_mode(), LiveBytes() as mode:
            sample_then_match(trees, [nodes - 1] * batch, logits, meta, Sampler().topk_topp_sampler,
                              max_rows)
        peaks[max_rows] = mode.peak
    assert peaks[None] > whole_fp32  # one pass: at least one fp32 copy of every row
    per_request_counts = batch * (vocab + 1) * 8
    # 8 rows: a few fp32 and int64 copies of 8 rows, and the requests' output-token counts
    assert peaks[batch] < 4 * (8 * vocab * 8) + per_request_counts < whole_fp32 / 3


def test_greedy_draws_need_no_fp32_copy():
    """All-greedy verify: the argmax of the logits' own dtype (the same index as plain's fp32
    argmax, first of equal values), with nothing the size of the logits allocated."""
    from subspec_testing.live_bytes import LiveBytes

    logits = torch.randn(40, 5000).to(torch.bfloat16)
    logits[3, [7, 9]] = 50.0  # a tie: the first index, as plain's fp32 argmax
    t = VerifiedTree(StoredTree([0] * 40, [-1] + list(range(39)),
                                torch.ones(40, 40, dtype=torch.bool)), 40, 0, compact=False)
    with torch.inference_mode(), LiveBytes() as mode:
        walk = sample_then_match([t], [39], logits, sampling(1), None)
    assert walk.tokens[0, 0].item() == logits[0].float().argmax().item()
    assert mode.peak < logits.numel()  # bytes: less than half the bf16 logits
    draws = draw_target_tokens(logits, torch.zeros(40, dtype=torch.int64), {}, sampling(1),
                               None)
    assert torch.equal(draws, logits.float().argmax(-1)) and draws[3].item() == 7


# ---- compaction right after the walk ------------------------------------------------------
BS, KV_HEADS, D = 16, 2, 64


@pytest.fixture
def cache():
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    kv = torch.zeros(6, KV_HEADS, BS, 2 * D, dtype=torch.bfloat16)
    block_table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)
    n = 60
    keys = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    values = torch.randn(n, KV_HEADS, D, dtype=torch.bfloat16)
    slots = logical_to_slots(block_table[0], torch.arange(n), BS)
    kc, vc = kv.view(6, KV_HEADS, 2 * BS, D).chunk(2, dim=2)  # the CPU backend's own writer
    ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, "vec16", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    return kv, block_table, keys, values


def read(kv, block_table, n=60):
    return CpuVecLayout(kv).gather(logical_to_slots(block_table[0], torch.arange(n), BS))


@pytest.mark.parametrize("draws, path", [
    ([6, 0, 0, 0, 0], [2]),       # node 2 at L+2 -> L+1
    ([5, 8, 0, 0, 0], [1, 4]),    # L+4 -> L+2 (node 1 already in place)
    ([5, 7, 0, 0, 0], [1, 3]),    # L+3 -> L+2
])
def test_accepted_path_kv_moves_into_place_right_after_the_walk(cache, draws, path):
    kv, block_table, keys, values = cache
    root = 13  # the tree spans a block boundary (slots 13..17)
    step = step_with({"a": VerifiedTree(tree(), root, 0, compact=True)}, kv, block_table)
    verify(step, [4], logits_for(draws), sampling(1))
    k, v = read(kv, block_table)
    expect = list(range(60))
    for j, node in enumerate(path, start=1):
        expect[root + j] = root + node
    assert torch.equal(k, keys[expect]) and torch.equal(v, values[expect])


def test_overlapping_moves_read_every_source_first(cache):
    kv, block_table, keys, values = cache
    # a deeper chain-like path 2 -> 3 -> 4: sources L+2..L+4, destinations L+1..L+3 overlap
    t = tree(tokens=[0, 1, 5, 7, 8], parents=[-1, 0, 0, 2, 3])
    root = 14
    step = step_with({"a": VerifiedTree(t, root, 0, compact=True)}, kv, block_table)
    verify(step, [4], logits_for([5, 0, 7, 8, 3]), sampling(1))
    k, _ = read(kv, block_table)
    expect = list(range(60))
    expect[root + 1: root + 4] = [root + 2, root + 3, root + 4]
    assert torch.equal(k, keys[expect])


def test_chains_and_rejected_trees_move_nothing(cache):
    kv, block_table, keys, _ = cache
    step = step_with({"a": VerifiedTree(chain_tree([5, 7, 8, 1]), 13, 0, compact=False)},
                     kv, block_table)
    step.kv_caches = lambda: pytest.fail("no KV move expected")  # noqa: E731
    out = verify(step, [4], logits_for([5, 7, 8, 3, 3]), sampling(1)).sampled_token_ids
    assert out[0, :4].tolist() == [5, 7, 8, 3]  # a chain walk: accepted 3, bonus 3


# ---- verify inputs ------------------------------------------------------------------------
def runner_for_prepare(num_computed, drafts_per_req):
    import numpy as np

    req_ids = list(drafts_per_req)
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts_per_req.values()])
    batch = SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids),
                            num_computed_tokens_cpu=np.array(num_computed))
    positions = torch.tensor([c + i for c, d in zip(num_computed, drafts_per_req.values())
                              for i in range(len(d) + 1)])
    return SimpleNamespace(input_batch=batch, positions=positions,
                           query_start_loc=SimpleNamespace(np=starts))


def verifier_for_prepare(runner) -> SampleMatchVerifier:
    return verifier(runner, lambda: pytest.fail("no KV move expected"))


def test_prepare_verify_tells_the_session_whether_the_step_runs_prompt_tokens():
    """Prompt tokens (a request's prefill, or a chunk) in a step: more scheduled tokens than
    one a request plus its drafts; the session plans the next step plain on them."""
    drafts = {"a": [5, 6, 7, 8]}
    for prompts, expected in (({}, False), ({"c": 1}, False), ({"c": 37}, True)):
        runner = runner_for_prepare([40], drafts)
        step = verifier_for_prepare(runner)
        step.prepare_verify(scheduler_output(drafts, prompts))
        assert step.session._prompt_step is expected, prompts
        step.prepare_verify(scheduler_output({}, {"a": 1, **prompts}))  # a plain step
        assert step.session._prompt_step is expected, prompts


def test_prepare_verify_rewrites_positions_and_consumes_each_tree_once():
    drafts = {"a": [5, 6, 7, 8], "b": [0, 0, 0, 0]}
    runner = runner_for_prepare([40, 90], drafts)
    step = verifier_for_prepare(runner)
    step.session.pending = {"a": tree()}  # "b" has no pending tree: vLLM's placeholder drafts
    sched = scheduler_output(drafts)
    step.prepare_verify(sched)
    # tree "a": node i at position L + depth(i); chain "b" keeps vLLM's positions
    assert runner.positions[:5].tolist() == [40, 41, 41, 42, 42]
    assert runner.positions[5:].tolist() == [90, 91, 92, 93, 94]
    verifying = step.session.verifying
    assert verifying["a"].compact and verifying["a"].root == 40
    assert not verifying["b"].compact and verifying["b"].tree.parents == [-1, 0, 1, 2, 3]
    assert [r.req_index for r in step.session._verify_plan.rows] == [0]
    with step.verify_forward():
        assert active_tree_plan() is not None and active_tree_plan().rows[0].prefix_len == 40
    assert active_tree_plan() is None and step.session._verify_plan is None  # one forward
    # the same scheduled drafts again (no new propose): no stale tree is reused
    runner = runner_for_prepare([40, 90], drafts)
    step.runner = runner
    step.prepare_verify(sched)
    assert not step.session.verifying["a"].compact and step.session._verify_plan is None
    assert runner.positions[:5].tolist() == [40, 41, 42, 43, 44]


def test_a_drafted_chain_verifies_with_the_backends_causal_rows():
    """A width-1 tree (the auto shape's chain) has the causal mask: no tree-attention rows are
    recomputed, the chain is still walked as a drafted tree, and its verify is still timed."""
    drafts = {"a": [5, 6, 7]}
    runner = runner_for_prepare([40], drafts)
    step = verifier_for_prepare(runner)
    chain = chain_tree(drafts["a"])
    step.session.pending = {"a": StoredTree(chain.tokens, chain.parents, chain.mask, 1)}
    step.prepare_verify(scheduler_output(drafts))
    assert step.session._verify_plan is None and step.session.verifying["a"].compact
    assert runner.positions.tolist() == [40, 41, 42, 43]
    with step.verify_forward():
        assert active_tree_plan() is None and step.session._verify_start is not None


def sampler_on(path: str) -> Sampler:
    """vLLM's Sampler drawing as on the CPU backend (`forward_cpu`: one randint per step from
    a seeded generator) or as on CUDA with per-request generators (`forward_native`: one
    vocabulary row of exponential noise per step)."""
    sampler = Sampler()
    topk_topp = sampler.topk_topp_sampler
    topk_topp.forward = getattr(topk_topp, f"forward_{path}")
    return sampler


@pytest.mark.parametrize("path", ["cpu", "native"])
@pytest.mark.parametrize("branch, accepted", [
    ("left", 3),    # the draws follow node 1 -> node 3 (a leaf): 3 tokens emitted
    ("right", 2),   # the draws follow node 2, which has no child: 2 tokens emitted
    ("none", 1),    # no child of the root carries the first draw: 1 token emitted
])
def test_seeded_draws_are_plain_decodings_draws(branch, accepted, path):
    # Every node at depth d has the same target distribution, so plain decoding's d-th seeded
    # draw from vLLM's own Sampler is the token the tree must emit at depth d, whichever branch
    # the draft took; afterwards the generator must be where plain's is after as many draws.
    torch.manual_seed(7)
    depth_logits = torch.randn(4, V) * 2
    meta = lambda gen: sampling(1, greedy=False, temperature=0.9, generators={0: gen})  # noqa
    for seed in range(6):
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [sampler_on(path).sample(depth_logits[d: d + 1].clone(), meta(plain_gen))[0]
                 .item() for d in range(4)]
        other = [(t + 1) % V for t in plain]  # tokens the walk must not follow
        tokens = {"left": [0, plain[0], other[0], plain[1], other[1]],
                  "right": [0, other[0], plain[0], other[1], other[1]],
                  "none": [0, other[0], other[0], other[1], other[1]]}[branch]
        depths = [0, 1, 1, 2, 2]
        logits = depth_logits[depths]
        gen = torch.Generator().manual_seed(seed)
        step = step_with({"a": VerifiedTree(tree(tokens=tokens), 40, 0, compact=False)})
        step.runner.sampler = sampler_on(path)
        out = verify(step, [4], logits, meta(gen)).sampled_token_ids[0]
        assert out[:accepted].tolist() == plain[:accepted]
        assert (out[accepted:] == PLACEHOLDER).all()
        # the generator advanced by one plain draw per emitted token: the next draw is plain's
        follow = sampler_on(path).sample(depth_logits[accepted: accepted + 1].clone(),
                                         meta(gen))[0]
        assert follow.item() == plain[accepted]


def test_seeded_draws_do_not_depend_on_the_batch_or_the_tree_size():
    # The same seeded request, alone with a 2-node chain and next to another request with the
    # full tree: the tokens it emits are the same (its generator's draws are per depth).
    torch.manual_seed(3)
    rows = torch.randn(5, V)
    chain = VerifiedTree(chain_tree([1]), 40, 0, compact=False)

    def emitted(batch_trees, num_draft, logits, gens):
        step = step_with(batch_trees)
        return verify(step, num_draft, logits, sampling(
            len(num_draft), greedy=False, generators=gens)).sampled_token_ids

    solo = emitted({"a": chain}, [1], rows[:2], {0: torch.Generator().manual_seed(11)})
    pair = emitted({"b": VerifiedTree(tree(), 40, 0, compact=False), "a": chain}, [4, 1],
                   torch.cat([torch.randn(5, V), rows[:2]]),
                   {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(11)})
    assert pair[1, :2].tolist() == solo[0, :2].tolist()


@pytest.mark.parametrize("greedy, logprobs", [(True, None), (False, None), (False, 3)])
def test_a_step_without_drafts_is_drawn_by_vllms_own_sampler(greedy, logprobs):
    """No request had drafts (a step the session planned plain): the verifier hands the logits
    to vLLM's `Sampler`, so the step draws, and reports logprobs, exactly as a plain engine
    does; nothing is walked."""
    logits = torch.randn(3, V)
    step = step_with({"a": None, "b": None, "c": None})
    seen = []
    plain_sampler = Sampler()
    step.runner.sampler = lambda logits, sampling_metadata: seen.append(1) or \
        plain_sampler(logits=logits, sampling_metadata=sampling_metadata)
    step.session.verifying = {"stale": None}

    def meta(seed):
        gens = {} if greedy else {i: torch.Generator().manual_seed(seed + i) for i in range(3)}
        return sampling(3, greedy=greedy, temperature=0.8, generators=gens,
                        max_logprobs=logprobs)

    out = verify(step, [0, 0, 0], logits.clone(), meta(7))
    assert seen == [1] and step.session.verifying == {}
    plain = plain_sampler(logits=logits.clone(), sampling_metadata=meta(7))
    assert torch.equal(out.sampled_token_ids, plain.sampled_token_ids)
    assert out.sampled_token_ids.shape == (3, 1)
    if logprobs is None:
        assert out.logprobs_tensors is None
    else:
        assert torch.equal(out.logprobs_tensors.logprob_token_ids,
                           plain.logprobs_tensors.logprob_token_ids)
