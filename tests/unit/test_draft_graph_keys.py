"""Which draft forwards CUDA would capture and replay, and how many rows they pad to: the
draft's pure rules (draft_graphs.py's `draft_cudagraph_mode`, `replay_or_eager`; `row_buckets`)
over vLLM's own `CudagraphDispatcher`, for the modes a CUDA runner hands the drafter. The
forwards themselves run padded on a CPU engine in tests/e2e/test_e2e_tree.py."""

from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_subspec.draft_model import row_buckets
from vllm_subspec.vllm_hooks.draft_graphs import draft_cudagraph_mode, replay_or_eager

SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def dispatcher(mode: CompilationMode, runner_mode: CUDAGraphMode, breakable=False,
               spec_eager=False):
    """vLLM's dispatcher with the keys vLLM's own drafter rule
    (`SpecDecodeBaseProposer.initialize_cudagraph_keys`, run on a stand-in holding only what it
    reads) makes for the mode `draft_cudagraph_mode` hands it."""
    compilation = CompilationConfig(
        mode=mode, cudagraph_mode=runner_mode, cudagraph_capture_sizes=SIZES,
        max_cudagraph_capture_size=SIZES[-1],
        splitting_ops=list(CompilationConfig._attention_ops))
    config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=1,
                             lora_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8))
    d = CudagraphDispatcher(config)
    keyed = draft_cudagraph_mode(compilation, runner_mode, breakable)
    SpecDecodeBaseProposer.initialize_cudagraph_keys(SimpleNamespace(
        speculative_config=SimpleNamespace(enforce_eager=spec_eager), cudagraph_dispatcher=d),
        keyed)
    return d, keyed


def dispatch(d, rows, graphs=True):
    mode, batch = d.dispatch(rows, valid_modes=None if graphs else {CUDAGraphMode.NONE})
    return mode, batch.num_tokens


@pytest.mark.parametrize("runner_mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_a_compiled_draft_pads_to_capture_sizes(runner_mode):
    """Compile mode, the runner capturing piecewise graphs (trees are pinned to PIECEWISE;
    chains keep vLLM's FULL_AND_PIECEWISE): PIECEWISE buckets at the capture sizes, eager
    past the largest."""
    d, keyed = dispatcher(CompilationMode.VLLM_COMPILE, runner_mode)
    assert keyed == runner_mode
    assert dispatch(d, 1) == (CUDAGraphMode.PIECEWISE, 1)
    assert dispatch(d, 6) == (CUDAGraphMode.PIECEWISE, 8)   # a 6-wide level of one request
    assert dispatch(d, 36) == (CUDAGraphMode.PIECEWISE, 40)
    assert dispatch(d, 65) == (CUDAGraphMode.NONE, 65)
    assert dispatch(d, 6, graphs=False) == (CUDAGraphMode.NONE, 6)


@pytest.mark.parametrize("mode, runner_mode, spec_eager, breakable", [
    (CompilationMode.NONE, CUDAGraphMode.FULL, False, False),  # no compiled draft: no pieces
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE, False, False),  # no graphs at all
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL, False, False),  # FULL wraps no piece
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, True, False),  # speculative eager
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, False, True),  # breakable graphs
])
def test_no_buckets_without_compiled_pieces(mode, runner_mode, spec_eager, breakable):
    d, _ = dispatcher(mode, CUDAGraphMode.NONE if mode == CompilationMode.NONE else runner_mode,
                      breakable, spec_eager)
    assert dispatch(d, 6) == (CUDAGraphMode.NONE, 6)
    assert dispatch(d, 1) == (CUDAGraphMode.NONE, 1)


def test_on_cuda_only_captured_buckets_replay_and_never_with_prompt_logprobs():
    """A bucket the capture phase did not capture runs eagerly (capturing on a miss outside
    that phase raises in vLLM), and so does every pass of a step whose batch asks for prompt
    logprobs; on CPU the dispatcher's answer stands."""
    piecewise = CUDAGraphMode.PIECEWISE
    captured = {8, 16}
    assert replay_or_eager(piecewise, 8, 6, True, captured, False) == (piecewise, 8)
    assert replay_or_eager(piecewise, 16, 12, True, captured, False) == (piecewise, 16)
    assert replay_or_eager(piecewise, 24, 20, True, captured, False) == (CUDAGraphMode.NONE, 20)
    assert replay_or_eager(piecewise, 8, 6, True, captured, True) == (CUDAGraphMode.NONE, 6)
    assert replay_or_eager(piecewise, 24, 20, False, set(), True) == (piecewise, 24)
    assert replay_or_eager(CUDAGraphMode.NONE, 20, 20, True, set(), False) == \
        (CUDAGraphMode.NONE, 20)


@pytest.mark.parametrize("widths, seqs, rows, bound, warm_up", [
    ((6,), 8, 8192, 48, 48),
    ((1,), 8, 8192, 8, 8),              # a chain: one row per request
    ((1, 2, 4, 6), 32, 100, 100, 100),  # a k=4 level of 25 requests fills 100 rows; k=6 only 96
    ((1, 2, 4, 6), 256, 100, 100, 100),  # a bonus pass: min(max_num_seqs, max rows)
    ((6,), 4, 5, 6, 5),                 # a level wider than a forward: one request's whole level
    ((6,), 3, 8192, 18, 24),            # padded to the next capture size
    ((1,), 1, 8192, 1, 2),              # never one row: a size-1 dimension is specialized
])
def test_the_draft_rows_bound_covers_every_width_and_the_bonus_pass(widths, seqs, rows, bound,
                                                                    warm_up):
    assert row_buckets.draft_rows_bound(seqs, rows, widths) == bound
    assert row_buckets.warm_up_rows(bound, SIZES, rows) == warm_up


def test_draft_row_counts_include_every_width_and_their_buckets():
    counts = row_buckets.draft_row_counts(3, (1, 6), capture_sizes=(4, 8, 16, 24))
    assert counts == [1, 2, 3, 4, 6, 8, 12, 16, 18, 24]
    assert row_buckets.capture_bucket(17, (4, 8, 16, 24)) == 24
    assert row_buckets.capture_bucket(30, (4, 8, 16, 24)) == 30
    assert row_buckets.verify_rows_bound(8192, 4, 6 * 48) == 4 * 289
    assert row_buckets.verify_rows_bound(1000, 4, 6 * 48) == 1000
