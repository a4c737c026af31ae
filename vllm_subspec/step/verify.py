"""Sample, then match: verifying a step's trees so that every emitted token is the target's own
draw (`StepSession.sample_and_walk` calls `sample_then_match` in place of vLLM's rejection
sampler, for every shape: a chain is a tree of width 1).

The target's token is drawn at every node (vLLM's own sampling rules, `node_constraints`, and
sampler), then each tree is walked from the root along the draws. Why this is plain ancestral
sampling, and how seeded requests reproduce plain's samples: docs/losslessness.md. Rows are laid
out request-major (each request's root row, then its scheduled nodes); every per-row step is a
whole-batch array operation (`VerifyRows`), so a step's launches do not grow with the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_subspec.step.node_constraints import (
    applies,
    constrain,
    penalized_at_widest,
    step_penalties,
)
from vllm_subspec.step.paged_kv import KvMove
from vllm_subspec.step.transfer import to_device
from vllm_subspec.step.tree import StoredTree

PLACEHOLDER = -1
_SAMPLING_EPS = 1e-5


@dataclass
class VerifiedTree:
    """A request's tree in the step being verified."""

    tree: StoredTree
    root: int  # L: logical position of the root (the last step's bonus token)
    req_index: int  # the request's row in this step's batch
    compact: bool  # False for a chain in vLLM's layout: its path is already in place


def chain_tree(draft_token_ids: list[int]) -> StoredTree:
    """Drafts laid out as a chain (node i's parent is i - 1); the root token is never matched."""
    n = len(draft_token_ids)
    return StoredTree(
        [0] + list(draft_token_ids),
        list(range(-1, n)),
        torch.ones(n + 1, n + 1, dtype=torch.bool).tril(),
    )


@dataclass
class WalkResult:
    tokens: torch.Tensor  # [B, max(num_draft) + 1] int32 emitted tokens, padded with -1
    drawn_at: torch.Tensor  # [B, same] int64 logits row of each emitted token (padding: 0)
    paths: list[list[int]]  # [B] accepted node indices (root excluded)
    moves: list[KvMove]  # the accepted paths whose KV must move


@dataclass
class VerifyRows:
    """Every logits row of a verify on the host, request-major: numpy arrays of length N."""

    request: np.ndarray  # batch index of each row
    depth: np.ndarray  # its node's depth (root 0; rows of a request without a tree: 0)
    parent: np.ndarray  # the row of its node's parent (-1: a root, or no tree)
    token: np.ndarray  # its node's token (-1 where there is no tree)
    start: np.ndarray  # [B + 1] each request's first row

    @classmethod
    def of(cls, trees: list[VerifiedTree | None], num_draft: list[int]) -> VerifyRows:
        counts = np.asarray(num_draft, dtype=np.int64) + 1
        start = np.concatenate([[0], np.cumsum(counts)])
        n = int(start[-1])
        request = np.repeat(np.arange(len(num_draft)), counts)
        parent_local = np.full(n, -1, dtype=np.int64)
        token = np.full(n, PLACEHOLDER, dtype=np.int64)
        has = [i for i, v in enumerate(trees) if v is not None]
        if has:  # each tree's lists, concatenated (C-level extends)
            parents, tokens = [], []
            for i in has:
                parents += trees[i].tree.parents[: counts[i]]
                tokens += trees[i].tree.tokens[: counts[i]]
            rows = (
                np.concatenate([np.arange(start[i], start[i + 1]) for i in has])
                if len(has) < len(trees)
                else np.arange(n)
            )
            parent_local[rows] = parents
            token[rows] = tokens
        parent = np.where(parent_local >= 0, start[request] + parent_local, -1)
        depth = np.zeros(n, dtype=np.int64)
        while True:  # one array operation per depth (parents precede their children)
            deeper = np.where(parent >= 0, depth[np.maximum(parent, 0)] + 1, 0)
            if np.array_equal(deeper, depth):
                break
            depth = deeper
        return cls(request, depth, parent, token, start)

    def path_tokens(self, pad: int) -> np.ndarray:
        """[N, max depth] the tokens from each row's root (exclusive) to its node (inclusive),
        by depth; `pad` elsewhere. One array operation per depth, for the whole batch."""
        depth = int(self.depth.max(initial=0))
        out = np.full((len(self.depth), max(depth, 1)), pad, dtype=np.int64)
        cur = np.arange(len(self.depth))
        for _ in range(depth):
            on = (cur >= 0) & (self.depth[np.maximum(cur, 0)] > 0)
            rows, at = np.nonzero(on)[0], cur[on]
            out[rows, self.depth[at] - 1] = self.token[at]
            cur = np.where(on, self.parent[np.maximum(cur, 0)], -1)
        return out


