"""SubSpec options: parsing and validation of the `speculative_config` JSON.

Users write `{"method": "subspec", ...}`. The SubSpec keys are validated here, before the engine
starts, and travel to the engine core and workers inside `VllmConfig.additional_config["subspec"]`
(a plain dict, so it pickles and is hashed by vLLM). vLLM itself sees `method="draft_model"` with
the target as the "draft model" (see `engine_rules.translate_speculative_config` for why).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

METHOD = "subspec"
ADDITIONAL_CONFIG_KEY = "subspec"

# Dense decoder-only architectures whose layers expose the linears SubSpec substitutes
# (`self_attn.qkv_proj/o_proj`, `mlp.gate_up_proj/down_proj`) and whose model forward is
# embed -> layers(positions, hidden, residual) -> norm.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
)
# Sparse mixture-of-experts targets: routed experts get 4-bit substitutes (experts.py; on CUDA
# the Triton kernels of experts_triton.py).
SUPPORTED_MOE_ARCHITECTURES = frozenset(
    {
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)

SUBSTITUTE_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

_SUBSTITUTE_LAYER_MODES = ("offloaded", "all")
_BITS = (2, 3, 4, 8)
_GROUP_SIZES = (32, 64, 128, 256)
_KERNELS = ("auto", "int4_cpu_dot", "int4_cpu", "gemlite", "reference")
_QUANTIZERS = ("hqq", "rtn")
_DRAFT_LM_HEADS = ("auto", "quantized", "target")
MAX_DEPTH = 64
MAX_WIDTH = 16
MAX_TREE_NODES = 512
AUTO = "auto"
DEFAULT_TREE_WIDTH = 6
# A fixed tree depth given without a width, or a chain's (tree_width 1) depth: the paper's 48
# where the target streams its weights over PCIe (CUDA offload); on the CPU backend, where a
# verify row costs a target row, 16.
DEFAULT_TREE_DEPTH = {"cuda": 48, "cpu": 16}
# "auto" (the default for both): the shape tuner (step/shape_tuner.py) picks each step's width among
# these and stops each step's tree at the depth that still pays, at most AUTO_MAX_DEPTH deep.
# A value the user gives is fixed.
AUTO_TREE_WIDTHS = (1, 2, 4, 6)
AUTO_MAX_DEPTH = {"cuda": 48, "cpu": 32}


class SubSpecConfigError(ValueError):
    """A bad SubSpec configuration. Raised before the engine starts."""

    def __init__(self, message: str):
        super().__init__(f"vllm-subspec: {message}")


@dataclasses.dataclass(frozen=True)
class SubSpecOptions:
    """The resolved SubSpec options: every field concrete (`from_dict` validates user input and
    fills the defaults; `options_from_vllm_config` does that once per process)."""

    tree_width: int = DEFAULT_TREE_WIDTH
    """k: tree nodes kept per depth (1 = chain drafting); with auto_width, the widest allowed."""
    tree_depth: int = AUTO_MAX_DEPTH["cpu"]
    """D: draft depth; with auto_depth, the deepest allowed ("max_tree_depth", by default
    AUTO_MAX_DEPTH)."""
    auto_width: bool = True
    """"tree_width": "auto" (the default): the shape tuner picks k per step."""
    auto_depth: bool = True
    """"tree_depth": "auto" (the default): each step's tree stops where more depth stops paying."""
    substitute_layers: str | tuple[int, ...] = "offloaded"
    """"offloaded" (layers vLLM's offloader put in CPU memory), "all", or layer indices."""
    bits: int = 4
    group_size: int = 64
    draft_temperature: float = 0.2
    """Sharpening temperature of the draft distribution (scores only; never verification)."""
    kernel: str = "auto"
    """Substitute matmul: auto (int4_cpu_dot on CPUs with AVX512-BF16, else int4_cpu on CPU;
    gemlite on CUDA), int4_cpu_dot, int4_cpu, gemlite, reference."""
    quantizer: str = "hqq"
    """hqq (HQQ solver, the paper's choice) or rtn (round-to-nearest; fast, for tests)."""
    substitute_cache: bool | str = True
    """Built substitutes are cached on disk: true = default folder, a folder path, or false."""
    draft_lm_head: str = "auto"
    """The draft's output projection: "quantized" (its own bits/group_size copy of the target's
    lm_head: the largest matrix a draft pass reads), "target" (the target's own), or "auto"
    (`draft_lm_heads`: an auto shape's tuner picks per engine between the two from paired
    measurements; a fixed shape drafts with the target's)."""
    head_start_levels: int = 0
    """Levels of the next tree drafted while the target verifies this one, below the likeliest
    leaf (step/head_start.py); 0: none. Trees only."""
    cpu_draft_memory: float = 0.4
    """On vLLM's CPU backend, the most RAM the draft may add (substitutes, its lm_head, dense
    twins) as a fraction of the target's weight bytes: dense twins only where they fit
    (draft_model/host_memory.py)."""

    @property
    def is_tree(self) -> bool:
        """Drafted as a tree (step/draft.py `draft_tree`); auto shapes always are, even when the
        tuner picks width 1. A chain (a fixed tree_width 1) is drafted by `draft_chain`; every
        shape is verified by sample-then-match (step/verify.py)."""
        return self.tree_width > 1 or self.auto_width

    @property
    def is_auto(self) -> bool:
        return self.auto_width or self.auto_depth

    @property
    def draft_lm_heads(self) -> tuple[str, ...]:
        """The lm_heads the draft holds, the first drafting unless a tuner chooses. "auto":
        both where a tuner can choose (an auto shape: `step/lm_head_choice.py`), else the
        target's (it never loses τ; docs/results.md, the draft's lm_head)."""
        if self.draft_lm_head != AUTO:
            return (self.draft_lm_head,)
        return ("target", "quantized") if self.is_auto and self.is_tree else ("target",)

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths a step may use: the tuner's candidates up to tree_width, or the one."""
        if not self.auto_width:
            return (self.tree_width,)
        return tuple(w for w in AUTO_TREE_WIDTHS if w < self.tree_width) + (self.tree_width,)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per step as vLLM counts them: the tree's nodes minus the root."""
        return self.tree_width * self.tree_depth

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.auto_width:  # fields a user cannot set; the "auto" values say it
            d["tree_width"] = AUTO
        if self.auto_depth:
            d["tree_depth"], d["max_tree_depth"] = AUTO, self.tree_depth
        del d["auto_width"], d["auto_depth"]
        if isinstance(self.substitute_layers, tuple):
            d["substitute_layers"] = list(self.substitute_layers)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SubSpecOptions:
        """Validate user options (every problem in one message) and resolve the defaults.
        `num_speculative_tokens: D` is the chain shorthand for tree_width 1, tree_depth D."""
        raw = {k.replace("-", "_"): v for k, v in raw.items()}
        known = ({f.name for f in dataclasses.fields(cls)} - {"auto_width", "auto_depth"}
                 | {"num_speculative_tokens", "max_tree_depth"})
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SubSpecConfigError(
                f"unknown speculative_config key(s) {unknown} for method 'subspec'; "
                f"valid keys: {sorted(known | {'method'})}"
            )
        problems = _problems(raw)
        if problems:
            raise SubSpecConfigError("invalid speculative_config: " + "; ".join(problems))
        chain = raw.pop("num_speculative_tokens", None)
        if chain is not None:
            raw.update(tree_width=1, tree_depth=chain)
        platform = "cpu" if _platform_is_cpu() else "cuda"
        width, depth = raw.get("tree_width", AUTO), raw.get("tree_depth", AUTO)
        # a chain (tree_width 1) keeps a fixed depth; it is verified by sample-then-match,
        # like a tree
        raw["auto_width"] = width in (AUTO, None)
        raw["auto_depth"] = depth in (AUTO, None) and width != 1
        raw["tree_width"] = DEFAULT_TREE_WIDTH if raw["auto_width"] else width
        max_depth = raw.pop("max_tree_depth", None)
        if depth in (AUTO, None):
            depth = ((max_depth or AUTO_MAX_DEPTH[platform]) if raw["auto_depth"]
                     else DEFAULT_TREE_DEPTH[platform])
        raw["tree_depth"] = depth
        if raw["tree_width"] * raw["tree_depth"] > MAX_TREE_NODES:
            raise SubSpecConfigError(
                f"invalid speculative_config: tree_width * tree_depth must be at most "
                f"{MAX_TREE_NODES}, got {raw['tree_width']} * {raw['tree_depth']}")
        levels, k, d = raw.get("head_start_levels", 0), raw["tree_width"], raw["tree_depth"]
        if levels and d + 2 + (levels - 1) * k > k * d:
            # vLLM reserves k * D slots past a verify; a head start needs its branch (up to D
            # nodes), the leaf, the predicted root and levels - 1 levels of k there
            raise SubSpecConfigError(
                f"invalid speculative_config: head_start_levels {levels} needs "
                f"{d + 2 + (levels - 1) * k} KV slots past a verify of a {k} x {d} tree, which "
                f"reserves {k * d}; lower head_start_levels or deepen the tree")
        if isinstance(raw.get("substitute_layers"), list):
            raw["substitute_layers"] = tuple(raw["substitute_layers"])
        if raw.get("substitute_cache") is None:
            raw.pop("substitute_cache", None)
        return cls(**raw)

    def resolve_layers(self, num_layers: int, offloaded: list[int]) -> list[int]:
        """The decoder layer indices that get a substitute."""
        if self.substitute_layers == "all":
            return list(range(num_layers))
        if self.substitute_layers == "offloaded":
            return sorted(offloaded)
        bad = [i for i in self.substitute_layers if i >= num_layers]
        if bad:
            raise SubSpecConfigError(
                f"substitute_layers {bad} out of range: the model has {num_layers} layers"
            )
        return sorted(self.substitute_layers)


