"""The kernels a substitute runs: each turns a `QuantizedWeight` into a callable
`x -> x @ W_deq.T` that owns only its packed tensors; `choose_kernel` picks one per device:
`Int4DotCpuKernel` (x86 with AVX512-BF16) and `Int4CpuKernel` (tinygemm), each with an
optional dense twin; `GemliteKernel` (CUDA only); `ReferenceKernel` (dequantize + matmul, any
bit width: the oracle for tests).

Design: docs/substitutes.md, "Kernels".
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F

from vllm_subspec.draft_model import dense_twin, int4_dot_cpu
from vllm_subspec.draft_model.gemlite_tuning import gemlite_warm_up_key
from vllm_subspec.draft_model.quantize import QuantizedWeight

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def int4_cpu_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    dense: torch.Tensor,
    dense_from_rows: int,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] with `Int4CpuKernel`'s tensors: the dense twin from
    `dense_from_rows` rows on (when there is one: `dense` not empty), else tinygemm int4."""
    if dense.numel() and x.shape[0] >= dense_from_rows:
        return F.linear(x, dense)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


# The same function as an operator opaque to torch.compile: the row-count choice stays a runtime
# decision inside a compiled draft forward (its fake gives the output shape: N = packed rows).
torch.library.custom_op(
    "vllm_subspec::int4_cpu_linear", int4_cpu_linear, mutates_args=()
).register_fake(lambda x, packed, *_: x.new_empty(x.shape[0], packed.shape[0]))


def int4_dot_cpu_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    meta: torch.Tensor,
    group_size: int,
    dense: torch.Tensor,
    dense_from_rows: int,
) -> torch.Tensor:
    """`int4_cpu_linear` with `Int4DotCpuKernel`'s tensors: its dense twin from
    `dense_from_rows` rows on, else the AVX512-BF16 kernel."""
    if dense.numel() and x.shape[0] >= dense_from_rows:
        return F.linear(x, dense)
    return int4_dot_cpu.linear(x, packed, meta, group_size)


torch.library.custom_op(
    "vllm_subspec::int4_dot_cpu_linear", int4_dot_cpu_linear, mutates_args=()
).register_fake(lambda x, packed, *_: x.new_empty(x.shape[0], packed.shape[0] * int4_dot_cpu.TILE))


