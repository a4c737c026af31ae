"""Where SubSpec's objects are made and wired, once per model runner (the composition root).

One `StepSession` per runner, shared by the drafter (`SubSpecProposer`, in the runner's
`drafter` slot) and the verifier (`TreeVerifier`, in the runner's `rejection_sampler` slot):
every shape, a chain included, is verified by sample-then-match, not vLLM's rejection sampler,
so every emitted token is the target's own draw under plain decoding's rules (seeded output
included).
"""

from __future__ import annotations

from vllm_subspec.config import SubSpecOptions
from vllm_subspec.step.session import StepSession


def install_subspec(runner, vllm_config, device, options: SubSpecOptions) -> None:
    from vllm.platforms import current_platform

    from vllm_subspec.vllm_hooks.engine_rules import check_final_config
    from vllm_subspec.vllm_hooks.proposer import SubSpecProposer
    from vllm_subspec.vllm_hooks.tree_verifier import TreeVerifier

    check_final_config(vllm_config, options, current_platform)
    session = StepSession.from_options(options)
    runner.drafter = SubSpecProposer(vllm_config, device, runner, session)
    runner.rejection_sampler = TreeVerifier(runner, session, runner.drafter.kv_caches)


def tree_verifier_of(runner):
    """The runner's TreeVerifier, or None (not a SubSpec tree engine)."""
    from vllm_subspec.vllm_hooks.tree_verifier import TreeVerifier

    sampler = getattr(runner, "rejection_sampler", None)
    return sampler if isinstance(sampler, TreeVerifier) else None
