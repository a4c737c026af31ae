"""Tree verification: "sample, then match" on the target's logits at every tree node.

Takes the place of vLLM's `RejectionSampler` (same call, same output format) when SubSpec drafts
trees. For each request the target's token is drawn at every node (argmax when greedy; else from
the request's own temperature / top-k / top-p distribution, with its seed); then the walk starts at
the root and moves to the child whose token equals the draw at the current node, as long as there
is one. The draws along the path are emitted, the last one being the bonus token. Drawing at all
nodes up front is the same in distribution as drawing lazily along the walk (every node is visited
at most once), and every emitted token is a draw from the target at its exact context: the output
is plain ancestral sampling from the target whatever the draft proposed.

Output rows are left-aligned emitted tokens padded with -1, as vLLM's sampler returns, so vLLM's
bookkeeping, scheduler and spec-decode metrics work unchanged (τ = emitted tokens per step).
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_subspec.tree import accepted_path

PLACEHOLDER = -1
_SAMPLING_EPS = 1e-5


class TreeVerifier:
    def __init__(self, runner, state):
        self.runner = runner
        self.state = state  # TreeState shared with the proposer

    def __call__(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        num_draft = list(metadata.num_draft_tokens)
        req_ids = self.runner.input_batch.req_ids[: len(num_draft)]
        rows = torch.tensor([n + 1 for n in num_draft])
        raw_logits = logits
        logits = self._constrain(logits, rows, req_ids, num_draft, sampling_metadata)
        draws = draw_target_tokens(logits, rows, sampling_metadata).tolist()

        width = max(num_draft) + 1
        out = torch.full((len(num_draft), width), PLACEHOLDER, dtype=torch.int32)
        # logits row at which each emitted token was drawn (for logprobs); padding reads row 0
        drawn_at = torch.zeros((len(num_draft), width), dtype=torch.int64)
        start = 0
        for i, (req_id, n) in enumerate(zip(req_ids, num_draft)):
            target = draws[start: start + n + 1]
            tree = self.state.trees.get(req_id) if n else None
            path = accepted_path(tree.tokens[: n + 1], tree.parents[: n + 1], target) \
                if tree is not None else []
            nodes = [0] + path  # emitted token j is the target's draw at nodes[j]
            out[i, : len(nodes)] = torch.tensor([target[a] for a in nodes], dtype=torch.int32)
            drawn_at[i, : len(nodes)] = start + torch.tensor(nodes)
            start += n + 1
            if n:
                self.state.accepted[req_id] = path
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw_logits, drawn_at, out,
                                      sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=logprobs)

    def _constrain(self, logits, rows, req_ids, num_draft, sampling_metadata):
        """What vLLM's rejection sampler applies to a chain's target logits, per tree node:
        repetition/frequency/presence penalties over the request's output plus the node's path,
        and allowed_token_ids. (Bad words and min_tokens are not applied to tree nodes.)"""
        allowed = sampling_metadata.allowed_token_ids_mask
        if sampling_metadata.no_penalties and allowed is None:
            return logits
        row_request = torch.repeat_interleave(torch.arange(len(num_draft)), rows) \
            .to(logits.device)
        logits = logits.to(torch.float32, copy=True)  # the raw logits stay for logprobs
        if not sampling_metadata.no_penalties:
            histories = []
            for i, (req_id, n) in enumerate(zip(req_ids, num_draft)):
                done = list(sampling_metadata.output_token_ids[i])
                tree = self.state.trees.get(req_id) if n else None
                histories += [done + (tree.path_tokens(r) if tree else []) for r in range(n + 1)]
            logits = apply_all_penalties(
                logits, sampling_metadata.prompt_token_ids[row_request],
                sampling_metadata.presence_penalties[row_request],
                sampling_metadata.frequency_penalties[row_request],
                sampling_metadata.repetition_penalties[row_request], histories)
        if allowed is not None:
            logits.masked_fill_(allowed[row_request], float("-inf"))
        return logits

    def _logprobs(self, logits, drawn_at, tokens, max_num_logprobs):
        """Logprobs of the emitted tokens (and the top ones) in vLLM's padded spec-decode
        layout: one row per output slot, padding rows filtered out by vLLM's parse_output.
        Raw logprobs (vLLM's default `logprobs_mode`), from the target's logits where each
        token was drawn, as a plain engine reports them."""
        sampler = self.runner.sampler
        rows = logits[drawn_at.flatten().to(logits.device)].float()
        values = rows if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(rows)
        ids = tokens.flatten().clamp(min=0).to(torch.int64).to(logits.device)
        return sampler.gather_logprobs(values, max_num_logprobs, ids)


def draw_target_tokens(logits: torch.Tensor, rows_per_request: torch.Tensor,
                       sampling_metadata) -> torch.Tensor:
    """One target token per logits row: argmax for greedy requests, else a seeded draw from
    the request's temperature/top-k/top-p distribution. rows_per_request: [num_reqs]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    expand = lambda t: None if t is None else t.repeat_interleave(  # noqa: E731
        rows_per_request.to(t.device), dim=0)
    temperature = expand(sampling_metadata.temperature)
    is_greedy = temperature < _SAMPLING_EPS
    scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)
    warped = apply_top_k_top_p(scaled, expand(sampling_metadata.top_k),
                               expand(sampling_metadata.top_p))
    probs = warped.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()  # Gumbel-max via exponential races
    offsets = torch.cumsum(rows_per_request, 0) - rows_per_request
    for req_index, gen in sampling_metadata.generators.items():
        a, n = int(offsets[req_index]), int(rows_per_request[req_index])
        noise[a: a + n].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)