def _problems(raw: dict[str, Any]) -> list[str]:
    """Every problem with the user's (raw) SubSpec keys."""
    p = []
    get = raw.get
    for name, hi in (("num_speculative_tokens", MAX_DEPTH), ("tree_depth", MAX_DEPTH),
                     ("tree_width", MAX_WIDTH)):
        v = get(name)
        if v is not None and not (name != "num_speculative_tokens" and v == AUTO) and (
                not _is_int(v) or not 1 <= v <= hi):
            auto = "" if name == "num_speculative_tokens" else f' or "{AUTO}"'
            p.append(f"{name} must be an integer in [1, {hi}]{auto}, got {v!r}")
    levels = get("head_start_levels", 0)
    if not _is_int(levels) or not 0 <= levels <= MAX_DEPTH:
        p.append(f"head_start_levels must be an integer in [0, {MAX_DEPTH}], got {levels!r}")
    elif levels and (get("tree_width") == 1 or get("num_speculative_tokens") is not None):
        p.append("head_start_levels needs a tree (tree_width > 1 or \"auto\"): a chain has no "
                 "KV slots to spare past its verify")
    max_depth = get("max_tree_depth")
    if max_depth is not None:
        if not _is_int(max_depth) or not 1 <= max_depth <= MAX_DEPTH:
            p.append(f"max_tree_depth must be an integer in [1, {MAX_DEPTH}], got {max_depth!r}")
        elif (get("tree_depth") not in (None, AUTO) or get("tree_width") == 1
              or get("num_speculative_tokens") is not None):
            p.append('max_tree_depth bounds "tree_depth": "auto" only; a fixed tree_depth or a '
                     "chain drafts exactly its depth")
    if get("num_speculative_tokens") is not None and (
            get("tree_depth") is not None or get("tree_width") not in (None, 1)):
        p.append("num_speculative_tokens is the chain depth (tree_width=1); for a tree give "
                 "tree_width and tree_depth instead")
    layers = get("substitute_layers", "offloaded")
    if isinstance(layers, (list, tuple)):
        if not all(_is_int(i) and i >= 0 for i in layers):
            p.append(f"substitute_layers must list non-negative layer indices, got {layers!r}")
        elif len(set(layers)) != len(layers):
            p.append(f"substitute_layers has duplicate indices: {layers!r}")
    elif layers not in _SUBSTITUTE_LAYER_MODES:
        p.append(
            f"substitute_layers must be one of {list(_SUBSTITUTE_LAYER_MODES)} or a list of "
            f"layer indices, got {layers!r}"
        )
    bits, group_size = get("bits", 4), get("group_size", 64)
    if bits not in _BITS or not _is_int(bits):
        p.append(f"bits must be one of {list(_BITS)}, got {bits!r}")
    if group_size not in _GROUP_SIZES or not _is_int(group_size):
        p.append(f"group_size must be one of {list(_GROUP_SIZES)}, got {group_size!r}")
    t = get("draft_temperature", 0.2)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 10:
        p.append(f"draft_temperature must be a number in (0, 10], got {t!r}")
    kernel = get("kernel", "auto")
    if kernel not in _KERNELS:
        p.append(f"kernel must be one of {list(_KERNELS)}, got {kernel!r}")
    elif kernel in ("int4_cpu", "int4_cpu_dot") and bits != 4:
        p.append(f"kernel {kernel!r} needs bits=4, got bits={bits}")
    elif kernel == "gemlite" and bits != 4:
        p.append(f"kernel 'gemlite' is wired for bits=4 only, got bits={bits}")
    c = get("substitute_cache")
    if not (c is None or isinstance(c, bool) or (isinstance(c, str) and c.strip())):
        p.append(f"substitute_cache must be true, false or a folder path, got {c!r}")
    if get("draft_lm_head", AUTO) not in _DRAFT_LM_HEADS:
        p.append(f"draft_lm_head must be one of {list(_DRAFT_LM_HEADS)}, "
                 f"got {get('draft_lm_head')!r}")
    m = get("cpu_draft_memory", 0.4)
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 4:
        p.append(f"cpu_draft_memory must be a number in [0, 4] (a fraction of the target's "
                 f"weight bytes), got {m!r}")
    if get("quantizer", "hqq") not in _QUANTIZERS:
        p.append(f"quantizer must be one of {list(_QUANTIZERS)}, got {get('quantizer')!r}")
    return p


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_target_supported(hf_config: Any, pipeline_parallel_size: int, bits: int = 4):
    """Reject targets SubSpec cannot draft for, with one clear message (bits: the
    substitutes')."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    moe = [a for a in archs if a in SUPPORTED_MOE_ARCHITECTURES]
    if not moe and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise SubSpecConfigError(
            f"unsupported architecture {archs}; SubSpec supports dense decoder-only models "
            f"{sorted(SUPPORTED_ARCHITECTURES)} and mixture-of-experts models "
            f"{sorted(SUPPORTED_MOE_ARCHITECTURES)}"
        )
    moe_keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
    if not moe and any(getattr(hf_config, k, None) for k in moe_keys):
        raise SubSpecConfigError(
            f"this {archs} checkpoint has mixture-of-experts settings; SubSpec supports "
            f"mixture-of-experts models {sorted(SUPPORTED_MOE_ARCHITECTURES)}")
    transform = (getattr(hf_config, "compression_config", None) or {})
    transform = transform.get("transform_config") if isinstance(transform, Mapping) else None
    if moe and (getattr(hf_config, "approximate_experts", None) or (
            isinstance(transform, Mapping) and transform.get("expert_substitution"))):
        raise SubSpecConfigError(
            f"this {moe[0]} checkpoint replaces pruned experts by constants (approximate_experts "
            "/ expert_substitution, vLLM 0.33's `fused_moe/expert_substitution.py`): its "
            "expert weights are stored compacted and remapped inside vLLM's kernel, which "
            "SubSpec's expert substitutes do not follow. Serve it without --speculative-config")
    if moe and bits != 4 and not _platform_is_cpu():
        raise SubSpecConfigError(
            f"mixture-of-experts targets ({moe[0]}) run with SubSpec on CUDA with 4-bit "
            f"substitutes (the routed experts' Triton kernel, docs/moe.md), not bits={bits}; "
            "use bits=4")
    if pipeline_parallel_size != 1:
        raise SubSpecConfigError(
            f"SubSpec does not run with pipeline parallelism (pipeline_parallel_size "
            f"{pipeline_parallel_size}): the draft's passes run every layer on one stage. Use "
            "tensor parallelism (--tensor-parallel-size) instead")


def check_tensor_parallel_shards(hf_config: Any, tensor_parallel_size: int,
                                 group_size: int) -> None:
    """Each rank quantizes its shard of the row-parallel linears in groups of `group_size`
    along their input: the shards' widths must be whole groups."""
    if tensor_parallel_size == 1:
        return
    heads = getattr(hf_config, "num_attention_heads", 0)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // max(heads, 1)
    widths = {"o_proj": heads * head_dim, "down_proj": getattr(hf_config, "intermediate_size", 0),
              # a MoE layer's experts' and shared expert's down weights (Qwen MoEs; Mixtral's
              # experts are `intermediate_size` wide)
              "experts' down_proj": getattr(hf_config, "moe_intermediate_size", 0),
              "shared_expert.down_proj": getattr(hf_config, "shared_expert_intermediate_size",
                                                 0)}
    bad = {name: width // tensor_parallel_size for name, width in widths.items()
           if width and (width // tensor_parallel_size) % group_size}
    if bad:
        raise SubSpecConfigError(
            f"with tensor_parallel_size {tensor_parallel_size}, each rank's shard of "
            + ", ".join(f"{n} ({w} inputs)" for n, w in bad.items())
            + f" is not a whole number of group_size {group_size} groups; choose a "
            "group_size dividing it (e.g. 32), or another tensor_parallel_size")


def options_from_vllm_config(vllm_config: Any) -> SubSpecOptions | None:
    """The SubSpec options carried by a VllmConfig, or None when SubSpec is off. The front end
    stores them resolved (`to_dict`); each process parses them once (`_parse_resolved`)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if raw is None else _parse_resolved(json.dumps(raw, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _parse_resolved(raw_json: str) -> SubSpecOptions:
    return SubSpecOptions.from_dict(json.loads(raw_json))
