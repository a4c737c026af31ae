"""One whole SubSpec step through `StepSession`, in run order, with a stub runner: the draft's
passes and the target's logits come from two small synthetic "language models" (next-token
tables), the KV cache is a real CPU-backend cache. No engine, seconds.

The check is the product's promise on a toy: whatever the draft proposes, the tokens a greedy
step emits are the target's own greedy continuation, and the accepted path's KV ends up right
after the root.
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_subspec.config import SubSpecOptions
from vllm_subspec.step.draft import draft_tree
from vllm_subspec.step.tuner.linear_cost import LinearCost
from vllm_subspec.step.tuner.lm_head_choice import COMPARED_REQUESTS, LmHeadComparison
from vllm_subspec.step.paged_kv import CpuVecLayout, PagedKv, logical_to_slots
from vllm_subspec.step.session import StepSession, VerifyRequest
from vllm_subspec.step.tuner.rate_guard import EXPLORE_BUDGET
from vllm_subspec.step.tuner.costs import StepCosts
from vllm_subspec.step.tuner.exploration import EXPLORE_COST
from vllm_subspec.step.tuner.tuner import ShapeTuner
from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tree_attention import TreeRows, active_tree_plan

V = 12
BS, KV_HEADS, D = 16, 2, 32


def next_token_table(seed: int) -> torch.Tensor:
    """[V, V] logits of the next token given the current one (a bigram model)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 3


DRAFT = next_token_table(1)
# the target agrees with the draft on most tokens: trees get accepted partway
TARGET = DRAFT.clone()
TARGET[[3, 7, 10]] = next_token_table(2)[[3, 7, 10]]


class StubPasses:
    """`step.draft.DraftPasses` over the bigram models: a row's "hidden state" is its token,
    and each lm_head is a next-token table (the target's head: DRAFT; the quantized one:
    OTHER_HEAD). Records what each pass was given and which heads were asked."""

    on_device = False

    def __init__(self, roots: list[int], max_model_len: int = 1000, max_rows: int = 1000):
        self.roots = torch.tensor(roots)
        self.batch_size = len(roots)
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self.calls = []
        self.heads_used = set()  # the lm_heads the passes drafted through
        self.ranked_rows = 0  # rows the verify ranked through the heads (one head's count)

    @staticmethod
    def _hidden(tokens):
        return tokens[:, None].float()

    def logits(self, hidden, lm_head):
        self.heads_used.add(lm_head)
        return HEADS[lm_head][hidden[:, 0].long()]

    def lm_head_logits(self, hidden, lm_head):
        """The session's `LmHeadLogits`, for a compared step's ranks."""
        self.ranked_rows += len(hidden) if lm_head == "target" else 0
        return HEADS[lm_head][hidden[:, 0].long()]

    def bonus_pass(self, next_token_ids):
        self.calls.append(("bonus", next_token_ids.tolist(), None))
        return self._hidden(next_token_ids), self.roots

    def root_bounds(self, roots):
        return roots.tolist()

    def chain_pass(self, index, input_ids):
        self.calls.append(("chain", input_ids.tolist(), None))
        return self._hidden(input_ids)

    def tree_rows(self, row, q_start, request, root, mask):
        return TreeRows(row, q_start, root, mask)

    def level_pass(self, depth, width, tokens, active):
        plan = active_tree_plan()
        self.calls.append(("level", tokens.tolist(), active,
                           None if plan is None else [r.prefix_len for r in plan.rows]))
        return self._hidden(tokens)

    def synchronize(self):
        pass


OTHER_HEAD = next_token_table(3)  # the draft's other lm_head: another bigram table
HEADS = {"target": DRAFT, None: DRAFT, "quantized": OTHER_HEAD}


def target_greedy(token: int, n: int, target: torch.Tensor = TARGET) -> list[int]:
    """Plain greedy decoding of the target (a bigram table) from `token`: the next n tokens."""
    out = []
    for _ in range(n):
        token = int(target[token].argmax())
        out.append(token)
    return out


