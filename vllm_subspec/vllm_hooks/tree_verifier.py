"""The verify side of a tree step, as vLLM's model runner sees it: the runner's
`rejection_sampler` (same call, same `SamplerOutput`), plus the two hooks patches.py runs around
`_prepare_inputs` and `_model_forward`. Everything it does is `StepSession`'s; this class only
reads the runner's batch and writes the runner's buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput

from vllm_subspec.step.session import StepSession, VerifyRequest


class TreeVerifier:
    def __init__(self, runner, session: StepSession,
                 kv_caches: Callable[[], list[tuple[object, torch.Tensor, str | None]]]):
        self.runner = runner
        self.session = session
        self.kv_caches = kv_caches  # (impl, KV cache, CPU ISA) per decoder layer, after load

    def prepare_verify(self, scheduler_output) -> None:
        """After vLLM's `_prepare_inputs` laid the scheduled drafts out as a chain."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        runner, batch = self.runner, self.runner.input_batch
        requests = [VerifyRequest(i, req_id, list(spec[req_id]),
                                  int(batch.num_computed_tokens_cpu[i]),
                                  int(runner.query_start_loc.np[i]))
                    for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
                    if spec.get(req_id)]
        for write in self.session.prepare_verify(requests):
            end = write.start + len(write.positions)
            runner.positions[write.start: end] = write.positions.to(runner.positions.device)

    def verify_forward(self):
        """Around vLLM's `_model_forward`: the tree mask of this step's verify is active."""
        return self.session.verify_forward()

    def __call__(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        """In place of vLLM's `RejectionSampler.__call__` (rejection_sampler.py 0.32.0)."""
        num_draft = list(metadata.num_draft_tokens)
        batch = self.runner.input_batch
        # fp32 work in chunks of max_num_seqs rows: the size vLLM's sampler warm-up profiles
        walk = self.session.sample_and_walk(batch.req_ids[: len(num_draft)], num_draft, logits,
                                            sampling_metadata,
                                            self.runner.sampler.topk_topp_sampler,
                                            self.runner.max_num_reqs)
        if walk.moves:
            # the runner's table holds KV-manager blocks of its own block size, which a
            # backend may split into smaller kernel blocks (block_table.py 0.32.0 :49-197)
            table = batch.block_table[0]
            self.session.compact(walk.moves, self.kv_caches(),
                                 table.get_device_tensor(batch.num_reqs), table.block_size)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(logits, walk.drawn_at, walk.tokens,
                                      sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=walk.tokens.to(logits.device),
                             logprobs_tensors=logprobs)

    def _logprobs(self, logits, drawn_at, tokens, max_num_logprobs):
        """Logprobs of the emitted tokens (and the top ones) in vLLM's padded spec-decode
        layout: one row per output slot, padding rows filtered out by vLLM's parse_output.
        Raw logprobs (vLLM's default `logprobs_mode`), from the target's logits where each
        token was drawn, as a plain engine reports them."""
        sampler = self.runner.sampler
        at = drawn_at.flatten().to(logits.device)
        ids = tokens.flatten().clamp(min=0).to(torch.int64).to(logits.device)
        parts = []
        # fp32 rows max_num_seqs at a time, as the draws (one row per output slot: B x (the
        # widest tree's nodes + 1) in all)
        for start in range(0, at.shape[0], self.runner.max_num_reqs):
            chunk = slice(start, start + self.runner.max_num_reqs)
            rows = logits[at[chunk]].float()
            values = rows if sampler.logprobs_mode == "raw_logits" \
                else sampler.compute_logprobs(rows)
            parts.append(sampler.gather_logprobs(values, max_num_logprobs, ids[chunk]))
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(*(torch.cat(field) for field in zip(*(p[:3] for p in parts))))
