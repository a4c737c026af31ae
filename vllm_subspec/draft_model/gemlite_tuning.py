"""GemLite's compile and autotune state (CUDA): which row counts share it, and its autotuning
kept across engine starts. Written against gemlite 0.6.0.post2; gemlite is imported lazily.

Design: docs/substitutes.md, "GemLite".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def gemlite_warm_up_key(m: int, closest_m, matmul_type, w_nbits: int = 4) -> tuple:
    """What gemlite 0.6.0.post2 autotunes/compiles separately for an m-row call: equal keys
    share every autotune result and compiled kernel (per weight shape and dtype).
    closest_m, matmul_type: gemlite's `triton_kernels.utils.get_closest_m` and
    `core.get_matmul_type` (passed in: importing gemlite needs CUDA)."""
    # GEMV* for m <= 4, GEMM_SPLITK below 64 (gemlite.core.get_matmul_type)
    family = matmul_type(m, w_nbits)
    # Autotune keys (gemlite.triton_kernels): GEMV kernels key on M (gemv_revsplitK_kernels.KEYS),
    # GEMM ones on M_CLOSEST = get_closest_m(M) (gemm_kernels.KEYS and gemm_forward;
    # gemm_splitK_kernels.KEYS and gemm_splitK_forward).
    tuned = m if family.startswith("GEMV") else closest_m(m)
    # Compiled variants within a bucket: Triton specializes an int argument on == 1 and on
    # % 16 == 0 (triton.runtime.jit: native_specialize_impl), and the GEMM kernels' heuristic
    # EVEN_M = M % BLOCK_SIZE_M == 0 (the triton.heuristics of gemm_kernels.gemm_INT_kernel and
    # gemm_splitK_kernels.gemm_splitK_INT_kernel) with BLOCK_SIZE_M a power of two in [16, 256]
    # (the pruners, e.g. gemm_kernels.kernel_config_pruner). The largest power of two dividing
    # m, capped at 256, and ignored below 16, covers both.
    align = math.gcd(m, 256) if m % 16 == 0 else 1
    return family, tuned, align


@contextlib.contextmanager
def gemlite_autotune_kept(path: Path | None):
    """GemLite's autotuning results kept across engine starts in `path` (None: not kept):
    loaded before the block (`gemlite.load_config`: Triton's autotuner then benchmarks no
    stored signature), every config tuned so far merged into the file after it
    (`gemlite.cache_config`), atomically. Written against gemlite 0.6.0.post2."""
    if path is None:
        yield
        return
    import gemlite  # lazy: importing gemlite needs CUDA

    loaded = path.exists() and gemlite.load_config(str(path), print_error=False)
    yield
    path.parent.mkdir(parents=True, exist_ok=True)
    # written aside, then renamed over the file: tensor-parallel ranks (and engines started
    # together) keep the same file, and a reader sees a whole one
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    gemlite.cache_config(str(partial))
    os.replace(partial, path)
    logger.info(
        "vllm-subspec: GemLite autotuning %s %s",
        "reused from and kept in" if loaded else "kept in",
        path,
    )


def gemlite_autotune_file(root: Path, device: torch.device) -> Path:
    """Where a GPU model's GemLite autotuning is kept: under the substitute cache's root, per
    gemlite version and device name (configs tuned on one GPU model do not carry over)."""
    from gemlite import __version__  # lazy: importing gemlite needs CUDA

    name = "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device))
    return root / "gemlite-autotune" / f"gemlite-{__version__}-{name.lower()}.json"