def greedy_sampling(batch: int) -> SamplingMetadata:
    """vLLM's own metadata of a greedy batch with no request features."""
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def kv_cache(num_blocks: int = 8):
    """A CPU-backend (vec16 layout) cache whose slot s holds keys/values equal to s."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    kv = torch.zeros(num_blocks, KV_HEADS, BS, 2 * D)
    layout = CpuVecLayout(kv)
    slots = torch.arange(num_blocks * BS)
    fill = slots.float()[:, None, None].expand(-1, KV_HEADS, D)
    layout.put(slots, fill, fill)
    return [(object.__new__(CPUAttentionBackendImpl), kv, "vec16")], layout


def run_step(session: StepSession, roots: list[int], bonus: list[int], num_spec: int,
             chain_only: list[bool] | None = None):
    """plan_step -> propose -> prepare_verify -> verify_forward -> sample_and_walk -> compact,
    in the runner's order: a plain plan proposes nothing (`SubSpecRunner.propose_draft_token_ids`)
    and a step without drafts is drawn by vLLM's sampler (`SampleMatchVerifier.__call__`:
    `sampled_plain`, walk None)."""
    passes = StubPasses(roots)
    req_ids = [f"r{i}" for i in range(len(roots))]
    if session.plan_step(req_ids).shape.depth == 0:
        drafts = [[] for _ in req_ids]
    else:
        drafts = session.propose(passes, req_ids, torch.tensor(bonus), num_spec, chain_only)
    drafts = drafts.tolist() if torch.is_tensor(drafts) else drafts
    # vLLM schedules the drafts as a chain after each root: query rows root, d_1, d_2, ...
    requests, starts, q = [], [], 0
    for i, (rid, d) in enumerate(zip(req_ids, drafts)):
        if d:
            requests.append(VerifyRequest(i, rid, list(d), roots[i], q))
        starts.append(q)
        q += len(d) + 1
    positions = torch.tensor([r + j for r, d in zip(roots, drafts) for j in range(len(d) + 1)])
    writes = session.prepare_verify(requests)
    positions[torch.from_numpy(writes.rows)] = torch.from_numpy(writes.positions)
    with session.verify_forward():
        plan = active_tree_plan()
    # the target's logits at every node: its next token after the node's own token
    node_tokens = [t for b, d in zip(bonus, drafts) for t in [b, *d]]
    logits = TARGET[torch.tensor(node_tokens)]
    blocks = 4 * max(2, len(roots))  # 4 blocks (64 slots) a request
    kv_caches, layout = kv_cache(blocks)
    table = torch.arange(blocks, dtype=torch.int32).flip(0).reshape(-1, 4)  # out of order
    if not any(drafts):
        session.sampled_plain()
        return SimpleNamespace(passes=passes, drafts=drafts, positions=positions, plan=plan,
                               walk=None, layout=layout, table=table)
    walk = session.sample_and_walk(req_ids, [len(d) for d in drafts], logits,
                                   greedy_sampling(len(roots)), topk_topp_sampler=None,
                                   kv=lambda: PagedKv(kv_caches, table, BS),
                                   lm_head_logits=passes.lm_head_logits)
    return SimpleNamespace(passes=passes, drafts=drafts, positions=positions, plan=plan,
                           walk=walk, layout=layout, table=table)


def emitted(walk, i: int) -> list[int]:
    return [t for t in walk.tokens[i].tolist() if t >= 0]


def assert_kv_compacted(step, i: int, root: int):
    """Slot L + j now holds what slot L + path[j - 1] held (the fill value: its old slot)."""
    path = step.walk.paths[i]
    slots = logical_to_slots(step.table[i], root + torch.arange(1, len(path) + 1), BS)
    was = logical_to_slots(step.table[i], root + torch.tensor(path, dtype=torch.int64), BS)
    keys, values = step.layout.gather(slots)
    assert torch.equal(keys[:, 0, 0], was.float()) and torch.equal(values[:, 0, 0], was.float())


def test_a_fixed_tree_step_emits_the_targets_greedy_tokens_and_compacts_kv():
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4})
    session = StepSession.from_options(options)
    assert session.tuner is None
    roots, bonus = [5, 20], [3, 8]
    step = run_step(session, roots, bonus, options.num_draft_tokens)

    # drafting: the bonus pass, then one pass per depth over every request's 3 frontier nodes,
    # each under the tree mask of both requests (prefix = the root's position)
    kinds = [c[0] for c in step.passes.calls]
    assert kinds == ["bonus", "level", "level", "level"]
    assert all(c[3] == roots and len(c[1]) == 2 * 3 for c in step.passes.calls[1:])
    assert [len(d) for d in step.drafts] == [12, 12]  # k * D tokens each (vLLM's fixed size)
    assert session.stats.draft_steps == 1 and session.stats.draft_passes == 4
    assert (session.stats.tree_width, session.stats.tree_depth) == (3, 4)  # metrics' gauges
    assert session.pending == {}  # consumed by prepare_verify: verified at most once

    # verify: positions are root + depth, and the plan's rows cover both trees
    depths = [0] + [1 + j // 3 for j in range(12)]
    assert step.positions.tolist() == [r + d for r in roots for d in depths]
    assert [r.prefix_len for r in step.plan.rows] == roots
    assert active_tree_plan() is None  # only inside the verify forward

    # sample, then match: the emitted tokens are the target's own greedy decoding
    for i, (root, b) in enumerate(zip(roots, bonus)):
        out = emitted(step.walk, i)
        assert out == target_greedy(b, len(out))
        assert len(out) == len(step.walk.paths[i]) + 1
        assert_kv_compacted(step, i, root)
    assert any(step.walk.paths), "the draft agrees with the target often: something accepted"
    assert session.stats.verified_trees == 2


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.01
        return self.now


# plain steps a fresh auto tuner runs before its first look (the engine's: no verify timed
# yet, at any batch size): its exploration
# allowance (EXPLORE_BUDGET of the time run) must cover EXPLORE_COST plain steps (+1: sums of
# floats)
PLAIN_BEFORE_FIRST_LOOK = round(EXPLORE_COST / EXPLORE_BUDGET) + 1


def plain_measured(tuner: ShapeTuner, batch_size: int) -> ShapeTuner:
    """A tuner that has timed plain steps at this batch size (an auto tuner decodes plainly
    first: its rate is what drafting must beat, its time what pays for exploring) until its
    next step drafts."""
    for _ in range(PLAIN_BEFORE_FIRST_LOOK):
        tuner.observe_step(False, batch_size, batch_size, 1.0)
    return tuner


def test_a_fresh_auto_session_decodes_plainly_first():
    """vLLM decodes plainly (no drafts, no plan) until the session has timed enough plain
    steps: the first for plain's rate, the rest for the allowance that pays the first look."""
    options = SubSpecOptions.from_dict({"tree_width": "auto", "tree_depth": "auto"})
    tuner = ShapeTuner(options.widths, 6, options.auto_width, options.auto_depth)
    session = StepSession(options, tuner, clock=FakeClock())
    roots, bonus = [5, 20], [3, 8]
    for n in range(2 * PLAIN_BEFORE_FIRST_LOOK):
        step = run_step(session, roots, bonus, options.num_draft_tokens)
        if any(step.drafts):
            break
        assert step.drafts == [[], []] and step.plan is None  # vLLM decodes plainly
        assert (tuner.guard.rate(False, 2) is not None) == (n >= 2)  # timed from the 3rd
    # each proposal closes the step before it (the fake clock's steps take the same time)
    assert PLAIN_BEFORE_FIRST_LOOK - 2 <= n <= PLAIN_BEFORE_FIRST_LOOK + 2, n


