"""A step without drafts (every plain step of a SubSpec engine): `SubSpecRunner` hands vLLM's
`_calc_spec_decode_metadata` a cached copy of vLLM's own result per batch size, with only the
logits indices copied anew. Checked field by field against vLLM's real method."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_subspec.vllm_hooks import verifier as verifier_module
from vllm_subspec.vllm_hooks.runner import SubSpecGPUModelRunner
from vllm_subspec.vllm_hooks.verifier import SampleMatchVerifier

MAX_TOKENS = 16384


def runner_state(runner) -> None:
    """The buffers `GPUModelRunner.__init__` makes that `_calc_spec_decode_metadata` reads."""
    runner.device = torch.device("cpu")
    runner.arange_np = np.arange(MAX_TOKENS, dtype=np.int64)
    runner._arange_scratch = np.empty(MAX_TOKENS, dtype=np.int64)
    runner.input_ids = SimpleNamespace(gpu=torch.randint(0, 50_000, (MAX_TOKENS,),
                                                         dtype=torch.int32))


@pytest.fixture
def runners():
    """SubSpec's runner (the real class, `__init__` skipped) and a plain `GPUModelRunner`
    state object with the same buffers, for vLLM's own result."""
    subspec = object.__new__(SubSpecGPUModelRunner)
    runner_state(subspec)
    subspec.rejection_sampler = SampleMatchVerifier(subspec, session=None, kv_caches=None,
                                                  head_stream=None, lm_head_logits=None)
    reference = SimpleNamespace()
    runner_state(reference)
    reference.input_ids = subspec.input_ids
    reference._get_cumsum_and_arange = GPUModelRunner._get_cumsum_and_arange.__get__(reference)
    return subspec, reference


def vllms(reference, num_draft, cu):
    return GPUModelRunner._calc_spec_decode_metadata(reference, num_draft.copy(), cu.copy())


def assert_same(got, want) -> None:
    assert got.num_draft_tokens == want.num_draft_tokens
    assert got.max_spec_len == want.max_spec_len
    for field in ("draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens",
                  "target_logits_indices", "bonus_logits_indices", "logits_indices"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, field
        assert torch.equal(a, b), field


def scheduled(rng, batch_size: int, prompt_chunks: bool) -> np.ndarray:
    """cu_num_scheduled_tokens as `_prepare_inputs` makes it (an int32 count per request,
    summed by np.cumsum: int64): one token a request, or prompt chunks among them."""
    counts = np.ones(batch_size, dtype=np.int32)
    if prompt_chunks:
        counts[rng.random(batch_size) < 0.5] = rng.integers(2, 300)
    return np.cumsum(counts)


@pytest.mark.parametrize("batch_size", [1, 3, 8, 32])
def test_a_step_without_drafts_gets_vllms_metadata_from_one_copy(runners, batch_size,
                                                                 monkeypatch):
    subspec, reference = runners
    rng = np.random.default_rng(batch_size)
    built = []
    original = GPUModelRunner._calc_spec_decode_metadata
    monkeypatch.setattr(GPUModelRunner, "_calc_spec_decode_metadata",
                        lambda self, *a: built.append(self) or original(self, *a))
    copies, h2d = [], verifier_module.async_tensor_h2d
    monkeypatch.setattr(verifier_module, "async_tensor_h2d",
                        lambda *a, **k: copies.append(1) or h2d(*a, **k))
    zeros = np.zeros(batch_size, dtype=np.int32)
    results = []
    for i in range(4):
        cu = scheduled(rng, batch_size, prompt_chunks=i % 2 == 1)
        got = subspec._calc_spec_decode_metadata(zeros.copy(), cu.copy())
        want = vllms(reference, zeros, cu)
        assert_same(got, want)
        results.append((got, want))
    assert [r for r in built if r is subspec] == [subspec]  # vLLM's own once: the cache
    assert len(copies) == 3  # one copy a step after the first
    for got, want in results:  # a later step did not change an earlier step's metadata
        assert_same(got, want)
    # a consumer that reassigned a field of a step's metadata (the first step's included)
    # does not reach the next step's
    for got, _ in results:
        got.cu_num_sampled_tokens = got.bonus_logits_indices = None
    cu = scheduled(rng, batch_size, prompt_chunks=False)
    assert_same(subspec._calc_spec_decode_metadata(zeros.copy(), cu.copy()),
                vllms(reference, zeros, cu))


def test_a_step_with_drafts_is_vllms_own(runners):
    subspec, reference = runners
    num_draft = np.array([0, 3, 0, 6], dtype=np.int32)
    cu = np.cumsum(num_draft + 1, dtype=np.int32)
    assert_same(subspec._calc_spec_decode_metadata(num_draft.copy(), cu.copy()),
                vllms(reference, num_draft, cu))
    assert subspec.rejection_sampler._no_draft == {}  # nothing cached from a drafting step
    zeros = np.zeros(4, dtype=np.int32)
    cu = np.arange(1, 5, dtype=np.int32)
    subspec._calc_spec_decode_metadata(zeros.copy(), cu.copy())
    assert_same(subspec._calc_spec_decode_metadata(num_draft.copy(), np.cumsum(
        num_draft + 1, dtype=np.int32)), vllms(reference, num_draft, np.cumsum(
            num_draft + 1, dtype=np.int32)))  # the cache does not answer a drafting step


def test_batch_sizes_in_turn_each_get_their_own(runners):
    """One engine's steps change batch size as requests join and finish."""
    subspec, reference = runners
    rng = np.random.default_rng(0)
    for batch_size in (3, 8, 3, 1, 8, 1, 32, 3):
        zeros = np.zeros(batch_size, dtype=np.int32)
        cu = scheduled(rng, batch_size, prompt_chunks=bool(rng.integers(2)))
        assert_same(subspec._calc_spec_decode_metadata(zeros.copy(), cu.copy()),
                    vllms(reference, zeros, cu))
    assert sorted(subspec.rejection_sampler._no_draft) == [1, 3, 8, 32]
