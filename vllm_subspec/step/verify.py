"""Sample, then match: verifying a step's trees so that every emitted token is the target's own
draw (`StepSession.sample_and_walk` calls `sample_then_match` in place of vLLM's rejection
sampler).

The target's token is drawn at every node (argmax when greedy; else from the request's own
temperature / top-k / top-p distribution, with its seed); the walk starts at the root and moves
to the child whose token equals the draw at the current node, while there is one. The draws
along the path are emitted, the last one being the bonus token. Drawing at all nodes up front is
the same in distribution as drawing lazily along the walk (each node is visited at most once),
and every emitted token is a draw from the target at its exact context: the output is plain
ancestral sampling from the target whatever the draft proposed. A seeded request's draw at
depth j uses the noise of plain decoding's j-th draw from its generator (`SeededDraws`), so its
output is reproducible and equals a plain engine's seeded output up to numerical near-ties.

Scheduled drafts with no pending tree (vLLM skipped the drafter and scheduled its all-zero
placeholders, gpu_model_runner.py 0.32.0 :4456-4466) are verified as what they are: a chain in
vLLM's own layout (`chain_tree`), whose path is already in place.

Output rows are left-aligned emitted tokens padded with -1, as vLLM's sampler returns, so vLLM's
bookkeeping, scheduler and spec-decode metrics work unchanged (τ = emitted tokens per step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vllm_subspec.step.node_constraints import constrain
from vllm_subspec.step.paged_kv import KvMove
from vllm_subspec.step.tree import StoredTree, accepted_path

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
    return StoredTree([0] + list(draft_token_ids), list(range(-1, n)),
                      torch.ones(n + 1, n + 1, dtype=torch.bool).tril())


@dataclass
class WalkResult:
    tokens: torch.Tensor  # [B, max(num_draft) + 1] int32 emitted tokens, padded with -1
    drawn_at: torch.Tensor  # [B, same] int64 logits row of each emitted token (padding: 0)
    paths: list[list[int]]  # [B] accepted node indices (root excluded)
    moves: list[KvMove]  # the accepted paths whose KV must move


def sample_then_match(trees: list[VerifiedTree | None], num_draft: list[int],
                      logits: torch.Tensor, sampling_metadata, topk_topp_sampler,
                      max_rows: int | None = None) -> WalkResult:
    """Draw the target's token at every node, then walk each tree along the draws.

    trees: [B] the verifying tree of each request (None: no drafts); num_draft: [B] its
    scheduled nodes; logits: [sum(num_draft) + B, V] the target's (root row first);
    max_rows: the most rows drawn at once (None: all). A verify over whole trees has up to
    max_num_seqs x (nodes + 1) rows; drawn max_num_seqs rows at a time, its fp32 work
    (constrained copies, temperature, vLLM's top-k/top-p sampler) is the size vLLM's own
    sampler warm-up runs in its memory profile. Each row's draw reads its own row and, when
    seeded, its own generator state, so the chunks change no draw."""
    rows = [n + 1 for n in num_draft]
    # one depth and path per logits row (a request without a tree: only its root row is
    # drawn from, the others are placeholders)
    depths = [v.tree.depths()[: n + 1] if v is not None else [0] * (n + 1)
              for v, n in zip(trees, num_draft)]
    row_request = torch.repeat_interleave(torch.arange(len(num_draft)), torch.tensor(rows))
    row_depth = [d for ds in depths for d in ds]
    node_paths: list[list[int]] = []

    def paths(start: int, stop: int) -> list[list[int]]:  # made once, only if a rule reads it
        if not node_paths:
            node_paths.extend(p for v, n in zip(trees, num_draft)
                              for p in (v.tree.node_paths(n + 1) if v else [[]] * (n + 1)))
        return node_paths[start:stop]

    seeded, row_generators = seeded_draws(depths, sampling_metadata, topk_topp_sampler,
                                          logits.shape[-1], logits.device)
    draws: list[int] = []
    chunk = max_rows or len(row_depth)
    for start in range(0, len(row_depth), chunk):
        stop = min(start + chunk, len(row_depth))
        constrained = constrain(logits[start:stop], row_request[start:stop],
                                row_depth[start:stop], lambda a=start, b=stop: paths(a, b),
                                sampling_metadata)
        generators = {row - start: g for row, g in row_generators.items() if start <= row < stop}
        draws += draw_target_tokens(constrained, row_request[start:stop], generators,
                                    sampling_metadata, topk_topp_sampler).tolist()
    width = max(num_draft) + 1
    out = torch.full((len(num_draft), width), PLACEHOLDER, dtype=torch.int32)
    drawn_at = torch.zeros((len(num_draft), width), dtype=torch.int64)
    walked, moves = [], []
    start = 0
    for i, (v, n) in enumerate(zip(trees, num_draft)):
        target = draws[start: start + n + 1]
        path = accepted_path(v.tree.tokens[: n + 1], v.tree.parents[: n + 1], target) \
            if v is not None else []
        nodes = [0] + path  # emitted token j is the target's draw at nodes[j]
        out[i, : len(nodes)] = torch.tensor([target[a] for a in nodes], dtype=torch.int32)
        drawn_at[i, : len(nodes)] = start + torch.tensor(nodes)
        if i in seeded:  # the generator has made one draw per emitted token, as plain's
            seeded[i].commit(len(nodes))
        start += n + 1
        walked.append(path)
        if v is not None and v.compact and path != list(range(1, len(path) + 1)):
            moves.append(KvMove(v.req_index, v.root, path))
    return WalkResult(out, drawn_at, walked, moves)


class SeededDraws:
    """A seeded request's generator over one verify step. The draw at a depth-j node is plain
    decoding's j-th sampling draw from this step on: the generator state after j of plain's draws
    is recorded for j = 0..max depth + 1 (each draw made by vLLM's own sampler on a dummy row, so
    it consumes the generator exactly as a plain step does on this platform: one `randint` on
    CPU, `topk_topp_sampler.py` 0.32.0 :343-348; one vocabulary row of `exponential_` in
    `random_sample` :575-576 elsewhere). Once the walk has emitted e tokens, the generator is set
    to the state after e draws. So the emitted tokens use exactly the noise a plain engine would,
    whatever the tree's shape: seeded output is reproducible, and equal to plain seeded output up
    to numerical near-ties of the logits. All nodes at one depth share a draw; that keeps it
    exact in distribution, because the walk visits at most one node per depth."""

    def __init__(self, generator: torch.Generator, num_draws: int, topk_topp_sampler,
                 vocab_size: int, device: torch.device):
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


def seeded_draws(depths: list[list[int]], sampling_metadata, topk_topp_sampler,
                 vocab_size: int, device: torch.device
                 ) -> tuple[dict[int, SeededDraws], dict[int, torch.Generator]]:
    """Per seeded request (batch index) its `SeededDraws`, and per logits row of it the
    generator in the state of plain's draw at that row's depth. depths: [B] each request's
    node depths, one per logits row (requests' rows consecutive)."""
    if sampling_metadata.all_greedy:
        return {}, {}
    offsets = [0, *itertools.accumulate(len(ds) for ds in depths)]  # first row per request
    seeded, row_generators = {}, {}
    for r, gen in sampling_metadata.generators.items():
        seeded[r] = SeededDraws(gen, max(depths[r]) + 1, topk_topp_sampler, vocab_size, device)
        row_generators.update({offsets[r] + j: seeded[r].at_depth(d)
                               for j, d in enumerate(depths[r])})
    return seeded, row_generators


def draw_target_tokens(logits: torch.Tensor, row_request: torch.Tensor,
                       row_generators: dict[int, torch.Generator], sampling_metadata,
                       topk_topp_sampler) -> torch.Tensor:
    """One target token per logits row, as vLLM's Sampler.sample draws it (sampler.py 0.32.0
    :247-305): argmax for greedy requests; else temperature, then vLLM's own TopKTopPSampler
    (top-k/top-p and the platform's draw).

    logits: [R, V]; row_request: [R] (host) the batch index of each row; row_generators: the
    generator of each seeded row (`seeded_draws`), by row."""
    # the argmax of the logits' own dtype: the index of plain's fp32 argmax (the first of
    # equal values either way), without an fp32 copy of the rows
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    expand = lambda t: None if t is None else t[row_request.to(t.device)]  # noqa: E731
    temperature = expand(sampling_metadata.temperature)
    is_greedy = temperature < _SAMPLING_EPS
    scaled = logits.float() / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)
    sampled, _ = topk_topp_sampler(scaled, row_generators, expand(sampling_metadata.top_k),
                                   expand(sampling_metadata.top_p))
    return torch.where(is_greedy, greedy, sampled)