def test_an_auto_step_feeds_the_tuner_from_the_session_only():
    options = SubSpecOptions.from_dict({"tree_width": "auto", "tree_depth": "auto"})
    tuner = plain_measured(ShapeTuner(options.widths, 6, options.auto_width,
                                      options.auto_depth), 2)
    clock = FakeClock()
    session = StepSession(options, tuner, clock=clock)
    roots, bonus = [5, 20], [3, 8]
    step = run_step(session, roots, bonus, options.num_draft_tokens)

    k = max(options.widths)  # the widest width is explored first
    assert [len(d) % k for d in step.drafts] == [0, 0] and step.plan is not None
    for i, b in enumerate(bonus):
        out = emitted(step.walk, i)
        assert out == target_greedy(b, len(out))
        assert_kv_compacted(step, i, roots[i])
    # the session told the tuner what the draft and the verify cost and what was accepted
    assert tuner.draft_pass[0].known and tuner.verify[k].known
    assert tuner.acceptance[k].steps == 2
    # a second step: the rest-of-step time between the two is observed too
    run_step(session, roots, [step.walk.tokens[0, 0].item(), step.walk.tokens[1, 0].item()],
             options.num_draft_tokens)
    assert tuner.other.known and session.stats.draft_steps == 2
    # the step clock: one step from the first proposal's end to the second's (fake: 10 ms a
    # reading), of which the second's drafting is part
    assert 0 < session.stats.draft_seconds / 2 < session.stats.step_seconds


