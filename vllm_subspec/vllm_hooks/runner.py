"""The seam: every call vLLM's model runner makes into SubSpec, in the order vLLM makes them.

`SubSpecRunner` is mixed into vLLM's own model runner classes (`SubSpecGPUModelRunner`, and
`SubSpecCPUModelRunner` in cpu_runner.py), which vLLM builds through the worker class the front
end names (`engine_rules.subspec_worker_cls`). The two parts it puts in vLLM's designed slots,
the drafter (`SubSpecProposer`) and the rejection sampler (`SampleMatchVerifier`), share one
`StepSession`, which this runner owns; nothing of SubSpec is stored on vLLM's objects.
"""

from __future__ import annotations

import contextvars

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_subspec.config import options_from_vllm_config
from vllm_subspec.step.session import StepSession, this_rank_decides
from vllm_subspec.vllm_hooks.stack_chunk import call_on_fresh_chunk

# The runner whose `load_model` is in progress (the weight hook builds its substitutes).
_LOADING: contextvars.ContextVar[SubSpecRunner | None] = contextvars.ContextVar(
    "subspec_loading_runner", default=None
)


class SubSpecRunner:
    """vLLM's model runner with SubSpec: its overrides, read top to bottom, are the calls vLLM
    makes into SubSpec, in vLLM's order (`drafter.propose` and `rejection_sampler(...)` are
    the runner's own calls into its slots)."""

    # ---- 1. construction (the worker's `init_device`) ------------------------------------
    def __init__(self, vllm_config, device, *args, **kwargs):
        super().__init__(vllm_config, device, *args, **kwargs)
        from vllm.model_executor.offloader.base import get_offloader, set_offloader
        from vllm.platforms import current_platform

        from vllm_subspec.vllm_hooks.engine_rules import check_final_config
        from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream
        from vllm_subspec.vllm_hooks.prefetch_overlap import OverlappingPrefetchOffloader
        from vllm_subspec.vllm_hooks.proposer import SubSpecProposer
        from vllm_subspec.vllm_hooks.verifier import SampleMatchVerifier

        options = options_from_vllm_config(vllm_config)
        check_final_config(vllm_config, options, current_platform)
        # vLLM's prefetch offloader, made by `GPUModelRunner.__init__` (its ring has not
        # wrapped any layer yet), becomes the one whose next copies overlap drafting
        overlapping = OverlappingPrefetchOffloader.replacing(
            get_offloader(), vllm_config.parallel_config.use_ubatching
        )
        if overlapping is not None:
            set_offloader(overlapping)
        self.session = StepSession.from_options(
            options, share=tensor_parallel_decisions(vllm_config.parallel_config)
        )
        # the head starts' stream: the drafter drafts on it, the verifier's walk waits for it
        self.head_stream = HeadStartStream(device)
        self.drafter = SubSpecProposer(
            vllm_config, device, self, self.session, overlapping, self.head_stream
        )
        self.rejection_sampler = SampleMatchVerifier(
            self,
            self.session,
            kv_caches=self.drafter.kv_caches,
            head_stream=self.head_stream,
            lm_head_logits=lambda hidden, head: self.drafter.model.compute_logits(hidden, head),
        )
        self._verify_cad = None  # this step's drafter metadata, until its forward is queued
        self._draft_pass_priced = False  # `SubSpecProposer.price_draft_pass` has run

    # ---- 2. loading (the worker's `load_model`) ------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        """vLLM loads the target, whose weight hook calls `target_weights_loaded` below, then
        calls `self.drafter.load_model(target)`."""
        token = _LOADING.set(self)
        try:
            super().load_model(*args, **kwargs)  # type: ignore[misc]  # (a mixin)
        finally:
            _LOADING.reset(token)

    def target_weights_loaded(self, model, target_device, process_weights) -> None:
        """From the weight hook (patches.py): the target's raw weights are loaded, not yet
        processed; the drafter builds its substitutes around vLLM's `process_weights()`."""
        self.drafter.build_substitutes(model, torch.device(target_device), process_weights)

    # ---- 3. each step (`execute_model`, then `sample_tokens`) ----------------------------
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        """After vLLM laid the scheduled drafts out as a chain: the verify's tree positions."""
        out = super()._prepare_inputs(scheduler_output, *args, **kwargs)
        self.rejection_sampler.prepare_verify(scheduler_output)
        return out

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        """vLLM's verify metadata; for a step without drafts (every plain step of a SubSpec
        engine) built from a cached copy: one host-to-device copy instead of five and no
        gathers (`SampleMatchVerifier.no_draft_metadata`)."""
        build = super()._calc_spec_decode_metadata
        if num_draft_tokens.any():
            return build(num_draft_tokens, cu_num_scheduled_tokens)
        return self.rejection_sampler.no_draft_metadata(
            num_draft_tokens, cu_num_scheduled_tokens, build
        )

    def _build_attention_metadata(self, *args, **kwargs):
        """vLLM's metadata of this step's forward; its drafter's copy is also the one the
        verify's head starts draft from (`execute_model`)."""
        out = super()._build_attention_metadata(*args, **kwargs)
        self._verify_cad = out[1]
        return out

    def _model_forward(self, *args, **kwargs):
        """The target's forward: the verify's tree plan is active for exactly this pass."""
        with self.rejection_sampler.verify_forward():
            return super()._model_forward(*args, **kwargs)

    def execute_model(self, *args, **kwargs):
        """vLLM's step up to the target's logits; once those are queued, the verify's head
        starts are drafted (`SubSpecProposer.draft_head_starts`: on CUDA beside the verify,
        on their own stream; on CPU after it)."""
        self._verify_cad = None
        out = super().execute_model(*args, **kwargs)
        cad, self._verify_cad = self._verify_cad, None
        self.drafter.draft_head_starts(cad)
        return out

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        """The session plans each step first: a plain plan drafts nothing, and vLLM's draft
        inputs (`EagleProposer.prepare_next_token_ids_padded`, `prepare_inputs_padded`) are
        not built for it; any other goes on to `self.drafter.propose`."""
        req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        if not self._draft_pass_priced:  # the first step: before the tuner plans any
            self._draft_pass_priced = True
            self.drafter.price_draft_pass()
        if self.session.plan_step(req_ids).shape.depth == 0:
            return self.drafter.plain_step(len(req_ids))
        return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """A tree stops each request at its own max_model_len (`draft.draft_tree`), so a tree
        engine drafts whenever there is a batch; a chain keeps vLLM's whole-batch rule (its
        passes past the limit would rely on vLLM's clamped positions)."""
        if not self.session.options.is_tree:
            return super()._input_fits_in_drafter(  # type: ignore[misc]  # (a mixin)
                common_attn_metadata
            )
        return common_attn_metadata is not None


