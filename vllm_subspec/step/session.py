"""One owner for SubSpec's speculative steps; its methods, in the order vLLM's model runner
calls them (through vllm_hooks/):

1. `plan_step`: this step's drafting budget; a plain plan is the whole proposal (the runner
   skips vLLM's draft inputs). `propose`: draft this step's trees (`draft.draft_tree`) and
   keep them pending until they are verified (a chain: `draft.draft_chain`, verified in
   vLLM's layout, nothing kept).
2. `prepare_verify` (next step): consume them; node i keeps slot L + i but moves to position
   L + depth(i), and the ancestor-only rows form the verify's `TreePlan`.
3. `verify_forward`: that plan is active for exactly the target's forward.
   With head starts (`head_start_levels`): `head_start_copies`, the branch KV to copy
   before the verify, then `draft_head_starts`, the next tree's first levels, drafted
   while the verify runs (step/head_start.py).
4. `sample_and_walk`: sample, then match (`verify.sample_then_match`), then move each accepted
   path's KV from slots L + a_j to L + j, and a confirmed head start's nodes to the next
   tree's slots; a step without drafts is sampled by vLLM's own sampler (`sampled_plain`).

The state across those calls (pending and verifying trees, the plan, an auto shape's tuner, the
step clock (`tuner.step_timer.StepTimer`), `StepStats`) lives here only. docs/architecture.md,
"One tree step, in run order".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_subspec.config import SubSpecOptions
from vllm_subspec.step.draft import DraftPasses, TreeDraft, draft_chain, draft_tree
from vllm_subspec.step.head_start import (
    HeadDraft,
    HeadPasses,
    HeadStart,
    choose_head_starts,
    draft_heads,
    hits,
)
from vllm_subspec.step.paged_kv import PagedKv, copy_kv, move_accepted_kv
from vllm_subspec.step.tree import StoredTree, TreeBatch, TreeShape
from vllm_subspec.step.tree_attention import TreePlan, TreeRows, tree_plan
from vllm_subspec.step.tuner.lm_head_choice import COMPARED_REQUESTS, LmHeadLogits
from vllm_subspec.step.tuner.policy import StepPlan
from vllm_subspec.step.tuner.step_timer import StepTimer
from vllm_subspec.step.tuner.tuner import ShapeTuner
from vllm_subspec.step.verify import VerifiedTree, WalkResult, chain_tree, sample_then_match


@dataclass
class StepStats:
    """Running totals over an engine's steps (benchmarks read them through collective_rpc)."""

    draft_steps: int = 0  # proposals (steps that asked the drafter)
    plain_steps: int = 0  # proposals that drafted nothing: plain decoding predicted faster
    first_drafting_step: int = 0  # the proposal (1, 2, ...) that first drafted (0: none yet)
    draft_passes: int = 0  # draft forwards
    # of those, dispatched to a captured CUDA-graph bucket (vLLM's CUDAGraphWrapper replays
    # them; a dispatch, not a counted replay), and the steps with at least one
    draft_graph_passes: int = 0
    draft_graph_steps: int = 0
    # wall time in `propose`; for a chain on a device the host's time (the stream is not waited
    # for: a chain's drafts stay on the device, vLLM consumes them in stream order)
    draft_seconds: float = 0.0
    verified_trees: int = 0  # drafted trees walked by the target
    verify_seconds: float = 0.0  # tree verifies: forward start to the end of the walk
    step_seconds: float = 0.0  # from one proposal's end to the next's, idle gaps left out
    tree_width: int = 0  # the last proposal's: nodes per depth (1: a chain; 0: no draft)
    tree_depth: int = 0  # the last proposal's deepest draft handed to vLLM (0: none)
    head_starts: int = 0  # requests whose next tree's first levels were drafted in a verify
    head_start_hits: int = 0  # of those, the ones the walk confirmed
    head_start_steps: int = 0  # proposals that started from confirmed head starts


