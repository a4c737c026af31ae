"""Head starts (step/head_start.py), on synthetic trees and the bigram stubs of
test_step_session.py: which leaf is extended, the slots every pass reads and writes, the walk's
check, resuming a tree from its first levels, and the session's serial schedule over many
steps (emitted tokens equal the target's greedy decoding; confirmed head starts skip the
next step's first passes; their KV lands in the next tree's slots)."""

from __future__ import annotations

import pytest
import torch
from test_step_session import (
    BS,
    DRAFT,
    StubPasses,
    greedy_sampling,
    kv_cache,
    next_token_table,
    target_greedy,
)

from vllm_subspec.config import SubSpecConfigError, SubSpecOptions
from vllm_subspec.step.draft import draft_tree
from vllm_subspec.step.head_start import HeadDraft, HeadStart, choose_head_starts, hits
from vllm_subspec.step.paged_kv import PagedKv, copy_kv, logical_to_slots
from vllm_subspec.step.session import StepSession, VerifyRequest
from vllm_subspec.step.tree import StoredTree, TreeBatch, TreeShape
from vllm_subspec.step.tree_attention import active_tree_plan

# the target agrees with the stub's draft but after token 6: most head starts are confirmed
TARGET = DRAFT.clone()
TARGET[6] = next_token_table(2)[6]


def stored_tree(shape: TreeShape, seed: int = 0) -> StoredTree:
    """A grown tree of `shape` from the stub draft's table (its levels best first)."""
    passes = StubPasses([10])
    draft = draft_tree(passes, torch.tensor([seed]), shape, 0.5)
    t = draft.tree
    return StoredTree(t.tokens[0].tolist(), t.parents[0].tolist(), t.mask[0], shape.width)


def test_the_leaf_is_the_best_node_of_the_deepest_verified_level():
    shape = TreeShape(3, 4)
    tree = stored_tree(shape)
    for n in (3, 6, 12):  # 1, 2, 4 verified levels of 3
        (head,) = choose_head_starts([("a", 0, 40, tree, n, 10_000)], levels=2)
        depth = n // 3
        assert head.branch[-1] == shape.level(depth).start
        assert len(head.branch) == depth + 1 and head.branch[0] == 0
        for parent, child in zip(head.branch, head.branch[1:]):  # a path through the tree
            assert tree.parents[child] == parent
        assert head.leaf_token == tree.tokens[head.branch[-1]]
        assert head.scratch == 40 + n + 1 and head.next_root == 40 + depth + 1


def test_a_chain_a_partial_level_and_a_request_without_room_get_none():
    tree = stored_tree(TreeShape(2, 3))
    chain = tree.best_path(3)
    n, root = 6, 100
    need = HeadStart("a", 0, root, [0, 1, 3, 5], 0, root + n + 1, 2).slots_needed(3)
    rows = [("chain", 0, root, chain, 3, 10_000), ("short", 1, root, tree, 1, 10_000),
            ("tight", 2, root, tree, n, root + n + 1 + need - 1),
            ("fits", 3, root, tree, n, root + n + 1 + need)]
    assert [h.req_id for h in choose_head_starts(rows, levels=3)] == ["fits"]


def test_every_head_slot_lies_past_the_verify_and_inside_the_reserved_room():
    """The slots a head start reads or writes while the verify writes L .. L + n: the branch's
    copy, the leaf, the head tree's nodes; and the masks of its passes see none of the
    verify's slots (only the prefix, the frame, and the head tree's own)."""
    k, depth, levels = 3, 4, 3
    tree = stored_tree(TreeShape(k, depth))
    root, n = 57, k * depth
    kv_end = root + n + 1 + k * depth  # vLLM: k * D lookahead slots past the verify's
    (head,) = choose_head_starts([("a", 0, root, tree, n, kv_end)], levels)
    src, dst = head.branch_copy()
    assert src.tolist() == [root + a for a in head.branch[:-1]]
    written = set(dst.tolist()) | {head.leaf_slot} | {
        head.node_slot(i) for i in range(1 + (levels - 1) * k)}
    assert min(written) == root + n + 1 and max(written) < kv_end
    assert len(written) == head.slots_needed(levels)  # no slot written twice
    frame = head.frame()
    visible = {root + j for j in range(len(frame)) if frame[j]}
    assert visible == set(dst.tolist()) | {head.leaf_slot}
    rows = head.rows(0, 0, torch.ones(2, 5, dtype=torch.bool), frame)
    seen = {root + j for j in rows.tree_mask.any(0).nonzero().view(-1).tolist()}
    assert not seen & set(range(root, root + n + 1))  # none of the verify's slots
    assert rows.prefix_len == root
    src, dst = head.next_tree_copy(levels)
    assert src.tolist() == [head.node_slot(i) for i in range(1 + (levels - 1) * k)]
    assert dst.tolist() == [head.next_root + i for i in range(1 + (levels - 1) * k)]


