"""The next verify pass's first offloaded-layer copies, run while SubSpec drafts, with CUDA graphs.

vLLM's `PrefetchOffloader` (identical in 0.32.0 and 0.33.0) starts, after the last offloaded
layers' forwards (`PrefetchOffloader._hook_module_forward`), "refill" copies of the first
s = `offload_prefetch_step` ones; a graph forward (`CUDAGraphWrapper.__call__`) captures them
and ends only once they have landed (`PrefetchOffloader.join_after_forward`): nothing is left
to overlap the draft. `OverlappingPrefetchOffloader` does not issue them while capturing; it
issues them eagerly on vLLM's copy stream (`_ModuleOffloader.start_onload_to_static`): before
drafting (`start_before_draft`), else at the next graph forward's first `sync_prev_onload`,
else before an eager forward's `_wait_for_layer`. It tracks which layer each slot holds (a
graph forward is taken to leave layers s..n-1 in the refilled slots), so no copy is issued
twice. The ring, the orderings and the hazards: docs/gpu.md, "Prefetch overlap".
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter

import torch
from vllm.model_executor.offloader.prefetch import PrefetchOffloader

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def _capturing() -> bool:
    return bool(torch.cuda.is_current_stream_capturing())


def _current_forward_context():
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


class OverlappingPrefetchOffloader(PrefetchOffloader):
    """vLLM's prefetch offloader whose refill copies of graph forwards run while the draft
    drafts (module docstring); installed in vLLM's place by SubSpec's runner. With no shared
    slot (s >= offloaded layers) or micro-batching, it behaves exactly as vLLM's."""

    def __init__(
        self, *args, use_ubatching: bool = False, forward_context=_current_forward_context, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.use_ubatching = use_ubatching  # its two threads run forwards concurrently
        self._forward_context = forward_context
        self._graph_forward: weakref.ref | None = None
        self.counts: Counter[str] = Counter()  # copies issued by this class, by where
        self._drafting = False  # inside `drafting()`
        self.slot_layer: dict[int, int | None] = {}  # slot -> layer last copied there

    @classmethod
    def replacing(
        cls, offloader, use_ubatching: bool = False
    ) -> OverlappingPrefetchOffloader | None:
        """One with the settings of vLLM's `offloader` (made by the runner, no layer wrapped
        yet); None for any other backend."""
        if type(offloader) is not PrefetchOffloader:
            return None
        return cls(
            group_size=offloader.group_size,
            num_in_group=offloader.num_in_group,
            prefetch_step=offloader.prefetch_step,
            offload_params=offloader.offload_params,
            mode=offloader.mode,
            use_ubatching=use_ubatching,
        )

    @property
    def overlaps(self) -> bool:
        """Whether any slot is refilled (s < offloaded layers) and forwards run one at a time."""
        return not self.use_ubatching and self.prefetch_step < len(self.module_offloaders)

    @property
    def first(self) -> range:
        return range(min(self.prefetch_step, len(self.module_offloaders)))

    @property
    def refilled(self) -> list[int]:
        """Slots of layers j < s that layer j + s (and later ones) also use."""
        return [j for j in self.first if j + self.prefetch_step < len(self.module_offloaders)]

    def post_init(self) -> None:
        super().post_init()  # it issues the copies of the first s layers
        self.slot_layer = {j: j for j in self.first}

    # ---- the copies --------------------------------------------------------------------
    def _slot(self, layer: int) -> int:
        return layer % self.prefetch_step  # `PrefetchOffloader.post_init`'s assignment

    def _ensure(self, layers, where: str) -> None:
        """Issue the copy of every layer in `layers` whose slot holds another one (eager: its
        event, recorded outside capture, is the one an eager forward waits on)."""
        for j in layers:
            if self.slot_layer.get(self._slot(j)) != j:
                self.module_offloaders[j].start_onload_to_static()
                self.slot_layer[self._slot(j)] = j
                self.counts[where] += 1

    def start_before_draft(self) -> None:
        """Called by the proposer before drafting: start the next verify's first-layer copies.
        A no-op after an eager forward (its own refill copies are already running)."""
        if self.overlaps and not _capturing():
            self._ensure(self.first, "before_draft")

    @contextlib.contextmanager
    def drafting(self):
        """The scope of a draft forward: a captured draft piece's replay calls
        `sync_prev_onload` too, which is skipped here. The draft reads no streamed layer, so
        it must neither wait for the copies it overlaps nor be taken for the next target
        forward."""
        self._drafting = True
        try:
            yield
        finally:
            self._drafting = False

    # ---- vLLM's PrefetchOffloader methods, overridden -----------------------------------
    def _start_prefetch(self, layer_idx: int) -> None:
        if not self.overlaps:
            return super()._start_prefetch(layer_idx)
        capturing = _capturing()
        if capturing and layer_idx < self.prefetch_step:
            self.counts["not_captured"] += 1  # issued eagerly before the next forward instead
            return
        super()._start_prefetch(layer_idx)
        if not capturing:
            self.slot_layer[self._slot(layer_idx)] = layer_idx

    def _wait_for_layer(self, layer_idx: int) -> None:
        if self.overlaps and not _capturing():  # an eager forward (or the draft's layer)
            # layer 0 opens a forward: fill every first slot at once; later layers need their own
            self._ensure(self.first if layer_idx == 0 else (layer_idx,), "eager_wait")
        super()._wait_for_layer(layer_idx)

    def sync_prev_onload(self) -> None:
        if not self.overlaps:
            return super().sync_prev_onload()
        if self._drafting:
            self.counts["draft_sync_skipped"] += 1
            return
        if not _capturing():
            # vLLM's graph wrappers call this only inside a forward context; a call without
            # one is treated as a new forward
            ctx = self._forward_context()
            if ctx is None or self._graph_forward is None or self._graph_forward() is not ctx:
                # first graph (or piece) of a new target forward
                self._ensure(self.first, "graph_entry")
                for j in self.refilled:  # its captured copies put layers j + s, ... there
                    self.slot_layer[j] = None
                self._graph_forward = None if ctx is None else weakref.ref(ctx)
        super().sync_prev_onload()  # vLLM: compute stream waits for the copy stream