@dataclass
class VerifyRequest:
    """A request of the verify batch that has scheduled drafts."""

    index: int  # its row in the batch
    req_id: str
    scheduled: list[int]  # the draft tokens vLLM scheduled for it
    root: int  # L: its computed tokens, the root's (bonus token's) position
    query_start: int  # its first query row in the verify forward
    kv_end: int = 0  # the first position without a KV slot (or max_model_len, if lower)


@dataclass
class PositionWrites:
    """The verify forward's position rewrites, for every request at once (one copy)."""

    rows: np.ndarray  # [W] int64 query rows of the forward
    positions: np.ndarray  # [W] int64 their positions, L + depth


NO_POSITION_WRITES = PositionWrites(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


@dataclass
class KvCopies:
    """K/V copies between logical positions, for every request at once (`paged_kv.copy_kv`)."""

    requests: np.ndarray  # [T] int64 batch rows
    src: np.ndarray  # [T] int64
    dst: np.ndarray  # [T] int64


def kv_copies(copies: list[tuple[int, tuple[np.ndarray, np.ndarray]]]) -> KvCopies:
    """(batch row, (src, dst)) per request -> one `KvCopies`."""
    if not copies:
        empty = np.zeros(0, dtype=np.int64)
        return KvCopies(empty, empty, empty)
    return KvCopies(
        np.concatenate([np.full(len(s), i, dtype=np.int64) for i, (s, _) in copies]),
        np.concatenate([s for _, (s, _) in copies]),
        np.concatenate([d for _, (_, d) in copies]),
    )


def this_rank_decides(decision):
    """One device (or tensor-parallel rank 0): its own decisions are the step's."""
    return decision


class StepSession:
    def __init__(
        self,
        options: SubSpecOptions,
        tuner: ShapeTuner | None = None,
        clock: Callable[[], float] = time.perf_counter,
        share: Callable = this_rank_decides,
    ):
        """share: decision -> the decision every rank takes (tensor parallel: rank 0's,
        broadcast; the tuner's choices rest on this rank's clock, and every rank must draft
        and verify the same shapes)."""
        self.options = options
        self.share = share
        self.shape = TreeShape(options.tree_width, options.tree_depth)
        self.tuner = tuner
        self.clock = clock
        self.timer = StepTimer(tuner)  # the step clock, and the tuner's timings of it
        self.stats = StepStats()
        self.pending: dict[str, StoredTree] = {}  # drafted, not yet verified
        self.verifying: dict[str, VerifiedTree] = {}  # this step's trees
        self._verify_plan: TreePlan | None = None  # this step's verify rows, until the forward
        self._verify_start: float | None = None
        # this step's plan until `propose` drafts it: (its start, its requests, the plan)
        self._plan: tuple[float, list[str], StepPlan] | None = None
        self._prompt_step = False  # the step just run also ran prompt tokens
        # head starts (step/head_start.py): this verify's, what their passes drafted, and the
        # confirmed ones' trees, from the walk to the next proposal
        self._heads: list[HeadStart] = []
        self._head_draft: HeadDraft | None = None
        self.head_trees: dict[str, TreeBatch] = {}
        self._head_start_seconds = 0.0  # this verify's host time in them: not the verify's

    @classmethod
    def from_options(
        cls, options: SubSpecOptions, share: Callable = this_rank_decides
    ) -> StepSession:
        """An auto shape gets a tuner measuring this engine's costs."""
        tuner = (
            ShapeTuner(
                options.widths,
                options.tree_depth,
                options.auto_width,
                options.auto_depth,
                lm_heads=options.draft_lm_heads,
            )
            if options.is_auto and options.is_tree
            else None
        )
        return cls(options, tuner, share=share)

    # ---- 1. plan, then propose ----------------------------------------------------------
    def plan_step(self, req_ids: list[str]) -> StepPlan:
        """This step's drafting budget for the requests `req_ids` (depth 0: plain decoding is
        predicted faster, or, with an auto shape after a step with prompt tokens, drafting
        would delay the next step by more than the tuner allows). A plain
        plan is the step's whole proposal: it is counted here and `propose` is not called; any
        other is drafted by the next `propose`."""
        start = self.clock()
        self._close_step(start, req_ids)
        if self.options.is_tree and self.tuner is not None:
            # after a step with prompt tokens, the batch may be forming (a burst's requests
            # join a step or a few apart): the tuner caps what drafting may delay the next
            # step's prefill by (`ShapeTuner.plan_step`)
            plan = self.share(self.tuner.plan_step(len(req_ids), self._prompt_step))
        else:
            plan = StepPlan(self.shape, adaptive=False, full_depth=True)
        self._plan = None
        if plan.shape.depth == 0:
            self.head_trees = {}
            self.stats.plain_steps += 1
            self.stats.tree_width = self.stats.tree_depth = 0
            self._end_proposal(start, 0, req_ids)
        else:
            self._plan = (start, list(req_ids), plan)
        return plan

    def propose(
        self,
        passes: DraftPasses,
        req_ids: list[str],
        next_token_ids: torch.Tensor,
        num_speculative_tokens: int,
        chain_only: list[bool] | None = None,
    ) -> torch.Tensor | list[list[int]]:
        """This step's drafts for the B requests `req_ids`: [B, D] tokens (chain), [B, k*D]
        (fixed tree shape), or per-request lists (auto shape; any shape with `chain_only`
        requests). Drafts the plan `plan_step` made for these requests (making it first if
        it was not: then a plain plan returns empty lists).

        chain_only: [B] requests a tree is not exact for (`node_constraints.chain_only_reason`):
        they are drafted with the others, and handed to vLLM as their tree's best path, a
        chain that vLLM's per-position rules (a grammar's masks) apply to exactly."""
        planned, self._plan = self._plan, None
        if planned is None or planned[1] != list(req_ids):
            plan = self.plan_step(req_ids)
            if plan.shape.depth == 0:
                return [[] for _ in req_ids]
            planned, self._plan = self._plan, None
        step_start, _, plan = planned
        start = self.clock()  # drafting's own start (vLLM built its inputs after the plan)
        graph_passes = self.stats.draft_graph_passes
        if not self.options.is_tree:
            chain = draft_chain(
                passes, next_token_ids, num_speculative_tokens, self.options.draft_lm_heads[0]
            )
            drafts, num_passes = chain.tokens, chain.passes
            self.stats.tree_width, self.stats.tree_depth = 1, num_speculative_tokens
        else:
            drafts, num_passes = self._draft_trees(
                passes, req_ids, next_token_ids, plan, chain_only or [False] * len(req_ids)
            )
        # no wait for the device here: a tree's host copy (`_keep_pending`) already waited, an
        # auto shape's tuner too, and a chain's drafts are consumed on the stream
        self.stats.draft_graph_steps += self.stats.draft_graph_passes > graph_passes
        self._end_proposal(start, num_passes, req_ids, step_start)
        return drafts

    def _end_proposal(
        self, start: float, num_passes: int, req_ids: list[str], step_start: float | None = None
    ) -> None:
        """start: the proposal's drafting start; step_start: the step's, for its measured
        rate (the plan's time: vLLM's draft inputs between the two are the step's too)."""
        end = self.clock()
        self.stats.step_seconds += self.timer.proposed(
            start, end, num_passes > 0, req_ids, step_start
        )
        self.stats.draft_steps += 1
        if num_passes and not self.stats.first_drafting_step:
            self.stats.first_drafting_step = self.stats.draft_steps
        self.stats.draft_passes += num_passes
        self.stats.draft_seconds += end - start

    def _draft_trees(
        self,
        passes: DraftPasses,
        req_ids: list[str],
        next_token_ids: torch.Tensor,
        plan: StepPlan,
        chain_only: list[bool],
    ):
        tuner, k = self.tuner, plan.shape.width
        self.stats.tree_width = k
        lm_head = plan.lm_head or self.options.draft_lm_heads[0]
        # a compared step keeps its first requests' hidden states until their verify, where
        # both lm_heads rank the target's draws along the accepted paths
        # (`LmHeadChoice.observe_paths`)
        compared = min(COMPARED_REQUESTS, len(req_ids)) if plan.compare_lm_heads else 0
        adaptive = tuner is not None and plan.adaptive and not plan.full_depth
        starts = self._head_trees_for(req_ids, k, chain_only)
        if starts is not None:  # their first levels are drafted: no comparison of heads
            compared = 0
            self.stats.head_start_steps += 1
        start = self.clock()
        draft = draft_tree(
            passes,
            next_token_ids,
            plan.shape,
            self.options.draft_temperature,
            lm_head,
            (lambda log_mass, reached: self.share(tuner.drafting_next(log_mass, k, reached)))
            if adaptive
            else None,
            clock=self.clock,
            keep_hidden=compared,
            # every rank checks at the same depths (tensor parallel)
            blocking_reads=self.share is not this_rank_decides,
            starts=starts,
        )
        if tuner is None:  # a fixed shape: k * D tokens each, unless cut short
            self.stats.tree_depth = max(draft.reached)
            pending = self._keep_pending(req_ids, draft, chain_only)
            if not any(chain_only) and min(draft.reached) == plan.shape.depth:
                return draft.tree.tokens[:, 1:], draft.passes
            return [
                t.tokens[1 : 1 + t.width * d] for t, d in zip(pending, draft.reached)
            ], draft.passes
        log_mass = draft.tree.log_mass[:, : draft.tree.grown + 1].cpu()  # one host read
        passes.synchronize()
        tuner.observe_draft(
            k, len(req_ids), draft.pass_rows, self.clock() - start, draft.root_seconds
        )
        pending = self._keep_pending(req_ids, draft, chain_only, log_mass, lm_head)
        depths = self.share(tuner.verify_depths(log_mass, k, draft.reached))
        self.stats.tree_depth = max(depths)
        return [t.tokens[1 : 1 + t.width * d] for t, d in zip(pending, depths)], draft.passes

    def _head_trees_for(
        self, req_ids: list[str], width: int, chain_only: list[bool]
    ) -> list[TreeBatch] | None:
        """The confirmed head starts' trees, when every request of the step has one of this
        step's width (a batch drafts its levels together) and none is chain-only."""
        trees, self.head_trees = self.head_trees, {}
        starts = [trees.get(r) for r in req_ids]
        if any(t is None or t.shape.width != width for t in starts) or any(chain_only):
            return None
        return starts

    def _keep_pending(
        self,
        req_ids: list[str],
        draft: TreeDraft,
        chain_only: list[bool],
        log_mass: torch.Tensor | None = None,
        head: str | None = None,
    ) -> list[StoredTree]:
        """Keep each request's tree (its best path, for `chain_only` ones) until it is
        verified. log_mass: [B, grown + 1] per-depth log frontier mass on the host, for an
        auto shape's tuner; None for a fixed shape. head: the lm_head that drafted; a compared
        step's trees keep their nodes' hidden states (`draft.node_hidden`, on the device)."""
        tree, hidden = draft.tree, draft.node_hidden
        rows, parents = tree.tokens.tolist(), tree.parents.tolist()  # the one host read
        masses = log_mass.tolist() if log_mass is not None else [[] for _ in req_ids]
        stored = [
            StoredTree(
                rows[i],
                parents[i],
                tree.mask[i],
                tree.shape.width,
                masses[i],
                head,
                hidden[i] if hidden is not None and i < len(hidden) else None,
                draft.reached[i],
            )
            for i in range(len(req_ids))
        ]
        stored = [
            t.best_path(draft.reached[i]) if chain_only[i] else t for i, t in enumerate(stored)
        ]
        self.pending = dict(zip(req_ids, stored))
        return stored

    def _close_step(self, now: float, req_ids: list[str]) -> None:
        """The last step ran from its proposal to this one (`req_ids`'): to the tuner's
        measured rates (`StepTimer.close_step`)."""
        self.timer.close_step(now, req_ids, decode_only=not self._prompt_step)

    # ---- 2. verify inputs ----------------------------------------------------------------
    def prepare_verify(
        self, requests: list[VerifyRequest], prompt_tokens: bool = False
    ) -> PositionWrites:
        """Consume the pending trees of the requests vLLM scheduled drafts for; returns the
        position rewrites of the verify forward (vLLM's chain positions L + i -> L + depth).
        prompt_tokens: the step also runs prompt tokens (a request's prefill or a chunk)."""
        self._prompt_step = prompt_tokens
        drafted, self.pending = self.pending, {}  # a tree is verified at most once
        self.verifying, self._verify_plan, self._plan = {}, None, None  # (a plan is one step's)
        self._heads, self._head_draft, self.head_trees = [], None, {}
        self._head_start_seconds = 0.0
        if not requests:  # a plain step
            return NO_POSITION_WRITES
        rows, starts, counts, widths, roots = [], [], [], [], []
        for r in requests:
            stored = drafted.get(r.req_id)
            if stored is None:  # placeholders of a skipped drafter: a chain, vLLM's layout
                self.verifying[r.req_id] = VerifiedTree(
                    chain_tree(r.scheduled), r.root, r.index, False
                )
                continue
            n = len(r.scheduled)
            starts.append(r.query_start + 1)
            counts.append(n)
            widths.append(stored.width)
            roots.append(r.root)
            if stored.width > 1:  # a chain's mask is causal: the backend's rows stand
                rows.append(TreeRows(r.index, r.query_start, r.root, stored.mask[: n + 1, : n + 1]))
            self.verifying[r.req_id] = VerifiedTree(stored, r.root, r.index, True)
        self._verify_plan = TreePlan(rows) if rows else None
        levels = self.options.head_start_levels
        if levels:
            self._heads = choose_head_starts(
                [
                    (r.req_id, r.index, r.root, drafted[r.req_id], len(r.scheduled), r.kv_end)
                    for r in requests
                    if r.req_id in drafted
                ],
                levels,
            )
        # node i (1..n) of a level-ordered tree of width k sits at depth (i - 1) // k + 1
        counts_np = np.asarray(counts, dtype=np.int64)
        owner = np.repeat(np.arange(len(counts)), counts_np)
        node = (
            np.arange(int(counts_np.sum()))
            - np.repeat(np.cumsum(counts_np) - counts_np, counts_np)
            + 1
        )
        widths_np = np.asarray(widths, dtype=np.int64)[owner]
        return PositionWrites(
            np.asarray(starts, dtype=np.int64)[owner] + node - 1,
            np.asarray(roots, dtype=np.int64)[owner] + (node - 1) // np.maximum(widths_np, 1) + 1,
        )

    # ---- 3. the verify forward -----------------------------------------------------------
    @contextlib.contextmanager
    def verify_forward(self):
        plan, self._verify_plan = self._verify_plan, None  # the plan is one forward's
        drafted = any(v.compact for v in self.verifying.values())  # chains have no plan rows
        self._verify_start = self.clock() if drafted else None
        with tree_plan(plan):
            yield

    def head_start_copies(self) -> KvCopies:
        """Before the verify: each head start's branch KV to its scratch slots."""
        return kv_copies([(h.req_index, h.branch_copy()) for h in self._heads])

    def head_starts_to_draft(self) -> bool:
        return bool(self._heads) and self._head_draft is None

    def draft_head_starts(self, make_passes: Callable[[list[HeadStart]], HeadPasses]) -> None:
        """The head starts' passes (`make_passes`: over these heads' frames), while the verify
        runs; kept until its walk."""
        heads = self._heads
        if not self.head_starts_to_draft():
            return
        start = self.clock()
        head = self.verifying[heads[0].req_id].tree.head or self.options.draft_lm_heads[0]
        self._head_draft = draft_heads(
            make_passes(heads),
            heads,
            self.options.head_start_levels,
            self.options.draft_temperature,
            head,
        )
        self.stats.head_starts += len(heads)
        self._head_start_seconds += self.clock() - start

    # ---- 4. sample, then match; move the accepted paths' KV -----------------------------
    def sampled_plain(self) -> None:
        """A step in which no request had drafts was sampled by vLLM's own sampler (as a
        plain engine draws): nothing to walk, nothing verified."""
        self.verifying, self._verify_start = {}, None

    def sample_and_walk(
        self,
        req_ids: list[str],
        num_draft: list[int],
        logits: torch.Tensor,
        sampling_metadata,
        topk_topp_sampler,
        kv: Callable[[], PagedKv],
        head_starts_done: Callable[[], None] = lambda: None,
        max_rows: int | None = None,
        lm_head_logits: LmHeadLogits | None = None,
    ) -> WalkResult:
        """logits: [sum(num_draft) + B, V] the target's, each request's root row first;
        kv: where the step's KV lives (asked for when a path moves); head_starts_done: waits
        for the head starts' passes (their stream, on CUDA); max_rows: the most rows drawn at
        once (`verify.sample_then_match`); lm_head_logits: the draft's heads, for a compared
        step's ranks."""
        trees = [self.verifying.get(rid) if n else None for rid, n in zip(req_ids, num_draft)]
        walk = sample_then_match(
            trees, num_draft, logits, sampling_metadata, topk_topp_sampler, max_rows
        )
        if walk.moves:  # the next step's prefix is contiguous
            move_accepted_kv(walk.moves, kv())
        self._confirm_head_starts(walk, kv, head_starts_done)
        drafted = [
            (v, path, n, emitted)
            for v, path, n, emitted in zip(trees, walk.paths, num_draft, walk.tokens)
            if v is not None and v.compact
        ]
        self.stats.verified_trees += len(drafted)
        # every request's emitted tokens: its accepted path and the bonus (from the host walk)
        self.timer.emitted(sum(len(p) + 1 for p in walk.paths))
        # the tuner learns from the trees of its shape (a chain-only request's best path is not)
        drafted = [(v, p, n, e) for v, p, n, e in drafted if v.tree.level_log_mass]
        if self.tuner is not None:
            for v, path, n, _ in drafted:
                self.tuner.observe_tree(
                    v.tree.width, v.tree.level_log_mass, len(path), n // v.tree.width
                )
            if lm_head_logits is not None and self.tuner.lm_heads is not None:
                self.tuner.lm_heads.observe_paths(
                    [
                        (v.tree, [0, *path], emitted)
                        for v, path, _, emitted in drafted
                        if v.tree.node_hidden is not None
                    ],
                    max_rows,
                    lm_head_logits,
                )
        if self._verify_start is not None:  # the head starts' time is theirs
            seconds = self.clock() - self._verify_start - self._head_start_seconds
            self.stats.verify_seconds += seconds
            widths = {v.tree.width for v, _, _, _ in drafted}
            if len(widths) == 1:  # one step drafts one width
                self.timer.verified(widths.pop(), sum(num_draft) + len(num_draft), seconds)
        self._verify_start = None
        self.verifying = {}
        return walk

    def _confirm_head_starts(
        self, walk: WalkResult, kv: Callable[[], PagedKv], done: Callable[[], None]
    ) -> None:
        """The head starts the walk confirmed keep their trees for the next proposal, their
        nodes' KV moved to the next tree's slots (after the accepted paths' moves)."""
        heads, draft, self._heads, self._head_draft = self._heads, self._head_draft, [], None
        if not heads or draft is None:
            return
        start = self.clock()
        done()
        self._head_start_seconds += self.clock() - start
        levels = self.options.head_start_levels
        confirmed = hits(heads, draft, levels, walk.paths, walk.tokens)
        if not confirmed:
            return
        copies = kv_copies([(h.req_index, h.next_tree_copy(levels)) for h, _ in confirmed])
        copy_kv(copies.requests, copies.src, copies.dst, kv())
        self.head_trees = {h.req_id: tree for h, tree in confirmed}
        self.stats.head_start_hits += len(confirmed)
