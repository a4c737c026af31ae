"""The AVX512-BF16 int4 kernel for CPU substitutes (csrc/int4_dot_cpu.cpp): its build, its
weight layout and its call. Built with torch's cpp_extension on first use, on x86 CPUs whose
flags include AVX512-BF16; elsewhere, or if the build fails (logged once), the substitutes use
torch's tinygemm kernel.

Design: docs/substitutes.md, "The AVX512-BF16 int4 kernel".
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

SOURCE = Path(__file__).with_name("csrc") / "int4_dot_cpu.cpp"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# -fopenmp: at::parallel_for splits the tiles over torch's intra-op threads only when built
# with OpenMP (ATen/ParallelOpenMP.h); the process's libgomp is torch's own.
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
TILE = 16  # output features per tile


def cpu_has_flags(cpuinfo: str | None = None) -> bool:
    """Whether the CPU (Linux /proc/cpuinfo, or the text given) has every flag the kernel uses."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in cpuinfo.splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    return all(f in flags for f in CPU_FLAGS)


@functools.lru_cache(maxsize=1)
def extension():
    """The built kernel module, or None where it cannot run or be built (logged once)."""
    if not cpu_has_flags():
        return None
    from torch.utils.cpp_extension import get_default_build_root, load

    # The name carries a hash of the source, the flags and torch's version (the module links
    # against torch's C++ API), in a folder per Python version, as torch's own default: an
    # edited kernel or an upgraded torch never loads a stale build.
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(CFLAGS + LDFLAGS + [torch.__version__]).encode()
    ).hexdigest()[:12]
    name = f"vllm_subspec_int4_dot_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folder = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with build_lock(folder):
            module = load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, an old assembler: tinygemm instead
        logger.warning(
            "vllm-subspec: the AVX512-BF16 int4 kernel could not be built (%s: %s); "
            "CPU substitutes use torch's tinygemm kernel",
            type(e).__name__,
            e,
        )
        return None
    seconds = time.perf_counter() - start
    if seconds > 2:  # a build, not a load from torch's extension cache
        logger.info(
            "vllm-subspec: built the AVX512-BF16 int4 kernel in %.0f s (kept in torch's "
            "extension cache)",
            seconds,
        )
    return module


@contextlib.contextmanager
def build_lock(folder: Path):
    """One process at a time loads or builds the kernel in `folder`, under an flock the kernel
    releases when its holder dies. torch's cpp_extension takes a lock file of its own on every
    load (`folder/lock`) and waits forever for one a killed process left behind
    (`torch.utils.file_baton.FileBaton.wait` has no timeout); under the flock any such file
    is a dead process's, so it is removed first."""
    with open(folder / "vllm_subspec.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning(
                    "vllm-subspec: removing %s, left by an int4 kernel build that did not finish",
                    stale,
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> bool:
    return extension() is not None


def packs(n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether an [n, k] weight of this bit width and group size fits the layout."""
    return bits == 4 and n % TILE == 0 and group_size % 8 == 0 and k % group_size == 0


def pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's codes [N, K] uint8, scale and zero [N, G] -> (packed [N/16, K/8, 64] uint8,
    meta [N/16, G, 32] bf16: per tile and group 16 scales, then 16 offsets (8 - zero) * scale,
    the numbers tinygemm stores)."""
    n, k = codes.shape
    g = scale.shape[1]
    # codes as [tile, c, r, block b, nibble, h, e]: output 16t + 4c + r, input 8b + 4*nibble
    # + 2h + e; byte 16c + 8h + 2r + e of block b holds both nibbles (csrc: the layout).
    c = codes.view(n // TILE, 4, 4, k // 8, 2, 2, 2).permute(0, 3, 1, 5, 2, 6, 4)
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(n // TILE, k // 8, 64).contiguous()
    per_tile = lambda t: t.view(n // TILE, TILE, g).transpose(1, 2)  # noqa: E731
    meta = torch.cat([per_tile(scale), per_tile((8 - zero) * scale)], -1).to(torch.bfloat16)
    return packed, meta.contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] bf16 contiguous -> x @ W.T [M, N] bf16, W = (codes - zero) * scale."""
    return extension().int4_dot_linear(x, packed, meta, group_size)
