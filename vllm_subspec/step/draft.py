"""Drafting one step: a chain, or a dynamic tree grown one depth per pass.

Both loops run over `DraftPasses`, the draft's forwards through the target's own layers (built
against vLLM's metadata by vllm_hooks/proposer.py; a stub in tests/unit/test_step_session.py),
so nothing here names vLLM. The first pass of every step is over the bonus token alone, at
position p + 1 (p: the last verified position), so draft KV lands only past p.

Tree (width k): the root pass drafts depth 1 from the bonus token; each later pass runs the k
frontier nodes of every request still drafting with an ancestor-only mask (`tree_attention`)
and keeps the global top-k by cumulative sharpened log-probability (`tree.TreeBatch.grow`).
Node i of a request sits in KV slot L + i at position L + depth(i) (L: the root's position).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_subspec.step.tree import TreeBatch, TreeShape, sharpened_log_probs
from vllm_subspec.step.tree_attention import TreeMask, TreePlan, TreeRows


class DraftPasses(Protocol):
    """The draft's forwards over one step's batch of B requests (logits: [rows, V])."""

    batch_size: int
    max_model_len: int
    on_device: bool  # CUDA: a host read is a sync, timings need `synchronize`

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's bonus token at p + 1 -> (logits [B, V], the roots' positions L [B])."""

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Chain pass `index` >= 1: one token per request, one position further -> [B, V]."""

    def level_pass(self, depth: int, width: int, tokens: torch.Tensor,
                   active: list[int] | None) -> torch.Tensor:
        """The k depth-`depth` nodes ([R * k] tokens) of the R requests `active` (batch
        indices; None: all B), in slots L + level(depth), at position L + depth ->
        [R * k, V]. The caller activates the tree mask around it."""

    def synchronize(self) -> None:
        """Wait for the device (no-op on CPU)."""


@dataclass
class ChainDraft:
    tokens: torch.Tensor  # [B, D] argmax drafts
    passes: int


@dataclass
class TreeDraft:
    tree: TreeBatch  # [B] trees, grown to `tree.grown` depths (dead nodes past `reached`)
    reached: list[int]  # [B] depths each request drafted
    pass_rows: list[int]  # rows of each pass after the root's
    root_seconds: float | None  # the root pass's time (None on a device: not synced)

    @property
    def passes(self) -> int:
        return 1 + len(self.pass_rows)


def draft_chain(passes: DraftPasses, next_token_ids: torch.Tensor, depth: int) -> ChainDraft:
    """Argmax drafting (sharpening does not change an argmax), `depth` tokens per request."""
    logits, _ = passes.bonus_pass(next_token_ids)
    drafts = [logits.argmax(dim=-1)]
    for index in range(1, depth):
        drafts.append(passes.chain_pass(index, drafts[-1]).argmax(dim=-1))
    return ChainDraft(torch.stack(drafts, dim=1), depth)


# (log frontier mass [B, d + 1] on the host, depths reached [B]) -> requests drafting on
DraftingNext = Callable[[torch.Tensor, list[int]], list[int]]


def draft_tree(passes: DraftPasses, next_token_ids: torch.Tensor, shape: TreeShape,
               mask: TreeMask, temperature: float, drafting_next: DraftingNext | None = None,
               pad_to_depth: bool = False,
               clock: Callable[[], float] = time.perf_counter) -> TreeDraft:
    """Grow this step's trees to `shape.depth` at most.

    drafting_next: asked every `check_every` depths (4 on a device, where each check reads the
    masses on the host: a sync; else every depth) which requests draft on; those left out stop
    (their later nodes stay dead), and drafting ends when none is left. None: all go on.
    pad_to_depth: when the next level would pass max_model_len, mark the remaining depths dead
    so the tree keeps its full shape (a fixed shape sends k * D tokens to vLLM); else stop."""
    b, k = passes.batch_size, shape.width
    check_every = 4 if passes.on_device else 1
    start = clock()
    logits, root_pos = passes.bonus_pass(next_token_ids)
    roots = root_pos.tolist()  # host copies, read once per step (not per depth)
    tree = TreeBatch(shape, next_token_ids.to(torch.int64))
    tree.grow(sharpened_log_probs(logits, temperature))
    root_seconds = None if passes.on_device else clock() - start
    active = list(range(b))  # the requests still drafting (host)
    rows = None  # their indices on the device; None while all are
    reached = [1] * b  # depths drafted, per request
    pass_rows = []
    for d in range(1, shape.depth):
        if drafting_next is not None and d % check_every == 0:
            going = drafting_next(tree.log_mass[:, : d + 1].cpu(), reached)
            if not going:
                break
            if len(going) < len(active):
                active = going
                rows = torch.tensor(active, device=root_pos.device)
        # stop before any node of the next level would pass max_model_len
        if max(roots[i] for i in active) + (d + 1) * k >= passes.max_model_len:
            if pad_to_depth:
                tree.truncate()
            break
        level = shape.level(d)
        # a chain's ancestor-only mask is the causal one: the backend's result stands
        plan = TreePlan([TreeRows(j, j * k, roots[i], tree.mask[i, level, : level.stop])
                         for j, i in enumerate(active)]) if k > 1 else None
        with mask.active(plan):
            logits = passes.level_pass(d, k, tree.frontier_tokens(rows).reshape(-1),
                                       None if rows is None else active)
        tree.grow(sharpened_log_probs(logits, temperature).view(len(active), k, -1), rows)
        pass_rows.append(len(active) * k)
        for i in active:
            reached[i] = d + 1
    return TreeDraft(tree, reached, pass_rows, root_seconds)