def test_an_auto_step_keeps_each_requests_level_masses_for_the_tuner():
    options = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": "auto"})
    tuner = plain_measured(ShapeTuner(options.widths, 3, options.auto_width,
                                      options.auto_depth), 2)
    session = StepSession(options, tuner)
    passes = StubPasses([5, 9])
    session.propose(passes, ["a", "b"], torch.tensor([3, 8]), options.num_draft_tokens)
    masses = session.pending["b"].level_log_mass
    assert len(masses) == 4 and masses[0] == 0.0 and all(m <= 0 for m in masses)
    fixed = StepSession.from_options(SubSpecOptions.from_dict({"tree_width": 2,
                                                               "tree_depth": 3}))
    fixed.propose(StubPasses([5, 9]), ["a", "b"], torch.tensor([3, 8]), 6)
    assert fixed.pending["a"].level_log_mass == [] and fixed.pending["a"].width == 2


def test_injected_costs_decide_and_a_plain_step_drafts_nothing():
    """A cost model where drafting never pays: after exploring, the session drafts nothing
    (empty drafts: vLLM runs a plain decoding step) but in one probe step per choice period."""

    class Flat(LinearCost):  # seconds = c whatever the rows; observations ignored
        def __init__(self, c):
            super().__init__()
            self.c = c

        known = True

        def add(self, rows, seconds):
            pass

        def coefficients(self):
            return self.c, 0.0

    options = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": "auto"})
    widths = options.widths

    session_stats = []

    def steps_drafting(pass_s: float, verify_s: float) -> list[bool]:
        costs = StepCosts({w: Flat(pass_s) for w in (0, *widths)},
                          {w: Flat(verify_s) for w in widths}, Flat(0.0))
        session = StepSession(options, ShapeTuner(widths, 4, False, True, costs=costs))
        session_stats.append(session.stats)
        drafted = []
        for _ in range(40):
            step = run_step(session, [5, 20], [3, 8], options.num_draft_tokens)
            drafted.append(any(step.drafts))
            assert (session.stats.tree_width == 0) == (not drafted[-1])
            for i, b in enumerate([3, 8] if step.walk is not None else []):
                assert emitted(step.walk, i) == target_greedy(b, len(emitted(step.walk, i)))
        return drafted

    # draft passes cost 1000x a verify: plain steps but for one probe per choice period (16)
    expensive = steps_drafting(1.0, 1e-3)
    assert not expensive[0] and 0 < expensive.count(True) <= 3, expensive
    assert session_stats[-1].plain_steps == expensive.count(False)
    # the other way round (a GPU with offloading): every step drafts
    assert all(steps_drafting(1e-3, 1.0))


def test_a_chain_step_drafts_argmax_tokens_without_trees():
    options = SubSpecOptions.from_dict({"tree_width": 1, "tree_depth": 4})
    session = StepSession.from_options(options)
    passes = StubPasses([5, 20])
    drafts = session.propose(passes, ["a", "b"], torch.tensor([3, 8]), 4)
    assert [c[0] for c in passes.calls] == ["bonus", "chain", "chain", "chain"]
    for row, b in zip(drafts.tolist(), [3, 8]):
        token, expect = b, []
        for _ in range(4):
            token = int(DRAFT[token].argmax())
            expect.append(token)
        assert row == expect
    assert session.pending == {}  # verified as vLLM scheduled them (chain_tree)
    assert (session.stats.tree_width, session.stats.tree_depth) == (1, 4)


