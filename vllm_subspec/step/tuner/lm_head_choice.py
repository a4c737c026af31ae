"""Which of the draft's two lm_heads drafts: the target's own, or the draft's quantized copy.
The head whose logits were timed cheaper at load drafts first (`observe_cost`); acceptance is
compared in pairs on the same target draws (`LmHeadComparison`; the ranks are taken along a
compared step's accepted paths, `LmHeadChoice.observe_paths`), and the shape tuner switches
heads when the other is predicted faster by a margin (`choice.ShapeChoice.best_drafting`).

Design: docs/shape_tuner.md, "The draft's lm_head".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vllm_subspec.step.tree import StoredTree
from vllm_subspec.step.tuner.linear_cost import LinearCost

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

COMPARE_UNTIL = 64  # paired observations (decayed) compared at every drafting step ...
COMPARE_EVERY = 8  # ... then at one drafting step in this many
COMPARED_REQUESTS = 4  # the first requests of a compared step score both heads (memory bound)
HEAD_DECAY = 0.995  # per paired observation (several per step): the last ~200 nodes

# (hidden states [rows, H], lm_head) -> [rows, V]: the draft's logits through that lm_head
LmHeadLogits = Callable[[torch.Tensor, str], torch.Tensor]


class LmHeadComparison:
    """Each lm_head's acceptance at each width, from paired observations: per node of an
    accepted path a pass ran from, the rank of the target's draw among each head's top tokens
    (accepted at width w iff rank < w). A switch is judged on the other head's rate less
    `doubt` standard errors of the paired difference."""

    def __init__(
        self, heads: tuple[str, ...], widths: tuple[int, ...] = (1,), decay: float = HEAD_DECAY
    ):
        self.decay = decay
        self.widths = widths
        self.n = 0.0
        self.hits = {h: {w: 0.0 for w in widths} for h in heads}
        self.discordant = {w: 0.0 for w in widths}  # observations where the heads disagree

    def add(self, ranks: dict[str, int | None]) -> None:
        """One node of an accepted path: the rank of the target's draw after it among each
        head's top tokens (0: its first; None: not among those ranked)."""
        self.n = self.decay * self.n + 1.0
        for w in self.widths:
            right = {h: ranks[h] is not None and ranks[h] < w for h in self.hits}
            for h, hits in self.hits.items():
                hits[w] = self.decay * hits[w] + float(right[h])
            self.discordant[w] = self.decay * self.discordant[w] + float(
                len(set(right.values())) > 1
            )

    def rate(self, head: str, width: int) -> float:
        return (self.hits[head][width] + 1.0) / (self.n + 2.0)  # prior 1/2, worth two roots

    def scale(self, head: str, drafting: str, width: int, doubt: float = 0.0) -> float:
        """P(accepted) with `head` over P(accepted) with `drafting`, per depth, at `width`;
        doubt: `head`'s rate lowered by that many standard errors of the paired difference."""
        error = doubt * (self.discordant[width] + 1.0) ** 0.5 / (self.n + 2.0)
        return max(self.rate(head, width) - error, 0.0) / self.rate(drafting, width)


