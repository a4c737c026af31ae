"""vLLM 0.32's CPU `expand_batch_to_tokens` bug and the plugin's replacement (cpu_sampling_fix.py):
per-request values expanded to their tokens, installed in vLLM's rejection sampler."""

import torch

from vllm_subspec.vllm_hooks.cpu_sampling_fix import expand_batch_to_tokens


def test_cpu_expand_fix_expands_per_request_values():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens(x, cu, 6, replace_from=0.0, replace_to=1.0)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    assert out.dtype == x.dtype
    ints = expand_batch_to_tokens(torch.tensor([3, 7], dtype=torch.int32),
                                  torch.tensor([1, 3], dtype=torch.int32), 3)
    assert ints.tolist() == [3, 7, 7] and ints.dtype == torch.int32


def test_cpu_expand_fix_is_installed_in_vllm():
    from vllm.v1.sample import rejection_sampler

    import vllm_subspec.vllm_hooks.patches as patches

    assert patches.apply_all()
    assert rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens
