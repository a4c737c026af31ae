"""What a plain step applies to the target's logits, applied at every tree node along that node's
own path, so the target's draw at a node is the draw plain decoding would make after generating
the node's path: allowed tokens, bad words, min_tokens' stop tokens, and the repetition,
frequency and presence penalties over output + path, in the order of vLLM's
`Sampler.apply_logits_processors`. Grammars are exact for chains only (`chain_only_reason`); a
thinking budget is refused (`refusals.request_refusal`). docs/losslessness.md, "Request
features".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words

from vllm_subspec.step.transfer import to_device


def chain_only_reason(params) -> str | None:
    """Why a request must draft a chain, not a tree (None: a tree is exact for it): vLLM's
    scheduler computes a grammar's masks along the scheduled drafts as a chain
    (`StructuredOutputManager.grammar_bitmask`), exact for a chain's positions only."""
    if getattr(params, "structured_outputs", None) is not None:
        return "structured outputs"
    return None


def min_tokens_state(sampling_metadata) -> dict[int, tuple[int, int, list[int], bool]]:
    """Per batch index still under its minimum: (min_tokens, output length, stop token ids,
    uses structured output), from vLLM's `MinTokensLogitsProcessor`."""
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            return {
                i: (m, len(out), sorted(stop), structured)
                for i, (m, out, stop, structured) in processor.min_toks.items()
                if stop
            }
    return {}


def applies(sampling_metadata) -> bool:
    """Whether any rule here changes a row's logits."""
    return (
        not sampling_metadata.no_penalties
        or sampling_metadata.allowed_token_ids_mask is not None
        or bool(sampling_metadata.bad_words_token_ids)
        or bool(min_tokens_state(sampling_metadata))
    )


@dataclass
class StepPenalties:
    """A verify step's penalty inputs, made once per step on the device: each request's
    output-token counts and prompt-token mask over V + 1 bins (the last: padding), as vLLM's
    `get_token_bin_counts_and_mask` makes them for a plain step."""

    output_counts: torch.Tensor  # [B, V + 1] int64
    prompt_mask: torch.Tensor  # [B, V] bool


def step_penalties(sampling_metadata, vocab: int, device: torch.device) -> StepPenalties | None:
    """The step's `StepPenalties` (None without penalties): one padded host copy of the
    requests' outputs (pinned, as vLLM's `_convert_to_tensors`) and two scatters, once per
    step, whatever the number of tree nodes."""
    if sampling_metadata.no_penalties:
        return None
    from vllm.model_executor.layers.utils import get_token_bin_counts_and_mask
    from vllm.utils.torch_utils import make_tensor_with_pad

    outputs = sampling_metadata.output_token_ids
    host = make_tensor_with_pad(
        outputs, pad=vocab, device="cpu", dtype=torch.int64, pin_memory=device.type == "cuda"
    )
    host.masked_fill_(host == -1, vocab)  # (async scheduling's placeholders, as vLLM does)
    tokens = host.to(device, non_blocking=True)
    counts = torch.zeros(len(outputs), vocab + 1, dtype=torch.int64, device=device)
    if tokens.numel():
        counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    _, prompt_mask = get_token_bin_counts_and_mask(
        sampling_metadata.prompt_token_ids, vocab, len(outputs)
    )
    return StepPenalties(counts, prompt_mask)


def penalized_at_widest(
    logits: torch.Tensor, num_requests: int, rows: int
) -> tuple[torch.Tensor, tuple]:
    """What the rules here hold at their widest, made for the start-up memory profile on
    `logits` ([>= rows, V], random): a step's penalty inputs over `num_requests` requests
    (`step_penalties`: the counts and the prompt mask beside them), then `rows` rows as
    `constrain` penalizes them (the fp32 copy, the rows' gathered counts, the frequency and
    presence terms). Returns (the penalized fp32 rows, what stays live beside them)."""
    vocab = logits.shape[-1]
    counts = torch.zeros(num_requests, vocab + 1, dtype=torch.int64, device=logits.device)
    penalties = StepPenalties(counts, counts[:, :vocab] > 0)
    row_counts = counts[:rows].clone()[:, :vocab]
    penalized = logits[:rows].float()
    penalized -= 0.5 * row_counts
    penalized -= 0.5 * (row_counts > 0)
    return penalized, (penalties, row_counts)


