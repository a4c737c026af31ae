"""SubSpecProposer: vLLM's draft-model proposer with the target itself, in draft mode, as draft.

The draft shares the target's attention layers, so it reads the target's verified KV and writes
its own KV into the same cache. What keeps that lossless:

* each step's first draft pass processes only the bonus/correction token (at position p+1, p being
  the last verified position), never an already-accepted token: vLLM's own draft-model first pass
  re-runs every verified token and would overwrite their verified KV with draft KV;
* draft KV therefore lands only in slots past p, inside the blocks vLLM reserved for lookahead
  (`num_lookahead_tokens` = draft tokens per step), and the next verify pass rewrites exactly
  those slots before it reads them (vLLM writes a layer's KV before computing its attention).

Chain (tree_width 1): argmax drafting (sharpening does not change an argmax), verified by vLLM's
rejection sampler with token ids only, which is lossless for greedy and sampled requests alike.

Tree (tree_width k > 1): the root pass over the bonus token, then D-1 passes over the k frontier
nodes with an ancestor-only mask (`tree_attention`), keeping the global top-k by cumulative
sharpened log-probability (`tree.TreeBatch`). The trees go to `verify.TreeStep`, which owns
them from there: vLLM schedules the D*k nodes as draft tokens, the step gives them depth-based
positions and the tree mask, walks the tree and moves the accepted path's KV into place.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_subspec.config import options_from_vllm_config
from vllm_subspec.draft_model import DraftModel, SubstituteSet, decoder_layers
from vllm_subspec.prefetch_overlap import PrefetchOverlap
from vllm_subspec.shape_tuner import ShapeTuner
from vllm_subspec.tree import TreeBatch, TreeShape, sharpened_log_probs, widest_level
from vllm_subspec.tree_attention import TreeMask, TreePlan, TreeRows, logical_to_slots
from vllm_subspec.verify import TreeStep

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

# CommonAttentionMetadata's per-request fields besides those a tree pass sets itself: the ones
# its `unpadded` slices per request (vllm/v1/attention/backend.py:515-543 in 0.32.0)
PER_REQUEST_FIELDS = ("causal", "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens",
                      "dcp_local_seq_lens_cpu_upper_bound", "is_prefilling", "req_idx",
                      "rswa_prefix_lens", "replayssm_decode_base_cpu")


class SubSpecProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.options = options_from_vllm_config(vllm_config)
        self.runner = runner
        self.tree_shape = TreeShape(self.options.tree_width, self.options.tree_depth)
        # the tree rows of the forward in progress (draft or verify), read by the attention layers
        self.tree_mask = TreeMask()
        # the verify side of a tree step; the runner uses it as its rejection sampler
        # auto shapes: the tuner picks each step's width and depth from measured costs
        self.tuner = ShapeTuner(self.options.widths, self.options.tree_depth,
                                self.options.auto_width, self.options.auto_depth) \
            if self.options.is_auto and self.options.is_tree else None
        self.tree_step = TreeStep(runner, self.tree_mask, self.tuner) \
            if self.options.is_tree else None
        self.draft_seconds = 0.0  # wall time spent drafting (benchmarks read it over RPC)
        self.draft_calls = 0
        self.draft_passes = 0  # draft forwards (benchmarks: passes per emitted token)
        self._last_draft_end: float | None = None  # for the tuner's "rest of a step" time
        self._peak_temporaries_profiled = False  # dummy_run: once, in vLLM's profiling pass
        self.prefetch_overlap: PrefetchOverlap | None = None  # set in load_model

    # ---- loading -------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        """Wrap the target (no second model is loaded) and draft through its attention layers."""
        substitutes = SubstituteSet.of(target_model)
        if substitutes is None:
            raise RuntimeError(
                "vllm-subspec: the target was loaded without SubSpec's weight hook; is the "
                "plugin enabled in this process (VLLM_PLUGINS)?"
            )
        self.model = DraftModel(target_model, substitutes, self.device)
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
            self.tree_mask.attach(all_attn[name].impl)
        if self.tree_step is not None:
            self.tree_step.kv_caches = self._kv_caches
        if self.device.type == "cuda":  # GemLite compiles per row-count bucket: do it now
            substitutes.warm_up(self.vllm_config.scheduler_config.max_num_seqs,
                                self.options.widths, self.vllm_config.model_config.dtype,
                                self.device)

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        logger.info(SubstituteSet.of(self.model.target).layout(kv_bytes))

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        # The draft loops over layers eagerly (the target's compiled graph spans all layers).
        super().initialize_cudagraph_keys(CUDAGraphMode.NONE)

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
        list). Draft passes run eagerly, so there is nothing to capture. The draft's own
        largest temporaries (`_run_peak_temporaries`) are allocated once, in the first call
        without slot mappings: `profile_run`, which a GPU worker runs first, inside its memory
        profiling (gpu_worker.py :678-693). Not again: the capture warm-ups would add them to
        vLLM's CUDA-graph memory estimate a second time (which is taken from the KV cache too,
        gpu_model_runner.py :6392-6422), and idle data-parallel steps would pay for them."""
        if is_graph_capturing:
            return
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=slot_mappings if isinstance(slot_mappings, dict)
                                 else {}):
            hidden = self.model(input_ids=self.input_ids[:num_tokens],
                                positions=self.positions[:num_tokens])
        if slot_mappings is None and not self._peak_temporaries_profiled:
            self._peak_temporaries_profiled = True
            self._run_peak_temporaries(hidden.shape[-1], hidden.dtype)

    def _run_peak_temporaries(self, hidden_size: int, dtype: torch.dtype) -> None:
        """The draft's widest pass past its layers, on random hidden states (as vLLM's sampler
        warm-up uses): the logits of max_num_seqs x the widest tree's rows, their sharpened fp32
        log-probabilities, and a tree level's top-k over k x V candidates per request (a
        chain: the argmax). What the attention rows of a tree pass need is not included: they
        read the KV cache, which does not exist yet."""
        k = max(self.options.widths)
        batch = self.vllm_config.scheduler_config.max_num_seqs
        hidden = torch.rand(batch * k, hidden_size, dtype=dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if k > 1:  # a chain's argmax adds nothing beyond its logits
            widest_level(logits, batch, k, self.options.draft_temperature)

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
    ) -> torch.Tensor:
        if self.prefetch_overlap is not None:  # first, so the copies run while this step drafts
            self.prefetch_overlap.start_before_draft()
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        start = time.perf_counter()
        cad, last_verified = self.bonus_token_metadata(common_attn_metadata,
                                                       num_rejected_tokens_gpu)
        if num_speculative_tokens == 0:
            return torch.empty(batch_size, 0, dtype=torch.int64, device=next_token_ids.device)
        if self.options.is_tree:
            drafts = self.draft_tree(cad, last_verified, next_token_ids)
        else:
            drafts = self.draft_chain(cad, last_verified, next_token_ids, num_speculative_tokens)
        if torch.is_tensor(drafts) and drafts.is_cuda:
            # the compute stream only: the offloader's copy stream keeps going
            torch.cuda.current_stream().synchronize()
        end = time.perf_counter()
        verify_seconds = self.tree_step.take_verify_seconds() if self.tree_step else None
        if self.tuner is not None and self._last_draft_end is not None and verify_seconds:
            # the rest of a step: from the end of the last draft to this one, less the verify
            # (not across an idle engine: the gap must be a step's, not a pause's)
            other = start - self._last_draft_end - verify_seconds
            if other < 4 * (verify_seconds + end - start):
                self.tuner.observe_other(other)
        self._last_draft_end = end
        self.draft_seconds += end - start
        self.draft_calls += 1
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

    def _forward_logits(self, cad, input_ids: torch.Tensor, draft_index: int) -> torch.Tensor:
        """One draft forward over cad's tokens (positions already in self.positions)."""
        num_tokens = cad.num_actual_tokens
        self.draft_passes += 1
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
            cad, draft_index=draft_index)
        self.input_ids[:num_tokens] = input_ids
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=self._get_slot_mapping(num_tokens, cad.slot_mapping),
        ):
            hidden = self.model(input_ids=self.input_ids[:num_tokens],
                                positions=self.positions[:num_tokens])
        return self.model.compute_logits(hidden)

    def _advance_one(self, positions, cad):
        """positions += 1, their slots, seq_lens += 1 (vLLM's helper; clamps at max_model_len)."""
        b = cad.batch_size()
        return self._update_positions_dependent_metadata(positions, cad, b, b, self.block_size)

    def draft_chain(self, cad, last_verified, next_token_ids, depth: int) -> torch.Tensor:
        input_ids, positions, drafts = next_token_ids, last_verified, []
        for step in range(depth):
            positions = self._advance_one(positions, cad)
            input_ids = self._forward_logits(cad, input_ids, step).argmax(dim=-1)
            drafts.append(input_ids)
        return torch.stack(drafts, dim=1)

    def draft_tree(self, cad, last_verified, next_token_ids) -> torch.Tensor | list[list[int]]:
        """Draft this step's trees: the root pass, then one pass per depth over the k frontier
        nodes. A fixed shape drafts every depth and returns [B, k*D] tokens. An auto shape asks
        the tuner for (k, D_max) and, every `check_every` depths (each check reads the masses on
        the host), which requests draft on: a request whose tree no longer pays drops out of
        the later passes, and drafting ends when none is left. It returns each request's tokens
        down to the depth worth verifying (lists; vLLM schedules what it gets; empty ones, a
        plain decoding step, when the tuner finds drafting does not pay).
        """
        batch_size = cad.batch_size()
        tuner = self.tuner
        plan = tuner.plan_step(batch_size) if tuner is not None else None
        if plan is not None and plan.shape.depth == 0:  # plain decoding is predicted faster
            return [[] for _ in range(batch_size)]
        shape = plan.shape if plan is not None else self.tree_shape
        k, temperature = shape.width, self.options.draft_temperature
        adaptive = plan is not None and plan.adaptive and not plan.full_depth
        check_every = 4 if cad.seq_lens.is_cuda else 1  # a check syncs with the device
        start = time.perf_counter()
        root_pos = self._advance_one(last_verified, cad).clone()  # the bonus token: L
        roots = root_pos.tolist()  # host copies, read once per step (not per depth)
        logits = self._forward_logits(cad, next_token_ids, 0)
        tree = TreeBatch(shape, next_token_ids.to(torch.int64))
        tree.grow(sharpened_log_probs(logits, temperature))
        root_seconds = time.perf_counter() - start if not logits.is_cuda else None
        dev = root_pos.device
        arange_k = torch.arange(k, device=dev)
        block_table = cad.block_table_tensor[:batch_size]
        active = list(range(batch_size))  # the requests still drafting (host)
        rows = None  # their indices on the device; None while all are
        reached = [1] * batch_size  # depths drafted, per request
        pass_rows = []  # rows of each pass after the root's
        for d in range(1, shape.depth):
            if adaptive and d % check_every == 0:
                going = tuner.drafting_next(tree.log_mass[:, : d + 1].cpu(), k, reached)
                if not going:
                    break
                if len(going) < len(active):
                    active = going
                    rows = torch.tensor(active, device=dev)
            level = shape.level(d)
            # stop before any node of the next level would pass max_model_len
            if max(roots[i] for i in active) + (d + 1) * k >= self.max_model_len:
                if plan is None:
                    tree.truncate()
                break
            root = root_pos if rows is None else root_pos[rows]
            table = block_table if rows is None else block_table[rows]
            slots = logical_to_slots(table, root[:, None] + level.start + arange_k,
                                     self.block_size)  # node slots L + i
            n = len(active) * k
            self.positions[:n] = (root[:, None] + d).expand(-1, k).reshape(-1)
            step_cad = self.tree_pass_metadata(cad, root, table, slots.reshape(-1), d, k,
                                               None if rows is None else active)
            # a chain's ancestor-only mask is the causal one: the backend's result stands
            plan_rows = TreePlan([TreeRows(j, j * k, roots[i], tree.mask[i, level, : level.stop])
                                  for j, i in enumerate(active)]) if k > 1 else None
            with self.tree_mask.active(plan_rows):
                logits = self._forward_logits(step_cad, tree.frontier_tokens(rows).reshape(-1), d)
            tree.grow(sharpened_log_probs(logits, temperature).view(len(active), k, -1), rows)
            pass_rows.append(n)
            for i in active:
                reached[i] = d + 1
        req_ids = self.runner.input_batch.req_ids[:batch_size]
        if plan is None:
            self.tree_step.store(req_ids, tree)
            return tree.tokens[:, 1:]
        log_mass = tree.log_mass[:, : tree.grown + 1].cpu()  # one host read: tuner and store
        self.tree_step.store(req_ids, tree, log_mass)
        if logits.is_cuda:
            torch.cuda.current_stream().synchronize()
        tuner.observe_draft(k, batch_size, pass_rows, time.perf_counter() - start, root_seconds)
        depths = tuner.verify_depths(log_mass, k, reached)
        tokens = tree.tokens[:, 1:].tolist()
        return [row[: k * d] for row, d in zip(tokens, depths)]

    def tree_pass_metadata(self, cad, root, block_table, slots, d: int, k: int,
                           active: list[int] | None):
        """Metadata of the pass over depth-d nodes: k query tokens per request, each request's
        context ending at its last depth-d node (slot L + d*k). root, block_table, slots: of
        the requests drafting, which are `active` (batch indices; None: all of them), whose
        other per-request fields are taken here."""
        b = root.shape[0]
        per_request = {}
        if active is not None:  # the fields vLLM slices per request (its `unpadded`)
            for name in PER_REQUEST_FIELDS:
                value = getattr(cad, name)
                if isinstance(value, torch.Tensor):
                    per_request[name] = value[torch.tensor(active, device=value.device)]
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

    def _kv_caches(self) -> list[tuple[object, torch.Tensor]]:
        """(attention impl, per-layer KV cache) of every decoder layer: the impl picks the
        cache reader (`tree_attention.layout_for`)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        caches = []
        for name in sorted(self._draft_attn_layer_names):
            kv = ctx[name].kv_cache
            caches.append((ctx[name].impl, kv[0] if isinstance(kv, (list, tuple)) else kv))
        return caches
