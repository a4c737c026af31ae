"""One RPC a step fewer: a step's drafts come back with its sampled tokens.

vLLM's engine core asks its workers for a step's drafts in an RPC of their own after each step
(`EngineCore.post_step` -> `Executor.take_draft_token_ids`). Under vLLM's multiprocess
executor, which its CPU backend always runs, that round trip cost ~0.25 ms a step on a 2-core
CPU, plain steps included: 1.5% of SmolLM2-135M's step. SubSpec's executor asks its workers
for the sampled tokens and the drafts in one RPC (`SubSpecWorker.sample_tokens_and_drafts`)
and hands the drafts to the engine core's `take_draft_token_ids` without another.
`engine_rules._drafts_with_samples` selects it on CPU where vLLM would run "mp";
docs/architecture.md, "One RPC a step".
"""

from __future__ import annotations

from vllm import envs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

_NOT_RECEIVED = object()  # no drafts came with this step's sampled tokens


class SubSpecMultiprocExecutor(MultiprocExecutor):
    """vLLM's `MultiprocExecutor`; its blocking `sample_tokens` also receives the step's drafts,
    which `take_draft_token_ids` then returns. Everything else (a batch queue's non-blocking
    calls, KV or encoder-cache connectors, whose aggregators merge every worker's output)
    runs vLLM's own RPCs."""

    _drafts = _NOT_RECEIVED

    def execute_model(self, scheduler_output, non_block: bool = False):
        self._drafts = _NOT_RECEIVED  # drafts are one step's
        return super().execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        if (
            non_block
            or self.kv_output_aggregator is not None
            or self.ec_output_aggregator is not None
        ):
            return super().sample_tokens(grammar_output, non_block)
        output, self._drafts = self.collective_rpc(
            "sample_tokens_and_drafts",
            args=(grammar_output,),
            unique_reply_rank=self.output_rank,
            timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
        )
        return output

    def take_draft_token_ids(self):
        drafts, self._drafts = self._drafts, _NOT_RECEIVED
        if drafts is _NOT_RECEIVED:
            return super().take_draft_token_ids()
        return drafts
