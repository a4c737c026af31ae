"""SubSpecProposer: vLLM's drafter interface for SubSpec, and the draft's forwards.

The draft is the target itself in draft mode (`draft_model.DraftModel`: offloaded layers swapped
for resident substitutes) and shares the target's attention layers, hence its KV cache. Each
step's first draft pass runs the bonus token alone at p + 1 (p: the last verified position), so
draft KV lands only in lookahead slots the next verify rewrites before reading them
(docs/losslessness.md). What to draft is the step session's (step/session.py); this module turns
its passes into vLLM forwards (`VllmDraftPasses`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import numpy as np
import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from vllm_subspec.config import options_from_vllm_config
from vllm_subspec.draft_model import row_buckets
from vllm_subspec.draft_model.gemlite_tuning import gemlite_autotune_kept
from vllm_subspec.draft_model.model import decoder_layers
from vllm_subspec.draft_model.substitute_cache import gemlite_autotune_path
from vllm_subspec.draft_model.substitute_set import (
    SubstituteSet,
    build_substitute_set,
    settle_host_memory,
)
from vllm_subspec.step.draft import HostCopy, device_index
from vllm_subspec.step.head_start import HeadStart
from vllm_subspec.step.lm_head_choice import COMPARED_REQUESTS
from vllm_subspec.step.node_constraints import chain_only_reason
from vllm_subspec.step.paged_kv import logical_to_slots
from vllm_subspec.step.session import StepSession
from vllm_subspec.step.transfer import to_device
from vllm_subspec.step.tree import TreeShape, sharpened_log_probs, widest_level
from vllm_subspec.step.tree_attention import TreePlan, TreeRows, tree_plan
from vllm_subspec.vllm_hooks.draft_compile import build_draft_model
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream
from vllm_subspec.vllm_hooks.metrics import METRICS_DIR_ENV, StepMetricsFile

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

# CommonAttentionMetadata's per-request fields besides those a tree pass sets itself: the ones
# its `unpadded` slices per request (`CommonAttentionMetadata.unpadded`, 0.32.0)
PER_REQUEST_FIELDS = ("causal", "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens",
                      "dcp_local_seq_lens_cpu_upper_bound", "is_prefilling", "req_idx",
                      "rswa_prefix_lens", "replayssm_decode_base_cpu")


class SubSpecProposer(DraftModelProposer):
    """In the runner's `drafter` slot: loads no model (the draft is the target with
    substitutes), drafts through the step session."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner,
                 session: StepSession, offloader=None):
        super().__init__(vllm_config, device, runner)
        self.options = options_from_vllm_config(vllm_config)
        self.runner = runner
        self.session = session
        self.offloader = offloader  # an `OverlappingPrefetchOffloader`, or None
        self.substitutes: SubstituteSet | None = None  # built when the target's weights load
        self._peak_temporaries_profiled = False  # dummy_run: once, in vLLM's profiling pass
        self.captured_buckets: set[int] = set()  # row counts whose draft pieces are captured
        self.metrics: StepMetricsFile | None = None  # set in load_model (TP rank 0)
        self.head_stream = HeadStartStream(device)

    # ---- loading -------------------------------------------------------------------------
    def build_substitutes(self, target: nn.Module, device: torch.device,
                          process_weights) -> None:
        """From the target's raw weights, before vLLM processes them (`process_weights()`;
        the CPU backend repacks linears there); on CPU the draft's host memory is planned
        against the KV cache vLLM's CPU worker will size."""
        from vllm_subspec.vllm_hooks.cpu_memory import kv_room_and_need

        kv_room = (lambda: kv_room_and_need(self.vllm_config)) if device.type == "cpu" \
            else None
        self.substitutes = build_substitute_set(target, self.options, self.vllm_config,
                                                device, kv_room)
        process_weights()
        if kv_room is not None:
            settle_host_memory(self.substitutes, kv_room)

    def load_model(self, target_model: nn.Module) -> None:
        """Wrap the target (no second model is loaded) and draft through its attention layers."""
        substitutes = self.substitutes
        if substitutes is None:
            raise RuntimeError("vllm-subspec: the target was loaded without SubSpec's weight "
                               "hook; is the plugin enabled in this process (VLLM_PLUGINS)?")
        self.model = build_draft_model(target_model, substitutes, self.device, self.vllm_config)
        target_attn = {id(layer.self_attn.attn) for layer in decoder_layers(target_model)}
        all_attn = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = {
            name for name, module in all_attn.items()
            if id(module) in target_attn
            and module.get_kv_cache_spec(self.vllm_config) is not None
        }
        if len(self._draft_attn_layer_names) != len(target_attn):
            raise RuntimeError("vllm-subspec: could not map every decoder layer to its attention")
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() == 0:  # one writer per engine
            # the engine index the front end labels stats with (`data_parallel_index`)
            self.metrics = StepMetricsFile(os.environ.get(METRICS_DIR_ENV),
                                           self.vllm_config.parallel_config.data_parallel_index,
                                           substitutes.memory_parts())
        if self.device.type == "cuda":  # GemLite compiles per row-count bucket: do it now,
            # with the autotuning of earlier starts (kept in the substitute cache's folder)
            kernels = [s.kernel for s in substitutes.every()]
            with gemlite_autotune_kept(gemlite_autotune_path(self.options, kernels,
                                                             self.device)):
                substitutes.warm_up(self.vllm_config.scheduler_config.max_num_seqs,
                                    self.options.widths, self.vllm_config.model_config.dtype,
                                    self.device,  # and the buckets draft graphs pad to
                                    self.vllm_config.compilation_config.cudagraph_capture_sizes
                                    or ())
        self._time_lm_heads()

    def _time_lm_heads(self, repeats: int = 3) -> None:
        """Each lm_head's logits timed at 1, k and 4k rows (k: the widest width) for the
        tuner's choice between them; at load, where waiting for the device costs nothing."""
        tuner = self.session.tuner
        heads = None if tuner is None else tuner.lm_heads
        if heads is None:
            return
        k = max(self.options.widths)
        hidden_size = self.vllm_config.model_config.get_hidden_size()
        dtype = self.vllm_config.model_config.dtype
        wait = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for rows in sorted({1, min(k, self.max_num_tokens), min(4 * k, self.max_num_tokens)}):
            hidden = torch.rand(rows, hidden_size, dtype=dtype, device=self.device)
            for head in heads.heads:
                self.model.compute_logits(hidden, head)  # first call: kernels' one-off work
                wait()
                start = time.perf_counter()
                for _ in range(repeats):
                    self.model.compute_logits(hidden, head)
                wait()
                heads.observe_cost(head, rows, (time.perf_counter() - start) / repeats)
        heads.start_with_cheaper(k)

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        logger.info(self.substitutes.layout(kv_bytes))

    # ---- CUDA graphs ---------------------------------------------------------------------
    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """vLLM's rule for its drafters, where the draft has pieces to capture
        (`draft_cudagraph_mode`)."""
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        super().initialize_cudagraph_keys(draft_cudagraph_mode(
            self.vllm_config.compilation_config, cudagraph_mode,
            is_breakable_cudagraph_enabled()))

    def draft_bucket(self, num_tokens: int, use_cudagraphs: bool = True
                     ) -> tuple[CUDAGraphMode, int]:
        """(runtime mode, padded row count) of a draft forward over `num_tokens` rows
        (`replay_or_eager` on vLLM's dispatch)."""
        mode, padded = self._dispatch(num_tokens, use_cudagraphs)
        return replay_or_eager(mode, padded, num_tokens, self.device.type == "cuda",
                               self.captured_buckets,
                               bool(getattr(self.runner, "num_prompt_logprobs", None)))

    def _dispatch(self, num_tokens: int, use_cudagraphs: bool) -> tuple[CUDAGraphMode, int]:
        """vLLM's dispatcher alone: the base class's `_determine_batch_execution_and_padding`
        synchronizes data-parallel ranks per forward, and a rank's draft passes are its own."""
        mode, batch = self.cudagraph_dispatcher.dispatch(
            num_tokens, valid_modes=None if use_cudagraphs else {CUDAGraphMode.NONE})
        return mode, batch.num_tokens

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings=None) -> None:
        """vLLM's warm-up of the drafter (`GPUModelRunner._dummy_run`): writes KV only through
        vLLM's slot mappings; in the capture phase captures the draft's pieces for a bucket;
        in the first call without slot mappings (`profile_run`) also allocates a step's
        largest temporaries for vLLM's memory profile (`_run_peak_temporaries`). The rows are
        capped at the draft's own bound (vLLM asks for its widest batch). docs/gpu.md."""
        if is_graph_capturing:
            mode, padded = self._dispatch(min(num_tokens, self.draft_rows_bound()),
                                          use_cudagraphs)
            if mode != CUDAGraphMode.NONE:
                self._capture_bucket(mode, padded)
            return
        num_tokens = min(num_tokens, self.warm_up_rows())
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=slot_mappings if isinstance(slot_mappings, dict)
                                 else {}):
            hidden = self.model(input_ids=self.input_ids[:num_tokens],
                                positions=self.positions[:num_tokens])
        if slot_mappings is None and not self._peak_temporaries_profiled:
            self._peak_temporaries_profiled = True
            self._run_peak_temporaries(hidden.shape[-1], hidden.dtype)

    def _capture_bucket(self, mode: CUDAGraphMode, padded: int) -> None:
        """Capture the draft's pieces for one bucket inside vLLM's capture phase, after one
        eager forward at that row count (GemLite's autotuning and Triton's compilation run
        outside the capture); neither forward writes KV (every slot -1)."""
        self.captured_buckets.add(padded)
        slots = self._slot_mapping_buffer[:padded].fill_(PADDING_SLOT_ID)
        for run_mode in (CUDAGraphMode.NONE, mode):
            with set_forward_context(None, self.vllm_config, num_tokens=padded,
                                     cudagraph_runtime_mode=run_mode,
                                     slot_mapping={n: slots for n in
                                                   self._draft_attn_layer_names}), \
                    self._drafting():
                self.model(input_ids=self.input_ids[:padded], positions=self.positions[:padded])

    def _drafting(self):
        """The scope of draft forwards: the overlapping offloader skips its waits in it."""
        if self.offloader is None:
            return contextlib.nullcontext()
        return self.offloader.drafting()

    def draft_rows_bound(self) -> int:
        return row_buckets.draft_rows_bound(self.vllm_config.scheduler_config.max_num_seqs,
                                            self.max_num_tokens, self.options.widths)

    def warm_up_rows(self) -> int:
        return row_buckets.warm_up_rows(
            self.draft_rows_bound(),
            self.vllm_config.compilation_config.cudagraph_capture_sizes or (),
            self.max_num_tokens)

    def verify_rows_bound(self) -> int:
        sc = self.vllm_config.scheduler_config
        return row_buckets.verify_rows_bound(sc.max_num_batched_tokens, sc.max_num_seqs,
                                             self.options.num_draft_tokens)

    def _run_peak_temporaries(self, hidden_size: int, dtype: torch.dtype) -> None:
        """What a step allocates past its forwards, at its widest, for vLLM's memory profile:
        the verify's logits, which the runner holds through the next drafting, and, while they
        are held, first the draft's widest level past its layers (logits, sharpened fp32
        log-probabilities, top-k over k x V candidates, a compared step's kept hidden states),
        then the verify's draws (the step's per-request penalty counts, one chunk of
        max_num_seqs rows in fp32 with its counts and masks, vLLM's top-k/top-p sampler);
        with head starts, a second widest level held throughout (they draft beside the verify).
        docs/gpu.md, "Engine start-up"."""
        sc = self.vllm_config.scheduler_config
        k = max(self.options.widths)
        batch = min(sc.max_num_seqs, max(1, self.max_num_tokens // k))
        vocab, rows = self.vllm_config.model_config.get_vocab_size(), self.verify_rows_bound()
        verify_logits = torch.rand(rows, vocab, dtype=dtype, device=self.device)
        compared = min(COMPARED_REQUESTS, sc.max_num_seqs) \
            if self.options.is_tree and len(self.options.draft_lm_heads) > 1 else 0
        node_hidden = torch.empty(compared * (self.options.num_draft_tokens + 1), hidden_size,
                                  dtype=dtype, device=self.device)
        hidden = torch.rand(batch * k, hidden_size, dtype=dtype, device=self.device)
        head_start = None
        if self.options.head_start_levels and k > 1:
            # head starts draft beside the verify, on a stream whose blocks the caching
            # allocator keeps apart: their widest level's logits and fp32 log-probabilities,
            # allocated there and held through the rest
            with self.head_stream.profiling():
                head_logits = self.model.compute_logits(hidden)
                head_start = (head_logits,
                              sharpened_log_probs(head_logits, self.options.draft_temperature))
        logits = self.model.compute_logits(hidden)
        if k > 1:  # a chain's argmax adds nothing beyond its logits
            widest_level(logits, batch, k, self.options.draft_temperature)
        del node_hidden, hidden, logits
        chunk = min(self.runner.max_num_reqs, rows)
        counts = torch.zeros(sc.max_num_seqs, vocab + 1, dtype=torch.int64, device=self.device)
        held = [counts[:, :vocab] > 0]  # the prompt mask, live beside the counts
        chunk_counts = counts[:chunk].clone()[:, :vocab]
        scaled = verify_logits[:chunk].float()
        scaled -= 0.5 * chunk_counts
        scaled -= 0.5 * (chunk_counts > 0)
        scaled /= 0.5
        full = lambda value: torch.full((chunk,), value, device=self.device)  # noqa: E731
        self.runner.sampler.topk_topp_sampler(scaled, {}, full(vocab - 1), full(0.9))
        del held, head_start

    # ---- drafting ------------------------------------------------------------------------
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
        cad, last_verified = self.bonus_token_metadata(common_attn_metadata,
                                                       num_rejected_tokens_gpu)
        if num_speculative_tokens == 0:
            return torch.empty(batch_size, 0, dtype=torch.int64, device=next_token_ids.device)
        req_ids = self.runner.input_batch.req_ids[:batch_size]
        chain_only = [chain_only_reason(self.runner.requests[r].sampling_params) is not None
                      for r in req_ids] if self.options.is_tree else None  # a chain is one
        drafts = self.session.propose(VllmDraftPasses(self, cad, last_verified), req_ids,
                                      next_token_ids, num_speculative_tokens, chain_only)
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
            self.session.draft_head_starts(
                lambda heads: VllmHeadPasses(self, verify_cad, heads))

    def plain_step(self, batch_size: int) -> list[list[int]]:
        """A step the session planned plain (`SubSpecRunner.propose_draft_token_ids`): no
        drafts; the next verify's first copies still start now."""
        if self.offloader is not None:
            self.offloader.start_before_draft()
        if self.metrics is not None:
            self.metrics.record(self.session.stats)
        return [[] for _ in range(batch_size)]

    def bonus_token_metadata(self, cad, num_rejected_tokens_gpu):
        """(decode-shaped metadata whose seq_lens end at the last verified token, the last
        verified positions): rejected drafts are dropped from seq_lens, so the first draft
        pass runs exactly the bonus token at p + 1 (a tree's accepted path is compacted)."""
        batch_size = cad.batch_size()
        seq_lens = cad.seq_lens.clone()
        if num_rejected_tokens_gpu is not None:
            seq_lens -= num_rejected_tokens_gpu.to(seq_lens.dtype)
        last_verified = (seq_lens - 1).to(torch.int64)
        upper = cad.seq_lens_cpu_upper_bound
        decode_cad = dataclasses.replace(
            cad,
            query_start_loc=self.arange[: batch_size + 1],
            query_start_loc_cpu=torch.from_numpy(self.token_arange_np[: batch_size + 1]).clone(),
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=None if upper is None else upper.clone(),
            num_actual_tokens=batch_size,
            max_query_len=1,
            slot_mapping=self._slot_mapping_buffer[:batch_size],
            positions=None,
            logits_indices_padded=None,
            num_logits_indices=None,
            max_logits_per_req=None,
        )
        return decode_cad, last_verified

    def _forward_hidden(self, cad, input_ids: torch.Tensor, draft_index: int,
                        eager: bool = False) -> torch.Tensor:
        """One draft forward over cad's tokens (positions already in self.positions), padded
        to its bucket (`draft_bucket`; padding rows write no KV and are attended by nothing);
        returns the hidden states of cad's tokens (on CUDA a graph output view). eager: no
        graph replay."""
        num_tokens = cad.num_actual_tokens
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=draft_index)
        mode, padded = self.draft_bucket(num_tokens, use_cudagraphs=not eager)
        if mode != CUDAGraphMode.NONE:
            self.session.stats.draft_graph_passes += 1
        self.input_ids[:num_tokens] = input_ids
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=padded,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(padded, cad.slot_mapping),
        ), self._drafting():
            hidden = self.model(input_ids=self.input_ids[:padded],
                                positions=self.positions[:padded])
        return hidden[:num_tokens]

    def _advance_one(self, positions, cad):
        """positions += 1, their slots, seq_lens += 1 (vLLM's helper; clamps at max_model_len)."""
        b = cad.batch_size()
        return self._update_positions_dependent_metadata(positions, cad, b, b, self.block_size)

    def tree_pass_metadata(self, cad, seq_lens, block_table, slots, k: int,
                           active: list[int] | None, rows: torch.Tensor | None,
                           max_seq_len: int):
        """Metadata of a pass over k query tokens per request, each request's context ending
        at `seq_lens` (its last node's slot + 1; at most `max_seq_len`). seq_lens,
        block_table, slots: of the requests drafting, `active` (batch indices; None: all;
        `rows`: on the device)."""
        b = seq_lens.shape[0]
        per_request = {}
        if active is not None:  # the fields vLLM slices per request (its `unpadded`)
            for name in PER_REQUEST_FIELDS:
                value = getattr(cad, name)
                if isinstance(value, torch.Tensor):  # host fields by the list: no copy
                    per_request[name] = value[active] if value.device.type == "cpu" \
                        else value[rows]
                elif isinstance(value, np.ndarray):
                    per_request[name] = value[active]
        return dataclasses.replace(
            cad,
            **per_request,
            query_start_loc=self.arange[: b + 1] * k,
            query_start_loc_cpu=torch.from_numpy(self.token_arange_np[: b + 1] * k).clone(),
            seq_lens=seq_lens.to(cad.seq_lens.dtype),
            num_reqs=b,
            num_actual_tokens=b * k,
            max_query_len=k,
            max_seq_len=max_seq_len,
            block_table_tensor=block_table,
            slot_mapping=slots,
            seq_lens_cpu_upper_bound=None,
            _num_computed_tokens_cache=None,  # computed from the batch this one replaces
            _token_to_req_indices_cache=None,
        )

    def kv_caches(self) -> list[tuple[object, torch.Tensor, str | None]]:
        """(attention impl, per-layer KV cache, CPU attention ISA) of every decoder layer."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        caches = []
        for name in sorted(self._draft_attn_layer_names):
            kv = ctx[name].kv_cache
            caches.append((ctx[name].impl, kv[0] if isinstance(kv, (list, tuple)) else kv,
                           getattr(ctx[name], "isa", None)))
        return caches


def draft_cudagraph_mode(compilation_config, cudagraph_mode: CUDAGraphMode,
                         breakable: bool) -> CUDAGraphMode:
    """The mode the drafter's graph keys are made for: the runner's where the draft forward
    has piecewise pieces to capture (vLLM's compile mode, a piecewise runner mode, no
    breakable graphs: these wrap the drafter's whole model), else NONE. docs/gpu.md."""
    from vllm.config import CompilationMode

    pieces = compilation_config.mode == CompilationMode.VLLM_COMPILE \
        and cudagraph_mode.has_piecewise_cudagraphs() and not breakable
    return cudagraph_mode if pieces else CUDAGraphMode.NONE


def replay_or_eager(mode: CUDAGraphMode, padded: int, num_tokens: int, on_cuda: bool,
                    captured: set[int], prompt_logprobs: bool) -> tuple[CUDAGraphMode, int]:
    """The dispatcher's (mode, padded rows), or eager at `num_tokens` on CUDA for a bucket the
    capture phase did not capture (capturing on a miss raises there) and while a request asks
    for prompt logprobs (a replay may write over the target's last output in the shared
    graph pool: vLLM issue 53488)."""
    if mode != CUDAGraphMode.NONE and on_cuda and (padded not in captured or prompt_logprobs):
        return CUDAGraphMode.NONE, num_tokens
    return mode, padded


class VllmDraftPasses:
    """`step.draft.DraftPasses` over one step's vLLM batch: node i of a request in slot L + i
    at position L + depth(i)."""

    def __init__(self, proposer: SubSpecProposer, cad, last_verified: torch.Tensor):
        self.proposer = proposer
        self.cad = cad  # decode-shaped: one token per request, seq_lens ending at p
        self.positions = last_verified  # [B] of the last pass's tokens
        self.batch_size = cad.batch_size()
        self.max_model_len = proposer.max_model_len
        self.max_rows = proposer.max_num_tokens  # its input/position/slot buffers' length
        self.on_device = cad.seq_lens.is_cuda
        self._root: torch.Tensor | None = None  # [B] L
        self._active: tuple[list[int] | None, torch.Tensor | None] = (None, None)

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.positions = self.proposer._advance_one(self.positions, self.cad)
        self._root = self.positions.clone()
        return self.proposer._forward_hidden(self.cad, next_token_ids, 0), self._root

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        self.positions = self.proposer._advance_one(self.positions, self.cad)
        return self.proposer._forward_hidden(self.cad, input_ids, index)

    def level_pass(self, depth: int, width: int, tokens: torch.Tensor,
                   active: list[int] | None) -> torch.Tensor:
        p, cad = self.proposer, self.cad
        rows = self._rows(active)
        root = self._root if rows is None else self._root[rows]
        table = cad.block_table_tensor[: self.batch_size]
        table = table if rows is None else table[rows]
        level = TreeShape(width, depth).level(depth)  # node indices i at this depth
        offsets = torch.arange(level.start, level.stop, device=root.device)
        slots = logical_to_slots(table, root[:, None] + offsets, p.block_size)  # L + i
        n = root.shape[0] * width
        p.positions[:n] = (root[:, None] + depth).expand(-1, width).reshape(-1)
        step_cad = p.tree_pass_metadata(cad, root + 1 + depth * width, table,
                                        slots.reshape(-1), width, active, rows,
                                        min(cad.max_seq_len + depth * width, p.max_model_len))
        return p._forward_hidden(step_cad, tokens, depth)

    def roots_without_pass(self) -> torch.Tensor:
        self.positions = self.proposer._advance_one(self.positions, self.cad)
        self._root = self.positions.clone()
        return self._root

    def tree_rows(self, row: int, q_start: int, request: int, root, mask: torch.Tensor
                  ) -> TreeRows:
        return TreeRows(row, q_start, root, mask)

    def logits(self, hidden: torch.Tensor, lm_head: str | None) -> torch.Tensor:
        return self.proposer.model.compute_logits(hidden, lm_head)

    def root_bounds(self, roots: torch.Tensor) -> list[int]:
        """On CPU the roots themselves; on a device vLLM's host bound of the verified lengths
        (`seq_lens_cpu_upper_bound`: >= the root L), read without a sync."""
        upper = self.cad.seq_lens_cpu_upper_bound
        if not self.on_device or upper is None:
            return roots.tolist()
        return upper[: self.batch_size].tolist()

    def _rows(self, active: list[int] | None) -> torch.Tensor | None:
        """The device indices of `active`, made once per change of the active set."""
        if active is None:
            return None
        if self._active[0] is not active:
            self._active = (active, device_index(active, self._root.device))
        return self._active[1]

    def copy_to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(tensor)

    def synchronize(self) -> None:
        if self.on_device:  # the compute stream only: the offloader's copy stream keeps going
            torch.cuda.current_stream().synchronize()


class VllmHeadPasses(VllmDraftPasses):
    """`head_start.HeadPasses` over a verify batch's head starts (`HeadStart`): request j's
    nodes in the slots past its verify's (the leaf at S + depth(f), head node i at
    S + depth(f) + 1 + i), at the positions they would have after the branch (L + depth(f),
    L' + depth(i)), each seeing the prefix [0, L), its frame and its ancestors. Eager: a
    graph replay would share the memory pool of the verify graph it runs beside."""

    def __init__(self, proposer: SubSpecProposer, verify_cad, heads: list[HeadStart]):
        cad, _ = proposer.bonus_token_metadata(verify_cad, None)  # decode-shaped, all rows
        super().__init__(proposer, cad, cad.seq_lens)
        self.heads = heads
        self.batch_size = len(heads)
        self.on_device = cad.seq_lens.is_cuda
        self._batch_rows = [h.req_index for h in heads]  # their rows in the verify batch
        device = cad.seq_lens.device
        self._batch_index = device_index(self._batch_rows, device)
        self._table = cad.block_table_tensor[self._batch_index]
        self._frames = [h.frame(device) for h in heads]
        self._root_pos: torch.Tensor | None = None

    def _pass(self, logical: list[list[int]], positions: list[list[int]], tokens,
              rows: list[TreeRows] | None, active: list[int] | None, draft_index: int
              ) -> torch.Tensor:
        """One eager forward: row r of request j at `logical[j][r]` (its KV slot), RoPE
        position `positions[j][r]`, attending as `rows[j]` says (None: the level pass's plan
        `draft_tree` made active, from `tree_rows`)."""
        p = self.proposer
        heads = self.heads if active is None else [self.heads[j] for j in active]
        index = None if active is None else device_index(active, self._table.device)
        table = self._table if index is None else self._table[index]
        k = len(logical[0])
        host = torch.tensor([logical, positions], dtype=torch.int64)  # [2, R, k]
        both = to_device(host, table.device)
        slots = logical_to_slots(table, both[0], p.block_size).reshape(-1)
        n = len(heads) * k
        p.positions[:n] = both[1].reshape(-1)
        ends = [row[-1] + 1 for row in logical]
        seq_lens = to_device(torch.tensor(ends, dtype=torch.int64), table.device)
        batch_rows = [self._batch_rows[j] for j in (range(len(self.heads)) if active is None
                                                    else active)]
        step_cad = p.tree_pass_metadata(self.cad, seq_lens, table, slots, k, batch_rows,
                                        device_index(batch_rows, table.device),
                                        min(max(ends), p.max_model_len))
        if rows is None:
            return p._forward_hidden(step_cad, tokens, draft_index, eager=True)
        with tree_plan(TreePlan(rows)):
            return p._forward_hidden(step_cad, tokens, draft_index, eager=True)

    def leaf_pass(self, tokens: list[int]) -> torch.Tensor:
        ids = to_device(torch.tensor(tokens, dtype=torch.int64), self._table.device)
        device = self._table.device
        return self._pass([[h.leaf_slot] for h in self.heads],
                          [[h.root + h.leaf_depth] for h in self.heads], ids,
                          [h.rows(j, j, torch.ones(1, 0, dtype=torch.bool, device=device), f)
                           for j, (h, f) in enumerate(zip(self.heads, self._frames))], None, 0)

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self._table.device
        hidden = self._pass([[h.node_slot(0)] for h in self.heads],
                            [[h.next_root] for h in self.heads], next_token_ids,
                            [h.rows(j, j, torch.ones(1, 1, dtype=torch.bool, device=device), f)
                             for j, (h, f) in enumerate(zip(self.heads, self._frames))], None, 0)
        self._root_pos = to_device(torch.tensor([h.next_root for h in self.heads]),
                                   self._table.device)
        return hidden, self._root_pos

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a head start drafts a tree")

    def roots_without_pass(self) -> torch.Tensor:
        raise NotImplementedError("a head start drafts its tree's first levels itself")

    def level_pass(self, depth: int, width: int, tokens: torch.Tensor,
                   active: list[int] | None) -> torch.Tensor:
        level = TreeShape(width, depth).level(depth)
        members = range(len(self.heads)) if active is None else active
        nodes = list(range(level.start, level.stop))
        return self._pass([[self.heads[j].node_slot(i) for i in nodes] for j in members],
                          [[self.heads[j].next_root + depth] * width for j in members],
                          tokens, None, None if active is None else list(active), depth)

    def tree_rows(self, row: int, q_start: int, request: int, root, mask: torch.Tensor
                  ) -> TreeRows:
        return self.heads[request].rows(row, q_start, mask, self._frames[request])

    def root_bounds(self, roots: torch.Tensor) -> list[int]:
        return [h.next_root for h in self.heads]

