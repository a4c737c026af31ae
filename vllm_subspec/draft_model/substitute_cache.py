"""On-disk cache of built substitutes, so a model's HQQ solve runs once, not on every start: each
linear's `QuantizedWeight` in a safetensors file, keyed by the model's weight files, the linear,
the quantization options and the versions (`SubstituteCache.key`), in the folder the
`substitute_cache` option names (`cache_root`). A bad entry is logged and rebuilt; an
unwritable cache logs a warning and never stops the engine.

Design: docs/substitutes.md, "The substitute cache".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from vllm_subspec.draft_model.hqq import HQQ_RELEASE
from vllm_subspec.draft_model.quantize import QuantizedWeight

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

CACHE_FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def cache_root(setting) -> Path | None:
    """The folder of the `substitute_cache` option (None/True: the default, False: off)."""
    if setting is False:
        return None
    return default_root() if setting in (None, True) else Path(setting).expanduser()


def gemlite_autotune_path(options, kernels, device) -> Path | None:
    """The file GemLite's autotuning is kept in across starts
    (`gemlite_tuning.gemlite_autotune_kept`), or None: no GemLite kernel among `kernels`, or the
    cache is off."""
    from vllm_subspec.draft_model.gemlite_tuning import gemlite_autotune_file
    from vllm_subspec.draft_model.kernels import GemliteKernel

    root = cache_root(options.substitute_cache)
    if root is None or not any(isinstance(k, GemliteKernel) for k in kernels):
        return None
    return gemlite_autotune_file(root, device)


def default_root() -> Path:
    env = os.environ.get("VLLM_SUBSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-subspec" / "substitutes"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    # "hqq": the release whose codes the solver reproduces bit for bit (entries written when the
    # hqq package itself solved stay valid)
    out = {"format": str(CACHE_FORMAT), "torch": torch.__version__, "hqq": HQQ_RELEASE}
    for dist in ("vllm-subspec", "vllm"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "none"
    if out["vllm"] == "none":
        try:
            import vllm

            out["vllm"] = vllm.__version__
        except ImportError:
            pass
    return out


def _local_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The local folder (or single .gguf file) holding `model`'s weights, or None."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:  # a hub id: its snapshot, when already downloaded (never downloads anything)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def weight_fingerprint(model_path: Path) -> str | None:
    """sha256 over (name, size, mtime) of the weight files; None when there are none."""
    files = (
        [model_path]
        if model_path.is_file()
        else sorted(p for p in model_path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    )
    if not files:
        return None
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, K] codes -> two 4-bit codes per byte (bits <= 4), else unchanged."""
    if bits > 4:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits > 4:
        return packed
    n = packed.shape[0]
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(n, -1)


