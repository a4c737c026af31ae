"""The eager CPU draft's RMSNorms through vLLM's C++ kernels (`model.cpu_fused_norms`): vLLM's own
RMSNorm modules, copied as `substitute_layer` copies them and replaced in the copy by
`CpuFusedRMSNorm`, against their native forward."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_subspec.draft_model.model import CpuFusedRMSNorm, cpu_fused_norms


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def layer(hidden: int, dtype: torch.dtype, var_hidden_size: int | None = None) -> nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        m = nn.Module()
        m.input_layernorm = RMSNorm(hidden, eps=1e-6, dtype=dtype)
        m.post_attention_layernorm = RMSNorm(hidden, eps=1e-6, var_hidden_size=var_hidden_size,
                                             dtype=dtype)
    with torch.no_grad():
        for norm in (m.input_layernorm, m.post_attention_layernorm):
            norm.weight.copy_(torch.randn(hidden, dtype=dtype))
    return m


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 0.07), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [1, 5])
def test_switched_norms_match_the_native_norm_in_one_kernel_call(dtype, atol, rows):
    torch.manual_seed(rows)
    target = layer(256, dtype)
    draft = copy.deepcopy(target)  # the draft's own copy, as substitute_layer makes it
    assert cpu_fused_norms([draft]) == 2
    assert isinstance(draft.input_layernorm, CpuFusedRMSNorm)
    assert type(target.input_layernorm).__name__ == "RMSNorm"  # vLLM's module: unchanged
    x, residual = torch.randn(rows, 256, dtype=dtype), torch.randn(rows, 256, dtype=dtype)
    want, xc = target.input_layernorm(x.clone()), x.clone()
    with CountOps() as counted:
        got = draft.input_layernorm(xc)
    assert torch.allclose(got.float(), want.float(), atol=atol, rtol=0)
    assert counted.ops == ["aten.empty_like", "_C.rms_norm"]
    want_out, want_res = target.input_layernorm(x.clone(), residual.clone())
    xs, rs = x.clone(), residual.clone()
    with CountOps() as counted:
        got_out, got_res = draft.input_layernorm(xs, rs)
    assert counted.ops == ["_C.fused_add_rms_norm"]
    assert got_out is xs and got_res is rs  # in place, as vLLM's CUDA path calls it
    assert torch.equal(got_res, want_res)  # the residual sum: exact
    assert torch.allclose(got_out.float(), want_out.float(), atol=atol, rtol=0)
    # the target's own norms still run vLLM's native forward (its IR op, or the ATen ops of
    # its native implementation once an engine in this process has set the IR op priorities)
    xs, rs = x.clone(), residual.clone()
    with CountOps() as counted:
        target.input_layernorm(xs, rs)
    assert "_C.fused_add_rms_norm" not in counted.ops and len(counted.ops) > 1


def test_norms_the_kernels_do_not_cover_keep_the_native_forward():
    torch.manual_seed(0)
    m = layer(256, torch.bfloat16, var_hidden_size=128)  # a variance over part of the row
    assert cpu_fused_norms([m]) == 1  # only input_layernorm
    assert not isinstance(m.post_attention_layernorm, CpuFusedRMSNorm)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    native = m.post_attention_layernorm.forward_native(x.clone())
    assert torch.equal(m.post_attention_layernorm(x.clone()), native)
    # a strided input falls back to the native forward, with the same result
    wide = torch.randn(4, 512, dtype=torch.bfloat16)[:, ::2]
    assert not wide.is_contiguous()
    assert torch.equal(m.input_layernorm(wide), m.input_layernorm.native.forward_native(wide))
    # so does a hidden size off the kernels' vector width (they raise on it), and a residual
    # of another dtype
    odd = layer(100, torch.bfloat16)
    assert cpu_fused_norms([odd]) == 2
    x, r = torch.randn(3, 100, dtype=torch.bfloat16), torch.randn(3, 100, dtype=torch.bfloat16)
    assert torch.equal(odd.input_layernorm(x.clone()), odd.input_layernorm.native.forward_native(x))
    got, want = odd.input_layernorm(x.clone(), r.clone()), \
        odd.input_layernorm.native.forward_native(x.clone(), r.clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    got = m.input_layernorm(x.clone(), x.float())
    want = m.input_layernorm.native.forward_native(x.clone(), x.float())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