def accepted_paths(rows: VerifyRows, draws: np.ndarray, has_tree: np.ndarray) -> np.ndarray:
    """[B, max depth] the accepted rows of each request's walk from its root, -1 past its end:
    at each step the child of the current node whose token is the draw there (the first, i.e.
    best-scored, of equal siblings), while there is one. One array operation per depth."""
    num = len(rows.start) - 1
    depth = int(rows.depth.max(initial=0))
    path = np.full((num, max(depth, 1)), -1, dtype=np.int64)
    cur = np.where(has_tree, rows.start[:-1], -1)
    order = np.arange(len(rows.request))
    for d in range(depth):
        alive = cur >= 0
        if not alive.any():
            break
        at = np.where(alive, cur, 0)
        hit = (
            (rows.parent >= 0)
            & (rows.parent == cur[rows.request])
            & (rows.token == draws[at][rows.request])
            & alive[rows.request]
        )
        first = np.full(num, len(order), dtype=np.int64)
        np.minimum.at(first, rows.request[hit], order[hit])
        cur = np.where(first < len(order), first, -1)
        path[:, d] = cur
    return path


def _draw_in_chunks(
    logits,
    rows: VerifyRows,
    row_request,
    host_request,
    sampling_metadata,
    topk_topp_sampler,
    chunk: int,
):
    """The target's draw at every row, `chunk` rows of fp32 work at a time: vLLM's rules
    (`constrain`), then its sampler; returns (draws per chunk on the device, seeded requests'
    `SeededDraws`)."""
    n, vocab = len(rows.request), logits.shape[-1]
    penalties = step_penalties(sampling_metadata, vocab, logits.device)
    path_tokens: list[np.ndarray] = []

    def paths(a: int, b: int) -> np.ndarray:  # [b - a, D] made once, if a rule reads them
        if not path_tokens:
            path_tokens.append(rows.path_tokens(vocab))
        return path_tokens[0][a:b]

    seeded, row_generators = seeded_draws(
        rows, sampling_metadata, topk_topp_sampler, vocab, logits.device
    )
    draws = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        constrained = constrain(
            logits[start:stop],
            row_request[start:stop],
            host_request[start:stop],
            rows.depth[start:stop],
            functools.partial(paths, start, stop),
            sampling_metadata,
            penalties,
        )
        generators = {row - start: g for row, g in row_generators.items() if start <= row < stop}
        draws.append(
            draw_target_tokens(
                constrained,
                row_request[start:stop],
                generators,
                sampling_metadata,
                topk_topp_sampler,
            )
        )
    return draws, seeded


def sample_then_match(
    trees: list[VerifiedTree | None],
    num_draft: list[int],
    logits: torch.Tensor,
    sampling_metadata,
    topk_topp_sampler,
    max_rows: int | None = None,
) -> WalkResult:
    """Draw the target's token at every node, then walk each tree along the draws.

    trees: [B] the verifying tree of each request (None: no drafts); num_draft: [B] its
    scheduled nodes; logits: [sum(num_draft) + B, V] the target's (root row first);
    max_rows: the most rows whose fp32 work runs at once (None: all; greedy rows without a
    rule to apply take the argmax of the logits' own dtype, all at once)."""
    trees = list(trees) + [None] * (len(num_draft) - len(trees))  # (vLLM's empty warm-up)
    rows = VerifyRows.of(trees, num_draft)
    n, device = len(rows.request), logits.device
    host_request = torch.from_numpy(rows.request)
    row_request = to_device(host_request, device)
    if sampling_metadata.all_greedy and not applies(sampling_metadata):
        # the argmax of the logits' own dtype: plain's fp32 argmax (the first of equal
        # values either way), for every row at once, with no fp32 copy
        draws = [logits.argmax(dim=-1)]
        seeded = {}
    else:
        draws, seeded = _draw_in_chunks(
            logits,
            rows,
            row_request,
            host_request,
            sampling_metadata,
            topk_topp_sampler,
            max_rows or n,
        )
    drawn = (draws[0] if len(draws) == 1 else torch.cat(draws)).cpu().numpy()  # the one read
    has_tree = np.array([v is not None for v in trees], dtype=bool)  # [B]
    path = accepted_paths(rows, drawn, has_tree)
    emitted_rows = np.concatenate([rows.start[:-1, None], path], axis=1)  # [B, 1 + D]
    valid = emitted_rows >= 0
    width = max(num_draft) + 1
    cols = min(width, emitted_rows.shape[1])
    out = np.full((len(num_draft), width), PLACEHOLDER, dtype=np.int32)
    at = np.zeros((len(num_draft), width), dtype=np.int64)
    safe = np.where(valid, emitted_rows, 0)[:, :cols]
    out[:, :cols] = np.where(valid[:, :cols], drawn[safe], PLACEHOLDER)
    at[:, :cols] = np.where(valid[:, :cols], safe, 0)
    lengths = valid.sum(axis=1)  # emitted tokens: the root's draw and one per accepted node
    walked = [(path[i, : lengths[i] - 1] - rows.start[i]).tolist() for i in range(len(trees))]
    for i, s in seeded.items():  # the generator has made one draw per emitted token
        s.commit(int(lengths[i]))
    moves = [
        KvMove(v.req_index, v.root, p)
        for v, p in zip(trees, walked)
        if v is not None and v.compact and p != list(range(1, len(p) + 1))
    ]
    return WalkResult(torch.from_numpy(out), torch.from_numpy(at), walked, moves)


