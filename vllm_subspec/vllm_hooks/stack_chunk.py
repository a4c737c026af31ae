"""A worker's calls on a fresh chunk of Python's frame stack: no mapping per Python call.

CPython 3.11-3.13.12 (and 3.14 before gh-142183's one-chunk cache) keeps a thread's Python frames
in a data stack of chunks (`_PyStackChunk`, Python/pystate.c: 16 KiB, doubled until a frame and
a 1000-slot margin fit) and unmaps a chunk as soon as the call that opened it returns. Calls
made in a loop from a frame at a chunk's edge therefore map, fault in and unmap a chunk each:
in vLLM 0.32's CPU worker, 54 such mappings per decoding step of SmolLM2-135M at 8 requests,
and ~140 in SubSpec's worker, whose frames sit deeper (strace; gdb: `push_chunk` under
`_PyEvalFramePushAndInit`). `call_on_fresh_chunk` runs a call with its frames at the start of a
chunk with ~FREE_BYTES free above them: one mapping per call, and no edge inside the call
unless it nests deeper than that. docs/architecture.md, "Python's frame stack".

Cost: a frame *object* for the entry (a traceback through it, a full stack walk, a tracer or
profiler) is FREE_BYTES large.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

FREE_BYTES = 128 * 1024  # frames above the entry's before an edge (~500 typical frames)
_SLOT_BYTES = 8  # a frame slot: one PyObject pointer


def _entry(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


if sys.version_info >= (3, 11):
    # A frame takes co_nlocalsplus + co_stacksize + a few slots, and only its header and
    # locals are written when it is pushed: a large co_stacksize makes the entry's frame need
    # a chunk of its own (256 KiB: 16 KiB doubled past the frame and CPython's 1000-slot
    # margin), whose upper ~128 KiB, never touched by the entry, hold the frames of the call.
    _entry.__code__ = _entry.__code__.replace(
        co_stacksize=_entry.__code__.co_stacksize + FREE_BYTES // _SLOT_BYTES
    )
    call_on_fresh_chunk = _entry
else:  # 3.10: frames are heap objects, no chunked stack

    def call_on_fresh_chunk(fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)
