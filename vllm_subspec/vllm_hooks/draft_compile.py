"""The draft forward under vLLM's compilation, as vLLM compiles its own drafters' models: one
dynamo graph over every layer in compile mode (split at the attention ops on CUDA, its pieces
captured per bucket of rows), eager with `enforce_eager` (on CPU with vLLM's C++ norms in the
substituted layers). How and why: docs/architecture.md, "The draft under vLLM's compilation".
"""

from __future__ import annotations

import copy
import hashlib
import json

import torch
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, set_current_vllm_config

from vllm_subspec.draft_model.model import DraftModel, cpu_fused_norms
from vllm_subspec.draft_model.substitute_set import SubstituteSet

# vLLM's draft-model proposer builds its model under "draft_model"
# (`DraftModelProposer._get_model`): a second model under the target's tag would share its
# compile cache folder
DRAFT_MODEL_TAG = "subspec_draft"


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class CompiledDraftModel(DraftModel):
    """`DraftModel` under vLLM's `support_torch_compile` (the decorator of the target's
    `Qwen2Model`); with CompilationMode.NONE (`enforce_eager`) it runs the plain forward."""


# vLLM keys its on-disk compile artifacts on the config's hash and the traced source files,
# not on the objects the graph reads: a draft whose substitutes run another kernel class than
# at the last start (gemlite installed since, say) would load a graph reading attributes its
# kernels no longer have. The draft's own config (the engine's plus this entry) and its model
# tag carry the draft's structure, so its artifacts are keyed on it.
STRUCTURE_KEY = "subspec_draft_structure"


def draft_structure(substitutes: SubstituteSet) -> str:
    """A digest of what a compiled draft graph reads besides vLLM's config: which layers are
    substituted, each substitute's kernel class, whether the lm_head is the draft's own, and
    the versions of this package and of gemlite (when a substitute runs it)."""
    from vllm_subspec import __version__

    kernels = {sub.source_name: type(sub.kernel).__name__ for sub in substitutes.every()}
    kernels.update({e.source_name: e.kernel_name for e in substitutes.experts.values()})
    versions = {"vllm_subspec": __version__}
    if "GemliteKernel" in kernels.values():
        from gemlite import __version__ as gemlite_version  # lazy: importing it needs CUDA

        versions["gemlite"] = gemlite_version
    text = json.dumps({"kernels": kernels, "versions": versions}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_draft_model(
    target: nn.Module, substitutes: SubstituteSet, device: torch.device, vllm_config
) -> DraftModel:
    """The draft as the engine runs it: compiled in vLLM's compile mode, with a config of its
    own (the engine's, plus `STRUCTURE_KEY`) and a model tag naming its structure, under which
    vLLM's AOT and per-tag caches keep its artifacts; the engine's config is not changed."""
    structure = draft_structure(substitutes)
    draft_config = copy.copy(vllm_config)  # shallow: the same sub-configs, its own extras
    draft_config.additional_config = {
        **(vllm_config.additional_config or {}),
        STRUCTURE_KEY: structure,
    }
    with set_current_vllm_config(draft_config), set_model_tag(f"{DRAFT_MODEL_TAG}_{structure}"):
        # (vLLM's support_torch_compile adds the vllm_config and prefix arguments)
        model = CompiledDraftModel(
            target=target,
            substitutes=substitutes,  # type: ignore[call-arg]
            device=device,
            vllm_config=draft_config,
            prefix=DRAFT_MODEL_TAG,
        )
    if device.type == "cpu" and vllm_config.compilation_config.mode == CompilationMode.NONE:
        cpu_fused_norms([model.layers[i] for i in model.substituted])
    return model
