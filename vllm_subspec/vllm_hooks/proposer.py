"""SubSpecProposer: vLLM's drafter interface for SubSpec, and the draft's forwards.

The draft is the target itself in draft mode (`draft_model.DraftModel`: offloaded layers swapped
for their resident substitutes); it shares the target's attention layers, so it reads the
target's verified KV and writes its own KV into the same cache. What keeps that lossless:

* each step's first draft pass processes only the bonus/correction token (at position p+1, p being
  the last verified position), never an already-accepted token: vLLM's own draft-model first pass
  re-runs every verified token and would overwrite their verified KV with draft KV;
* draft KV therefore lands only in slots past p, inside the blocks vLLM reserved for lookahead
  (`num_lookahead_tokens` = draft tokens per step), and the next verify pass rewrites exactly
  those slots before it reads them (vLLM writes a layer's KV before computing its attention).

What to draft is the step session's (`step/session.py`, `step/draft.py`); this module turns its
passes into vLLM forwards (`VllmDraftPasses`: attention metadata, slots, positions).
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
from vllm_subspec.draft_model.model import SubstituteSet, capture_bucket, decoder_layers
from vllm_subspec.draft_model.substitute import gemlite_autotune_kept
from vllm_subspec.draft_model.substitute_cache import gemlite_autotune_path
from vllm_subspec.step.node_constraints import chain_only_reason
from vllm_subspec.step.paged_kv import logical_to_slots
from vllm_subspec.step.draft import HostCopy, device_index
from vllm_subspec.step.session import StepSession
from vllm_subspec.step.shape_tuner import COMPARED_REQUESTS
from vllm_subspec.step.tree import TreeShape, widest_level
from vllm_subspec.vllm_hooks.draft_compile import draft_model
from vllm_subspec.vllm_hooks.metrics import METRICS_DIR_ENV, StepMetricsFile
from vllm_subspec.vllm_hooks.prefetch_overlap import PrefetchOverlap

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

# CommonAttentionMetadata's per-request fields besides those a tree pass sets itself: the ones
# its `unpadded` slices per request (vllm/v1/attention/backend.py:515-543 in 0.32.0)
PER_REQUEST_FIELDS = ("causal", "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens",
                      "dcp_local_seq_lens_cpu_upper_bound", "is_prefilling", "req_idx",
                      "rswa_prefix_lens", "replayssm_decode_base_cpu")


class SubSpecProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner,
                 session: StepSession):
        super().__init__(vllm_config, device, runner)
        self.options = options_from_vllm_config(vllm_config)
        self.runner = runner
        self.session = session  # decides what to draft; owns the tree mask and the tuner
        self._peak_temporaries_profiled = False  # dummy_run: once, in vLLM's profiling pass
        self.captured_buckets: set[int] = set()  # row counts whose draft pieces are captured
        self.prefetch_overlap: PrefetchOverlap | None = None  # set in load_model
        self.metrics: StepMetricsFile | None = None  # set in load_model (TP rank 0)

    # ---- loading -------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        """Wrap the target (no second model is loaded) and draft through its attention layers."""
        substitutes = SubstituteSet.of(target_model)
        if substitutes is None:
            raise RuntimeError(
                "vllm-subspec: the target was loaded without SubSpec's weight hook; is the "
                "plugin enabled in this process (VLLM_PLUGINS)?"
            )
        self.model = draft_model(target_model, substitutes, self.device, self.vllm_config)
        # Prefetch backend: the next verify's first offloaded layers are copied while this
        # proposer drafts, with CUDA graphs too (prefetch_overlap.py); None otherwise.
        from vllm.model_executor.offloader.base import get_offloader

        self.prefetch_overlap = PrefetchOverlap.from_offloader(
            get_offloader(), use_ubatching=self.vllm_config.parallel_config.use_ubatching)
        target_attn = {id(layer.self_attn.attn) for layer in decoder_layers(target_model)}
        all_attn = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = {
            name for name, module in all_attn.items()
            if id(module) in target_attn
            and module.get_kv_cache_spec(self.vllm_config) is not None
        }
        if len(self._draft_attn_layer_names) != len(target_attn):
            raise RuntimeError("vllm-subspec: could not map every decoder layer to its attention")
        for name in self._draft_attn_layer_names:  # draft and verify forwards share the mask
            self.session.mask.attach(all_attn[name].impl)
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() == 0:  # one writer per engine
            self.metrics = StepMetricsFile(
                os.environ.get(METRICS_DIR_ENV),
                # the engine index the front end labels stats with (core_client.py 0.32.0
                # :717-724); data_parallel_rank is reset to 0 in each dense-model engine
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
        self._time_heads()

    def _time_heads(self, repeats: int = 3) -> None:
        """Each lm_head's logits timed at 1, k and 4k rows (k: the widest width), for the
        tuner's choice between the draft's two heads (`ShapeTuner.observe_head_cost`; it
        starts with the cheaper at k rows); at load, where waiting for the device costs
        nothing."""
        tuner = self.session.tuner
        if tuner is None or len(tuner.heads) < 2:
            return
        k = max(self.options.widths)
        hidden_size = self.vllm_config.model_config.get_hidden_size()
        dtype = self.vllm_config.model_config.dtype
        wait = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for rows in sorted({1, min(k, self.max_num_tokens), min(4 * k, self.max_num_tokens)}):
            hidden = torch.rand(rows, hidden_size, dtype=dtype, device=self.device)
            for head in tuner.heads:
                self.model.compute_logits(hidden, head)  # first call: kernels' one-off work
                wait()
                start = time.perf_counter()
                for _ in range(repeats):
                    self.model.compute_logits(hidden, head)
                wait()
                tuner.observe_head_cost(head, rows, (time.perf_counter() - start) / repeats)
        tuner.start_with_cheaper_head(k)

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        logger.info(SubstituteSet.of(self.model.target).layout(kv_bytes))

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """vLLM's rule for its drafters (llm_base_proposer.py 0.32.0 :421-436: PIECEWISE keys
        at the runner's capture sizes where it captures graphs and the speculative config is
        not eager), where the draft forward is compiled by vLLM's backend (compile mode:
        vllm_hooks/draft_compile.py), which splits it at the attention ops and wraps each piece
        between them in a CUDAGraphWrapper. A draft pass then pads its rows to the next capture
        size and replays the pieces of that bucket; attention, tree attention inside it, runs
        eagerly between them. No keys where there are no pieces: without a compiled draft, or
        without piecewise graphs (a FULL mode wraps no piece, backends.py 0.32.0 :656-662, and
        the runner asks for no draft capture in it, gpu_model_runner.py :5873-5882), and none
        under vLLM's breakable graphs (the runner wraps the drafter's model in its own wrapper
        then, :5189-5208)."""
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
        from vllm.config import CompilationMode

        pieces = self.vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE \
            and cudagraph_mode.has_piecewise_cudagraphs() \
            and not is_breakable_cudagraph_enabled()
        super().initialize_cudagraph_keys(cudagraph_mode if pieces else CUDAGraphMode.NONE)

    def draft_bucket(self, num_tokens: int, use_cudagraphs: bool = True
                     ) -> tuple[CUDAGraphMode, int]:
        """(runtime mode, padded row count) of a draft forward over `num_tokens` rows: a
        captured bucket of vLLM's dispatcher (`_dispatch`: the next capture size), or eager
        unpadded (no keys, CPU, past the largest capture size).

        Eager instead, on CUDA, for a bucket the capture phase did not capture (the wrapper
        would capture on the miss, and capturing outside that phase raises, monitor.py :101-110)
        and while a request in the batch asks for prompt logprobs: the runner computes them
        from the target's hidden states after drafting (gpu_model_runner.py :4409, :4477,
        :3589), and all graphs share one memory pool, which a draft replay may write over the
        target's last piece's output (vLLM issue 53488)."""
        mode, padded = self._dispatch(num_tokens, use_cudagraphs)
        if mode != CUDAGraphMode.NONE and self.device.type == "cuda" and (
                padded not in self.captured_buckets
                or getattr(self.runner, "num_prompt_logprobs", None)):
            return CUDAGraphMode.NONE, num_tokens
        return mode, padded

    def _dispatch(self, num_tokens: int, use_cudagraphs: bool) -> tuple[CUDAGraphMode, int]:
        """vLLM's dispatcher alone, not the base class's `_determine_batch_execution_and_padding`:
        that one synchronizes data-parallel ranks per forward, and a rank's draft passes per
        step are its own."""
        mode, batch = self.cudagraph_dispatcher.dispatch(
            num_tokens, valid_modes=None if use_cudagraphs else {CUDAGraphMode.NONE})
        return mode, batch.num_tokens

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings=None) -> None:
        """vLLM's warm-up of the drafter, called from the runner's `_dummy_run`
        (gpu_model_runner.py 0.32.0 :5894): by `profile_run` before the KV cache exists (every
        attention layer's `kv_cache` is still vLLM's empty placeholder and `slot_mappings` is
        None), by `capture_model` (`is_graph_capturing`) and by later warm-ups (`slot_mappings`
        are the runner's, filled with -1 :5685-5688, so no KV is written).

        The draft's layers are the target's, so KV is written only through the slot mappings
        vLLM hands in, as vLLM's own drafters do (`slot_mappings or {}`, llm_base_proposer.py
        0.32.0 :1638-1645): none while the caches are placeholders (nor for a microbatched
        list). A capture call captures the draft's pieces for its bucket (`_capture_bucket`)
        where there are keys, and does nothing else (in compile mode the first call here, in
        `profile_run`, compiles the draft forward). The draft's own
        largest temporaries (`_run_peak_temporaries`) are allocated once, in the first call
        without slot mappings: `profile_run`, which a GPU worker runs first, inside its memory
        profiling (gpu_worker.py :678-693). Not again: the capture warm-ups would add them to
        vLLM's CUDA-graph memory estimate a second time (which is taken from the KV cache too,
        gpu_model_runner.py :6392-6422), and idle data-parallel steps would pay for them."""
        # the runner asks for its own widest batch (max_num_batched_tokens in the profile); a
        # draft pass is never wider than its bound, and wider rows would only cost start-up
        # time (16,384 rows through CPU int4 kernels: minutes) and profile memory never used
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
        """Capture the draft's pieces for one bucket, inside vLLM's capture phase (the runner's
        capture loop calls `dummy_run` per capture size, gpu_model_runner.py 0.32.0
        :6588-6635). One eager forward at that row count first, so GemLite's autotuning and
        Triton's compilation of the bucket run outside the capture; both forwards write no KV
        (every slot -1, in the drafter's own slot buffer, which its passes use too). A bucket
        already captured (the runner's larger sizes cap to the draft's bound) is replayed,
        harmlessly."""
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
        """The scope of draft forwards: the prefetch offloader's waits are skipped in it (the
        draft reads no streamed layer; `PrefetchOverlap.drafting`)."""
        if self.prefetch_overlap is None:
            return contextlib.nullcontext()
        return self.prefetch_overlap.drafting()

    def draft_rows_bound(self) -> int:
        """The most rows one draft pass has: a bonus or chain pass one row per request (at
        most max_num_seqs, within max_num_tokens), a tree level k rows per request in whole
        levels of at most max_num_tokens rows (step/draft.py splits wider ones over several
        passes), for every width a step may use (a narrower one can fill more rows)."""
        seqs = self.vllm_config.scheduler_config.max_num_seqs
        return max([min(seqs, self.max_num_tokens)]
                   + [k * min(seqs, max(1, self.max_num_tokens // k))
                      for k in self.options.widths])

    def warm_up_rows(self) -> int:
        """The row count of the draft's warm-up forwards, its first (compiling) one included:
        its bound padded to a capture size (vLLM sizes static graph inputs from the first call,
        backends.py :1316-1341), never one row (a dynamic dimension of size 1 is
        specialized away)."""
        padded = capture_bucket(self.draft_rows_bound(),
                                self.vllm_config.compilation_config.cudagraph_capture_sizes or ())
        return min(max(2, padded), self.max_num_tokens)

    def verify_rows_bound(self) -> int:
        """The most logits rows one tree verify has: every node of max_num_seqs trees (the
        widest, deepest shape), within the step's token budget."""
        return min(self.vllm_config.scheduler_config.max_num_batched_tokens,
                   self.vllm_config.scheduler_config.max_num_seqs
                   * (self.options.num_draft_tokens + 1))

    def _run_peak_temporaries(self, hidden_size: int, dtype: torch.dtype) -> None:
        """What a step allocates past its forwards, at its widest, for vLLM's memory profile
        (it computes logits for max_num_seqs rows only, gpu_model_runner.py 0.32.0 :6193-6200,
        and warms the rejection sampler over one draft per request, :5999-6041):

        * the draft's widest pass past its layers, on random hidden states (as vLLM's sampler
          warm-up uses): the logits of max_num_seqs x the widest tree level, their sharpened
          fp32 log-probabilities, and a level's top-k over k x V candidates per request (a
          chain: the argmax);
        * a tree verify: the target's logits at every node of max_num_seqs trees, held while
          one chunk of max_num_seqs rows (`verify.sample_then_match`) is copied to fp32 (the
          constraints' copy), scaled by a temperature and drawn by vLLM's own top-k/top-p
          sampler. A chain is verified by vLLM's rejection sampler, as vLLM's drafters are;
        * with two lm_heads (an auto shape compares them), a compared step's hidden states of
          every node of its first `COMPARED_REQUESTS` trees, kept from its passes through the
          verify (`draft.TreeDraft.node_hidden`; the heads then rank chunks of max_num_seqs
          rows, as the verify draws).

        What the attention rows of a tree pass need is not included: one Triton launch's
        small inputs on CUDA (step/tree_attention_triton.py); they read the KV cache, which
        does not exist yet."""
        k = max(self.options.widths)
        batch = min(self.vllm_config.scheduler_config.max_num_seqs,
                    max(1, self.max_num_tokens // k))
        # held from a compared step's first pass through its verify
        compared = min(COMPARED_REQUESTS, self.vllm_config.scheduler_config.max_num_seqs) \
            if self.options.is_tree and len(self.options.draft_heads) > 1 else 0
        node_hidden = torch.empty(compared * (self.options.num_draft_tokens + 1), hidden_size,
                                  dtype=dtype, device=self.device)  # noqa: F841 (held)
        hidden = torch.rand(batch * k, hidden_size, dtype=dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if k > 1:  # a chain's argmax adds nothing beyond its logits
            widest_level(logits, batch, k, self.options.draft_temperature)
        if not self.options.is_tree:
            return
        vocab, rows = logits.shape[-1], self.verify_rows_bound()
        chunk = min(self.runner.max_num_reqs, rows)
        del hidden, logits
        verify_logits = torch.rand(rows, vocab, dtype=dtype, device=self.device)
        scaled = verify_logits[:chunk].float() / 0.5
        full = lambda value: torch.full((chunk,), value, device=self.device)  # noqa: E731
        self.runner.sampler.topk_topp_sampler(scaled, {}, full(vocab - 1), full(0.9))

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
        """vLLM's drafter call (gpu_model_runner.py 0.32.0 `propose_draft_token_ids`)."""
        if self.prefetch_overlap is not None:  # first, so the copies run while this step drafts
            self.prefetch_overlap.start_before_draft()
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

    def bonus_token_metadata(self, cad, num_rejected_tokens_gpu):
        """Decode-shaped metadata whose seq_lens end at the last verified token.

        Returns (metadata, last_verified_positions). The first draft step advances both by one,
        so it processes exactly the bonus token at p+1 and writes KV only there. Rejected draft
        tokens are dropped from seq_lens; what is left ends at the last verified token, for a
        chain and for a tree alike (a tree's accepted path is compacted to follow the root).
        """
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

    def _forward_hidden(self, cad, input_ids: torch.Tensor, draft_index: int) -> torch.Tensor:
        """One draft forward over cad's tokens (positions already in self.positions), padded
        to its bucket (`draft_bucket`): the padding rows hold earlier passes' tokens and
        positions, write no KV (slot -1, vLLM's `_get_slot_mapping`) and are attended by
        nothing (the metadata's num_actual_tokens); returns the hidden states of cad's tokens
        (on CUDA a view of the graph's output: the next pass overwrites it)."""
        num_tokens = cad.num_actual_tokens
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=draft_index)
        mode, padded = self.draft_bucket(num_tokens)
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

    def tree_pass_metadata(self, cad, root, block_table, slots, d: int, k: int,
                           active: list[int] | None, rows: torch.Tensor | None):
        """Metadata of the pass over depth-d nodes: k query tokens per request, each request's
        context ending at its last depth-d node (slot L + d*k). root, block_table, slots: of
        the requests drafting, which are `active` (batch indices; None: all of them; `rows`:
        the same on the device), whose other per-request fields are taken here."""
        b = root.shape[0]
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
            seq_lens=(root + 1 + d * k).to(cad.seq_lens.dtype),
            num_reqs=b,
            num_actual_tokens=b * k,
            max_query_len=k,
            max_seq_len=min(cad.max_seq_len + d * k, self.max_model_len),
            block_table_tensor=block_table,
            slot_mapping=slots,
            seq_lens_cpu_upper_bound=None,
            _num_computed_tokens_cache=None,  # computed from the batch this one replaces
            _token_to_req_indices_cache=None,
        )

    def kv_caches(self) -> list[tuple[object, torch.Tensor, str | None]]:
        """(attention impl, per-layer KV cache, CPU attention ISA) of every decoder layer: the
        impl and the ISA pick the cache reader (`paged_kv.layout_for`)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        caches = []
        for name in sorted(self._draft_attn_layer_names):
            kv = ctx[name].kv_cache
            caches.append((ctx[name].impl, kv[0] if isinstance(kv, (list, tuple)) else kv,
                           getattr(ctx[name], "isa", None)))
        return caches


class VllmDraftPasses:
    """`step.draft.DraftPasses` over one step's vLLM batch: the draft's forwards with the
    attention metadata, slots and positions of each pass (node i of a request in slot L + i at
    position L + depth(i))."""

    def __init__(self, proposer: SubSpecProposer, cad, last_verified: torch.Tensor):
        self.proposer = proposer
        self.cad = cad  # decode-shaped: one token per request, seq_lens ending at p
        self.positions = last_verified  # [B] of the last pass's tokens
        self.batch_size = cad.batch_size()
        self.max_model_len = proposer.max_model_len
        self.max_rows = proposer.max_num_tokens  # its input/position/slot buffers' length
        self.on_device = cad.seq_lens.is_cuda
        self._root: torch.Tensor | None = None  # [B] L
        self.heads = proposer.options.draft_heads
        self.head = self.heads[0]  # the session sets each step's (`StepPlan.head`)
        self.keep_hidden = False  # the session sets it on a step that compares the heads
        self._hidden: torch.Tensor | None = None
        self._active: tuple[list[int] | None, torch.Tensor | None] = (None, None)

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.positions = self.proposer._advance_one(self.positions, self.cad)
        self._root = self.positions.clone()
        return self._logits(self.proposer._forward_hidden(self.cad, next_token_ids, 0)), \
            self._root

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pass's logits through the step's head; with keep_hidden, `hidden` is kept for
        `last_hidden` (on CUDA a graph output the next pass overwrites: draft_tree copies the
        rows it keeps before the next pass, in stream order)."""
        self._hidden = hidden if self.keep_hidden else None
        return self.proposer.model.compute_logits(hidden, self.head)

    def last_hidden(self) -> torch.Tensor:
        return self._hidden

    def rank_heads(self, hidden: torch.Tensor, top: int) -> dict[str, torch.Tensor]:
        return {h: self.proposer.model.compute_logits(hidden, h).topk(top, dim=-1).indices
                for h in self.heads}

    def root_bounds(self, roots: torch.Tensor) -> list[int]:
        """On CPU the roots themselves. On a device vLLM's host bound of the verified lengths
        (`seq_lens_cpu_upper_bound`: rejected drafts not taken off, so >= the root L, which is
        the verified length), read without a sync; the roots only where vLLM has none."""
        upper = self.cad.seq_lens_cpu_upper_bound
        if not self.on_device or upper is None:
            return roots.tolist()
        return upper[: self.batch_size].tolist()

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        self.positions = self.proposer._advance_one(self.positions, self.cad)
        return self._logits(self.proposer._forward_hidden(self.cad, input_ids, index))

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
        step_cad = p.tree_pass_metadata(cad, root, table, slots.reshape(-1), depth, width,
                                        active, rows)
        return self._logits(p._forward_hidden(step_cad, tokens, depth))

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
