"""The draft forward under vLLM's compilation, as vLLM compiles its own drafters' models.

In vLLM's compile mode (no `--enforce-eager`) the whole draft forward, every decoder layer shared
or substituted, is one dynamo graph with a dynamic token count (fullgraph, guards dropped): on
CPU inductor compiles it; on CUDA vLLM's backend splits it at the attention ops, which run
eagerly (tree attention runs inside them), and compiles the pieces between. The substitutes are
custom ops in it (`substitute.int4_cpu_linear`, GemLite's `forward_functional`). On CUDA the
pieces are CUDA graphs per bucket of rows (the proposer's `initialize_cudagraph_keys`,
`draft_bucket`). Eager (`enforce_eager`) on CPU, the substituted layers' RMSNorms run vLLM's
C++ kernels instead of its native forward (`model.cpu_fused_norms`).
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode

from vllm_subspec.draft_model.model import DraftModel, SubstituteSet, cpu_fused_norms

# vLLM's draft-model proposer builds its model under "draft_model" (draft_model.py 0.32.0 :107):
# a second model under the target's tag would share its compile cache folder
DRAFT_MODEL_TAG = "subspec_draft"


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class CompiledDraftModel(DraftModel):
    """`DraftModel` under vLLM's `support_torch_compile` (the decorator the target's
    Qwen2Model carries, qwen2.py 0.32.0 :314); with CompilationMode.NONE (`enforce_eager`) the
    decorator runs the plain forward."""


# vLLM keys its on-disk compile artifacts on the config's hash and the traced source files
# (decorators.py 0.32.0 :561-564, :266-282), not on the objects the graph reads: a draft whose
# substitutes run another kernel class than at the last start (gemlite installed since, say)
# would load a graph reading attributes its kernels no longer have. This entry, hashed with
# the config, keys the artifacts on the draft's structure as well.
STRUCTURE_KEY = "subspec_draft_structure"


def draft_structure(substitutes: SubstituteSet) -> str:
    """A digest of what a compiled draft graph reads besides vLLM's config: which layers are
    substituted, each substitute's kernel class, whether the lm_head is the draft's own, and
    the versions of this package and of gemlite (when a substitute runs it)."""
    from vllm_subspec import __version__

    kernels = {sub.source_name: type(sub.kernel).__name__ for sub in substitutes.every()}
    versions = {"vllm_subspec": __version__}
    if "GemliteKernel" in kernels.values():
        from gemlite import __version__ as gemlite_version  # lazy: importing it needs CUDA

        versions["gemlite"] = gemlite_version
    text = json.dumps({"kernels": kernels, "versions": versions}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def draft_model(target: nn.Module, substitutes: SubstituteSet, device: torch.device,
                vllm_config) -> DraftModel:
    """The draft as the engine runs it: compiled in vLLM's compile mode, under its own tag.
    Called at load, before the target's or the draft's first compile reads the config hash."""
    if isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config[STRUCTURE_KEY] = draft_structure(substitutes)
    with set_model_tag(DRAFT_MODEL_TAG):
        model = CompiledDraftModel(target=target, substitutes=substitutes, device=device,
                                   vllm_config=vllm_config, prefix=DRAFT_MODEL_TAG)
    if device.type == "cpu" and vllm_config.compilation_config.mode == CompilationMode.NONE:
        cpu_fused_norms([model.layers[i] for i in model.substituted])
    return model