class LmHeadChoice:
    """The draft's lm_heads, the one drafting (`current`), their logits' costs and their
    paired acceptance."""

    def __init__(self, heads: tuple[str, ...], widths: tuple[int, ...]):
        self.heads = heads
        self.current = heads[0]
        self.compared = LmHeadComparison(heads, widths)
        self.costs = {h: LinearCost() for h in heads}  # seconds of a head's logits by rows
        self.drafting_steps = 0  # steps that drafted: the comparison's schedule
        self.switches = 0  # heads switched to since the start

    def use_costs(self, costs: dict) -> None:
        """Decide with `costs` (lm_head -> a `LinearCost`-like cost) from now on, e.g. a GPU's
        projected costs in a CPU benchmark; call `start_with_cheaper` to start by them."""
        self.costs = dict(costs)

    def observe_cost(self, head: str, rows: int, seconds: float) -> None:
        """The logits of `rows` rows through `head` took `seconds` (timed at load)."""
        self.costs[head].add(rows, seconds)

    def start_with_cheaper(self, rows: int) -> None:
        """Before the first step: the head timed cheaper at `rows` rows drafts (before any
        paired observation the heads are taken to accept alike); untimed: the first."""
        if not all(c.known for c in self.costs.values()):
            self.current = self.heads[0]
            return
        self.current = min(self.heads, key=lambda h: (self.costs[h](rows), self.heads.index(h)))
        logger.info(
            "vllm-subspec: drafting with the %s lm_head first (its logits timed cheapest: %s)",
            self.current,
            ", ".join(f"{h} {1e3 * self.costs[h](rows):.2f} ms" for h in self.heads),
        )

    def compare_this_step(self) -> bool:
        """Called once per drafting step: whether it compares the heads (every step until
        COMPARE_UNTIL observations, then one in COMPARE_EVERY)."""
        self.drafting_steps += 1
        return self.compared.n < COMPARE_UNTIL or self.drafting_steps % COMPARE_EVERY == 0

    def observe_ranks(self, ranks: dict[str, int | None]) -> None:
        self.compared.add(ranks)

    def observe_paths(
        self,
        paths: list[tuple[StoredTree, list[int], torch.Tensor]],
        max_rows: int | None,
        lm_head_logits: LmHeadLogits,
    ) -> None:
        """Score both lm_heads on the same target draws, paired (`LmHeadComparison`): along
        each accepted path (tree, its nodes: the root, then the accepted ones, and the
        target's draws after them), the rank of the target's draw after each node a pass ran
        from among each head's top tokens there. The drafts along the path are the target's
        own tokens, so the draft's hidden states there are the same whichever head drafted;
        only these rows go through the heads (in chunks of max_rows, as the verify draws), not
        every row of every pass."""
        rows, draws = _rows_passes_ran_from(paths)
        if not draws:
            return
        top = max(self.compared.widths)
        chunk = max_rows or len(draws)
        tops: dict[str, list[list[int]]] = {h: [] for h in self.heads}
        for start in range(0, len(draws), chunk):
            for h in self.heads:
                logits = lm_head_logits(rows[start : start + chunk], h)
                tops[h].extend(logits.topk(top, dim=-1).indices.tolist())
        for j, drawn in enumerate(draws):
            self.observe_ranks(
                {h: t[j].index(drawn) if drawn in t[j] else None for h, t in tops.items()}
            )

    def can_switch(self) -> bool:
        return self.compared.n >= COMPARE_UNTIL / 2

    def others(self) -> list[str]:
        return [h for h in self.heads if h != self.current]

    def extra_seconds(self, head: str, rows: float) -> float:
        """Seconds a pass over `rows` rows takes more with `head` than with the current head
        (negative: less); 0 where either was not timed."""
        a, b = self.costs[head], self.costs[self.current]
        return a(rows) - b(rows) if a.known and b.known else 0.0

    def acceptance_scale(self, head: str, width: int, doubt: float = 0.0) -> float:
        """P(accepted) drafting with `head` over that with the current head, per depth."""
        return (
            1.0 if head == self.current else self.compared.scale(head, self.current, width, doubt)
        )

    def switch(self, head: str) -> None:
        c = self.compared
        logger.info(
            "vllm-subspec: drafting with the %s lm_head (acceptance at widths %s: %s vs "
            "%s with the %s one, paired)",
            head,
            list(c.widths),
            [round(c.rate(head, w), 3) for w in c.widths],
            [round(c.rate(self.current, w), 3) for w in c.widths],
            self.current,
        )
        self.current = head
        self.switches += 1


def _rows_passes_ran_from(
    paths: list[tuple[StoredTree, list[int], torch.Tensor]],
) -> tuple[torch.Tensor | None, list[int]]:
    """The hidden states [N, H] of the path nodes a pass ran from (depth < the tree's
    hidden_depth) and the target's draw after each (None, []: none)."""
    hidden, draws = [], []
    for tree, nodes, emitted in paths:
        depths = tree.depths()
        ran = [
            (node, drawn)
            for node, drawn in zip(nodes, emitted.tolist())
            if depths[node] < tree.hidden_depth
        ]
        if ran:  # one gather per tree
            hidden.append(tree.node_hidden[[node for node, _ in ran]])
            draws += [drawn for _, drawn in ran]
    return (torch.cat(hidden) if hidden else None), draws
