"""The draft's forwards over one step's vLLM batch: `VllmDraftPasses` (`step.draft.DraftPasses`
for a step's proposal) and `VllmHeadPasses` (`step.head_start.HeadPasses` for a verify's head
starts), built by `SubSpecProposer` (proposer.py), whose buffers, metadata builders and
graph buckets they use, and the vLLM metadata of their passes (`bonus_token_metadata`,
`tree_pass_metadata`). Each step's first pass runs the bonus token alone at p + 1 (p: the
last verified position), so draft KV lands only in lookahead slots the next verify rewrites
before reading them (docs/losslessness.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context

from vllm_subspec.step.draft import HostCopy, device_index
from vllm_subspec.step.head_start import HeadStart
from vllm_subspec.step.paged_kv import logical_to_slots
from vllm_subspec.step.transfer import to_device
from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tree_attention import TreePlan, TreeRows, tree_plan

# CommonAttentionMetadata's per-request fields besides those a tree pass sets itself: the ones
# its `unpadded` slices per request (`CommonAttentionMetadata.unpadded`, 0.32.0)
PER_REQUEST_FIELDS = (
    "causal",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound",
    "is_prefilling",
    "req_idx",
    "rswa_prefix_lens",
    "replayssm_decode_base_cpu",
)


def bonus_token_metadata(drafter, cad, num_rejected_tokens_gpu):
    """(decode-shaped metadata whose seq_lens end at the last verified token, the last
    verified positions): rejected drafts are dropped from seq_lens, so the first draft
    pass runs exactly the bonus token at p + 1 (a tree's accepted path is compacted).
    drafter: the `SubSpecProposer` (its index buffers and slot buffer)."""
    batch_size = cad.batch_size()
    seq_lens = cad.seq_lens.clone()
    if num_rejected_tokens_gpu is not None:
        seq_lens -= num_rejected_tokens_gpu.to(seq_lens.dtype)
    last_verified = (seq_lens - 1).to(torch.int64)
    upper = cad.seq_lens_cpu_upper_bound
    decode_cad = dataclasses.replace(
        cad,
        query_start_loc=drafter.arange[: batch_size + 1],
        query_start_loc_cpu=torch.from_numpy(drafter.token_arange_np[: batch_size + 1]).clone(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=None if upper is None else upper.clone(),
        num_actual_tokens=batch_size,
        max_query_len=1,
        slot_mapping=drafter._slot_mapping_buffer[:batch_size],
        positions=None,
        logits_indices_padded=None,
        num_logits_indices=None,
        max_logits_per_req=None,
    )
    return decode_cad, last_verified


def tree_pass_metadata(
    drafter,
    cad,
    seq_lens,
    block_table,
    slots,
    k: int,
    active: list[int] | None,
    rows: torch.Tensor | None,
    max_seq_len: int,
):
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
                per_request[name] = value[active] if value.device.type == "cpu" else value[rows]
            elif isinstance(value, np.ndarray):
                per_request[name] = value[active]
    return dataclasses.replace(
        cad,
        **per_request,
        query_start_loc=drafter.arange[: b + 1] * k,
        query_start_loc_cpu=torch.from_numpy(drafter.token_arange_np[: b + 1] * k).clone(),
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


class VllmDraftPasses:
    """`step.draft.DraftPasses` over one step's vLLM batch: node i of a request in slot L + i
    at position L + depth(i). drafter: the `SubSpecProposer`; cad: vLLM's metadata of the
    verify just run (`bonus_token_metadata` makes the passes' own from it)."""

    def __init__(self, drafter, cad, num_rejected_tokens_gpu: torch.Tensor | None):
        self.drafter = drafter
        # decode-shaped: one token per request, seq_lens ending at p; the last pass's positions
        self.cad, self.positions = bonus_token_metadata(drafter, cad, num_rejected_tokens_gpu)
        self.batch_size = self.cad.batch_size()
        self.max_model_len = drafter.max_model_len
        self.max_rows = drafter.max_num_tokens  # its input/position/slot buffers' length
        self.on_device = self.cad.seq_lens.is_cuda
        self._root: torch.Tensor | None = None  # [B] L
        self._active: tuple[list[int] | None, torch.Tensor | None] = (None, None)

    def _forward(
        self, cad, input_ids: torch.Tensor, draft_index: int, eager: bool = False
    ) -> torch.Tensor:
        """One draft forward over cad's tokens (positions already in the drafter's
        `positions`), padded to its bucket (`SubSpecProposer.draft_bucket`; padding rows write
        no KV and are attended by nothing); returns the hidden states of cad's tokens (on CUDA
        a graph output view). eager: no graph replay."""
        d = self.drafter
        num_tokens = cad.num_actual_tokens
        _, per_layer_metadata = d.build_per_group_and_layer_attn_metadata(
            cad, draft_index=draft_index
        )
        mode, padded = d.draft_bucket(num_tokens, use_cudagraphs=not eager)
        if mode != CUDAGraphMode.NONE:
            d.session.stats.draft_graph_passes += 1
        d.input_ids[:num_tokens] = input_ids
        with (
            set_forward_context(
                per_layer_metadata,
                d.vllm_config,
                num_tokens=padded,
                cudagraph_runtime_mode=mode,
                slot_mapping=d._get_slot_mapping(padded, cad.slot_mapping),
            ),
            d.drafting(),
        ):
            hidden = d.model(input_ids=d.input_ids[:padded], positions=d.positions[:padded])
        return hidden[:num_tokens]

    def _advance(self) -> torch.Tensor:
        """positions += 1, their slots, seq_lens += 1 (vLLM's helper; clamps at
        max_model_len)."""
        b = self.cad.batch_size()
        return self.drafter._update_positions_dependent_metadata(
            self.positions, self.cad, b, b, self.drafter.block_size
        )

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.positions = self._advance()
        self._root = self.positions.clone()
        return self._forward(self.cad, next_token_ids, 0), self._root

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        self.positions = self._advance()
        return self._forward(self.cad, input_ids, index)

    def level_pass(
        self, depth: int, width: int, tokens: torch.Tensor, active: list[int] | None
    ) -> torch.Tensor:
        d, cad = self.drafter, self.cad
        rows = self._rows(active)
        root = self._root if rows is None else self._root[rows]
        table = cad.block_table_tensor[: self.batch_size]
        table = table if rows is None else table[rows]
        level = TreeShape(width, depth).level(depth)  # node indices i at this depth
        offsets = torch.arange(level.start, level.stop, device=root.device)
        slots = logical_to_slots(table, root[:, None] + offsets, d.block_size)  # L + i
        n = root.shape[0] * width
        d.positions[:n] = (root[:, None] + depth).expand(-1, width).reshape(-1)
        step_cad = tree_pass_metadata(
            d,
            cad,
            root + 1 + depth * width,
            table,
            slots.reshape(-1),
            width,
            active,
            rows,
            min(cad.max_seq_len + depth * width, d.max_model_len),
        )
        return self._forward(step_cad, tokens, depth)

    def roots_without_pass(self) -> torch.Tensor:
        self.positions = self._advance()
        self._root = self.positions.clone()
        return self._root

    def tree_rows(self, row: int, q_start: int, request: int, root, mask: torch.Tensor) -> TreeRows:
        return TreeRows(row, q_start, root, mask)

    def logits(self, hidden: torch.Tensor, lm_head: str | None) -> torch.Tensor:
        return self.drafter.model.compute_logits(hidden, lm_head)

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

    def __init__(self, drafter, verify_cad, heads: list[HeadStart]):
        super().__init__(drafter, verify_cad, None)  # decode-shaped, all rows
        self.heads = heads
        self.batch_size = len(heads)
        cad = self.cad
        self._batch_rows = [h.req_index for h in heads]  # their rows in the verify batch
        device = cad.seq_lens.device
        self._batch_index = device_index(self._batch_rows, device)
        self._table = cad.block_table_tensor[self._batch_index]
        self._frames = [h.frame(device) for h in heads]
        self._root_pos: torch.Tensor | None = None

    def _pass(
        self,
        logical: list[list[int]],
        positions: list[list[int]],
        tokens,
        rows: list[TreeRows] | None,
        active: list[int] | None,
        draft_index: int,
    ) -> torch.Tensor:
        """One eager forward: row r of request j at `logical[j][r]` (its KV slot), RoPE
        position `positions[j][r]`, attending as `rows[j]` says (None: the level pass's plan
        `draft_tree` made active, from `tree_rows`)."""
        d = self.drafter
        heads = self.heads if active is None else [self.heads[j] for j in active]
        index = None if active is None else device_index(active, self._table.device)
        table = self._table if index is None else self._table[index]
        k = len(logical[0])
        host = torch.tensor([logical, positions], dtype=torch.int64)  # [2, R, k]
        both = to_device(host, table.device)
        slots = logical_to_slots(table, both[0], d.block_size).reshape(-1)
        n = len(heads) * k
        d.positions[:n] = both[1].reshape(-1)
        ends = [row[-1] + 1 for row in logical]
        seq_lens = to_device(torch.tensor(ends, dtype=torch.int64), table.device)
        batch_rows = [
            self._batch_rows[j] for j in (range(len(self.heads)) if active is None else active)
        ]
        step_cad = tree_pass_metadata(
            d,
            self.cad,
            seq_lens,
            table,
            slots,
            k,
            batch_rows,
            device_index(batch_rows, table.device),
            min(max(ends), d.max_model_len),
        )
        if rows is None:
            return self._forward(step_cad, tokens, draft_index, eager=True)
        with tree_plan(TreePlan(rows)):
            return self._forward(step_cad, tokens, draft_index, eager=True)

    def leaf_pass(self, tokens: list[int]) -> torch.Tensor:
        ids = to_device(torch.tensor(tokens, dtype=torch.int64), self._table.device)
        device = self._table.device
        return self._pass(
            [[h.leaf_slot] for h in self.heads],
            [[h.root + h.leaf_depth] for h in self.heads],
            ids,
            [
                h.rows(j, j, torch.ones(1, 0, dtype=torch.bool, device=device), f)
                for j, (h, f) in enumerate(zip(self.heads, self._frames))
            ],
            None,
            0,
        )

    def bonus_pass(self, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self._table.device
        hidden = self._pass(
            [[h.node_slot(0)] for h in self.heads],
            [[h.next_root] for h in self.heads],
            next_token_ids,
            [
                h.rows(j, j, torch.ones(1, 1, dtype=torch.bool, device=device), f)
                for j, (h, f) in enumerate(zip(self.heads, self._frames))
            ],
            None,
            0,
        )
        self._root_pos = to_device(
            torch.tensor([h.next_root for h in self.heads]), self._table.device
        )
        return hidden, self._root_pos

    def chain_pass(self, index: int, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a head start drafts a tree")

    def roots_without_pass(self) -> torch.Tensor:
        raise NotImplementedError("a head start drafts its tree's first levels itself")

    def level_pass(
        self, depth: int, width: int, tokens: torch.Tensor, active: list[int] | None
    ) -> torch.Tensor:
        level = TreeShape(width, depth).level(depth)
        members = range(len(self.heads)) if active is None else active
        nodes = list(range(level.start, level.stop))
        return self._pass(
            [[self.heads[j].node_slot(i) for i in nodes] for j in members],
            [[self.heads[j].next_root + depth] * width for j in members],
            tokens,
            None,
            None if active is None else list(active),
            depth,
        )

    def tree_rows(self, row: int, q_start: int, request: int, root, mask: torch.Tensor) -> TreeRows:
        return self.heads[request].rows(row, q_start, mask, self._frames[request])

    def root_bounds(self, roots: torch.Tensor) -> list[int]:
        return [h.next_root for h in self.heads]
