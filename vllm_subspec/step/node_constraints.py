"""What a plain step applies to the target's logits, applied at every tree node along that node's
own path, so that the target's draw at a node is the draw plain decoding would make after
generating the node's path.

A node at depth j (the root: 0) stands for the request's output plus the j tokens of its path.
Per node, in the order vLLM's Sampler applies them to a plain step (sampler.py 0.32.0 :390-414):

* `allowed_token_ids` (a per-request mask: the same at every node);
* `bad_words`: a banned sequence whose last token would complete it after output + path
  (vLLM's own `apply_bad_words` on the node's history);
* `min_tokens`: stop tokens (EOS unless ignore_eos, plus stop_token_ids) masked while
  output length + depth < min_tokens, read from vLLM's own `MinTokensLogitsProcessor` state;
  with structured outputs a row left all -inf gets its stop tokens back, as
  `_mask_stop_token_logits` (logits_processor/builtin.py 0.32.0 :254-277) does;
* repetition / frequency / presence penalties over output + path.

Structured-output grammars are applied by vLLM before the verifier runs, one mask per scheduled
position in chain order (the grammar state is the scheduler's). That is exact for a chain, not
for a tree node whose parent is not the previous position: such requests draft a chain
(`chain_only_reason`). A thinking budget is refused per request (`refusal`). vLLM's chain
rejection sampler applies min_tokens at the bonus row from the committed output alone
(sampler.py :404-405); here every row, the bonus included, counts its own path, as plain
decoding would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties


def chain_only_reason(params) -> str | None:
    """Why a request must draft a chain, not a tree (None: a tree is exact for it).

    params: its SamplingParams. A grammar's masks are computed by vLLM's scheduler along the
    scheduled drafts as a chain (structured_output/__init__.py `grammar_bitmask`) and applied to
    the logits before the verifier runs: exact for a chain's positions only."""
    if getattr(params, "structured_outputs", None) is not None:
        return "structured outputs"
    return None


def refusal(params) -> str | None:
    """Why SubSpec refuses a request vLLM would accept with speculative decoding (None: it
    does not). `thinking_token_budget`'s forced end of thinking is applied by vLLM's samplers
    (sampler.py 0.32.0 :408-420, rejection_sampler.py :355-361), which SubSpec's verify
    replaces, and nothing here applies it yet."""
    if getattr(params, "thinking_token_budget", None) is not None:
        return ("thinking_token_budget is not supported with speculative method 'subspec' "
                "(its forced end of thinking would not be applied); drop it, or serve "
                "without --speculative-config")
    return None


def min_tokens_state(sampling_metadata) -> dict[int, tuple[int, int, list[int], bool]]:
    """Per batch index still under its minimum: (min_tokens, output length, stop token ids,
    uses structured output), from vLLM's MinTokensLogitsProcessor (builtin.py 0.32.0 :165)."""
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            return {i: (m, len(out), sorted(stop), structured)
                    for i, (m, out, stop, structured) in processor.min_toks.items() if stop}
    return {}


def constrain(logits: torch.Tensor, row_request: torch.Tensor, depths: Sequence[int],
              paths: Callable[[], Sequence[list[int]]], sampling_metadata) -> torch.Tensor:
    """The target's logits as plain decoding would sample them at each node.

    logits: [R, V] one row per node (each request's root row first); row_request: [R] batch
    index of each row; depths: [R] each node's depth; paths: () -> [R] each node's path tokens
    (root excluded), asked for only where a rule reads them. Returns a processed fp32 copy, or
    `logits` itself when nothing applies (the raw logits stay for logprobs)."""
    allowed = sampling_metadata.allowed_token_ids_mask
    bad_words = sampling_metadata.bad_words_token_ids
    min_tokens = min_tokens_state(sampling_metadata)
    if sampling_metadata.no_penalties and allowed is None and not bad_words and not min_tokens:
        return logits
    logits = logits.to(torch.float32, copy=True)
    requests = row_request.tolist()
    outputs = sampling_metadata.output_token_ids
    needs_history = bool(bad_words) or not sampling_metadata.no_penalties
    histories = [list(outputs[i]) + path for i, path in zip(requests, paths())] \
        if needs_history else []
    if allowed is not None:
        logits.masked_fill_(allowed[row_request.to(allowed.device)], float("-inf"))
    if bad_words:
        rows = {r: bad_words[i] for r, i in enumerate(requests) if i in bad_words}
        apply_bad_words(logits, rows, histories)
    if min_tokens:
        _mask_stop_tokens(logits, requests, depths, min_tokens)
    if not sampling_metadata.no_penalties:
        device_rows = row_request.to(logits.device)
        logits = apply_all_penalties(
            logits, sampling_metadata.prompt_token_ids[device_rows],
            sampling_metadata.presence_penalties[device_rows],
            sampling_metadata.frequency_penalties[device_rows],
            sampling_metadata.repetition_penalties[device_rows], histories)
    return logits


def _mask_stop_tokens(logits: torch.Tensor, requests: list[int], depths: Sequence[int],
                      state: dict[int, tuple[int, int, list[int], bool]]) -> None:
    """Stop tokens to -inf at every row whose output length (committed + depth) is still below
    the request's min_tokens; rows of structured-output requests left all -inf keep them."""
    rows, tokens, restorable = [], [], []
    for r, i in enumerate(requests):
        if i not in state:
            continue
        minimum, length, stop, structured = state[i]
        if length + depths[r] < minimum:
            rows += [r] * len(stop)
            tokens += stop
            if structured:
                restorable.append(r)
    if not rows:
        return
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    before = logits[index]  # a copy (advanced indexing)
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
    if restorable:
        dead = torch.isneginf(logits[torch.tensor(restorable, device=logits.device)]).all(-1)
        dead_rows = {r for r, d in zip(restorable, dead.tolist()) if d}
        keep = torch.tensor([r in dead_rows for r in rows], device=logits.device)
        keep &= torch.isfinite(before)
        logits.index_put_((index[0][keep], index[1][keep]), before[keep])
