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
from typing import Any

from vllm_subspec import architectures, refusals

# the option domains and the error live with every other refusal (refusals.py)
from vllm_subspec.refusals import (  # noqa: F401 (re-exported)
    AUTO,
    MAX_DEPTH,
    MAX_TREE_NODES,
    MAX_WIDTH,
    SubSpecConfigError,
)

METHOD = "subspec"
ADDITIONAL_CONFIG_KEY = "subspec"

DEFAULT_TREE_WIDTH = 6
# A fixed tree depth given without a width, or a chain's (tree_width 1) depth: the paper's 48
# where the target streams its weights over PCIe (CUDA offload); on the CPU backend, where a
# verify row costs a target row, 16.
DEFAULT_TREE_DEPTH = {"cuda": 48, "cpu": 16}
# "auto" (the default for both): the shape tuner (step/tuner/) picks each step's width among
# these and stops each step's tree at the depth that still pays, at most AUTO_MAX_DEPTH deep.
# A value the user gives is fixed.
AUTO_TREE_WIDTHS = (1, 2, 4, 6)
AUTO_MAX_DEPTH = {"cuda": 48, "cpu": 32}


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
        both where a tuner can choose (an auto shape: `step/tuner/lm_head_choice.py`), else the
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
        known = {f.name for f in dataclasses.fields(cls)} - {"auto_width", "auto_depth"} | {
            "num_speculative_tokens",
            "max_tree_depth",
        }
        refusals.refuse_unknown_keys(sorted(set(raw) - known), known)
        refusals.refuse_option_values(raw)
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
            depth = (
                (max_depth or AUTO_MAX_DEPTH[platform])
                if raw["auto_depth"]
                else DEFAULT_TREE_DEPTH[platform]
            )
        raw["tree_depth"] = depth
        refusals.refuse_tree_size(raw["tree_width"], raw["tree_depth"])
        refusals.refuse_head_start_slots(
            raw.get("head_start_levels", 0), raw["tree_width"], raw["tree_depth"]
        )
        if isinstance(raw.get("substitute_layers"), list):
            raw["substitute_layers"] = tuple(raw["substitute_layers"])
        if raw.get("substitute_cache") is None:
            raw.pop("substitute_cache", None)
        return cls(**raw)

    def resolve_layers(self, num_layers: int, offloaded: list[int]) -> list[int]:
        """The decoder layer indices that get a substitute."""
        layers = self.substitute_layers
        if isinstance(layers, str):  # "all" or "offloaded" (`from_dict` refuses other names)
            return list(range(num_layers)) if layers == "all" else sorted(offloaded)
        refusals.refuse_layers_out_of_range([i for i in layers if i >= num_layers], num_layers)
        return sorted(layers)


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_target_supported(hf_config: Any, pipeline_parallel_size: int, bits: int = 4):
    """Reject targets SubSpec cannot draft for, with one clear message (bits: the
    substitutes'; the rules: `refusals.refuse_target`)."""
    refusals.refuse_target(hf_config, pipeline_parallel_size, bits, lambda: _platform_is_cpu())


def check_tensor_parallel_shards(
    hf_config: Any, tensor_parallel_size: int, group_size: int
) -> None:
    """Each rank quantizes its shard of the row-parallel linears in groups of `group_size`
    along their input: the shards' widths must be whole groups (the widths: the target's
    family's, `architectures.tp_shard_widths`)."""
    if tensor_parallel_size == 1:
        return
    refusals.refuse_tensor_parallel_shards(
        architectures.tp_shard_widths(hf_config), tensor_parallel_size, group_size
    )


def options_from_vllm_config(vllm_config: Any) -> SubSpecOptions | None:
    """The SubSpec options carried by a VllmConfig, or None when SubSpec is off. The front end
    stores them resolved (`to_dict`); each process parses them once (`_parse_resolved`)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if raw is None else _parse_resolved(json.dumps(raw, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _parse_resolved(raw_json: str) -> SubSpecOptions:
    return SubSpecOptions.from_dict(json.loads(raw_json))
