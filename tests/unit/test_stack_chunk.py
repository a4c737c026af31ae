"""A step's calls on a fresh chunk of Python's frame stack (vllm_hooks/stack_chunk.py): CPython
3.11-3.13.12 maps and unmaps a 16 KiB chunk per call made from a frame at a chunk's edge (a
page fault each); inside `call_on_fresh_chunk` no call nesting less than FREE_BYTES deep meets
an edge."""

import resource
import sys

import pytest

from vllm_subspec.vllm_hooks import stack_chunk
from vllm_subspec.vllm_hooks.stack_chunk import FREE_BYTES, call_on_fresh_chunk

CALLS = 400
# nesting inside the entry, in frames of `_at_depth` (~128 bytes each): a third of FREE_BYTES
INNER_DEPTHS = range(FREE_BYTES // 3 // 128)

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11),
                                reason="frames are heap objects before CPython 3.11")


def _leaf():
    return 1


def _calls(n: int) -> None:
    for _ in range(n):
        _leaf()


def _padded(slots: int):
    def pad(fn, *args):
        return fn(*args)

    pad.__code__ = pad.__code__.replace(co_stacksize=pad.__code__.co_stacksize + slots)
    return pad


# frames 0..15 slots larger than the smallest: with the 16-slot steps of `_at_depth`, the
# loop's frame ends at every slot offset of a chunk
PADS = [_padded(slots) for slots in range(16)]


def _at_depth(depth: int, fn, *args):
    if depth == 0:
        return fn(*args)
    return _at_depth(depth - 1, fn, *args)


def _plain_entry(fn, args, kwargs):  # call_on_fresh_chunk's signature, an ordinary frame
    return fn(*args, **kwargs)


def _faults(fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _worst_placement(entry) -> int:
    """The most page faults CALLS calls took, over every placement of the loop under `entry`:
    `depth` frames of nesting, then a frame 0..15 slots larger than the smallest, then the
    loop."""
    return max(_faults(entry, _at_depth, (depth, pad, _calls, CALLS), {})
               for depth in INNER_DEPTHS for pad in PADS)


def test_calls_at_a_chunk_edge_fault_and_on_a_fresh_chunk_never_do():
    edge = _worst_placement(_plain_entry)
    if edge < CALLS // 2:  # 3.13.13+ and newer 3.14s keep a spare chunk (gh-142183)
        assert sys.version_info >= (3, 13), "CPython 3.11-3.12 unmap a chunk when the call " \
            "that opened it returns: some placement must fault at every call"
        pytest.skip("no chunk edge that faults per call on this CPython")
    # (a fresh chunk faults in its first page and the pages its frames reach: ~12 here)
    assert _worst_placement(call_on_fresh_chunk) < CALLS // 10


def test_the_call_gets_its_arguments_result_and_exceptions():
    assert call_on_fresh_chunk(lambda a, b=0: a + b, (2,), {"b": 3}) == 5

    def boom():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        call_on_fresh_chunk(boom, (), {})


def test_subspec_worker_runs_both_step_calls_on_a_fresh_chunk(monkeypatch):
    """SubSpecWorker (mixed into vLLM's GPU and CPU workers) routes vLLM's `execute_model` and
    `sample_tokens` through `call_on_fresh_chunk`, with their arguments and results."""
    from vllm_subspec.vllm_hooks import runner

    routed = []

    def recording(fn, args, kwargs):
        routed.append(fn.__name__)
        return stack_chunk.call_on_fresh_chunk(fn, args, kwargs)

    monkeypatch.setattr(runner, "call_on_fresh_chunk", recording)

    class VllmWorker:  # the methods' owner in vLLM: Worker (gpu_worker.py)
        def execute_model(self, scheduler_output):
            return ("executed", scheduler_output)

        def sample_tokens(self, grammar_output):
            return ("sampled", grammar_output)

    class Worker(runner.SubSpecWorker, VllmWorker):
        pass

    worker = Worker()
    assert worker.execute_model("so") == ("executed", "so")
    assert worker.sample_tokens(grammar_output=None) == ("sampled", None)
    assert routed == ["execute_model", "sample_tokens"]
