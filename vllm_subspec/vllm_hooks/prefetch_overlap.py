"""The next verify pass's first offloaded-layer copies, run while SubSpec drafts, with CUDA graphs.

vLLM's prefetch offloader (vllm/model_executor/offloader/prefetch.py, identical in 0.32.0 and
0.33.0) keeps `s = offload_prefetch_step` GPU slots; offloaded layer i lives in slot i % s
(`post_init`, :373). After layer i's forward the hook starts the copy of layer
`_get_next_prefetch_index(i)` (:248-259); for the last layers that target is one of the first s
("refill" copies: they put layers 0..s-1 back into the slots the later layers used).

* Eager forwards: a refill copy is left running on the copy stream; the next forward's layer j
  waits on its event (`_wait_for_layer`, :292-299). It already runs while the draft runs.
* CUDA graphs (CUDAGraphWrapper, compilation/cuda_graph.py:309-360): the copy is captured into
  the graph and `join_after_forward` (:315-334) makes the graph (FULL) or the piece (PIECEWISE)
  end only once it has landed. The verify pass therefore ends after the refill copies; nothing
  is left to overlap the draft.

`OverlappingPrefetchOffloader` moves the refill copies of graph forwards out of the graphs: while a graph
is being captured, a start of a target below s is not issued (so it is not captured), and the
copy is issued eagerly instead, outside any graph, on vLLM's copy stream, by vLLM's own
`_ModuleOffloader.start_onload_to_static` (fork event on the compute stream first: the copy
starts only after every kernel queued before it, i.e. after the last reader of the slot):

1. `start_before_draft()` — by the proposer, after the verify pass and sampling were queued,
   before drafting: the copies run while the draft runs;
2. otherwise at the first `sync_prev_onload()` of the next graph forward (vLLM calls it before
   every capture and replay), before vLLM's `wait_stream(copy_stream)` there;
3. otherwise (an eager forward) in `_wait_for_layer(j)`, before vLLM's wait for that layer.

The graph forward waits for them in `sync_prev_onload` (`wait_stream(copy_stream)`); an eager
forward waits for each layer's `_copy_done_event`, which `start_onload_to_static` recorded
outside capture (`_event_valid_for_eager`).

Which layer each slot holds is tracked from every copy issued in Python (eager ring copies,
the copies above, `post_init`'s first s); a graph forward (seen at its first `sync_prev_onload`,
one forward context per target forward) is taken to leave the slots of layers s..n-1 in the
slots of 0..s-1. A copy is issued only when a slot does not hold (or is not already loading)
the layer about to read it, so eager mode gets no second copy.
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

    def __init__(self, *args, use_ubatching: bool = False,
                 forward_context=_current_forward_context, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_ubatching = use_ubatching  # its two threads run forwards concurrently
        self._forward_context = forward_context
        self._graph_forward: weakref.ref | None = None
        self.counts: Counter[str] = Counter()  # copies issued by this class, by where
        self._drafting = False  # inside `drafting()`
        self.slot_layer: dict[int, int | None] = {}  # slot -> layer last copied there

    @classmethod
    def replacing(cls, offloader, use_ubatching: bool = False
                  ) -> OverlappingPrefetchOffloader | None:
        """One with the settings of vLLM's `offloader` (made by the runner, no layer wrapped
        yet); None for any other backend."""
        if type(offloader) is not PrefetchOffloader:
            return None
        return cls(group_size=offloader.group_size, num_in_group=offloader.num_in_group,
                   prefetch_step=offloader.prefetch_step,
                   offload_params=offloader.offload_params, mode=offloader.mode,
                   use_ubatching=use_ubatching)

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
        """Issue the copy of every layer in `layers` whose slot holds another one (eager)."""
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
