"""Head starts: the next tree's first levels, drafted while the target verifies this one.

For each request whose tree goes to the verify, the leaf f (the best-scored node of its deepest
verified level) is extended: the draft's pass at f predicts the target's bonus token there, c
(its argmax), and the next step's first `levels` levels are drafted below c, as `draft_tree`
drafts a tree. The walk then checks the guess: where it accepted the whole branch to f and the
target drew c there (a hit), the next step starts from those levels (`draft_tree`'s `starts`),
else they are dropped. They are proposals only, verified by the next step's target draws, so no
emitted token depends on them.

KV: the verify overwrites its slots L .. L + n with the target's KV while these passes run (on
a device, on a stream of their own), so they never touch those slots. Before the verify, the
branch's draft KV (the root and f's ancestors) is copied to the first slots past the verify's,
S = L + n + 1 (`HeadStart.branch_copy`); f and the new nodes write their KV after it; each pass
attends to the prefix [0, L) and to those slots only (`HeadStart.frame`). On a hit the new
nodes' KV moves to the next tree's slots L' + i (`HeadStart.next_tree_copy`), after the
accepted path's own move. Every slot lies in the KV vLLM reserves past a verify
(`VllmConfig.num_lookahead_tokens`); a request without room gets no head start.
Design and ordering: docs/gpu.md, "Drafting during the verify's own transfers".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_subspec.step.draft import DraftPasses, draft_tree
from vllm_subspec.step.tree import StoredTree, TreeBatch, TreeShape
from vllm_subspec.step.tree_attention import TreeRows


@dataclass
class HeadStart:
    """One request's head start, from the verify's inputs to its walk."""

    req_id: str
    req_index: int  # its row in the verify batch
    root: int  # L: the verified tree's root position
    branch: list[int]  # node indices from the root to the leaf f: [0, a_1, ..., f]
    leaf_token: int
    scratch: int  # S = L + n + 1: the first slot past the verify's
    width: int  # k: the verified tree's, and the head tree's

    @property
    def leaf_depth(self) -> int:
        return len(self.branch) - 1

    @property
    def next_root(self) -> int:
        """L': the position of the bonus token drawn at f (the next tree's root)."""
        return self.root + self.leaf_depth + 1

    @property
    def frame_len(self) -> int:
        """Slots from L to the head tree's root: the verify's n + 1, the branch and f."""
        return self.scratch + self.leaf_depth + 1 - self.root

    @property
    def leaf_slot(self) -> int:
        """f's KV slot (logical): after the branch's copy."""
        return self.scratch + self.leaf_depth

    def node_slot(self, i: int) -> int:
        """Head tree node i's KV slot (logical; node 0: the predicted bonus token c)."""
        return self.scratch + self.leaf_depth + 1 + i

    def frame(self, device=None) -> torch.Tensor:
        """[frame_len] bool over logical positions L ..: the slots every head pass sees beyond
        the prefix (the branch's copy and f), none of the verify's."""
        seen = torch.zeros(self.frame_len, dtype=torch.bool, device=device)
        seen[self.scratch - self.root :] = True
        return seen

    def rows(self, row: int, q_start: int, mask: torch.Tensor, frame: torch.Tensor) -> TreeRows:
        """The attention rows of head tree nodes whose ancestor-or-self mask over the head
        tree's slots is `mask` [q_len, m]: the prefix [0, L), the frame (`frame()`), then
        `mask`. The leaf's row: an empty mask ([1, 0]; f is the frame's last slot)."""
        return TreeRows(
            row,
            q_start,
            self.root,
            torch.cat([frame.expand(mask.shape[0], -1), mask.to(torch.bool)], 1),
        )

    def slots_needed(self, levels: int) -> int:
        """Slots past the verify's: the branch with f, then the head tree's nodes the passes
        forward (the root c and levels 1 .. levels - 1)."""
        return self.leaf_depth + 2 + (levels - 1) * self.width

    def branch_copy(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) logical positions: the branch's draft KV (root and f's ancestors, whose
        passes ran) from its tree slots to S, S + 1, ...; before the verify."""
        src = self.root + np.asarray(self.branch[:-1], dtype=np.int64)
        return src, self.scratch + np.arange(len(src), dtype=np.int64)

    def next_tree_copy(self, levels: int) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst): on a hit, the head tree's forwarded nodes from the scratch slots to the
        next tree's, L' + i; after the accepted path's KV moved."""
        nodes = np.arange(1 + (levels - 1) * self.width, dtype=np.int64)
        return self.scratch + self.leaf_depth + 1 + nodes, self.next_root + nodes


def choose_head_starts(
    trees: list[tuple[str, int, int, StoredTree, int, int]], levels: int
) -> list[HeadStart]:
    """The requests whose next tree gets a head start, from the verify's trees: (req_id, batch
    row, root L, tree, scheduled nodes n, the first position without a KV slot). A tree of
    width 1 (a chain, a chain-only request's best path) gets none, nor a request without
    room for `levels` levels past its verify's slots."""
    heads = []
    for req_id, index, root, tree, n, kv_end in trees:
        k = tree.width
        if k < 2 or n < k:
            continue
        depth = n // k  # the verified depth: levels are whole, best first
        leaf = TreeShape(k, depth).level(depth).start
        if tree.parents[leaf] < 0:
            continue
        branch = [leaf]
        while branch[-1] > 0:
            branch.append(tree.parents[branch[-1]])
        head = HeadStart(req_id, index, root, branch[::-1], tree.tokens[leaf], root + n + 1, k)
        if head.scratch + head.slots_needed(levels) <= kv_end:
            heads.append(head)
    return heads


@dataclass
class HeadDraft:
    """What the passes drafted for the heads, kept until the walk: the predicted bonus tokens
    c [H] (device) and the trees below them, `levels` deep where `reached` says so."""

    predicted: torch.Tensor
    trees: TreeBatch
    reached: list[int]


def hits(
    heads: list[HeadStart],
    draft: HeadDraft,
    levels: int,
    paths: list[list[int]],
    emitted: torch.Tensor,
) -> list[tuple[HeadStart, TreeBatch]]:
    """The heads the walk confirmed, with their trees: the walk accepted the whole branch to f
    and the target drew c there (paths, emitted: the walk's, by batch row), and the passes
    reached `levels` levels."""
    predicted = draft.predicted.tolist()  # one host read, after the passes have run
    out = []
    for j, head in enumerate(heads):
        path = paths[head.req_index]
        if path != head.branch[1:] or draft.reached[j] < levels:
            continue
        if int(emitted[head.req_index, len(path)]) == predicted[j]:
            out.append((head, draft.trees.row(j)))
    return out


class HeadPasses(DraftPasses, Protocol):
    """`DraftPasses` in a head start's frame (`HeadStart`) over its requests, plus the pass at
    their leaves."""

    def leaf_pass(self, tokens: list[int]) -> torch.Tensor:
        """Each leaf f at position L + depth(f), its KV at S + depth(f) -> hidden [H, .]."""


def draft_heads(
    passes: HeadPasses, heads: list[HeadStart], levels: int, temperature: float, lm_head: str | None
) -> HeadDraft:
    """The passes of a verify's head starts: at each leaf, then `levels` levels below the
    predicted bonus token (the draft's argmax at the leaf)."""
    hidden = passes.leaf_pass([h.leaf_token for h in heads])
    predicted = passes.logits(hidden, lm_head).argmax(dim=-1)
    draft = draft_tree(passes, predicted, TreeShape(heads[0].width, levels), temperature, lm_head)
    return HeadDraft(predicted, draft.tree, draft.reached)
