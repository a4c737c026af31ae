"""The draft forward under vLLM's compilation, as vLLM compiles its own drafters' models.

In vLLM's compile mode (no `--enforce-eager`) the whole draft forward, every decoder layer shared
or substituted, is one dynamo graph with a dynamic token count (fullgraph, guards dropped): on
CPU inductor compiles it; on CUDA vLLM's backend splits it at the attention ops, which run
eagerly (tree attention runs inside them), and compiles the pieces between. The substitutes are
custom ops in it (`substitute.int4_cpu_linear`, GemLite's `forward_functional`). No CUDA graph
is captured of it (the proposer's `initialize_cudagraph_keys`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import support_torch_compile

from vllm_subspec.draft_model.model import DraftModel, SubstituteSet

# vLLM's draft-model proposer builds its model under "draft_model" (draft_model.py 0.32.0 :107):
# a second model under the target's tag would share its compile cache folder
DRAFT_MODEL_TAG = "subspec_draft"


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class CompiledDraftModel(DraftModel):
    """`DraftModel` under vLLM's `support_torch_compile` (the decorator the target's
    Qwen2Model carries, qwen2.py 0.32.0 :314); with CompilationMode.NONE (`enforce_eager`) the
    decorator runs the plain forward."""


def draft_model(target: nn.Module, substitutes: SubstituteSet, device: torch.device,
                vllm_config) -> DraftModel:
    """The draft as the engine runs it: compiled in vLLM's compile mode, under its own tag."""
    with set_model_tag(DRAFT_MODEL_TAG):
        return CompiledDraftModel(target=target, substitutes=substitutes, device=device,
                                  vllm_config=vllm_config, prefix=DRAFT_MODEL_TAG)
