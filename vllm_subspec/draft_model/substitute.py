"""Substitutes: low-bit copies of a target linear, built from the target's own weights.

One small interface: `quantize(weight, ...) -> QuantizedWeight`, then `make_kernel(qw, ...)`
gives a callable `x -> x @ W_deq.T` that owns only its packed tensors. `SubstituteLinear` wraps a
kernel so it drops into a vLLM decoder layer where a `LinearBase` was (it returns `(y, None)`).

Kernels:
- `Int4DotCpuKernel`: x86 CPUs with AVX512-BF16 (draft_model/int4_dot_cpu.py, a C++ kernel built
  on first use): each block of codes unpacked once for up to 8 rows; the same stored numbers as
  tinygemm (s and (8 - z)*s in bf16), the same dense twin.
- `Int4CpuKernel`: `aten._weight_int4pack_mm_for_cpu`. tinygemm computes (q - 8)*s + z_tg and
  HQQ (q - z)*s, so z_tg = (8 - z)*s carries HQQ's fractional zeros (s and z_tg are stored in
  the activation dtype). From the row count where a dense matmul of the same HQQ weights is
  faster (timed per shape at start-up), a dense twin runs instead.
- `GemliteKernel`: GemLite A16W4 (CUDA only; gemlite is imported lazily, never on CPU).
- `ReferenceKernel`: dequantize + matmul on every call; the oracle for tests, any bit width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_subspec.draft_model import int4_dot_cpu

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


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
        return tuple(self.codes.shape)  # type: ignore[return-value]

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
    """Quantize a [N, K] weight with HQQ (axis=1, i.e. groups of consecutive input elements).

    `method="hqq"` runs HQQ's proximal solver (refines the zero point; draft_model/hqq.py, the
    same numbers as the hqq package); `"rtn"` is plain min/max round-to-nearest. The input is
    not modified and no full-precision copy is kept.
    Groups never span rows, so a large weight is solved in blocks of rows (each block's solver
    stops on its own error, so a blocked HQQ solve can differ slightly from a whole one).
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    rows = max(1, QUANTIZE_BLOCK_ELEMENTS // k)
    if n <= rows:
        return _quantize_block(weight, bits, group_size, method)
    parts = [_quantize_block(weight[i: i + rows], bits, group_size, method)
             for i in range(0, n, rows)]
    return QuantizedWeight(codes=torch.cat([p.codes for p in parts]),
                           scale=torch.cat([p.scale for p in parts]),
                           zero=torch.cat([p.zero for p in parts]),
                           bits=bits, group_size=group_size)


def _quantize_block(weight: torch.Tensor, bits: int, group_size: int, method: str):
    from vllm_subspec.draft_model.hqq import quantize_groups

    n, k = weight.shape
    # HQQLinear kept scale and zero in its compute dtype: fp16 on CUDA, bf16 elsewhere
    meta_dtype = torch.float16 if weight.is_cuda else torch.bfloat16
    q = quantize_groups(weight.detach().reshape(-1, group_size), bits,
                        optimize=method == "hqq", meta_dtype=meta_dtype)
    g = k // group_size
    return QuantizedWeight(codes=q.codes.view(n, k), scale=q.scale.view(n, g),
                           zero=q.zero.view(n, g), bits=bits, group_size=group_size)


def int4_cpu_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int, dense: torch.Tensor, dense_from_rows: int) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] with `Int4CpuKernel`'s tensors: the dense twin from
    `dense_from_rows` rows on (when there is one: `dense` not empty), else tinygemm int4."""
    if dense.numel() and x.shape[0] >= dense_from_rows:
        return F.linear(x, dense)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


# The same function as an operator opaque to torch.compile: the row-count choice stays a runtime
# decision inside a compiled draft forward (its fake gives the output shape: N = packed rows).
torch.library.custom_op("vllm_subspec::int4_cpu_linear", int4_cpu_linear, mutates_args=()) \
    .register_fake(lambda x, packed, *_: x.new_empty(x.shape[0], packed.shape[0]))


def int4_dot_cpu_linear(x: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor,
                        group_size: int, dense: torch.Tensor, dense_from_rows: int) -> torch.Tensor:
    """`int4_cpu_linear` with `Int4DotCpuKernel`'s tensors: its dense twin from
    `dense_from_rows` rows on, else the AVX512-BF16 kernel."""
    if dense.numel() and x.shape[0] >= dense_from_rows:
        return F.linear(x, dense)
    return int4_dot_cpu.linear(x, packed, meta, group_size)


torch.library.custom_op("vllm_subspec::int4_dot_cpu_linear", int4_dot_cpu_linear,
                        mutates_args=()) \
    .register_fake(lambda x, packed, *_: x.new_empty(x.shape[0],
                                                     packed.shape[0] * int4_dot_cpu.TILE))


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
        self.dense_from_rows = dense_crossover(type(self), n, k, qw.group_size, self.act_dtype,
                                               max_rows) if max_rows > 0 else None
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
        return packed, (torch.stack([qw.scale, zero_tg], -1).transpose(0, 1).contiguous()
                        .to(act_dtype))


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
        run = getattr(torch.ops.vllm_subspec, self.op) if torch.compiler.is_compiling() \
            else self.linear
        y = run(x2, self.packed, self.scales_and_zeros, self.group_size, self.twin,
                self.dense_from_rows or 0)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros] + ([self.dense] if self.dense is not None
                                                       else [])

    @staticmethod
    def warm_up_key(m: int) -> None:
        return None  # an aten op: nothing is compiled per row count


class Int4DotCpuKernel(Int4CpuKernel):
    """`Int4CpuKernel` with the AVX512-BF16 kernel in tinygemm's place (int4_dot_cpu.py): each
    64-byte block of codes is unpacked once into bf16 and multiplied with up to 8 rows, so a
    tree level of k rows costs far less than k chain steps (measured in
    benchmarks/draft_kernels.py). It stores what tinygemm stores (the codes, s and (8 - z)*s
    in bf16) in its own layout and computes in bf16 activations, also for float16 models; the
    dense twin, its crossover and the call are `Int4CpuKernel`'s."""

    name = "int4_cpu_dot"
    linear = staticmethod(int4_dot_cpu_linear)
    op = "int4_dot_cpu_linear"
    compute_dtype = torch.bfloat16

    @staticmethod
    def supports(qw: QuantizedWeight, device: torch.device) -> bool:
        n, k = qw.shape
        return (device.type == "cpu" and int4_dot_cpu.packs(n, k, qw.bits, qw.group_size)
                and int4_dot_cpu.available())

    @classmethod
    def activation_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        return cls.compute_dtype

    @staticmethod
    def pack(qw: QuantizedWeight, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return int4_dot_cpu.pack(qw.codes, qw.scale, qw.zero)


# Row counts timed to find where a dense matmul overtakes the int4 kernel (those up to the most
# rows a draft pass can send).
CROSSOVER_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TIMED_MAX_N = 32768


@functools.lru_cache(maxsize=64)
def dense_crossover(kernel_cls: type, n: int, k: int, group_size: int, dtype: torch.dtype,
                    max_rows: int) -> int | None:
    """The fewest rows from which a dense [n, k] matmul beats the int4 kernel (`kernel_cls`:
    `Int4CpuKernel` or its subclass), up to max_rows (None: not there). Timed once per kernel
    and shape in this process (best of 3 per row count, random weights: the time depends on
    the shape only), on at most TIMED_MAX_N output features (both kernels' time is linear in
    n; a vocabulary-sized lm_head would take ~20 s)."""
    import time

    n = min(n, TIMED_MAX_N)
    qw = QuantizedWeight(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8),
                         scale=torch.rand(n, k // group_size) / 8,
                         zero=torch.rand(n, k // group_size) * 15, bits=4,
                         group_size=group_size)
    int4 = kernel_cls(qw, dtype)
    dense = qw.dequantize(dtype)

    def best(fn, x) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t0)
        return min(times)

    rows = [m for m in CROSSOVER_ROWS if m <= max_rows] or [max_rows]
    int4_s, dense_s = [], []
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            int4_s.append(best(int4, x))
            dense_s.append(best(lambda v: F.linear(v, dense), x))
    crossover = crossover_rows(rows, int4_s, dense_s, max_rows)
    logger.debug("vllm-subspec: int4 vs dense [%d, %d]: dense from %s rows", n, k, crossover)
    return crossover


def crossover_rows(rows: list[int], int4_s: list[float], dense_s: list[float],
                   max_rows: int) -> int | None:
    """Where the dense matmul's time line crosses below the int4 kernel's: each kernel's
    seconds fitted as a + b * rows (Theil-Sen: the median of the pairwise slopes, so a few
    timings slowed by the rest of the machine do not move the fit). The first whole row count
    from which dense is predicted faster, or None if that is past max_rows (or never)."""
    def fit(ys):
        slopes = sorted((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2)
                        in itertools.combinations(zip(rows, ys), 2) if x2 != x1)
        b = slopes[len(slopes) // 2] if slopes else 0.0
        a = sorted(y - b * x for x, y in zip(rows, ys))[len(ys) // 2]
        return a, b

    (a_i, b_i), (a_d, b_d) = fit(int4_s), fit(dense_s)
    if a_d <= a_i and b_d <= b_i:
        return 1  # dense is never slower
    if b_d >= b_i:
        return None  # int4 is faster from the start and grows no faster
    first = max(1, math.ceil((a_d - a_i) / (b_i - b_d)))
    return first if first <= max_rows else None


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
    """GemLite A16W4 (Triton), fma mode: W = q*s + (-z*s), with HQQ's fractional zeros.

    GemLite keeps the metadata in the activation dtype: `from_weights` casts scales and zeros to
    it (gemlite/helper.py:219-220) and `pack` stores the fma offset `(-z*s)` rounded back to it
    (gemlite/core.py:674). In bf16 that offset is off HQQ's fp32 value by up to ~0.04
    quantization steps (0.036 measured on a 1536x576 weight, fp16: 0.0044;
    tests/integration/test_gemlite_interpreter.py).
    Written against gemlite 0.6.0.post2 (`gemlite.helper.A16W4_HQQ_INT.from_weights`).
    """

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
        # without a mask (gemm_splitK_kernels.py:438-449), also the blocks wholly past K when
        # K / BLOCK_SIZE_K is not a multiple of SPLIT_K (K=576: 9 blocks, SPLIT_K=2): an
        # out-of-bounds read whose NaN/inf reaches the output (0 * NaN; seen under the
        # interpreter, tests/integration/test_gemlite_interpreter.py). Back those rows with
        # zeros, up to a multiple of 16 groups (SPLIT_K <= 16, gemm_splitK_kernels.py:170);
        # views keep GemLite's shapes and strides.
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
        # (gemlite/core.py:765-793); the placeholders __init__ made are buffers (core.py:382-387).
        seen: dict[int, torch.Tensor] = {}
        for t in itertools.chain(self.layer.parameters(), self.layer.buffers()):
            seen.setdefault(id(t), t)
        return list(seen.values())

    def warm_up_key(self, m: int) -> tuple:
        from gemlite.core import get_matmul_type
        from gemlite.triton_kernels import utils

        # utils.get_closest_m is what set_autotune_setting replaces (core.py:93) and what the
        # kernel modules bind on (re)load (`from .utils import *`, triton_kernels/config.py:34).
        return gemlite_warm_up_key(m, utils.get_closest_m, get_matmul_type)


def gemlite_warm_up_key(m: int, closest_m, matmul_type, w_nbits: int = 4) -> tuple:
    """What gemlite 0.6.0.post2 autotunes/compiles separately for an m-row call: equal keys
    share every autotune result and compiled kernel (per weight shape and dtype).

    closest_m, matmul_type: gemlite's `triton_kernels.utils.get_closest_m` and
    `core.get_matmul_type` (passed in: importing gemlite needs CUDA).
    """
    family = matmul_type(m, w_nbits)  # GEMV* for m <= 4, GEMM_SPLITK below 64 (core.py:171)
    # Autotune keys: GEMV kernels key on M (gemv_revsplitK_kernels.py:13), GEMM ones on
    # M_CLOSEST = get_closest_m(M) (gemm_kernels.py:13,756; gemm_splitK_kernels.py:13,787).
    tuned = m if family.startswith("GEMV") else closest_m(m)
    # Compiled variants within a bucket: Triton specializes an int argument on == 1 and on
    # % 16 == 0 (triton/runtime/jit.py: native_specialize_impl), and the GEMM kernels' heuristic
    # EVEN_M = M % BLOCK_SIZE_M == 0 (gemm_kernels.py:281, gemm_splitK_kernels.py:296) with
    # BLOCK_SIZE_M a power of two in [16, 256] (the pruners, gemm_kernels.py:77-82). The
    # largest power of two dividing m, capped at 256, and ignored below 16, covers both.
    align = math.gcd(m, 256) if m % 16 == 0 else 1
    return family, tuned, align


@contextlib.contextmanager
def gemlite_autotune_kept(path: Path | None):
    """GemLite's autotuning results kept across engine starts in `path` (None: not kept).

    Before the block, the stored configs are loaded (`gemlite.load_config`): for a kernel call
    whose signature is stored, gemlite's config pruner offers only that config
    (gemlite/triton_kernels/gemm_kernels.py:31-34, the same in every family), so Triton's
    autotuner benchmarks nothing. After it, every config tuned so far is merged into the file
    (`gemlite.cache_config`, core.py:839-878). Written against gemlite 0.6.0.post2."""
    if path is None:
        yield
        return
    import gemlite  # lazy: importing gemlite needs CUDA

    loaded = path.exists() and gemlite.load_config(str(path), print_error=False)
    yield
    path.parent.mkdir(parents=True, exist_ok=True)
    gemlite.cache_config(str(path))
    logger.info("vllm-subspec: GemLite autotuning %s %s", "reused from and kept in" if loaded
                else "kept in", path)


def gemlite_autotune_file(root: Path, device: torch.device) -> Path:
    """Where a GPU model's GemLite autotuning is kept: under the substitute cache's root, per
    gemlite version and device name (configs tuned on one GPU model do not carry over)."""
    from gemlite import __version__  # lazy: importing gemlite needs CUDA

    name = "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device))
    return root / "gemlite-autotune" / f"gemlite-{__version__}-{name.lower()}.json"


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
            raise ValueError(f"kernel {kernel!r} cannot run a {qw.shape} {qw.bits}-bit "
                             f"weight on {device.type}")
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


class SubstituteLinear(torch.nn.Module):
    """Stands in for a vLLM linear inside the draft: same call convention, low-bit weights."""

    def __init__(self, kernel, bias: torch.Tensor | None, source_name: str = "",
                 in_features: int = 0):
        super().__init__()
        self.kernel = kernel
        self.in_features = in_features
        # Biases are tiny; copy them so the substitute never reads offloaded memory.
        self.bias = None if bias is None else bias.detach().clone()
        self.source_name = source_name

    def forward(self, x: torch.Tensor):
        y = self.kernel(x)
        if self.bias is not None:
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


def keeps_dense_twin(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device,
                     kernel: str, max_rows: int) -> bool:
    """Whether `substitute_from_quantized(..., max_rows)` would keep a dense twin: an int4 CPU
    kernel chosen by "auto", and a dense matmul faster at some row count up to max_rows."""
    if max_rows <= 0 or kernel != "auto" or device.type != "cpu":
        return False
    cls = choose_kernel(qw, device, kernel)  # on CPU: no gemlite, no warning
    if not issubclass(cls, Int4CpuKernel):
        return False
    n, k = qw.shape
    return dense_crossover(cls, n, k, qw.group_size, cls.activation_dtype(dtype),
                           max_rows) is not None


def substitute_from_quantized(qw: QuantizedWeight, linear: torch.nn.Module,
                              device: torch.device, kernel: str,
                              name: str = "", max_rows: int = 0) -> SubstituteLinear:
    """The substitute for `linear` from its (built or cached) quantized weight. max_rows: the
    most rows a draft pass can send; with kernel "auto" on CPU, the int4 kernel then keeps a
    dense twin where a dense matmul is faster at some of those row counts."""
    cls = choose_kernel(qw, device, kernel)
    if keeps_dense_twin(qw, linear.weight.dtype, device, kernel, max_rows):
        built = cls(qw, linear.weight.dtype, max_rows)
    else:
        built = cls(qw, linear.weight.dtype)
    bias = getattr(linear, "bias", None)
    return SubstituteLinear(built, None if bias is None else bias.data.to(device), name,
                            in_features=qw.shape[1])
