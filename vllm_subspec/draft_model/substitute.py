"""`SubstituteLinear`: a low-bit copy of a target linear, built from the target's own weights,
that drops into a vLLM decoder layer where a `LinearBase` was (it returns `(y, None)`).

Design: docs/substitutes.md.
"""

from __future__ import annotations

import torch

from vllm_subspec.draft_model import dense_twin
from vllm_subspec.draft_model.kernels import Int4CpuKernel, choose_kernel
from vllm_subspec.draft_model.quantize import QuantizedWeight


class SubstituteLinear(torch.nn.Module):
    """Stands in for a vLLM linear inside the draft: same call convention, low-bit weights."""

    def __init__(
        self,
        kernel,
        bias: torch.Tensor | None,
        source_name: str = "",
        in_features: int = 0,
        all_reduce: bool = False,
    ):
        """all_reduce: it stands in for a tensor-parallel row-parallel linear whose partial
        products vLLM sums over the ranks (`RowParallelLinear.forward`): so does it."""
        super().__init__()
        self.kernel = kernel
        self.all_reduce = all_reduce
        self.in_features = in_features
        # Biases are tiny; copy them so the substitute never reads offloaded memory.
        self.bias = None if bias is None else bias.detach().clone()
        self.source_name = source_name

    def forward(self, x: torch.Tensor):
        y = self.kernel(x)
        if self.all_reduce:
            from vllm.distributed import tensor_model_parallel_all_reduce

            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:  # once, after the sum (vLLM adds it on rank 0 before)
            y = y + self.bias
        return y, None  # vLLM linears return (output, output_bias)

    def tensors(self) -> list[torch.Tensor]:
        return self.kernel.tensors() + ([self.bias] if self.bias is not None else [])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def warm_up_key(self, m: int):
        """Row counts with equal keys share the kernel's compiled/autotuned state; a kernel
        without `warm_up_key` is warmed at every row count."""
        key = getattr(self.kernel, "warm_up_key", None)
        return m if key is None else key(m)

    def extra_repr(self) -> str:
        return f"{self.source_name}, kernel={self.kernel.name}"


def keeps_dense_twin(
    qw: QuantizedWeight, dtype: torch.dtype, device: torch.device, kernel: str, max_rows: int
) -> bool:
    """Whether `substitute_from_quantized(..., max_rows)` would keep a dense twin: an int4 CPU
    kernel chosen by "auto", and a dense matmul faster at some row count up to max_rows."""
    if max_rows <= 0 or kernel != "auto" or device.type != "cpu":
        return False
    cls = choose_kernel(qw, device, kernel)  # on CPU: no gemlite, no warning
    if not issubclass(cls, Int4CpuKernel):
        return False
    n, k = qw.shape
    return (
        dense_twin.dense_crossover(cls, n, k, qw.group_size, cls.activation_dtype(dtype), max_rows)
        is not None
    )


def substitute_from_quantized(
    qw: QuantizedWeight,
    linear: torch.nn.Module,
    device: torch.device,
    kernel: str,
    name: str = "",
    max_rows: int = 0,
) -> SubstituteLinear:
    """The substitute for `linear` from its (built or cached) quantized weight. max_rows: the
    most rows a draft pass can send; with kernel "auto" on CPU, the int4 kernel then keeps a
    dense twin where a dense matmul is faster at some of those row counts."""
    cls = choose_kernel(qw, device, kernel)
    if keeps_dense_twin(qw, linear.weight.dtype, device, kernel, max_rows):
        built = cls(qw, linear.weight.dtype, max_rows)
    else:
        built = cls(qw, linear.weight.dtype)
    bias = getattr(linear, "bias", None)
    tp_size = getattr(linear, "tp_size", 1)
    if tp_size > 1 and (
        getattr(linear, "gather_output", False)
        or getattr(linear, "input_is_parallel", True) is False
    ):
        raise ValueError(
            f"vllm-subspec: {name} gathers its output or splits its input over "
            "tensor-parallel ranks; SubSpec substitutes only linears that keep "
            "their shard"
        )
    return SubstituteLinear(
        built,
        None if bias is None else bias.data.to(device),
        name,
        in_features=qw.shape[1],
        all_reduce=tp_size > 1 and getattr(linear, "reduce_results", False),
    )
