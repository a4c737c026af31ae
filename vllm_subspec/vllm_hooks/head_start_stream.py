"""Where head starts are drafted (step/head_start.py): on CUDA a stream of their own, so their
passes run while the verify forward runs on the compute stream; on CPU the same calls, in
order (the passes after the verify's forward: its serial schedule).

The order, on CUDA: the branch copies, then `inputs_copied` (an event), are queued on the
compute stream before the verify forward; the passes, issued once the verify's logits are
queued, wait for that event alone, not for the verify; the walk's stream waits for the passes'
end (`join`) only before it reads or moves what they drafted, after the sampling and the
accepted paths' KV moves (which touch no slot of theirs). tests/unit/test_head_start_schedule.py
checks the slots each stream reads and writes under these rules with a vector-clock model of
streams and events.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class HeadStartStream:
    def __init__(self, device: torch.device, cuda=None):
        """cuda: the CUDA module (`torch.cuda`; a model of it in tests); None on CPU."""
        self.cuda = cuda if cuda is not None else (torch.cuda if device.type == "cuda" else None)
        # made now: the profiling pass allocates on it (the caching allocator keeps each
        # stream's blocks apart)
        self.stream = self.cuda.Stream() if self.cuda is not None else None
        self._inputs: Any = None  # event: the branch copies are queued before it
        self._done: Any = None  # event: the passes' end

    def inputs_copied(self) -> None:
        """On the compute stream, after the branch copies and before the verify forward."""
        if self.cuda is not None:
            self._inputs = self.cuda.Event()
            self._inputs.record()

    @contextlib.contextmanager
    def drafting(self):
        """The head-start passes run inside: after the branch copies, beside the verify."""
        if self.cuda is None:
            yield
            return
        if self._inputs is None:
            raise RuntimeError(
                "vllm-subspec: head starts drafted before their branch copies "
                "were queued (inputs_copied)"
            )
        self.stream.wait_event(self._inputs)
        self._inputs = None
        with self.cuda.stream(self.stream):
            yield
        self._done = self.cuda.Event()
        self._done.record(self.stream)

    def profiling(self):
        """Where the profiling pass allocates the passes' temporaries: their stream."""
        if self.cuda is None:
            return contextlib.nullcontext()
        return self.cuda.stream(self.stream)

    def join(self) -> None:
        """Before the walk: the current stream (and so the host reads queued on it) waits for
        the passes' end."""
        if self.cuda is not None and self._done is not None:
            self.cuda.current_stream().wait_event(self._done)
        self._done = None
