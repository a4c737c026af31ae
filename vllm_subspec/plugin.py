"""vLLM plugin entry point (`vllm.general_plugins`: `subspec = vllm_subspec.plugin:register`).

vLLM calls it once in every process it starts (front end, engine core, each worker), which is
what makes the patches reach spawned workers without user code or environment variables.
"""

from vllm_subspec.vllm_hooks import patches


def register() -> None:
    patches.apply_all()
