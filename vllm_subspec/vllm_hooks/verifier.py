"""SampleMatchVerifier: in the runner's `rejection_sampler` slot, the verify side of every step
(a chain's too): vLLM's call and `SamplerOutput`, with sample-then-match inside
(`StepSession.sample_and_walk`); a step without drafts goes to vLLM's own `Sampler`. It reads
the runner's batch and writes the runner's buffers; everything else is the session's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_subspec.step.paged_kv import PagedKv, copy_kv
from vllm_subspec.step.session import StepSession, VerifyRequest
from vllm_subspec.step.transfer import to_device
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream


class SampleMatchVerifier:
    def __init__(
        self,
        runner,
        session: StepSession,
        kv_caches: Callable[[], list[tuple[object, torch.Tensor, str | None]]],
        head_stream: HeadStartStream,
        lm_head_logits: Callable[[torch.Tensor, str | None], torch.Tensor],
    ):
        """From the runner (`SubSpecRunner`): kv_caches: () -> (attention impl, KV cache, CPU
        attention ISA) of every decoder layer, once the model is loaded; head_stream: where
        head starts draft (the walk waits for them); lm_head_logits: (hidden, lm_head) -> the
        draft's logits through that lm_head (a compared step's ranks)."""
        self.runner = runner
        self.session = session
        self.kv_caches = kv_caches
        self.head_stream = head_stream
        self.lm_head_logits = lm_head_logits
        self._no_draft: dict[int, SpecDecodeMetadata] = {}  # batch size -> vLLM's metadata

    def no_draft_metadata(
        self,
        num_draft_tokens: np.ndarray,
        cu_num_scheduled_tokens: np.ndarray,
        build: Callable[[np.ndarray, np.ndarray], SpecDecodeMetadata],
    ) -> SpecDecodeMetadata:
        """vLLM's `SpecDecodeMetadata` for a step in which no request has drafts, as
        `build` (`GPUModelRunner._calc_spec_decode_metadata`) makes it. Without drafts every
        field but the logits indices depends on the batch size alone, so `build`'s own result
        is kept per batch size (device tensors nothing writes: vLLM and SubSpec only read a
        step's metadata) and only the logits indices (each request's last scheduled token) are
        copied to the device."""
        fixed = self._no_draft.get(len(num_draft_tokens))
        if fixed is None:
            built = build(num_draft_tokens, cu_num_scheduled_tokens)
            # the cache is a copy: a step's consumers may reassign fields of their own
            self._no_draft[len(num_draft_tokens)] = dataclasses.replace(built)
            return built
        # vLLM's np.repeat(cu - sampled, sampled) + arange with one token sampled a request
        logits_indices = cu_num_scheduled_tokens - (num_draft_tokens + 1)
        return dataclasses.replace(
            fixed,
            num_draft_tokens=num_draft_tokens.tolist(),
            logits_indices=async_tensor_h2d(logits_indices, device=fixed.logits_indices.device),
        )

    def prepare_verify(self, scheduler_output) -> None:
        """After vLLM's `_prepare_inputs` laid the scheduled drafts out as a chain."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        # prompt tokens run in this step (a request's prefill, or a chunk of it): more tokens
        # than one a request and its drafts
        prompt = scheduler_output.total_num_scheduled_tokens > len(
            scheduler_output.num_scheduled_tokens
        ) + sum(len(d) for d in spec.values())
        if not spec:  # a plain step: nothing to lay out
            self.session.prepare_verify([], prompt_tokens=prompt)
            return
        runner, batch = self.runner, self.runner.input_batch
        kv_end = np.zeros(batch.num_reqs, dtype=np.int64)
        if self.session.options.head_start_levels:
            # the positions with a KV slot (vLLM reserves lookahead slots past the verify)
            table = batch.block_table[0]
            kv_end = np.minimum(
                table.num_blocks_per_row[: batch.num_reqs] * table.block_size, runner.max_model_len
            )
        requests = [
            VerifyRequest(
                i,
                req_id,
                list(spec[req_id]),
                int(batch.num_computed_tokens_cpu[i]),
                int(runner.query_start_loc.np[i]),
                int(kv_end[i]),
            )
            for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
            if spec.get(req_id)
        ]
        writes = self.session.prepare_verify(requests, prompt_tokens=prompt)
        if len(writes.rows):  # one copy for every request's rewrites
            device = runner.positions.device
            both = to_device(torch.from_numpy(np.stack([writes.rows, writes.positions])), device)
            runner.positions.index_copy_(0, both[0], both[1].to(runner.positions.dtype))
        copies = self.session.head_start_copies()
        if len(copies.src):  # before the verify overwrites the branches' slots
            copy_kv(copies.requests, copies.src, copies.dst, self._paged_kv())
            self.head_stream.inputs_copied()

    def _paged_kv(self) -> PagedKv:
        """The step's KV: the runner's table holds KV-manager blocks of its own block size,
        which a backend may split into smaller kernel blocks: slots are computed at the
        table's."""
        batch = self.runner.input_batch
        table = batch.block_table[0]
        return PagedKv(self.kv_caches(), table.get_device_tensor(batch.num_reqs), table.block_size)

    def verify_forward(self):
        """Around vLLM's `_model_forward`: the tree plan of this step's verify is active."""
        return self.session.verify_forward()

    def __call__(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        """In place of vLLM's `RejectionSampler.__call__`."""
        num_draft = list(metadata.num_draft_tokens)
        if not any(num_draft):  # no drafts this step: drawn as a plain engine draws them
            self.session.sampled_plain()
            return self.runner.sampler(logits=logits, sampling_metadata=sampling_metadata)
        batch = self.runner.input_batch
        # fp32 work in chunks of max_num_seqs rows: the size vLLM's sampler warm-up profiles
        walk = self.session.sample_and_walk(
            batch.req_ids[: len(num_draft)],
            num_draft,
            logits,
            sampling_metadata,
            self.runner.sampler.topk_topp_sampler,
            self._paged_kv,
            # before the walk reads the head starts' drafts
            self.head_stream.join,
            self.runner.max_num_reqs,
            self.lm_head_logits,
        )
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(
                logits, walk.drawn_at, walk.tokens, sampling_metadata.max_num_logprobs
            )
        return SamplerOutput(
            sampled_token_ids=to_device(walk.tokens, logits.device), logprobs_tensors=logprobs
        )

    def _logprobs(self, logits, drawn_at, tokens, max_num_logprobs):
        """Raw logprobs of the emitted tokens (and the top ones) in vLLM's padded spec-decode
        layout, from the target's logits where each token was drawn, as a plain engine
        reports them; fp32 rows max_num_seqs at a time."""
        sampler = self.runner.sampler
        host = torch.stack(
            [drawn_at.flatten().to(torch.int64), tokens.flatten().clamp(min=0).to(torch.int64)]
        )
        at, ids = to_device(host, logits.device)  # one copy
        parts = []
        for start in range(0, at.shape[0], self.runner.max_num_reqs):
            chunk = slice(start, start + self.runner.max_num_reqs)
            rows = logits[at[chunk]].float()
            values = (
                rows if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(rows)
            )
            parts.append(sampler.gather_logprobs(values, max_num_logprobs, ids[chunk]))
        if len(parts) == 1:
            return parts[0]
        return LogprobsTensors(*(torch.cat(field) for field in zip(*(p[:3] for p in parts))))