def test_the_walk_confirms_only_a_whole_branch_with_the_predicted_bonus():
    head = HeadStart("a", 1, 30, [0, 2, 5], 7, 40, 3)
    trees = TreeBatch(TreeShape(3, 2), torch.tensor([4, 9]))
    draft = HeadDraft(torch.tensor([4, 9]), trees, [2, 2])
    other = HeadStart("b", 0, 10, [0, 1, 4], 7, 20, 3)
    emitted = torch.tensor([[1, 2, 3, 9], [5, 6, 4, -1]], dtype=torch.int32)
    # b (row 0) accepted [1, 4] and drew 3 where 9 was predicted... a (row 1) accepted
    # [2, 5] and drew 4: a hit
    confirmed = hits([other, head], HeadDraft(torch.tensor([9, 4]), trees, [2, 2]), 2,
                     [[1, 4], [2, 5]], emitted)
    assert [h.req_id for h, _ in confirmed] == ["a"]
    assert torch.equal(confirmed[0][1].tokens, trees.tokens[1:2])
    # a shorter walk, another path, or levels not reached: no hit
    assert not hits([head], draft, 2, [[], [2]], emitted)
    assert not hits([head], draft, 2, [[], [1, 5]], emitted)
    assert not hits([head], HeadDraft(torch.tensor([4]), trees, [1]), 2, [[], [2, 5]],
                    emitted)


@pytest.mark.parametrize("levels", [1, 2, 4, 6])
def test_a_tree_resumed_from_its_first_levels_is_the_tree_drafted_at_once(levels):
    """The bigram stub's draft does not depend on its context, so the levels drafted in a
    head start are exactly the ones the next step would draft: resuming from them gives the
    same tree, with the bonus pass and levels - 1 level passes fewer."""
    shape, bonus = TreeShape(3, 5), torch.tensor([4, 11])
    whole = draft_tree(StubPasses([20, 50]), bonus, shape, 0.3)
    first = draft_tree(StubPasses([20, 50]), bonus, TreeShape(3, levels), 0.3)
    passes = StubPasses([20, 50])
    passes.roots_without_pass = lambda: passes.roots
    resumed = draft_tree(passes, bonus, shape, 0.3,
                         starts=[first.tree.row(0), first.tree.row(1)])
    for name in ("tokens", "parents", "scores", "mask", "log_mass"):
        assert torch.equal(getattr(resumed.tree, name), getattr(whole.tree, name)), name
    assert resumed.reached == whole.reached
    assert [c[0] for c in passes.calls] == ["level"] * max(0, shape.depth - levels)


class StubHeadPasses(StubPasses):
    """`HeadPasses` over the bigram stub: records each pass's rows and the slots it writes."""

    def __init__(self, heads: list[HeadStart]):
        super().__init__([h.next_root for h in heads])
        self.heads = heads
        self.frames = [h.frame() for h in heads]
        self.seen: list[tuple[int, set[int]]] = []  # (prefix L, logical positions a row saw)

    def _record(self, rows):
        for r in rows:
            for q in range(r.tree_mask.shape[0]):
                seen = set(range(r.prefix_len)) | {
                    r.prefix_len + j for j in r.tree_mask[q].nonzero().view(-1).tolist()}
                self.seen.append((r.prefix_len, seen))

    def leaf_pass(self, tokens):
        self._record([h.rows(j, j, torch.ones(1, 0, dtype=torch.bool), f)
                      for j, (h, f) in enumerate(zip(self.heads, self.frames))])
        return self._hidden(torch.tensor(tokens))

    def bonus_pass(self, next_token_ids):
        self._record([h.rows(j, j, torch.ones(1, 1, dtype=torch.bool), f)
                      for j, (h, f) in enumerate(zip(self.heads, self.frames))])
        return super().bonus_pass(next_token_ids)

    def level_pass(self, depth, width, tokens, active):
        self._record(active_tree_plan().rows)
        return super().level_pass(depth, width, tokens, active)

    def tree_rows(self, row, q_start, request, root, mask):
        return self.heads[request].rows(row, q_start, mask, self.frames[request])


