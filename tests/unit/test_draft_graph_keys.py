"""Which draft forwards CUDA would capture: `SubSpecProposer.initialize_cudagraph_keys` through
vLLM's own base-class rule and `CudagraphDispatcher`, for the modes a CUDA runner hands it
(`gpu_model_runner._check_and_update_cudagraph_mode` calls it with the resolved mode). The
forwards themselves run padded on a CPU engine in tests/e2e/test_e2e_tree.py."""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_subspec.vllm_hooks.proposer import SubSpecProposer

SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def proposer(mode: CompilationMode, cudagraph_mode: CUDAGraphMode, spec_eager=False):
    """A proposer with only what the key rule reads: vLLM's config pieces and a real
    dispatcher over a config with these capture sizes."""
    compilation = CompilationConfig(
        mode=mode, cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=SIZES,
        max_cudagraph_capture_size=SIZES[-1],
        splitting_ops=list(CompilationConfig._attention_ops))
    config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=1,
                             lora_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8))
    p = object.__new__(SubSpecProposer)
    p.vllm_config = config
    p.speculative_config = SimpleNamespace(enforce_eager=spec_eager)
    p.cudagraph_dispatcher = CudagraphDispatcher(config)
    p.device = torch.device("cpu")  # the CUDA guards are tested apart
    p.captured_buckets = set()
    p.runner = SimpleNamespace(num_prompt_logprobs={})
    return p


@pytest.mark.parametrize("runner_mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_a_compiled_draft_pads_to_capture_sizes(runner_mode):
    """Compile mode, the runner capturing piecewise graphs (trees are pinned to PIECEWISE;
    chains keep vLLM's FULL_AND_PIECEWISE): PIECEWISE buckets at the capture sizes, eager
    past the largest."""
    p = proposer(CompilationMode.VLLM_COMPILE, runner_mode)
    p.initialize_cudagraph_keys(runner_mode)
    assert p.draft_bucket(1) == (CUDAGraphMode.PIECEWISE, 1)
    assert p.draft_bucket(6) == (CUDAGraphMode.PIECEWISE, 8)   # a 6-wide level of one request
    assert p.draft_bucket(36) == (CUDAGraphMode.PIECEWISE, 40)
    assert p.draft_bucket(65) == (CUDAGraphMode.NONE, 65)
    assert p.draft_bucket(6, use_cudagraphs=False) == (CUDAGraphMode.NONE, 6)


@pytest.mark.parametrize("mode, runner_mode, spec_eager, breakable", [
    (CompilationMode.NONE, CUDAGraphMode.FULL, False, False),  # no compiled draft: no pieces
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE, False, False),  # no graphs at all
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL, False, False),  # FULL wraps no piece
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, True, False),  # speculative eager
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, False, True),  # breakable graphs
])
def test_no_buckets_without_compiled_pieces(mode, runner_mode, spec_eager, breakable,
                                            monkeypatch):
    import vllm.envs

    monkeypatch.setattr(vllm.envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", breakable, raising=False)
    p = proposer(mode, CUDAGraphMode.NONE if mode == CompilationMode.NONE else runner_mode,
                 spec_eager)
    p.initialize_cudagraph_keys(runner_mode)
    assert p.draft_bucket(6) == (CUDAGraphMode.NONE, 6)
    assert p.draft_bucket(1) == (CUDAGraphMode.NONE, 1)


def test_on_cuda_only_captured_buckets_replay_and_never_with_prompt_logprobs():
    """A bucket the capture phase did not capture runs eagerly (capturing on a miss outside
    that phase raises in vLLM), and so does every pass of a step whose batch asks for prompt
    logprobs (computed from the target's hidden states after drafting; a replay may write over
    them in the shared graph pool)."""
    p = proposer(CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE)
    p.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
    p.device = torch.device("cuda")  # a device object only: nothing runs on it
    p.captured_buckets = {8, 16}
    assert p.draft_bucket(6) == (CUDAGraphMode.PIECEWISE, 8)
    assert p.draft_bucket(12) == (CUDAGraphMode.PIECEWISE, 16)
    assert p.draft_bucket(20) == (CUDAGraphMode.NONE, 20)  # bucket 24: not captured
    p.runner.num_prompt_logprobs = {"req-1": 5}
    assert p.draft_bucket(6) == (CUDAGraphMode.NONE, 6)


@pytest.mark.parametrize("widths, seqs, tokens, bound", [
    ((6,), 8, 8192, 48),
    ((1,), 8, 8192, 8),            # a chain: one row per request
    ((1, 2, 4, 6), 32, 100, 100),  # a k=4 level of 25 requests fills 100 rows; k=6 only 96
    ((1, 2, 4, 6), 256, 100, 100),  # a bonus pass: min(max_num_seqs, max_num_batched_tokens)
    ((6,), 4, 5, 6),               # a level wider than a forward: one request's whole level
])
def test_the_draft_rows_bound_covers_every_width_and_the_bonus_pass(widths, seqs, tokens,
                                                                    bound):
    p = proposer(CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE)
    p.vllm_config.scheduler_config.max_num_seqs = seqs
    p.max_num_tokens = tokens
    p.options = SimpleNamespace(widths=widths)
    assert p.draft_rows_bound() == bound
    # the warm-up forwards: the bound padded to a capture size, at least 2 rows, within the
    # runner's buffers
    assert p.warm_up_rows() == min(max(2, next((c for c in SIZES if c >= bound), bound)),
                                   tokens)