class Int4CpuKernel:
    """tinygemm int4 on CPU, with an optional dense twin: HQQ's weights dequantized once into
    the activation dtype, used from the row count where a plain matmul is faster than the int4
    kernel (`dense_from_rows`, measured per weight shape). Both paths compute x @ W.T with the
    same HQQ weights (the twin holds (q - z) * s rounded to the activation dtype), so they
    differ by rounding only; either way the draft only proposes."""

    name = "int4_cpu"
    # The call, eager, and its `vllm_subspec::` operator, opaque to torch.compile.
    linear = staticmethod(int4_cpu_linear)
    op = "int4_cpu_linear"

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and Int4CpuKernel.packs(qw.shape[0], qw.bits, qw.group_size)

    @staticmethod
    def packs(n: int, bits: int, group_size: int) -> bool:
        """Whether tinygemm can pack an [n, k] weight of this bit width and group size."""
        return bits == 4 and n % 16 == 0 and group_size in (32, 64, 128, 256)

    # The kernel's fp32 path is ~100x slower than its bf16 one (194 ms vs 1.5 ms at M=60 for a
    # 3072x576 weight), so a float32 model drafts through bf16 activations: the draft's
    # precision shapes proposals only, never the verified output.
    compute_dtype = torch.bfloat16

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, max_rows: int = 0):
        """max_rows: the most rows a draft pass can send (0: the int4 kernel only). A dense
        twin is kept when it is faster than int4 at some row count up to there."""
        n, k = qw.shape
        self.out_features, self.in_features = n, k
        self.group_size = qw.group_size
        self.act_dtype = self.activation_dtype(dtype)
        self.packed, self.scales_and_zeros = self.pack(qw, self.act_dtype)
        self.dense_from_rows = (
            dense_twin.dense_crossover(
                type(self),  # type: ignore[arg-type]  # a class is hashable; mypy's lru_cache stub
                n,
                k,
                qw.group_size,
                self.act_dtype,
                max_rows,
            )
            if max_rows > 0
            else None
        )
        self.dense = qw.dequantize(self.act_dtype) if self.dense_from_rows is not None else None

    @classmethod
    def activation_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype == torch.float16 else cls.compute_dtype

    @staticmethod
    def pack(qw: QuantizedWeight, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            qw.codes.to(torch.int32).contiguous(), 1
        )  # [N, K/2] uint8
        zero_tg = (8 - qw.zero) * qw.scale
        # [G, N, 2] in the activation dtype, as tinygemm wants.
        return packed, (
            torch.stack([qw.scale, zero_tg], -1).transpose(0, 1).contiguous().to(act_dtype)
        )

    @property
    def dense(self) -> torch.Tensor | None:
        """The dense twin, None without one."""
        return self.twin if self.twin.numel() else None

    @dense.setter
    def dense(self, value: torch.Tensor | None) -> None:
        # `twin` is always a tensor (empty without a twin): a compiled draft forward reads
        # `kernel.twin` whichever substitutes kept one, so one graph serves them all, also
        # after `SubstituteSet.drop_twins` and from vLLM's on-disk copy of the graph
        self.twin = value if value is not None else torch.empty(0, dtype=self.act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        x2 = (x2 if x2.dtype == self.act_dtype else x2.to(self.act_dtype)).contiguous()
        # Compiled (the draft forward in vLLM's compile mode), through the custom op: dynamo
        # traces one graph for every row count and vLLM drops its guards, so a branch on the
        # row count here would be fixed at the traced size for all of them.
        run = (
            getattr(torch.ops.vllm_subspec, self.op)
            if torch.compiler.is_compiling()
            else self.linear
        )
        y = run(
            x2,
            self.packed,
            self.scales_and_zeros,
            self.group_size,
            self.twin,
            self.dense_from_rows or 0,
        )
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros] + (
            [self.dense] if self.dense is not None else []
        )

    @staticmethod
    def warm_up_key(m: int) -> None:
        return None  # an aten op: nothing is compiled per row count