def run_serial_schedule(options: SubSpecOptions, bonus: list[int], steps: int,
                        roots: list[int]):
    """The runner's order with head starts, serially (as on CPU): plan, propose, prepare the
    verify, copy the branches' KV, the verify forward, the head starts' passes, then
    sample-then-match. Returns per request the emitted tokens, and what the steps saw."""
    session = StepSession.from_options(options)
    req_ids = [f"r{i}" for i in range(len(roots))]
    out = [[] for _ in roots]
    blocks = 32 * len(roots)
    kv_caches, layout = kv_cache(blocks)  # slot s holds s until written
    table = torch.arange(blocks, dtype=torch.int32).flip(0).reshape(len(roots), -1)
    kv = lambda: PagedKv(kv_caches, table, BS)  # noqa: E731
    record = []
    for _ in range(steps):
        passes = StubPasses(roots)
        passes.roots_without_pass = lambda p=passes: p.roots
        session.plan_step(req_ids)
        drafts = session.propose(passes, req_ids, torch.tensor(bonus), options.num_draft_tokens)
        drafts = drafts.tolist() if torch.is_tensor(drafts) else drafts
        requests, q = [], 0
        for i, (rid, d) in enumerate(zip(req_ids, drafts)):
            # vLLM reserves k * D slots past the verify's
            requests.append(VerifyRequest(i, rid, list(d), roots[i], q,
                                          roots[i] + len(d) + 1 + options.num_draft_tokens))
            q += len(d) + 1
        session.prepare_verify(requests)
        copies = session.head_start_copies()
        copy_kv(copies.requests, copies.src, copies.dst, kv())
        with session.verify_forward():
            pass
        heads = list(session._heads)
        made = []
        session.draft_head_starts(lambda hs: made.append(StubHeadPasses(hs)) or made[-1])
        node_tokens = [t for b, d in zip(bonus, drafts) for t in [b, *d]]
        walk = session.sample_and_walk(req_ids, [len(d) for d in drafts],
                                       TARGET[torch.tensor(node_tokens)],
                                       greedy_sampling(len(roots)), None, kv)
        record.append((passes, heads, made, walk, copies))
        for i in range(len(roots)):
            emitted = [t for t in walk.tokens[i].tolist() if t >= 0]
            out[i] += emitted
            roots[i] += len(emitted)
            bonus[i] = emitted[-1]
    return session, out, record, layout, table


@pytest.mark.parametrize("batch", [1, 3])
def test_the_serial_schedule_emits_the_targets_greedy_tokens_and_uses_its_hits(batch):
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4,
                                        "head_start_levels": 2})
    first = [0, 2, 9][:batch]
    session, out, record, layout, table = run_serial_schedule(
        options, list(first), 12, [20 + 40 * i for i in range(batch)])
    for i, b in enumerate(first):
        assert out[i] == target_greedy(b, len(out[i]), TARGET)
    stats = session.stats
    assert stats.head_starts > 0 and 0 < stats.head_start_hits < stats.head_starts
    assert stats.head_start_steps > 0
    rows_checked = 0
    for _, heads, made, _, _ in record:
        # every row of a head pass saw the prefix, its frame and head nodes: no verify slot
        scratch = {h.root: h.scratch for h in heads}
        for hp in made:
            for prefix, seen in hp.seen:
                assert not seen & set(range(prefix, scratch[prefix]))
                assert seen >= set(range(prefix))
                rows_checked += 1
    assert rows_checked > 0
    # a step without its bonus pass followed hits for every request of the step before
    resumed = [i for i, r in enumerate(record) if r[0].calls[0][0] != "bonus"]
    assert len(resumed) == stats.head_start_steps
    for i in resumed:
        _, heads, _, walk, _ = record[i - 1]
        assert len(heads) == batch
        assert all(walk.paths[h.req_index] == h.branch[1:] for h in heads)


def test_a_confirmed_head_starts_kv_lands_in_the_next_trees_slots():
    """With the slot-valued cache: after a hit, the next tree's slots L' + i hold what the
    head start's slots held (its scratch slots: their own numbers, as nothing wrote them), and
    the scratch's branch copy holds the tree slots' values."""
    options = SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": 4,
                                        "head_start_levels": 2})
    session, _, record, layout, table = run_serial_schedule(options, [2], 1, [20])
    (_, heads, made, walk, copies), = record
    (head,) = heads
    src, dst = head.branch_copy()
    keys, _ = layout.gather(logical_to_slots(table[0], torch.from_numpy(dst), BS))
    assert keys[:, 0, 0].tolist() == logical_to_slots(
        table[0], torch.from_numpy(src), BS).float().tolist()
    if session.stats.head_start_hits:
        src, dst = head.next_tree_copy(2)
        keys, _ = layout.gather(logical_to_slots(table[0], torch.from_numpy(dst), BS))
        assert keys[:, 0, 0].tolist() == logical_to_slots(
            table[0], torch.from_numpy(src), BS).float().tolist()
    else:
        pytest.fail("the stub's first step was expected to confirm its head start")


def test_head_start_levels_is_validated_before_the_engine_starts():
    with pytest.raises(SubSpecConfigError, match="needs a tree"):
        SubSpecOptions.from_dict({"tree_width": 1, "tree_depth": 4, "head_start_levels": 2})
    with pytest.raises(SubSpecConfigError, match="KV slots past a verify"):
        SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": 2, "head_start_levels": 2})
    with pytest.raises(SubSpecConfigError, match="head_start_levels must be"):
        SubSpecOptions.from_dict({"head_start_levels": -1})
    assert SubSpecOptions.from_dict({"head_start_levels": 4}).head_start_levels == 4
    assert SubSpecOptions.from_dict({}).head_start_levels == 0


def test_without_head_starts_the_session_copies_and_drafts_nothing_extra():
    options = SubSpecOptions.from_dict({"tree_width": 3, "tree_depth": 4})
    session, out, record, _, _ = run_serial_schedule(options, [0], 4, [20])
    assert out[0] == target_greedy(0, len(out[0]), TARGET)
    assert all(len(copies.src) == 0 and not made for _, _, made, _, copies in record)
    assert session.stats.head_starts == 0
    assert all(r[0].calls[0][0] == "bonus" for r in record)
