"""Drafting one step: a chain (`draft_chain`) or a dynamic tree grown one depth per pass
(`draft_tree`), over `DraftPasses`, the draft's forwards through the target's own layers (built
against vLLM's metadata by vllm_hooks/draft_passes.py; a stub in
tests/unit/test_step_session.py), so nothing here names vLLM. Either is verified by
sample-then-match (step/verify.py).

Design: docs/shape_tuner.md, "Dynamic trees" and "Frontier reads".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_subspec.step.transfer import to_device
from vllm_subspec.step.tree import TreeBatch, TreeShape, sharpened_log_probs
from vllm_subspec.step.tree_attention import TreePlan, TreeRows, tree_plan


class DraftPasses(Protocol):
    """The draft's forwards over one step's batch of B requests: each returns the hidden
    states of its rows ([rows, H]; on CUDA a graph output the next pass overwrites), which
    `logits` turns into [rows, V] through one of the draft's lm_heads."""

    batch_size: int
    max_model_len: int
    max_rows: int  # the most tokens one forward takes (vLLM's buffers: max_num_batched_tokens)
    on_device: bool  # CUDA: a host read is a sync, timings need `synchronize`

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's bonus token at p + 1 -> (hidden [B, H], the roots' positions L [B])."""

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Chain pass `index` >= 1: one token per request, one position further."""

    def level_pass(
        self, depth: int, width: int, tokens: torch.Tensor, active: list[int] | None
    ) -> torch.Tensor:
        """The k depth-`depth` nodes ([R * k] tokens) of the R requests `active` (batch
        indices; None: all B), in slots L + level(depth), at position L + depth. The caller
        makes the tree plan active around it (`tree_attention.tree_plan`)."""

    def logits(self, hidden: torch.Tensor, lm_head: str | None) -> torch.Tensor:
        """[rows, V] through `lm_head` ("target", "quantized"; None: the draft's only one)."""

    def roots_without_pass(self) -> torch.Tensor:
        """The roots' positions L [B], as `bonus_pass` returns them, without its forward: the
        trees' first levels were drafted already (a head start, step/head_start.py)."""

    def tree_rows(self, row: int, q_start: int, request: int, root, mask: torch.Tensor) -> TreeRows:
        """The attention rows of `request`'s tree nodes in a level pass (`row`: its row in the
        pass; mask: [q_len, m] over the tree's slots L .. L + m - 1): `TreeRows(row, q_start,
        root, mask)` where the tree's slots follow its root."""

    def root_bounds(self, roots: torch.Tensor) -> list[int]:
        """Upper bounds of the roots' positions on the host, known without reading `roots` on a
        device (a sync); exact where reading them is free (CPU)."""

    def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start copying a device tensor to the host without waiting (on a device only)."""

    def synchronize(self) -> None:
        """Wait for the device (no-op on CPU)."""


class HostCopy:
    """A device tensor's copy into pinned host memory, started without waiting; `ready()` asks
    the copy's event, which does not wait either (CUDA)."""

    def __init__(self, tensor: torch.Tensor):
        self.value = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.value.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()


class FrontierReads:
    """The frontier masses `drafting_next` reads, with the depths reached when they were taken.
    On CPU: read at once. On a device, never waited for: each check starts a non-blocking copy
    and a later check reads it once it has landed (until then checks start none), so the
    adaptive stop costs no host sync and acts a check late (drafting more than it needs: a
    draft decision, never an output one)."""

    def __init__(self, passes: DraftPasses, blocking: bool = False):
        """blocking: read at each check, waiting for the device (tensor parallelism: when a
        copy lands is this rank's timing, and every rank must check at the same depths)."""
        self.passes = passes
        self.blocking = blocking
        self.landing: tuple[HostCopy, list[int]] | None = None

    def read(
        self, log_mass: torch.Tensor, reached: list[int]
    ) -> tuple[torch.Tensor, list[int]] | None:
        if not self.passes.on_device or self.blocking:
            return log_mass.cpu(), list(reached)
        seen = None
        if self.landing is not None and self.landing[0].ready():
            seen, self.landing = (self.landing[0].value, self.landing[1]), None
        if self.landing is None:
            self.landing = (self.passes.copy_to_host(log_mass), list(reached))
        return seen