@dataclasses.dataclass
class SubstituteCache:
    """The cache for one model at one set of quantization options."""

    folder: Path
    fingerprint: str
    bits: int
    group_size: int
    quantizer: str
    versions: dict[str, str] = dataclasses.field(default_factory=_versions)
    # (rank, size) under tensor parallelism: each rank quantizes its own shard of a linear
    shard: tuple[int, int] = (0, 1)
    hits: int = 0
    misses: int = 0
    rebuilt: int = 0  # misses caused by an unreadable or mismatched entry
    write_errors: int = 0

    @classmethod
    def create(
        cls, model: str, setting, options, revision: str | None = None
    ) -> SubstituteCache | None:
        """`setting`: the `substitute_cache` option (None/True: default folder, False: off, or a
        path). None when caching is off or the model's weight files cannot be found."""
        root = cache_root(setting)
        if root is None:
            return None
        local = _local_model_dir(model, revision)
        fingerprint = weight_fingerprint(local) if local is not None else None
        if fingerprint is None:
            logger.info(
                "vllm-subspec: substitute cache off: no local weight files found for "
                "%r; substitutes are built on every start",
                model,
            )
            return None
        name = (local.stem if local.is_file() else local.name) or "model"
        return cls(
            folder=root / f"{name}-{fingerprint[:16]}",
            fingerprint=fingerprint,
            bits=options.bits,
            group_size=options.group_size,
            quantizer=options.quantizer,
        )

    def key(self, layer: int, name: str, shape, dtype: torch.dtype, device: torch.device) -> dict:
        key = {
            "weights": self.fingerprint,
            "layer": int(layer),
            "linear": name,
            "shape": [int(s) for s in shape],
            "dtype": str(dtype),
            "device": torch.device(device).type,
            "bits": self.bits,
            "group_size": self.group_size,
            "quantizer": self.quantizer,
            "versions": self.versions,
        }
        if self.shard[1] > 1:  # (one device's keys stay as they were)
            key["tensor_parallel_shard"] = list(self.shard)
        return key

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.folder / f"layers.{key['layer']}.{key['linear']}-{digest}.safetensors"

    def load(self, key: dict, device: torch.device) -> QuantizedWeight | None:
        """The stored QuantizedWeight for `key`, or None (missing, unreadable or mismatched)."""
        from safetensors import safe_open

        path = self.path(key)
        if not path.exists():
            self.misses += 1
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                stored = json.loads((f.metadata() or {}).get("subspec_key", "null"))
                if stored != key:
                    raise ValueError(
                        "its key does not match (a different model, linear, option or version)"
                    )
                codes = unpack_codes(f.get_tensor("codes"), self.bits)
                scale, zero = f.get_tensor("scale"), f.get_tensor("zero")
            n, k = key["shape"]
            g = k // self.group_size
            if (
                tuple(codes.shape) != (n, k)
                or codes.dtype != torch.uint8
                or tuple(scale.shape) != (n, g)
                or tuple(zero.shape) != (n, g)
            ):
                raise ValueError(
                    f"unexpected tensor shapes {tuple(codes.shape)}, "
                    f"{tuple(scale.shape)}, {tuple(zero.shape)}"
                )
        except Exception as e:  # truncated file, corrupt header, wrong key: rebuild it
            logger.warning(
                "vllm-subspec: substitute cache entry %s is unusable (%s); rebuilding it", path, e
            )
            self.misses += 1
            self.rebuilt += 1
            return None
        self.hits += 1
        return QuantizedWeight(
            codes=codes.to(device),
            scale=scale.float().to(device),
            zero=zero.float().to(device),
            bits=self.bits,
            group_size=self.group_size,
        )

    def store(self, key: dict, qw: QuantizedWeight) -> None:
        from safetensors.torch import save_file

        path = self.path(key)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(
                {
                    "codes": pack_codes(qw.codes.cpu(), qw.bits),
                    "scale": qw.scale.cpu().contiguous(),
                    "zero": qw.zero.cpu().contiguous(),
                },
                str(tmp),
                metadata={"subspec_key": json.dumps(key)},
            )
            os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1:
                logger.warning(
                    "vllm-subspec: cannot write the substitute cache in %s (%s); "
                    "continuing without it",
                    self.folder,
                    e,
                )
            with contextlib.suppress(OSError):
                tmp.unlink()


def quantized_weights(jobs, options, device: torch.device, cache: SubstituteCache | None):
    """Yield (job, linear, QuantizedWeight) for each `(job, layer_index, name, linear)`, loading
    from `cache` where it can and building (then storing) the rest. One at a time, so at most
    one linear's full-precision weight and codes are on `device` beyond the kernels built."""
    from tqdm import tqdm

    from vllm_subspec.draft_model.quantize import quantize

    built, start = 0, time.perf_counter()
    for job, index, name, linear in tqdm(
        jobs, desc=f"SubSpec: {options.bits}-bit substitutes", unit="linear", disable=not jobs
    ):
        w = linear.weight
        key = cache.key(index, name, w.shape, w.dtype, device) if cache else None
        qw = cache.load(key, device) if cache else None
        if qw is None:
            qw = quantize(
                w.data.to(device),
                bits=options.bits,
                group_size=options.group_size,
                method=options.quantizer,
            )
            built += 1
            if cache:
                cache.store(key, qw)
        yield job, linear, qw
    if jobs:
        where = f"{cache.hits} loaded from {cache.folder}" if cache else "no cache"
        logger.info(
            "vllm-subspec: substitutes ready in %.1f s: %d built, %s",
            time.perf_counter() - start,
            built,
            where,
        )


def cache_for_current_model(options) -> SubstituteCache | None:
    """The cache for the target of the current vLLM config (None outside an engine, or off)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    mc = vllm_config.model_config
    cache = SubstituteCache.create(
        mc.model, options.substitute_cache, options, revision=getattr(mc, "revision", None)
    )
    size = vllm_config.parallel_config.tensor_parallel_size
    if cache is not None and size > 1:
        from vllm.distributed import get_tensor_model_parallel_rank

        cache.shard = (get_tensor_model_parallel_rank(), size)
    return cache
