"""The draft's CUDA graphs: which mode its graph keys are made for (`draft_cudagraph_mode`),
the (mode, padded rows) of a draft forward (`dispatched`, then `replay_or_eager`), and the
capture of one bucket's pieces in vLLM's capture phase (`capture_bucket`). Called by
`SubSpecProposer` (proposer.py: `initialize_cudagraph_keys`, `draft_bucket`, `dummy_run`).
docs/gpu.md, "CUDA graphs".
"""

from __future__ import annotations

from vllm.config import CompilationMode, CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID


def draft_cudagraph_mode(
    compilation_config, cudagraph_mode: CUDAGraphMode, breakable: bool
) -> CUDAGraphMode:
    """The mode the drafter's graph keys are made for: the runner's where the draft forward
    has piecewise pieces to capture (vLLM's compile mode, a piecewise runner mode, no
    breakable graphs: these wrap the drafter's whole model), else NONE. docs/gpu.md."""
    pieces = (
        compilation_config.mode == CompilationMode.VLLM_COMPILE
        and cudagraph_mode.has_piecewise_cudagraphs()
        and not breakable
    )
    return cudagraph_mode if pieces else CUDAGraphMode.NONE


def dispatched(dispatcher, num_tokens: int, use_cudagraphs: bool) -> tuple[CUDAGraphMode, int]:
    """vLLM's dispatcher alone (the drafter's `cudagraph_dispatcher`): the base class's
    `_determine_batch_execution_and_padding` synchronizes data-parallel ranks per forward, and
    a rank's draft passes are its own."""
    mode, batch = dispatcher.dispatch(
        num_tokens, valid_modes=None if use_cudagraphs else {CUDAGraphMode.NONE}
    )
    return mode, batch.num_tokens


def replay_or_eager(
    mode: CUDAGraphMode,
    padded: int,
    num_tokens: int,
    on_cuda: bool,
    captured: set[int],
    prompt_logprobs: bool,
) -> tuple[CUDAGraphMode, int]:
    """The dispatcher's (mode, padded rows), or eager at `num_tokens` on CUDA for a bucket the
    capture phase did not capture (capturing on a miss raises there) and while a request asks
    for prompt logprobs (a replay may write over the target's last output in the shared
    graph pool: vLLM issue 53488)."""
    if mode != CUDAGraphMode.NONE and on_cuda and (padded not in captured or prompt_logprobs):
        return CUDAGraphMode.NONE, num_tokens
    return mode, padded


def capture_bucket(drafter, mode: CUDAGraphMode, padded: int) -> None:
    """Capture the draft's pieces for one bucket inside vLLM's capture phase, after one
    eager forward at that row count (GemLite's autotuning and Triton's compilation run
    outside the capture); neither forward writes KV (every slot -1). drafter: the
    `SubSpecProposer`, whose `captured_buckets` gains `padded`."""
    drafter.captured_buckets.add(padded)
    slots = drafter._slot_mapping_buffer[:padded].fill_(PADDING_SLOT_ID)
    for run_mode in (CUDAGraphMode.NONE, mode):
        with (
            set_forward_context(
                None,
                drafter.vllm_config,
                num_tokens=padded,
                cudagraph_runtime_mode=run_mode,
                slot_mapping={n: slots for n in drafter._draft_attn_layer_names},
            ),
            drafter.drafting(),
        ):
            drafter.model(
                input_ids=drafter.input_ids[:padded], positions=drafter.positions[:padded]
            )