class Int4DotCpuKernel(Int4CpuKernel):
    """`Int4CpuKernel` with the AVX512-BF16 kernel in tinygemm's place (int4_dot_cpu.py): what
    tinygemm stores (the codes, s and (8 - z)*s in bf16) in its own layout, bf16 activations
    also for float16 models; the dense twin, its crossover and the call are `Int4CpuKernel`'s.
    Why it is faster: docs/substitutes.md, "The AVX512-BF16 int4 kernel"."""

    name = "int4_cpu_dot"
    linear = staticmethod(int4_dot_cpu_linear)  # type: ignore[assignment]  # (arg names)
    op = "int4_dot_cpu_linear"
    compute_dtype = torch.bfloat16

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        n, k = qw.shape
        return (
            device.type == "cpu"
            and int4_dot_cpu.packs(n, k, qw.bits, qw.group_size)
            and int4_dot_cpu.available()
        )

    @classmethod
    def activation_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        return cls.compute_dtype

    @staticmethod
    def pack(qw: QuantizedWeight, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return int4_dot_cpu.pack(qw.codes, qw.scale, qw.zero)


class ReferenceKernel:
    """Dequantize + matmul on every call. Slow; the oracle the fast kernels are tested against."""

    name = "reference"

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        return True

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        self.qw = qw
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qw.dequantize(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [self.qw.codes, self.qw.scale, self.qw.zero]

    @staticmethod
    def warm_up_key(m: int) -> None:
        return None  # plain torch ops: nothing is compiled per row count


class GemliteKernel:
    """GemLite A16W4 (Triton), fma mode: W = q*s + (-z*s), with HQQ's fractional zeros. The
    metadata is kept in the activation dtype (in bf16 the offset -z*s is off HQQ's fp32 value
    by up to ~0.04 quantization steps: docs/substitutes.md, "GemLite"). Written against
    gemlite 0.6.0.post2 (`gemlite.helper.A16W4_HQQ_INT.from_weights`)."""

    name = "gemlite"

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        _, k = qw.shape
        return device.type == "cuda" and qw.bits == 4 and k % 32 == 0 and gemlite_available()

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        from gemlite.helper import A16W4_HQQ_INT  # lazy: importing gemlite needs CUDA

        self.layer = A16W4_HQQ_INT(device=str(qw.codes.device), dtype=dtype).from_weights(
            W_q=qw.codes, scales=qw.scale.to(dtype), zeros=qw.zero.to(dtype), bias=None
        )
        # GEMM_SPLITK loads the scale/zero row of every K block its SPLIT_K programs visit
        # without a mask (gemlite.triton_kernels.gemm_splitK_kernels.gemm_splitK_INT_kernel),
        # also the blocks wholly past K when K / BLOCK_SIZE_K is not a multiple of SPLIT_K
        # (K=576: 9 blocks, SPLIT_K=2): an out-of-bounds read whose NaN/inf reaches the output
        # (0 * NaN; seen under the interpreter, tests/integration/test_gemlite_interpreter.py).
        # Back those rows with zeros, up to a multiple of 16 groups (SPLIT_K <= 16: the
        # configs of gemm_splitK_kernels.get_max_autotune_config_nvidia); views keep
        # GemLite's shapes and strides.
        for name in ("scales", "zeros"):
            meta = getattr(self.layer, name)
            groups = meta.shape[0]
            padded = meta.new_zeros(-(-groups // 16) * 16, meta.shape[1])
            padded[:groups] = meta.data
            meta.data = padded[:groups]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def tensors(self) -> list[torch.Tensor]:
        # pack() re-registers W_q/scales/zeros/metadata/orig_shape/meta_scale as Parameters
        # (gemlite.core.GemLiteLinearTriton.pack); the placeholders __init__ made are buffers
        # (GemLiteLinearTriton.__init__).
        seen: dict[int, torch.Tensor] = {}
        for t in itertools.chain(self.layer.parameters(), self.layer.buffers()):
            seen.setdefault(id(t), t)
        return list(seen.values())

    def warm_up_key(self, m: int) -> tuple:
        from gemlite.core import get_matmul_type
        from gemlite.triton_kernels import utils

        # utils.get_closest_m is what gemlite.core.set_autotune_setting replaces and what the
        # kernel modules bind on (re)load (`from .utils import *`; the reload:
        # gemlite.triton_kernels.config.reload_all_modules).
        return gemlite_warm_up_key(m, utils.get_closest_m, get_matmul_type)


def gemlite_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import gemlite  # noqa: F401
    except Exception:  # gemlite raises various errors when CUDA/triton are unusable
        return False
    return True


KERNELS = {k.name: k for k in (Int4DotCpuKernel, Int4CpuKernel, GemliteKernel, ReferenceKernel)}


def choose_kernel(qw: QuantizedWeight, device: torch.device, kernel: str = "auto"):
    """Pick the kernel class. "auto": int4_cpu_dot on CPUs with AVX512-BF16 (where its
    extension builds), else int4_cpu on CPU, gemlite on CUDA, else reference."""
    if kernel != "auto":
        cls = KERNELS[kernel]
        if not cls.supports(qw, device):
            raise ValueError(
                f"kernel {kernel!r} cannot run a {qw.shape} {qw.bits}-bit weight on {device.type}"
            )
        return cls
    for cls in (Int4DotCpuKernel, Int4CpuKernel, GemliteKernel):
        if cls.supports(qw, device):
            return cls
    if device.type == "cuda" and qw.bits == 4:
        logger.warning(
            "vllm-subspec: gemlite is not importable on this CUDA machine; substitutes fall back "
            "to the slow dequantize+matmul path. `pip install gemlite==0.6.0.post2` to fix."
        )
    return ReferenceKernel