@dataclass
class ChainDraft:
    tokens: torch.Tensor  # [B, D] argmax drafts
    passes: int


@dataclass
class TreeDraft:
    tree: TreeBatch  # [B] trees, grown to `tree.grown` depths (dead nodes past `reached`)
    reached: list[int]  # [B] depths each request drafted
    pass_rows: list[int]  # rows of each level after the root's
    root_seconds: float | None  # the root pass's time (None on a device: not synced)
    level_forwards: int  # forwards over those levels (more than levels where one was split)
    # with `keep_hidden` = n: [min(n, B), nodes, H] the draft's hidden state after each node a
    # pass ran from, of the first n requests (nodes of depth < reached; zeros elsewhere), for
    # the lm_heads' comparison after the verify
    node_hidden: torch.Tensor | None = None

    @property
    def passes(self) -> int:
        return 1 + self.level_forwards


def draft_chain(
    passes: DraftPasses, next_token_ids: torch.Tensor, depth: int, lm_head: str | None = None
) -> ChainDraft:
    """Argmax drafting (sharpening does not change an argmax), `depth` tokens per request."""
    hidden, _ = passes.bonus_pass(next_token_ids)
    drafts = [passes.logits(hidden, lm_head).argmax(dim=-1)]
    for index in range(1, depth):
        hidden = passes.chain_pass(index, drafts[-1])
        drafts.append(passes.logits(hidden, lm_head).argmax(dim=-1))
    return ChainDraft(torch.stack(drafts, dim=1), depth)


# (log frontier mass [B, d + 1] on the host, depths reached [B]) -> requests drafting on
DraftingNext = Callable[[torch.Tensor, list[int]], list[int]]