def tensor_parallel_decisions(parallel_config):
    """With tensor parallelism every rank runs the session, and the decisions its tuner takes
    from its own clock must be one rank's: rank 0 decides, the others take its decision
    (broadcast over the group's CPU communicator: a few small objects a step)."""
    if parallel_config.tensor_parallel_size == 1:
        return this_rank_decides

    def rank0_decides(decision):
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(decision, src=0)

    return rank0_decides


def loading_runner() -> SubSpecRunner | None:
    """The SubSpec runner loading its target in this thread (None: not SubSpec's load)."""
    return _LOADING.get()


class SubSpecGPUModelRunner(SubSpecRunner, GPUModelRunner):
    pass


class SubSpecWorker:
    """Mixed into vLLM's worker classes (GPU and CPU) that build SubSpec's runner. A step's
    two calls run on a fresh chunk of Python's frame stack (stack_chunk.py): no chunk mapped
    and unmapped per Python call inside them."""

    def execute_model(self, *args, **kwargs):
        return call_on_fresh_chunk(super().execute_model, args, kwargs)

    def sample_tokens(self, *args, **kwargs):
        return call_on_fresh_chunk(super().sample_tokens, args, kwargs)

    def sample_tokens_and_drafts(self, grammar_output):
        """vLLM's `sample_tokens`, then the drafts proposed in it (`take_draft_token_ids`):
        one RPC for both (executor.py, `SubSpecMultiprocExecutor`)."""
        output = self.sample_tokens(grammar_output)
        return output, self.model_runner.take_draft_token_ids()


class SubSpecGPUWorker(SubSpecWorker, Worker):
    """vLLM's GPU worker, building SubSpec's runner (`Worker._make_model_runner`)."""

    def _make_model_runner(self) -> SubSpecGPUModelRunner:
        if self.use_v2_model_runner:  # patches.py forces V1 for SubSpec engines
            raise RuntimeError("vllm-subspec: SubSpec runs on vLLM's V1 model runner only")
        return SubSpecGPUModelRunner(self.vllm_config, self.device)


def subspec_of(worker_or_runner) -> SubSpecRunner:
    """A worker's (or runner's) SubSpec runner: its `session`, `drafter`,
    `rejection_sampler` and `drafter.substitutes`. The one way tests and benchmarks reach them
    (through `collective_rpc`)."""
    runner = getattr(worker_or_runner, "model_runner", worker_or_runner)
    if not isinstance(runner, SubSpecRunner):
        raise TypeError(f"vllm-subspec: {type(runner).__name__} is not a SubSpec model runner")
    return runner
