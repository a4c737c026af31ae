"""GemLite's compile and autotune state (CUDA): which row counts share it, and its autotuning
kept across engine starts. Written against gemlite 0.6.0.post2; gemlite is imported lazily."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


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