def draft_tree(
    passes: DraftPasses,
    next_token_ids: torch.Tensor,
    shape: TreeShape,
    temperature: float,
    lm_head: str | None = None,
    drafting_next: DraftingNext | None = None,
    clock: Callable[[], float] = time.perf_counter,
    keep_hidden: int = 0,
    blocking_reads: bool = False,
    starts: list[TreeBatch] | None = None,
) -> TreeDraft:
    """Grow this step's trees to `shape.depth` at most, drafting through `lm_head`.
    drafting_next: which requests draft on (`FrontierReads`: every depth on CPU, every 4 on
    a device, without a sync); None: all go on. keep_hidden: keep the first n requests'
    hidden states after each node a pass ran from (`TreeDraft.node_hidden`); blocking_reads:
    `FrontierReads` waits for each check's copy (tensor parallelism). A request stops before a
    level that would pass max_model_len; `reached` says how deep each got. starts: [B] each
    request's first levels, drafted already (`TreeBatch.resumed`; their nodes' KV in place):
    no bonus pass, drafting goes on below them."""
    b, k = passes.batch_size, shape.width
    check_every = 4 if passes.on_device else 1
    start = clock()
    hidden, root_seconds = None, None
    if starts is not None:
        root_pos = passes.roots_without_pass()
        tree = TreeBatch.resumed(shape, starts)
    else:
        root_hidden, root_pos = passes.bonus_pass(next_token_ids)
        logits = passes.logits(root_hidden, lm_head)
        tree = TreeBatch(shape, next_token_ids.to(torch.int64))
        tree.grow(sharpened_log_probs(logits, temperature))
        if keep_hidden:  # [n, nodes, H]: the root's row now, each level's after its pass
            kept = root_hidden[:keep_hidden]
            hidden = kept.new_zeros(len(kept), tree.tokens.shape[1], kept.shape[-1])
            hidden[:, 0] = kept
        root_seconds = None if passes.on_device else clock() - start
    bounds = passes.root_bounds(root_pos)  # host, without a device read
    # each request's root for its tree rows: exact ints on CPU, 0-d device tensors on a device
    roots = list(root_pos.unbind()) if passes.on_device else bounds
    active = list(range(b))  # the requests still drafting (host)
    rows = None  # their indices on the device; None while all are
    reached = [tree.grown] * b  # depths drafted, per request
    pass_rows, level_forwards = [], 0
    frontier = FrontierReads(passes, blocking_reads)
    for d in range(tree.grown, shape.depth):
        seen = (
            frontier.read(tree.log_mass[:, : d + 1], reached)
            if drafting_next is not None and d % check_every == 0
            else None
        )
        if seen is not None:
            going = set(drafting_next(*seen))  # of the requests at that check's depth
            if not going:
                break
            if not going.issuperset(active):  # in order; any stopped since stays stopped
                active = [i for i in active if i in going]
                if not active:
                    break
                rows = device_index(active, root_pos.device)
        # a request stops before any node of its next level would pass max_model_len
        fits = [i for i in active if bounds[i] + (d + 1) * k < passes.max_model_len]
        if not fits:
            break
        if len(fits) < len(active):
            active = fits
            rows = device_index(active, root_pos.device)
        logits, forwards = _level_logits(passes, tree, d, roots, active, rows, lm_head, hidden)
        tree.grow(sharpened_log_probs(logits, temperature).view(len(active), k, -1), rows)
        pass_rows.append(len(active) * k)
        level_forwards += forwards
        for i in active:
            reached[i] = d + 1
    return TreeDraft(tree, reached, pass_rows, root_seconds, level_forwards, hidden)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, copied from pinned host memory without waiting
    on CUDA (a plain `torch.tensor(values, device=...)` waits for the stream: a host sync)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def _level_logits(
    passes: DraftPasses,
    tree: TreeBatch,
    d: int,
    roots: list,
    active: list[int],
    rows: torch.Tensor | None,
    lm_head: str | None,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """The draft's logits at the k depth-d nodes of the `active` requests ([R * k, V]) and
    the forwards that took: one, or one per group of requests when R * k rows would not fit
    one forward (max_num_seqs x k can exceed vLLM's max_num_batched_tokens). hidden:
    `draft_tree`'s kept hidden states, filled in at this level."""
    k, level = tree.shape.width, tree.shape.level(d)
    per_pass = max(1, passes.max_rows // k)
    groups = (
        [active]
        if len(active) <= per_pass
        else [active[g : g + per_pass] for g in range(0, len(active), per_pass)]
    )
    logits = []
    for group in groups:
        if len(groups) == 1:  # the active requests as they are (rows None: all of them)
            group_rows, subset = rows, None if rows is None else group
        else:
            group_rows, subset = device_index(group, tree.tokens.device), group
        # a chain's ancestor-only mask is the causal one: the backend's result stands
        plan = (
            TreePlan(
                [
                    passes.tree_rows(j, j * k, i, roots[i], tree.mask[i, level, : level.stop])
                    for j, i in enumerate(group)
                ]
            )
            if k > 1
            else None
        )
        with tree_plan(plan):
            out = passes.level_pass(d, k, tree.frontier_tokens(group_rows).reshape(-1), subset)
        logits.append(passes.logits(out, lm_head))
        kept = 0 if hidden is None else sum(i < len(hidden) for i in group)  # group: in order
        if kept:  # [R, k, H]: rows are the requests' level nodes
            h = out.view(len(group), k, -1)[:kept]
            if group_rows is None:  # group: every request
                hidden[:, level] = h
            else:
                hidden[group_rows[:kept], level] = h
    return (logits[0] if len(logits) == 1 else torch.cat(logits)), len(groups)