def constrain(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    host_request: torch.Tensor,
    depths: np.ndarray,
    paths: Callable[[], np.ndarray],
    sampling_metadata,
    penalties: StepPenalties | None,
) -> torch.Tensor:
    """The target's logits as plain decoding would sample them at each node.

    logits: [R, V] one row per node; row_request: [R] each row's batch index on the logits'
    device, `host_request` the same on the host; depths: [R] each node's depth; paths: () ->
    [R, D] each node's path tokens (root excluded) padded with V, asked for only where a rule
    reads them. Returns a processed fp32 copy, or `logits` itself when nothing applies."""
    allowed = sampling_metadata.allowed_token_ids_mask
    bad_words = sampling_metadata.bad_words_token_ids
    min_tokens = min_tokens_state(sampling_metadata)
    if penalties is None and allowed is None and not bad_words and not min_tokens:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if allowed is not None:
        logits.masked_fill_(allowed[row_request], float("-inf"))
    if bad_words:
        requests = host_request.tolist()
        rows = {r: bad_words[i] for r, i in enumerate(requests) if i in bad_words}
        if rows:  # per row, as vLLM's `apply_bad_words` takes it: only for such requests
            vocab = logits.shape[-1]
            outputs = sampling_metadata.output_token_ids
            path_lists = paths()
            histories = [
                list(outputs[i]) + [t for t in path_lists[r].tolist() if t != vocab]
                if r in rows
                else []
                for r, i in enumerate(requests)
            ]
            apply_bad_words(logits, rows, histories)
    if min_tokens:
        _mask_stop_tokens(logits, host_request.numpy(), depths, min_tokens)
    if penalties is not None:
        _apply_penalties(logits, row_request, paths(), sampling_metadata, penalties)
    return logits


def _apply_penalties(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    paths: np.ndarray,
    sampling_metadata,
    penalties: StepPenalties,
) -> None:
    """vLLM's `apply_penalties` at every row: its request's output-token counts plus the
    row's own path tokens (one gather and one scatter for all rows), then vLLM's repetition
    penalty op and the frequency and presence terms, as a plain step computes them."""
    from vllm._custom_ops import apply_repetition_penalties

    vocab = logits.shape[-1]
    path = to_device(torch.from_numpy(paths), logits.device)
    counts = penalties.output_counts[row_request]  # [R, V + 1]
    counts.scatter_add_(1, path, torch.ones_like(path))
    counts = counts[:, :vocab]
    mask = counts > 0
    apply_repetition_penalties(
        logits,
        penalties.prompt_mask[row_request],
        mask,
        sampling_metadata.repetition_penalties[row_request],
    )
    logits -= sampling_metadata.frequency_penalties[row_request].unsqueeze(dim=1) * counts
    logits -= sampling_metadata.presence_penalties[row_request].unsqueeze(dim=1) * mask


def _mask_stop_tokens(
    logits: torch.Tensor,
    requests: np.ndarray,
    depths: np.ndarray,
    state: dict[int, tuple[int, int, list[int], bool]],
) -> None:
    """Stop tokens to -inf at every row whose output length (committed + depth) is still below
    the request's min_tokens; rows of structured-output requests left all -inf keep them (as
    `MinTokensLogitsProcessor._mask_stop_token_logits`). The rows are found on the host per
    request, written with one copy, and restored on the device: no host read."""
    row_parts, token_parts, structured_parts = [], [], []
    for i, (minimum, length, stop, is_structured) in state.items():
        under = np.flatnonzero((requests == i) & (length + depths < minimum))
        row_parts.append(np.repeat(under, len(stop)))
        token_parts.append(np.tile(np.asarray(stop, dtype=np.int64), under.size))
        structured_parts.append(np.full(under.size * len(stop), is_structured))
    rows = np.concatenate(row_parts) if row_parts else np.zeros(0, dtype=np.int64)
    if not rows.size:
        return
    tokens, structured = np.concatenate(token_parts), np.concatenate(structured_parts)
    restorable = np.unique(rows[structured])
    # each entry's place among the restorable rows (entries of other rows: masked out below)
    place = np.minimum(np.searchsorted(restorable, rows), max(restorable.size - 1, 0))
    host = np.stack([rows, tokens, place, structured]).astype(np.int64)
    index_rows, index_tokens, places, is_restorable = to_device(
        torch.from_numpy(host), logits.device
    )
    index = (index_rows, index_tokens)
    before = logits[index]  # a copy (advanced indexing)
    minus_inf = torch.full((), float("-inf"), device=logits.device)
    logits.index_put_(index, minus_inf)
    if restorable.size:
        dead = torch.isneginf(logits[to_device(torch.from_numpy(restorable), logits.device)]).all(
            -1
        )
        restore = is_restorable.bool() & dead[places] & torch.isfinite(before)
        logits.index_put_(index, torch.where(restore, before, minus_inf))