@pytest.mark.parametrize("limit, reached_b", [(30, 3), (27, 2), (20 + 3 + 1, 1)])
def test_a_request_near_max_model_len_stops_alone(limit, reached_b):
    """Roots at 5 and 20, width 3: depth d's nodes need slots up to root + d * 3 < limit. The
    request near the limit stops there; the other drafts on to the full depth, and each hands
    vLLM the nodes it drafted (a fixed shape's k * D only where every request got that deep)."""
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4})
    session = StepSession.from_options(options)
    passes = StubPasses([5, 20], max_model_len=limit)
    drafts = session.propose(passes, ["a", "b"], torch.tensor([3, 8]), 12)
    assert [len(d) for d in drafts] == [12, 3 * reached_b]
    assert 20 + reached_b * 3 < limit <= 20 + (reached_b + 1) * 3
    levels = [c[2] for c in passes.calls if c[0] == "level"]
    assert levels == [None] * (reached_b - 1) + [[0]] * (4 - reached_b)  # b dropped out alone
    assert drafts[0] == session.pending["a"].tokens[1:]
    assert drafts[1] == session.pending["b"].tokens[1: 1 + 3 * reached_b]


def test_a_level_wider_than_one_forward_is_drafted_in_groups():
    """max_num_seqs x width can exceed vLLM's max_num_batched_tokens (the drafter's buffers):
    a level of 5 requests x 3 nodes with room for 7 rows per forward runs as 2 + 2 + 1
    requests, and drafts exactly what one wide pass drafts."""
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 3})
    roots, bonus = [5, 20, 9, 14, 30], torch.tensor([3, 8, 1, 4, 2])
    wide, narrow = StepSession.from_options(options), StepSession.from_options(options)
    one = StubPasses(roots)
    split = StubPasses(roots, max_rows=7)
    assert torch.equal(wide.propose(one, list("abcde"), bonus, 9),
                       narrow.propose(split, list("abcde"), bonus, 9))
    assert [c[2] for c in one.calls if c[0] == "level"] == [None, None]
    assert [c[2] for c in split.calls if c[0] == "level"] == [[0, 1], [2, 3], [4]] * 2
    assert all(len(c[1]) <= 7 for c in split.calls)
    # each group's tree rows are its own: prefix lengths of its requests, in order
    assert [c[3] for c in split.calls if c[0] == "level"][:3] == [[5, 20], [9, 14], [30]]


def test_a_fixed_shape_hands_vllm_its_tensor_when_every_request_is_full_depth():
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4})
    session = StepSession.from_options(options)
    drafts = session.propose(StubPasses([5, 20]), ["a", "b"],
                             torch.tensor([3, 8]), 12)
    assert isinstance(drafts, torch.Tensor) and drafts.shape == (2, 12)


def test_chain_only_requests_get_their_trees_best_path():
    """A request a tree is not exact for (structured outputs) is drafted with the batch and
    handed to vLLM as the chain to its tree's best deepest node, verified as a chain."""
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4})
    session = StepSession.from_options(options)
    step = run_step(session, [5, 20], [3, 8], 12, chain_only=[False, True])
    assert len(step.drafts[0]) == 12 and len(step.drafts[1]) == 4
    assert step.plan is not None and [r.req_index for r in step.plan.rows] == [0]  # b: causal
    assert step.walk.moves == [] or all(m.req_index == 0 for m in step.walk.moves)
    for i, b in enumerate([3, 8]):  # both are the target's greedy tokens
        assert emitted(step.walk, i) == target_greedy(b, len(emitted(step.walk, i)))
    assert step.walk.paths[1] == list(range(1, len(step.walk.paths[1]) + 1))  # a chain prefix


