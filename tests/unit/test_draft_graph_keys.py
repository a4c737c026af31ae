"""Which draft forwards CUDA would capture: `SubSpecProposer.initialize_cudagraph_keys` through
vLLM's own base-class rule and `CudagraphDispatcher`, for the modes a CUDA runner hands it
(`gpu_model_runner._check_and_update_cudagraph_mode` calls it with the resolved mode). The
forwards themselves run padded on a CPU engine in tests/e2e/test_e2e_tree.py."""

from types import SimpleNamespace

import pytest
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


@pytest.mark.parametrize("mode, runner_mode, spec_eager", [
    (CompilationMode.NONE, CUDAGraphMode.FULL, False),  # no compiled draft: no pieces
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE, False),  # the runner captures nothing
    (CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, True),  # speculative enforce_eager
])
def test_no_buckets_without_a_compiled_draft_or_graphs(mode, runner_mode, spec_eager):
    p = proposer(mode, CUDAGraphMode.NONE if mode == CompilationMode.NONE else runner_mode,
                 spec_eager)
    p.initialize_cudagraph_keys(runner_mode)
    assert p.draft_bucket(6) == (CUDAGraphMode.NONE, 6)
    assert p.draft_bucket(1) == (CUDAGraphMode.NONE, 1)
