"""Every change vllm-subspec makes to vLLM, in one place.

Each patch names the vLLM function it wraps and the versions it was written and tested against
(`TESTED_VLLM`). `apply_all()` is idempotent and runs in every vLLM process (front end, engine
core, workers) through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from vllm_subspec.config import (
    ADDITIONAL_CONFIG_KEY,
    METHOD,
    options_from_vllm_config,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

TESTED_VLLM = ((0, 32), (0, 34))  # [min, max): 0.32.0 ran end to end, 0.33 diffed
# On another vLLM the patches are not applied (SubSpec disabled, with an error) unless this is
# "1": then they are applied with a warning (each wrap target may have moved: check the output
# against plain decoding; docs/troubleshooting.md).
ALLOW_UNTESTED_VLLM_ENV = "VLLM_SUBSPEC_ALLOW_UNTESTED_VLLM"
_APPLIED: set[str] = set()


def _wrap(owner, attr: str, make_wrapper, patch_id: str) -> None:
    """Replace owner.attr by make_wrapper(original), once per process."""
    if patch_id in _APPLIED:
        return
    original = getattr(owner, attr)
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__subspec_original__ = original
    setattr(owner, attr, wrapper)
    _APPLIED.add(patch_id)


# ---- 1. front end: accept {"method": "subspec", ...} -------------------------------------
# Target: vllm.engine.arg_utils.EngineArgs.create_speculative_config (0.32.0 :2060, 0.33 :2100),
# called by create_engine_config before the scheduler/attention/compilation configs are built
# from the EngineArgs fields. The translation and the platform rules live in engine_rules.py.
def _patch_create_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == METHOD:
                from vllm.platforms import current_platform

                from vllm_subspec.vllm_hooks.engine_rules import (
                    apply_platform_rules, translate_speculative_config)

                self.speculative_config, self.additional_config, options = \
                    translate_speculative_config(spec, self.additional_config,
                                                 target_model_config, target_parallel_config)
                apply_platform_rules(self, options, target_model_config, current_platform)
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config

    _wrap(EngineArgs, "create_speculative_config", make, "create_speculative_config")


# ---- 2. force the V1 model runner --------------------------------------------------------
# Target: vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features (0.32.0 :2914).
# Model Runner V2 ignores weight offload and rejects custom drafters; the engine core and each
# worker evaluate this separately, so the patch must be live in every process.
def _patch_force_v1_runner() -> None:
    from vllm.config.vllm import VllmConfig

    def make(original):
        def _get_v2_model_runner_unsupported_features(self):
            unsupported = original(self)
            if ADDITIONAL_CONFIG_KEY in (self.additional_config or {}):
                unsupported.append("speculative method 'subspec' (V1 runner only)")
            return unsupported

        return _get_v2_model_runner_unsupported_features

    _wrap(VllmConfig, "_get_v2_model_runner_unsupported_features", make, "force_v1")


# ---- 3. build substitutes from the target's freshly loaded weights -----------------------
# Target: vllm.model_executor.model_loader.base_loader.process_weights_after_loading
# (module global called by BaseModelLoader.load_model, 0.32.0 :109). At that point the
# parameters hold the raw fused bf16 weights (offloaded ones already in CPU memory), nothing has
# been repacked yet (the CPU backend replaces `weight` by an empty tensor right after), and vLLM
# has not sized the KV cache. No second checkpoint read, no second full-precision copy.
def _patch_weight_hook() -> None:
    from vllm.model_executor.model_loader import base_loader

    def make(original):
        def process_weights_after_loading(model, model_config, target_device):
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
            options = options_from_vllm_config(vllm_config) if vllm_config else None
            if options is not None and model_config is vllm_config.model_config:
                from vllm_subspec.draft_model.model import (
                    after_weights_processed,
                    attach_substitutes,
                )
                from vllm_subspec.vllm_hooks.cpu_memory import kv_room_and_need

                device = torch.device(target_device)
                kv_room = (lambda: kv_room_and_need(vllm_config)) if device.type == "cpu" \
                    else None
                attach_substitutes(model, options, vllm_config, device, kv_room)
                out = original(model, model_config, target_device)
                after_weights_processed(model, device, kv_room)  # (CPU: the KV cache fits)
                return out
            return original(model, model_config, target_device)

        return process_weights_after_loading

    _wrap(base_loader, "process_weights_after_loading", make, "weight_hook")


# ---- 4. install the SubSpec drafter ------------------------------------------------------
# Target: vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__ (0.32.0 :590-666 builds a
# DraftModelProposer for method draft_model). CPUModelRunner calls it via super().__init__, so
# this covers both. The replaced proposer has loaded nothing yet (that happens in load_model).
def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def __init__(self, vllm_config, device, *args, **kwargs):
            original(self, vllm_config, device, *args, **kwargs)
            options = options_from_vllm_config(vllm_config)
            if options is not None and hasattr(self, "drafter"):
                from vllm_subspec.vllm_hooks.install import install_subspec

                install_subspec(self, vllm_config, device, options)

        return __init__

    _wrap(GPUModelRunner, "__init__", make, "model_runner")


# ---- 5. tree verification: inputs, and the scope of the tree mask ------------------------
# Targets: vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs (0.32.0 :1920) and
# GPUModelRunner._model_forward (0.32.0 :3620, 0.33.0 :3586; "can be overridden by subclasses
# for model execution"). After vLLM has laid the drafts out as a chain and computed their slots,
# the tree verifier rewrites positions and builds the tree mask (`TreeVerifier.prepare_verify`);
# the mask is active for the verify forward only (`TreeVerifier.verify_forward`).
def _patch_tree_verify() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_subspec.vllm_hooks.install import tree_verifier_of

    def make_prepare(original):
        def _prepare_inputs(self, scheduler_output, *args, **kwargs):
            out = original(self, scheduler_output, *args, **kwargs)
            verifier = tree_verifier_of(self)
            if verifier is not None:
                verifier.prepare_verify(scheduler_output)
            return out

        return _prepare_inputs

    def make_forward(original):
        def _model_forward(self, *args, **kwargs):
            verifier = tree_verifier_of(self)
            if verifier is None:
                return original(self, *args, **kwargs)
            with verifier.verify_forward():
                return original(self, *args, **kwargs)

        return _model_forward

    _wrap(GPUModelRunner, "_prepare_inputs", make_prepare, "prepare_inputs")
    _wrap(GPUModelRunner, "_model_forward", make_forward, "model_forward")


# ---- 6. tree attention inside vLLM's attention backends ---------------------------------
# Targets: vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward (0.32.0 :344)
# and, on CUDA, vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward. The backend
# writes KV and computes causal attention; the rows of tree requests are then recomputed with
# the ancestor-only mask (`tree_attention.apply_tree_attention`); a no-op without a tree plan.
def _patch_attention_backends() -> None:
    from vllm.platforms import current_platform

    from vllm_subspec.step.tree_attention import apply_tree_attention

    def make(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args,
                    **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                              *args, **kwargs)
            apply_tree_attention(self, layer, query, kv_cache, attn_metadata, output)
            return result

        return forward

    try:
        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl
        else:
            from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as impl
    except ImportError as e:  # e.g. a platform without FlashAttention: trees unavailable
        logger.warning("vllm-subspec: no tree attention on this platform (%s); use "
                       "tree_width=1", e)
        return
    _wrap(impl, "forward", make, "attention_forward")


# ---- 7. CPU only: vLLM bug in expand_batch_to_tokens -------------------------------------
# Target: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens (0.32.0 :581, 0.33 :648),
# replaced on CPU by a torch version (upstream #55005; the bug: cpu_sampling_fix.py).
def _patch_cpu_expand() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler

    from vllm_subspec.vllm_hooks.cpu_sampling_fix import expand_batch_to_tokens

    _wrap(rejection_sampler, "expand_batch_to_tokens", lambda original: expand_batch_to_tokens,
          "cpu_expand")


# ---- 8. tree drafting near max_model_len: per request, not per batch ---------------------
# Target: vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter (0.32.0 :4288,
# 0.33.0 :4254). vLLM skips the drafter for the whole batch once any request is within
# num_speculative_tokens (k * D = 288 for the default tree) of max_model_len, and schedules
# that many zero placeholders per request (:4454-4465). A tree stops each request at its own
# limit (step/draft.py `draft_tree`: no pass runs past it), so a tree engine's drafter runs
# whenever there is a batch. Chains keep vLLM's rule (k tokens): their passes past the limit
# would rely on vLLM's clamped positions, which changed a near-tie token in the context-limit
# test.
def _patch_drafting_near_the_limit() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_subspec.vllm_hooks.install import tree_verifier_of

    def make(original):
        def _input_fits_in_drafter(self, common_attn_metadata):
            verifier = tree_verifier_of(self)
            if verifier is None or not verifier.session.options.is_tree:
                return original(self, common_attn_metadata)
            return common_attn_metadata is not None

        return _input_fits_in_drafter

    _wrap(GPUModelRunner, "_input_fits_in_drafter", make, "drafting_near_the_limit")


# ---- 9. request features SubSpec refuses: one clear error per request --------------------
# Target: vllm.v1.engine.input_processor.InputProcessor._validate_params (0.32.0 :138, 0.33.0
# :138), where vLLM refuses min_p and logit_bias for every speculative method (through
# SamplingParams.verify). The rule is node_constraints.refusal.
def _patch_request_refusals() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def make(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            if ADDITIONAL_CONFIG_KEY in (self.vllm_config.additional_config or {}):
                from vllm.exceptions import VLLMValidationError

                from vllm_subspec.step.node_constraints import refusal

                reason = refusal(params)
                if reason is not None:
                    raise VLLMValidationError(reason)
            return result

        return _validate_params

    _wrap(InputProcessor, "_validate_params", make, "request_refusals")


def vllm_version_supported(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    lo, hi = TESTED_VLLM
    return lo <= (major, minor) < hi


def apply_all() -> bool:
    """Apply every patch. Returns False (patching nothing) on an untested vLLM, unless
    `VLLM_SUBSPEC_ALLOW_UNTESTED_VLLM=1` (then it warns and applies them)."""
    import vllm

    if not vllm_version_supported(vllm.__version__):
        supported = "vLLM >={}.{},<{}.{}".format(*TESTED_VLLM[0], *TESTED_VLLM[1])
        if os.environ.get(ALLOW_UNTESTED_VLLM_ENV) != "1":
            logger.error("vllm-subspec supports %s; found %s. SubSpec is disabled (set %s=1 to "
                         "try it anyway).", supported, vllm.__version__, ALLOW_UNTESTED_VLLM_ENV)
            return False
        logger.warning("vllm-subspec: vLLM %s is untested (supported: %s); %s=1, so SubSpec's "
                       "patches are applied anyway. Compare its output with plain decoding.",
                       vllm.__version__, supported, ALLOW_UNTESTED_VLLM_ENV)
    _patch_create_speculative_config()
    _patch_force_v1_runner()
    _patch_weight_hook()
    _patch_model_runner()
    _patch_tree_verify()
    _patch_attention_backends()
    _patch_cpu_expand()
    _patch_drafting_near_the_limit()
    _patch_request_refusals()
    logger.debug("vllm-subspec patches applied in pid %d", os.getpid())
    return True