def test_step_seconds_leave_idle_gaps_out():
    """The step clock behind `vllm:subspec_draft_time_share`: from one proposal's end to the
    next's, except across an idle gap (or before the first), where a step counts from its own
    drafting on, so drafting is never more than the step time."""
    options = SubSpecOptions.from_dict({"tree_width": 1, "tree_depth": 2})
    clock = FakeClock()  # 10 ms a reading: each proposal drafts for 10 ms
    session = StepSession(options, clock=clock)
    propose = lambda: session.propose(StubPasses([5]), ["a"],  # noqa: E731
                                      torch.tensor([3]), 2)
    propose()
    assert session.stats.step_seconds == pytest.approx(session.stats.draft_seconds)
    clock.now += 0.5  # a step's verify and the rest of it
    propose()  # (three readings: the plan, drafting's start, its end)
    assert session.stats.step_seconds == pytest.approx(0.01 + 0.5 + 0.03)
    clock.now += 60.0  # the engine waited for requests
    propose()
    assert session.stats.step_seconds == pytest.approx(0.01 + 0.53 + 0.01)
    assert session.stats.draft_seconds == pytest.approx(0.03)


def test_a_compared_step_scores_both_lm_heads_on_every_draw_of_the_accepted_paths():
    """`draft_lm_head: "auto"`: the step drafts with the tuner's head; on a compared step the
    passes keep their rows' hidden states, and at the verify each node of an accepted path a
    pass ran from is one paired observation: the rank of the target's draw after it among each
    head's top tokens there (accepted at width w iff rank < w). Only those nodes go through the
    heads, and only the first COMPARED_REQUESTS requests' trees are scored."""
    options = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": "auto"})
    assert options.draft_lm_heads == ("target", "quantized")
    tuner = ShapeTuner((1, 2), 3, auto_width=False, auto_depth=False,  # always drafts, 2 x 3
                       lm_heads=options.draft_lm_heads)
    tuner.lm_heads.compared = LmHeadComparison(options.draft_lm_heads, (1, 2), decay=1.0)
    session = StepSession(options, tuner)
    n, hits = 0, {h: {1: 0, 2: 0} for h in options.draft_lm_heads}
    batch = COMPARED_REQUESTS + 1  # the last request is drafted, verified, not compared
    for first in range(0, V - batch, batch):  # every token as a root
        bonus = list(range(first, first + batch))
        step = run_step(session, [5 + 15 * (i % 3) for i in range(batch)], bonus,
                        options.num_draft_tokens)
        assert step.passes.heads_used == {"target"}  # the tuner's head drafts
        ranked = n
        n = _ranked_by_both_tables(step.walk, bonus[:COMPARED_REQUESTS], n, hits)
        assert step.passes.ranked_rows == n - ranked  # the accepted paths' nodes, no more
    compared = tuner.lm_heads.compared
    assert compared.n == n > V  # deeper nodes too, not only the roots
    assert compared.hits == hits
    assert hits["target"] != hits["quantized"]  # the two heads were told apart


def _ranked_by_both_tables(walk, bonus, n, hits):
    """The oracle: along each request's emitted tokens, both tables' top 2 at each node's
    token, for the nodes a pass ran from (depth < 3)."""
    for i, b in enumerate(bonus):
        out = emitted(walk, i)
        assert out == target_greedy(b, len(out))
        nodes = [b] + out[:-1]  # the root's token, then the accepted drafts'
        for x, drawn in list(zip(nodes, out))[:3]:  # no pass ran from the depth-3 nodes
            n += 1
            for h, table in (("target", DRAFT), ("quantized", OTHER_HEAD)):
                top = table[x].topk(2).indices.tolist()
                for w in (1, 2):
                    hits[h][w] += drawn in top[:w]
    return n


def test_node_hidden_is_kept_per_node_also_for_requests_that_dropped_out():
    """draft_tree's node_hidden: row r of a level pass is node level(d)[r % k] of the r // k-th
    request drafting; only the first keep_hidden requests keep theirs; a request that stopped
    keeps zeros (no pass ran from its nodes)."""
    passes = StubPasses([5, 20, 40, 60])
    shape = TreeShape(2, 3)
    draft = draft_tree(passes, torch.tensor([1, 4, 7, 9]), shape, 0.2, "target",
                       lambda log_mass, reached: [0, 2, 3], keep_hidden=3)  # request 1 stops
    assert draft.reached == [3, 1, 3, 3]
    tokens, hidden = draft.tree.tokens, draft.node_hidden  # [3, nodes, 1]: the stub's tokens
    assert hidden.shape == (3, 7, 1)
    for i in range(3):
        for node in range(7):
            depth = 0 if node == 0 else (node - 1) // 2 + 1
            ran = depth < draft.reached[i]  # a pass ran from this node
            assert hidden[i, node, 0] == (tokens[i, node] if ran else 0), (i, node)