def draws_at_widest(logits: torch.Tensor, num_requests: int, rows: int, topk_topp_sampler) -> None:
    """The largest temporaries a verify's draws make past its logits (`_draw_in_chunks`),
    made on `logits` (random, [N, V]) for the start-up memory profile: the step's penalty
    inputs over `num_requests` requests and one chunk of `rows` rows penalized in fp32
    (`node_constraints.penalized_at_widest`), scaled by a temperature, then drawn by vLLM's
    top-k/top-p sampler while all of it is held."""
    scaled, held = penalized_at_widest(logits, num_requests, rows)
    scaled /= 0.5
    full = lambda value: torch.full((rows,), value, device=logits.device)  # noqa: E731
    topk_topp_sampler(scaled, {}, full(logits.shape[-1] - 1), full(0.9))
    del held


class SeededDraws:
    """A seeded request's generator over one verify step: the state before each of plain
    decoding's next draws (made by vLLM's own sampler on a dummy row: `TopKTopPSampler`), so a
    depth-j node draws with plain's j-th noise; `commit(e)` leaves the generator where plain's
    is after e tokens. docs/losslessness.md, "Seeded requests"."""

    def __init__(
        self,
        generator: torch.Generator,
        num_draws: int,
        topk_topp_sampler,
        vocab_size: int,
        device: torch.device,
    ):
        self.generator = generator
        self.states = [generator.get_state()]
        dummy = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_draws):
            topk_topp_sampler(dummy.clone(), {0: generator}, None, None)
            self.states.append(generator.get_state())

    def at_depth(self, depth: int) -> torch.Generator:
        """A generator in the state of plain's draw for a node at `depth`."""
        g = torch.Generator(device=self.generator.device)
        g.set_state(self.states[depth])
        return g

    def commit(self, num_emitted: int) -> None:
        self.generator.set_state(self.states[num_emitted])


def seeded_draws(
    rows: VerifyRows, sampling_metadata, topk_topp_sampler, vocab_size: int, device: torch.device
) -> tuple[dict[int, SeededDraws], dict[int, torch.Generator]]:
    """Per seeded request (batch index) its `SeededDraws`, and per logits row of it the
    generator in the state of plain's draw at that row's depth."""
    if sampling_metadata.all_greedy:
        return {}, {}
    seeded, row_generators = {}, {}
    for r, gen in sampling_metadata.generators.items():
        depths = rows.depth[rows.start[r] : rows.start[r + 1]].tolist()
        seeded[r] = SeededDraws(gen, max(depths) + 1, topk_topp_sampler, vocab_size, device)
        row_generators.update(
            {int(rows.start[r]) + j: seeded[r].at_depth(d) for j, d in enumerate(depths)}
        )
    return seeded, row_generators


def draw_target_tokens(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    row_generators: dict[int, torch.Generator],
    sampling_metadata,
    topk_topp_sampler,
) -> torch.Tensor:
    """One target token per logits row, as vLLM's `Sampler.sample` draws it: argmax for greedy
    requests; else temperature, then vLLM's own TopKTopPSampler (top-k/top-p, the draw).
    logits: [R, V]; row_request: [R] on the logits' device, the batch index of each row;
    row_generators: the generator of each seeded row (`seeded_draws`), by row."""
    # the argmax of the logits' own dtype: the index of plain's fp32 argmax (the first of
    # equal values either way), without an fp32 copy of the rows
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    expand = lambda t: None if t is None else t[row_request]  # noqa: E731
    temperature = expand(sampling_metadata.temperature)
    is_greedy = temperature < _SAMPLING_EPS
    scaled = logits.float() / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)
    sampled, _ = topk_topp_sampler(
        scaled, row_generators, expand(sampling_metadata.top_k), expand(sampling_metadata.top_p)
    )
    return torch.where(is_greedy, greedy, sampled)
