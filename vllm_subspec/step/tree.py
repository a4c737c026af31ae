"""Dynamic draft trees: layout, growth by global top-k, ancestor masks, the stored tree (its
walk: step/verify.py).
A tree of depth D and width k has n = 1 + D*k nodes numbered level by level (root 0: the bonus
token of the last step); node i lives in KV slot L + i of its request and is computed at RoPE
position L + depth(i) (L: the root's position). Depth-D nodes are never forwarded by the draft.

Design: docs/shape_tuner.md, "Dynamic trees".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeShape:
    width: int  # k: nodes kept per depth
    depth: int  # D

    @property
    def num_nodes(self) -> int:
        return 1 + self.depth * self.width

    def depths(self, device=None) -> torch.Tensor:
        """depth of every node, [n] int64 (root 0)."""
        d = torch.arange(self.num_nodes, device=device)
        return torch.where(d == 0, 0, (d - 1) // self.width + 1)

    def level(self, d: int) -> slice:
        """Node indices at depth d >= 1."""
        return slice((d - 1) * self.width + 1, d * self.width + 1)


class TreeBatch:
    """The trees of a batch of requests, grown one depth at a time on the device: tokens
    [B, n], parents [B, n] (root: -1), log-scores [B, n] (fp32 sums of log q along the path),
    the ancestor-or-self mask [B, n, n] and the log frontier mass [B, D + 1] (log of the summed
    path probability of the nodes kept at each depth; the root's 0). docs/shape_tuner.md,
    "Dynamic trees"."""

    def __init__(self, shape: TreeShape, root_tokens: torch.Tensor):
        b, n = root_tokens.shape[0], shape.num_nodes
        dev = root_tokens.device
        self.shape = shape
        self.tokens = torch.zeros(b, n, dtype=torch.int64, device=dev)
        self.tokens[:, 0] = root_tokens
        self.parents = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        self.scores = torch.zeros(b, n, dtype=torch.float32, device=dev)
        self.mask = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
        self.mask[:, 0, 0] = True
        self.log_mass = torch.full((b, shape.depth + 1), -math.inf, device=dev)
        self.log_mass[:, 0] = 0.0
        self.grown = 0  # depths filled so far

    def grow(self, log_q: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Add the next depth from the draft's log-probabilities at the current frontier: log_q
        [R, V] at the root for depth 1, else [R, k, V] at the k frontier nodes of the R requests
        in `rows` (indices, default all B). Keeps the global top-k of score(parent) +
        log q(token | parent) over all k*V candidates. A request left out has stopped: its nodes
        at this depth stay parentless and its mass -inf (never verified)."""
        k = self.shape.width
        d = self.grown + 1
        sel = slice(None) if rows is None else rows
        r, dev = log_q.shape[0], log_q.device
        if d == 1:
            assert log_q.dim() == 2
            cand = log_q.float()
            parent_nodes = torch.zeros(r, 1, dtype=torch.int64, device=dev)
        else:
            frontier = self.shape.level(d - 1)
            cand = (self.scores[sel, frontier].unsqueeze(-1) + log_q.float()).flatten(1)
            parent_nodes = torch.arange(frontier.start, frontier.stop, device=dev).expand(r, -1)
        vocab = log_q.shape[-1]
        top, flat = cand.topk(k, dim=-1)  # sorted: best first
        parent = parent_nodes.gather(1, torch.div(flat, vocab, rounding_mode="floor"))
        level = self.shape.level(d)
        self.tokens[sel, level] = flat % vocab
        self.parents[sel, level] = parent
        self.scores[sel, level] = top
        self.log_mass[sel, d] = torch.logsumexp(top, dim=-1)
        masks = self.mask[sel].gather(1, parent.unsqueeze(-1).expand(-1, -1, self.shape.num_nodes))
        ids = torch.arange(level.start, level.stop, device=dev)
        masks[:, torch.arange(k, device=dev), ids] = True  # a host index would sync
        self.mask[sel, level] = masks
        self.grown = d

    def row(self, i: int) -> TreeBatch:
        """Request i's tree alone (views of this batch's tensors)."""
        one = TreeBatch.__new__(TreeBatch)
        one.shape, one.grown = self.shape, self.grown
        for name in ("tokens", "parents", "scores", "mask", "log_mass"):
            setattr(one, name, getattr(self, name)[i : i + 1])
        return one

    @classmethod
    def resumed(cls, shape: TreeShape, starts: list[TreeBatch]) -> TreeBatch:
        """The trees of `shape` of a batch whose requests' first levels were drafted already:
        request i's are `starts[i]` (one-request trees of the same width, each grown to the
        same depth), of which the first min(that depth, shape.depth) levels are kept."""
        grown = min(starts[0].grown, shape.depth)
        nodes = 1 + grown * shape.width
        tree = cls(shape, torch.cat([s.tokens[:, 0] for s in starts]))
        for name in ("tokens", "parents", "scores"):
            getattr(tree, name)[:, :nodes] = torch.cat(
                [getattr(s, name)[:, :nodes] for s in starts]
            )
        tree.mask[:, :nodes, :nodes] = torch.cat([s.mask[:, :nodes, :nodes] for s in starts])
        tree.log_mass[:, : grown + 1] = torch.cat([s.log_mass[:, : grown + 1] for s in starts])
        tree.grown = grown
        return tree

    def frontier_tokens(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[R, k] tokens at the deepest grown level of the requests in `rows` (default all)."""
        return self.tokens[slice(None) if rows is None else rows, self.shape.level(self.grown)]


def widest_level(logits: torch.Tensor, batch: int, width: int, temperature: float) -> TreeBatch:
    """The largest temporaries a draft pass past its layers makes: a root level from the first
    `batch` rows of `logits` [batch * width, V], then one frontier level over all of them
    (sharpened fp32 log-probabilities, the top-k over width x V candidates per request). Run on
    random logits by the proposer's profiling pass, where vLLM measures peak memory."""
    tree = TreeBatch(
        TreeShape(width, 2), torch.zeros(batch, dtype=torch.int64, device=logits.device)
    )
    tree.grow(sharpened_log_probs(logits[:batch], temperature))
    tree.grow(sharpened_log_probs(logits, temperature).view(batch, width, -1))
    return tree


def sharpened_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T_d): the draft distribution that scores the tree (never verifies)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


@dataclass
class StoredTree:
    """A request's drafted tree, kept until the target has verified it."""

    tokens: list[int]
    parents: list[int]
    mask: torch.Tensor  # [n, n] ancestor-or-self
    width: int = 1  # k: nodes per depth (1 for a chain)
    level_log_mass: list[float] = field(default_factory=list)  # TreeBatch.log_mass, per depth
    head: str | None = None  # the lm_head that drafted it
    # a compared step's: [n, H] the draft's hidden state after each node, for the nodes of
    # depth < hidden_depth (a pass ran from them); `lm_head_choice.LmHeadComparison`
    node_hidden: torch.Tensor | None = None
    hidden_depth: int = 0

    def depths(self) -> list[int]:
        """Each node's depth (root 0); parents precede their children."""
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    def best_path(self, reached: int) -> StoredTree:
        """The chain from the root to the best-scored node at depth `reached` (levels are
        kept best first, so node level(reached).start), as a tree of width 1."""
        node = TreeShape(self.width, reached).level(reached).start if reached else 0
        path = []
        while node > 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        m = len(path)
        return StoredTree(
            [self.tokens[0]] + path[::-1],
            list(range(-1, m)),
            torch.ones(m + 1, m + 1, dtype=torch.bool).tril(),
            1,
        )
