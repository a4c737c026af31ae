"""The AVX512-BF16 int4 kernel for CPU substitutes (csrc/int4_dot_cpu.cpp): its build, its
weight layout and its call.

torch's tinygemm CPU kernel (`aten._weight_int4pack_mm_for_cpu`) dequantizes the weight again
for every row of x: 6 rows cost ~3x one. This kernel unpacks each block of 4-bit codes once into
bf16 vectors and multiplies it with up to 8 rows (`vdpbf16ps`, fp32 accumulation), applying each
group's scale and zero point once per group. It is built with torch's cpp_extension on first use
(a C++ compiler and ninja; ~30 s once, then loaded from torch's extension cache) on x86 CPUs
whose flags include AVX512-BF16; elsewhere, or if the build fails (logged once), the substitutes
use tinygemm.
"""

from __future__ import annotations

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
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
TILE = 16  # output features per tile
MAX_ROWS = 8  # rows of x sharing one pass over a tile (csrc: kMaxRows)
STALE_LOCK_S = 600  # a build lock older than this was left by a killed build (~30 s builds)


def cpu_has_flags(cpuinfo: str | None = None) -> bool:
    """Whether the CPU (Linux /proc/cpuinfo, or the text given) has every flag the kernel uses."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
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
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + [torch.__version__])
                            .encode()).hexdigest()[:12]
    name = f"vllm_subspec_int4_dot_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folder = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(folder / "lock")
        module = load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                      build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, no ninja, an old assembler: tinygemm instead
        logger.warning("vllm-subspec: the AVX512-BF16 int4 kernel could not be built (%s: %s); "
                       "CPU substitutes use torch's tinygemm kernel", type(e).__name__, e)
        return None
    seconds = time.perf_counter() - start
    if seconds > 2:  # a build, not a load from torch's extension cache
        logger.info("vllm-subspec: built the AVX512-BF16 int4 kernel in %.0f s (kept in torch's "
                    "extension cache)", seconds)
    return module


def clear_stale_lock(lock: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """torch's cpp_extension builds under a lock file that a killed build leaves behind, and
    then every later load waits for it forever (torch/utils/file_baton.py: FileBaton.wait).
    A build takes well under `max_age_s`: an older lock is a dead build's, removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > max_age_s:
        logger.warning("vllm-subspec: removing %s, left %.0f s ago by an int4 kernel build "
                       "that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def available() -> bool:
    return extension() is not None


def packs(n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether an [n, k] weight of this bit width and group size fits the layout."""
    return bits == 4 and n % TILE == 0 and group_size % 8 == 0 and k % group_size == 0


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's codes [N, K] uint8, scale and zero [N, G] -> (packed [N/16, K/4, 32] uint8,
    meta [N/16, G, 32] bf16: per tile and group 16 scales, then 16 offsets (8 - zero) * scale,
    the numbers tinygemm stores)."""
    n, k = codes.shape
    g = scale.shape[1]
    # [tile, out j, block b, half h, e] -> [tile, b, h, j, e]: byte 2j+e of block b holds
    # q[16t+j, 4b+e] (low nibble, h=0) and q[16t+j, 4b+2+e] (high nibble, h=1).
    c = codes.view(n // TILE, TILE, k // 4, 2, 2).permute(0, 2, 3, 1, 4)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n // TILE, k // 4, 32).contiguous()
    per_tile = lambda t: t.view(n // TILE, TILE, g).transpose(1, 2)  # noqa: E731
    meta = torch.cat([per_tile(scale), per_tile((8 - zero) * scale)], -1).to(torch.bfloat16)
    return packed, meta.contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """x [M, K] bf16 contiguous -> x @ W.T [M, N] bf16, W = (codes - zero) * scale."""
    return extension().int4_dot_linear(x, packed, meta, group_size)