def test_each_step_reaches_the_tuner_with_its_tokens_and_wall_time():
    """The measured rates' input (`ShapeTuner.observe_step`): at each proposal, the step before
    it, from its own proposal's start: drafted or not, its requests, the tokens its verify
    emitted (a plain step: one a request), its wall time, and whether every request ran one
    token in it (a prompt chunk's step is no plain forward of B rows); nothing across an idle
    gap."""
    options = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": "auto"})
    tuner = plain_measured(ShapeTuner(options.widths, 3, options.auto_width,
                                      options.auto_depth), 2)
    seen = []
    tuner.observe_step = lambda *args, decode_only: seen.append((*args, decode_only))
    clock = FakeClock()
    session = StepSession(options, tuner, clock=clock)
    first = run_step(session, [5, 20], [3, 8], options.num_draft_tokens)
    assert seen == [] and any(first.drafts)  # no step before the first
    start = session.timer.step[0]
    tokens = sum(len(emitted(first.walk, i)) for i in range(2))
    clock.now += 0.5  # the rest of the step
    run_step(session, [5 + tokens, 20], [3, 8], options.num_draft_tokens)
    (drafted, batch, got, seconds, _), = seen
    assert drafted and batch == 2 and got == tokens
    assert seconds == pytest.approx(session.timer.step[0] - start - 0.0, abs=0.011)
    # a plain step (nothing drafted) counts one token a request
    both = frozenset(["r0", "r1"])
    session.timer.step, session.timer.step_tokens = (clock.now, False, both), None
    clock.now += 0.2
    session.prepare_verify([], prompt_tokens=False)
    session._close_step(clock(), ["r0", "r1"])
    assert seen[-1][:3] == (False, 2, 2) and seen[-1][3] == pytest.approx(0.21)
    assert seen[-1][4] is True
    session.timer.step = (clock.now, False, both)
    session.prepare_verify([], prompt_tokens=True)  # a prompt chunk ran in it
    session._close_step(clock(), ["r0", "r1"])
    assert seen[-1][4] is False
    del seen[-1]
    # a request finished: still counted; one joined (its prefill ran in the step): not
    session.timer.step = (clock.now, False, both)
    session._close_step(clock(), ["r1"])
    assert len(seen) == 3
    session.timer.step = (clock.now, False, both)
    session._close_step(clock(), ["r0", "r1", "r2"])
    assert len(seen) == 3
    # after an idle engine nothing is observed
    session.timer.step = (clock.now, False, both)
    clock.now += 60.0
    session._close_step(clock(), ["r0", "r1"])
    assert len(seen) == 3


