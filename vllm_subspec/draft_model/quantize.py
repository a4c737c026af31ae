"""Group quantization of a target weight: `quantize(weight) -> QuantizedWeight`, by HQQ's solver
(`hqq.py`) or round-to-nearest. The kernels that run a quantized weight: kernels.py.

Design: docs/substitutes.md, "Quantization".
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class QuantizedWeight:
    """Asymmetric group quantization along the input dim: W[n, k] = (codes - zero) * scale."""

    codes: torch.Tensor  # uint8 [N, K], values in [0, 2**bits)
    scale: torch.Tensor  # float32 [N, K // group_size]
    zero: torch.Tensor  # float32 [N, K // group_size] (HQQ zeros are fractional)
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        w = (self.codes.float().view(n, k // g, g) - self.zero[..., None]) * self.scale[..., None]
        return w.view(n, k).to(dtype)


# Rows are quantized in blocks of at most this many weights (the solver holds fp32 copies of
# what it solves; a whole 151936 x 1536 lm_head is 0.9 GB per copy). Kept at the size HQQ
# needed (about ten copies), so the blocks, and with them the substitutes, stay as before.
QUANTIZE_BLOCK_ELEMENTS = 1 << 25


def quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 64, method: str = "hqq"):
    """Quantize a [N, K] weight in groups of consecutive input elements (HQQ's axis=1):
    `method="hqq"` by HQQ's proximal solver (draft_model/hqq.py), `"rtn"` by plain min/max
    round-to-nearest. The input is not modified and no full-precision copy is kept. A large
    weight is solved in blocks of rows, so its HQQ solve can differ slightly from a whole one
    (docs/substitutes.md, "Quantization")."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    rows = max(1, QUANTIZE_BLOCK_ELEMENTS // k)
    if n <= rows:
        return _quantize_block(weight, bits, group_size, method)
    parts = [
        _quantize_block(weight[i : i + rows], bits, group_size, method) for i in range(0, n, rows)
    ]
    return QuantizedWeight(
        codes=torch.cat([p.codes for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        zero=torch.cat([p.zero for p in parts]),
        bits=bits,
        group_size=group_size,
    )


def _quantize_block(weight: torch.Tensor, bits: int, group_size: int, method: str):
    from vllm_subspec.draft_model.hqq import quantize_groups

    n, k = weight.shape
    # HQQLinear kept scale and zero in its compute dtype: fp16 on CUDA, bf16 elsewhere
    meta_dtype = torch.float16 if weight.is_cuda else torch.bfloat16
    q = quantize_groups(
        weight.detach().reshape(-1, group_size),
        bits,
        optimize=method == "hqq",
        meta_dtype=meta_dtype,
    )
    g = k // group_size
    return QuantizedWeight(
        codes=q.codes.view(n, k),
        scale=q.scale.view(n, g),
        zero=q.zero.view(n, g),
        bits=bits,
        group_size=group_size,
    )
