"""SubSpecProposer: vLLM's drafter interface for SubSpec.

The draft is the target itself in draft mode (`draft_model.DraftModel`: offloaded layers swapped
for resident substitutes) and shares the target's attention layers, hence its KV cache. What to
draft is the step session's (step/session.py); its passes become vLLM forwards in
draft_passes.py (`VllmDraftPasses`, `VllmHeadPasses`). The start-up work (substitutes, kernel
warm-up, lm_head timing, the memory profile's temporaries) is in draft_startup.py, the draft's
CUDA graphs in draft_graphs.py; this class holds vLLM's overrides and the state they share.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_subspec.config import options_from_vllm_config
from vllm_subspec.draft_model import row_buckets
from vllm_subspec.step.node_constraints import chain_only_reason
from vllm_subspec.step.session import StepSession
from vllm_subspec.vllm_hooks import draft_startup
from vllm_subspec.vllm_hooks.draft_compile import build_draft_model
from vllm_subspec.vllm_hooks.draft_graphs import (
    capture_bucket,
    dispatched,
    draft_cudagraph_mode,
    replay_or_eager,
)
from vllm_subspec.vllm_hooks.draft_passes import VllmDraftPasses, VllmHeadPasses
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream
from vllm_subspec.vllm_hooks.metrics import METRICS_DIR_ENV, StepMetricsFile

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


class SubSpecProposer(DraftModelProposer):
    """In the runner's `drafter` slot: loads no model (the draft is the target with
    substitutes), drafts through the step session."""

    model: nn.Module  # the draft (`build_draft_model`), set in load_model
    _draft_attn_layer_names: set[str]

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        runner,
        session: StepSession,
        offloader,
        head_stream: HeadStartStream,
    ):
        """offloader: an `OverlappingPrefetchOffloader`, or None; head_stream: the runner's,
        where head starts draft (`draft_head_starts`) and are profiled."""
        super().__init__(vllm_config, device, runner)
        self.options = options_from_vllm_config(vllm_config)
        self.runner = runner
        self.session = session
        self.offloader = offloader
        self.substitutes: Any = None  # a SubstituteSet, built when the target's weights load
        self._peak_temporaries_profiled = False  # dummy_run: once, in vLLM's profiling pass
        self.captured_buckets: set[int] = set()  # row counts whose draft pieces are captured
        self.metrics: StepMetricsFile | None = None  # set in load_model (TP rank 0)
        self.head_stream = head_stream

    # ---- loading -------------------------------------------------------------------------
    def build_substitutes(self, target: nn.Module, device: torch.device, process_weights) -> None:
        """From the target's raw weights, around vLLM's `process_weights()`
        (`draft_startup.build_substitutes`)."""
        self.substitutes = draft_startup.build_substitutes(
            target, self.options, self.vllm_config, device, process_weights
        )

    def load_model(self, target_model: nn.Module) -> None:
        """Wrap the target (no second model is loaded) and draft through its attention layers."""
        substitutes = self.substitutes
        if substitutes is None:
            raise RuntimeError(
                "vllm-subspec: the target was loaded without SubSpec's weight "
                "hook; is the plugin enabled in this process (VLLM_PLUGINS)?"
            )
        self.model = build_draft_model(target_model, substitutes, self.device, self.vllm_config)
        self._draft_attn_layer_names = draft_startup.draft_attention_layers(
            self.vllm_config, target_model
        )
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() == 0:  # one writer per engine
            # the engine index the front end labels stats with (`data_parallel_index`)
            self.metrics = StepMetricsFile(
                os.environ.get(METRICS_DIR_ENV),
                self.vllm_config.parallel_config.data_parallel_index,
                substitutes.memory_parts(),
            )
        if self.device.type == "cuda":  # GemLite compiles per row-count bucket: do it now
            draft_startup.warm_up_kernels(substitutes, self.options, self.vllm_config, self.device)
        tuner = self.session.tuner
        saved = draft_startup.saved_tuner_costs(
            self.options, self.vllm_config, substitutes, self.device
        )
        if tuner is not None and tuner.model.measure_rates and saved is not None:
            tuner.keep_costs(saved)
        if tuner is not None and tuner.lm_heads is not None:
            draft_startup.time_lm_heads(
                tuner.lm_heads,
                self.model.compute_logits,
                max(self.options.widths),
                self.max_num_tokens,
                self.vllm_config.model_config.get_hidden_size(),
                self.vllm_config.model_config.dtype,
                self.device,
            )

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        logger.info(self.substitutes.layout(kv_bytes))

    # ---- CUDA graphs (draft_graphs.py) ---------------------------------------------------
    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """vLLM's rule for its drafters, where the draft has pieces to capture
        (`draft_cudagraph_mode`)."""
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        super().initialize_cudagraph_keys(
            draft_cudagraph_mode(
                self.vllm_config.compilation_config,
                cudagraph_mode,
                is_breakable_cudagraph_enabled(),
            )
        )

    def draft_bucket(
        self, num_tokens: int, use_cudagraphs: bool = True
    ) -> tuple[CUDAGraphMode, int]:
        """(runtime mode, padded row count) of a draft forward over `num_tokens` rows
        (`replay_or_eager` on vLLM's dispatch)."""
        mode, padded = dispatched(self.cudagraph_dispatcher, num_tokens, use_cudagraphs)
        return replay_or_eager(
            mode,
            padded,
            num_tokens,
            self.device.type == "cuda",
            self.captured_buckets,
            bool(getattr(self.runner, "num_prompt_logprobs", None)),
        )

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings=None,
    ) -> None:
        """vLLM's warm-up of the drafter (`GPUModelRunner._dummy_run`): writes KV only through
        vLLM's slot mappings; in the capture phase captures the draft's pieces for a bucket;
        in the first call without slot mappings (`profile_run`) also allocates a step's
        largest temporaries for vLLM's memory profile (`run_peak_temporaries`). The rows are
        capped at the draft's own bound (vLLM asks for its widest batch). docs/gpu.md."""
        if is_graph_capturing:
            mode, padded = dispatched(
                self.cudagraph_dispatcher, min(num_tokens, self.draft_rows_bound()), use_cudagraphs
            )
            if mode != CUDAGraphMode.NONE:
                capture_bucket(self, mode, padded)
            return
        num_tokens = min(num_tokens, self.warm_up_rows())
        with set_forward_context(
            None,
            self.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slot_mappings if isinstance(slot_mappings, dict) else {},
        ):
            hidden = self.model(
                input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens]
            )
        if slot_mappings is None and not self._peak_temporaries_profiled:
            self._peak_temporaries_profiled = True
            self.run_peak_temporaries(hidden.shape[-1], hidden.dtype)

    @torch.inference_mode()
    def price_draft_pass(self) -> None:
        """Time a draft pass at 1, k and 4k rows for the tuner (`draft_startup.time_draft_pass`):
        with plain steps' time, it prices the first drafting steps before any is timed. Called
        by the runner once, before the first step is planned; writes no KV."""
        tuner = self.session.tuner
        if tuner is None or not tuner.model.measure_rates:
            return
        widest, bound = max(self.options.widths), self.warm_up_rows()
        rows = sorted({1, min(widest, bound), min(4 * widest, bound)})

        def run_pass(r: int) -> None:
            with set_forward_context(
                None,
                self.vllm_config,
                num_tokens=r,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
                slot_mapping={},
            ):
                hidden = self.model(input_ids=self.input_ids[:r], positions=self.positions[:r])
            self.model.compute_logits(hidden[:r], tuner.lm_head)

        draft_startup.time_draft_pass(run_pass, rows, self.device, tuner.model.seed_draft_pass)

    def run_peak_temporaries(self, hidden_size: int, dtype: torch.dtype) -> None:
        """A step's widest temporaries past its forwards, for vLLM's memory profile
        (`draft_startup.allocate_peak_temporaries`)."""
        draft_startup.allocate_peak_temporaries(
            self.options,
            self.vllm_config,
            hidden_size,
            dtype,
            self.device,
            draft_rows=self.max_num_tokens,
            verify_rows=self.verify_rows_bound(),
            draw_rows=self.runner.max_num_reqs,
            compute_logits=self.model.compute_logits,
            head_stream=self.head_stream,
            topk_topp_sampler=self.runner.sampler.topk_topp_sampler,
        )

    def drafting(self):
        """The scope of draft forwards: the overlapping offloader skips its waits in it."""
        if self.offloader is None:
            return contextlib.nullcontext()
        return self.offloader.drafting()

    def draft_rows_bound(self) -> int:
        return row_buckets.draft_rows_bound(
            self.vllm_config.scheduler_config.max_num_seqs, self.max_num_tokens, self.options.widths
        )

    def warm_up_rows(self) -> int:
        return row_buckets.warm_up_rows(
            self.draft_rows_bound(),
            self.vllm_config.compilation_config.cudagraph_capture_sizes or (),
            self.max_num_tokens,
        )

    def verify_rows_bound(self) -> int:
        sc = self.vllm_config.scheduler_config
        return row_buckets.verify_rows_bound(
            sc.max_num_batched_tokens, sc.max_num_seqs, self.options.num_draft_tokens
        )

    # ---- drafting (draft_passes.py) ------------------------------------------------------
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor | list[list[int]]:
        """vLLM's drafter call (`GPUModelRunner.propose_draft_token_ids`)."""
        if self.offloader is not None:  # first, so the copies run while this step drafts
            self.offloader.start_before_draft()
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        passes = VllmDraftPasses(self, common_attn_metadata, num_rejected_tokens_gpu)
        if num_speculative_tokens == 0:
            return torch.empty(batch_size, 0, dtype=torch.int64, device=next_token_ids.device)
        req_ids = self.runner.input_batch.req_ids[:batch_size]
        chain_only = (
            [
                chain_only_reason(self.runner.requests[r].sampling_params) is not None
                for r in req_ids
            ]
            if self.options.is_tree
            else None
        )  # a chain is one
        drafts = self.session.propose(
            passes, req_ids, next_token_ids, num_speculative_tokens, chain_only
        )
        if self.metrics is not None:
            self.metrics.record(self.session.stats)
        return drafts

    @torch.inference_mode()
    def draft_head_starts(self, verify_cad) -> None:
        """After the verify forward is queued (`SubSpecRunner._model_forward`): the session's
        head starts of this verify, on the head-start stream."""
        if verify_cad is None or not self.session.head_starts_to_draft():
            return
        with self.head_stream.drafting():
            self.session.draft_head_starts(lambda heads: VllmHeadPasses(self, verify_cad, heads))

    def plain_step(self, batch_size: int) -> list[list[int]]:
        """A step the session planned plain (`SubSpecRunner.propose_draft_token_ids`): no
        drafts; the next verify's first copies still start now."""
        if self.offloader is not None:
            self.offloader.start_before_draft()
        if self.metrics is not None:
            self.metrics.record(self.session.stats)
        return [[] for _ in range(batch_size)]

    def kv_caches(self) -> list[tuple[object, torch.Tensor, str | None]]:
        """(attention impl, per-layer KV cache, CPU attention ISA) of every decoder layer."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        caches = []
        for name in sorted(self._draft_attn_layer_names):
            kv = ctx[name].kv_cache
            caches.append(
                (
                    ctx[name].impl,
                    kv[0] if isinstance(kv, (list, tuple)) else kv,
                    getattr(ctx[name], "isa", None),
                )
            )
        return caches