def test_a_step_after_prompt_tokens_drafts_only_what_its_costs_allow():
    """A burst's requests join a step or a few apart: after a step that ran prompt tokens
    (`prepare_verify(prompt_tokens=True)`), the session asks its tuner with `after_prompt`,
    which caps drafting at what delays the next step's prefill by one plain step: an engine
    that has priced nothing plans plain; one where a pass costs a hundredth of a plain step
    (weights streamed) drafts as deep as the tuner chose; one where a pass costs as much as a
    plain step (a CPU) drafts one depth. A fixed shape drafts as configured."""
    options = SubSpecOptions.from_dict({"tree_width": "auto", "tree_depth": "auto"})

    def session_after_prompt(pass_seconds: float | None) -> tuple[StepSession, list]:
        tuner = plain_measured(ShapeTuner(options.widths, 6, options.auto_width,
                                          options.auto_depth), 2)
        if pass_seconds is not None:
            for rows in (1, 8, 32):  # a draft pass timed at start, flat in rows
                tuner.model.seed_draft_pass(rows, pass_seconds)
            tuner.model.observe_plain_forward(2, 1.0)
        asked = []
        plan_step = tuner.plan_step
        tuner.plan_step = lambda b, after: asked.append((b, after)) or plan_step(b, after)
        session = StepSession(options, tuner, clock=FakeClock())
        session.prepare_verify([], prompt_tokens=True)
        return session, asked

    session, asked = session_after_prompt(None)
    plan = session.plan_step(["r0", "r1"])
    assert asked == [(2, True)] and plan.shape.depth == 0 and session.stats.plain_steps == 1
    session.prepare_verify([], prompt_tokens=False)
    session.plan_step(["r0", "r1"])
    assert asked[-1] == (2, False)
    session, _ = session_after_prompt(0.01)  # 1 plain step: the root and 99 passes
    assert session.plan_step(["r0", "r1"]).shape.depth == 6
    session, _ = session_after_prompt(0.6)  # the root pass and no later one
    assert session.plan_step(["r0", "r1"]).shape.depth == 1
    session, _ = session_after_prompt(1.2)  # the root pass alone is more than a plain step
    assert session.plan_step(["r0", "r1"]).shape.depth == 0
    fixed = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": 3})
    session = StepSession(fixed, None, clock=FakeClock())
    session.prepare_verify([], prompt_tokens=True)
    assert session.plan_step(["r0"]).shape.depth == 3


def test_each_step_is_planned_once_and_a_plain_plan_is_the_whole_proposal():
    """The runner plans every step first (`plan_step`): a plain plan is counted there and
    nothing else runs (no draft inputs, no propose, vLLM's sampler draws); a drafting plan is
    the one the next `propose` drafts, so the tuner plans each step exactly once."""
    options = SubSpecOptions.from_dict({"tree_width": "auto", "tree_depth": "auto"})
    tuner = ShapeTuner(options.widths, 6, options.auto_width, options.auto_depth)
    plans = []
    plan_step = tuner.plan_step
    tuner.plan_step = lambda *a: plans.append(plan_step(*a)) or plans[-1]
    session = StepSession(options, tuner, clock=FakeClock())
    roots, bonus = [5, 20], [3, 8]
    for n in range(1, PLAIN_BEFORE_FIRST_LOOK + 8):
        step = run_step(session, roots, bonus, options.num_draft_tokens)
        assert len(plans) == n  # once a step, drafting or not
        assert session.stats.draft_steps == n
        assert session.stats.plain_steps == sum(p.shape.depth == 0 for p in plans)
        assert any(step.drafts) == (plans[-1].shape.depth > 0)
        assert session.verifying == {} and session._verify_start is None
        if step.walk is not None:
            tokens = [emitted(step.walk, i) for i in range(2)]
            roots = [r + len(t) for r, t in zip(roots, tokens)]
            bonus = [t[-1] for t in tokens]
        # (a plain step's position is vLLM's alone: roots stay within the stub's KV)
    assert plans[0].shape.depth == 0 and plans[1].shape.depth == 0  # plain first
    assert any(p.shape.depth > 0 for p in plans)
    # a propose for other requests than the plan's plans anew (the plan is one step's)
    session.plan_step(["r0", "r1"])
    n = len(plans)
    session.propose(StubPasses([9]), ["x"], torch.tensor([3]), options.num_draft_tokens)
    assert len(plans) == n + 1


def test_tensor_parallel_ranks_take_the_shared_decision():
    """`share` (tensor parallelism: rank 0's decision, broadcast) decides the step: the plan
    the session follows is the one `share` returns, not its own tuner's."""
    from vllm_subspec.step.tuner.policy import StepPlan
    from vllm_subspec.step.tree import TreeShape

    seen = []
    rank0 = StepPlan(TreeShape(4, 3), adaptive=True, full_depth=True)

    def share(decision):
        seen.append(decision)
        return rank0 if isinstance(decision, StepPlan) else decision

    session = StepSession.from_options(SubSpecOptions.from_dict({}), share=share)
    plan = session.plan_step(["a", "b"])
    assert plan is rank0 and len(seen) == 1 and isinstance(seen[0], StepPlan)
    assert session.stats.plain_steps == 0  # this rank's tuner would have waited (plain)
    assert seen[0].shape.depth == 0
