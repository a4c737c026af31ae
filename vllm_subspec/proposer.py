"""SubSpecProposer: vLLM's draft-model proposer with the target itself, in draft mode, as draft.

The draft shares the target's attention layers, so it reads the target's verified KV and writes
its own KV into the same cache. What keeps that lossless:

* each step's first draft pass processes only the bonus/correction token (at position p+1, p being
  the last verified position), never an already-accepted token: vLLM's own draft-model first pass
  re-runs every verified token and would overwrite their verified KV with draft KV;
* draft KV therefore lands only at positions p+1 .. p+k, inside the blocks vLLM reserved for
  lookahead (`num_lookahead_tokens = k`), and the next verify pass rewrites exactly those
  positions before it reads them (vLLM writes a layer's KV before computing its attention).

Drafting is a chain: argmax of the draft distribution (sharpening by `draft_temperature` does
not change an argmax). Verification is vLLM's rejection sampler with token ids only (a point-mass
draft), which is lossless for greedy and sampled requests alike.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_subspec.config import options_from_vllm_config
from vllm_subspec.draft_model import DraftModel, SubstituteSet, decoder_layers

logger = logging.getLogger(__name__)


class SubSpecProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.options = options_from_vllm_config(vllm_config)

    # ---- loading -------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        """Wrap the target (no second model is loaded) and draft through its attention layers."""
        substitutes = SubstituteSet.of(target_model)
        if substitutes is None:
            raise RuntimeError(
                "vllm-subspec: the target was loaded without SubSpec's weight hook; is the "
                "plugin enabled in this process (VLLM_PLUGINS)?"
            )
        self.model = DraftModel(target_model, substitutes)
        target_attn = {id(layer.self_attn.attn) for layer in decoder_layers(target_model)}
        all_attn = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = {
            name for name, module in all_attn.items()
            if id(module) in target_attn
            and module.get_kv_cache_spec(self.vllm_config) is not None
        }
        if len(self._draft_attn_layer_names) != len(target_attn):
            raise RuntimeError("vllm-subspec: could not map every decoder layer to its attention")

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        # The draft loops over layers eagerly (the target's compiled graph spans all layers).
        super().initialize_cudagraph_keys(CUDAGraphMode.NONE)

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings=None) -> None:
        if is_graph_capturing:
            return
        super().dummy_run(num_tokens, use_cudagraphs=False, slot_mappings=slot_mappings)

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
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        cad = common_attn_metadata
        batch_size = cad.batch_size()
        if num_speculative_tokens == 0:
            return torch.empty(batch_size, 0, dtype=torch.int64, device=next_token_ids.device)

        cad, last_verified = self.bonus_token_metadata(
            cad, target_positions, token_indices_to_sample, num_rejected_tokens_gpu)
        input_ids = next_token_ids
        positions = last_verified
        drafts = []
        for step in range(num_speculative_tokens):
            # positions <- positions + 1, slot mapping for them, seq_lens += 1 (vLLM's helper).
            positions = self._update_positions_dependent_metadata(
                positions, cad, batch_size, batch_size, self.block_size)
            _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(
                cad, draft_index=step)
            self.input_ids[:batch_size] = input_ids
            with set_forward_context(
                per_layer_metadata,
                self.vllm_config,
                num_tokens=batch_size,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
                slot_mapping=self._get_slot_mapping(batch_size),
            ):
                hidden = self.model(input_ids=self.input_ids[:batch_size],
                                    positions=self._get_positions(batch_size))
            input_ids = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(input_ids)
        return torch.stack(drafts, dim=1)

    def bonus_token_metadata(self, cad, target_positions, token_indices_to_sample,
                             num_rejected_tokens_gpu):
        """Decode-shaped metadata whose seq_lens end at the last verified token.

        Returns (metadata, last_verified_positions). The first draft step advances both by one,
        so it processes exactly the bonus token at p+1 and writes KV only there.
        """
        batch_size = cad.batch_size()
        if token_indices_to_sample is None:  # no drafts were verified: last scheduled token
            token_indices_to_sample = cad.query_start_loc[1:batch_size + 1] - 1
        last_verified = target_positions[token_indices_to_sample.long()].to(torch.int64)
        seq_lens = cad.seq_lens.clone()
        if num_rejected_tokens_gpu is not None:
            seq_lens -= num_rejected_tokens_gpu.to(seq_lens.dtype)
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
