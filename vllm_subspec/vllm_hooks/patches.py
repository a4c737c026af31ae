"""Every vLLM function vllm-subspec wraps, in one place: the process-wide patches.

The model runner's calls into SubSpec are not patches: vLLM builds SubSpec's own runner class
(runner.py). Each patch names the vLLM function it wraps; all of them are version-gated
(`TESTED_VLLM`), inventoried and fingerprinted (docs/vllm_inventory.md). `apply_all()` is
idempotent and runs in every vLLM process through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_subspec.config import ADDITIONAL_CONFIG_KEY, METHOD

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

TESTED_VLLM = ((0, 32), (0, 34))  # [min, max): 0.32.0 ran end to end, 0.33 diffed
# On another vLLM the patches are not applied (SubSpec disabled, with an error) unless this is
# "1": then they are applied with a warning (each wrap target may have moved: check the output
# against plain decoding; docs/troubleshooting.md).
ALLOW_UNTESTED_VLLM_ENV = "VLLM_SUBSPEC_ALLOW_UNTESTED_VLLM"
# patch id -> the (owner, attribute) it wrapped in this process
_APPLIED: dict[str, tuple[object, str]] = {}


def _wrap(owner, attr: str, make_wrapper, patch_id: str) -> None:
    """Replace owner.attr by make_wrapper(original), once per process."""
    if patch_id in _APPLIED:
        return
    original = getattr(owner, attr)
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__subspec_original__ = original
    setattr(owner, attr, wrapper)
    _APPLIED[patch_id] = (owner, attr)


# ---- 1. front end: accept {"method": "subspec", ...} -------------------------------------
# Target: vllm.engine.arg_utils.EngineArgs.create_speculative_config, called by
# `EngineArgs.create_engine_config` before the scheduler/attention/compilation configs are built
# from the EngineArgs fields. The translation and the platform rules live in engine_rules.py.
def _patch_create_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == METHOD:
                from vllm.platforms import current_platform

                from vllm_subspec.vllm_hooks.engine_rules import (
                    apply_platform_rules,
                    translate_speculative_config,
                )

                self.speculative_config, self.additional_config, options = (
                    translate_speculative_config(
                        spec, self.additional_config, target_model_config, target_parallel_config
                    )
                )
                apply_platform_rules(
                    self, options, target_model_config, target_parallel_config, current_platform
                )
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config

    _wrap(EngineArgs, "create_speculative_config", make, "create_speculative_config")


# ---- 2. force the V1 model runner --------------------------------------------------------
# Target: vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features. Model Runner
# V2 ignores weight offload and rejects custom drafters; the engine core and each worker
# evaluate this separately, so the patch must be live in every process.
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
# Target: vllm.model_executor.model_loader.base_loader.process_weights_after_loading (a
# module global `BaseModelLoader.load_model` calls after `load_weights`). The parameters then
# hold the raw fused weights (offloaded ones already in host memory), nothing is repacked yet
# (the CPU backend empties `weight` right after), and vLLM has not sized the KV cache. Only the
# target of a SubSpec runner's `load_model` is handed over (runner.py).
def _patch_weight_hook() -> None:
    from vllm.model_executor.model_loader import base_loader

    _wrap(base_loader, "process_weights_after_loading", weight_hook, "weight_hook")


def weight_hook(original):
    def process_weights_after_loading(model, model_config, target_device):
        from vllm_subspec.vllm_hooks.runner import loading_runner  # a worker's import

        runner = loading_runner()
        if runner is None or model_config is not runner.model_config:
            return original(model, model_config, target_device)
        runner.target_weights_loaded(
            model, target_device, lambda: original(model, model_config, target_device)
        )

    return process_weights_after_loading


# ---- 4. tree attention inside vLLM's attention backends ---------------------------------
# Targets: vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward and, on CUDA,
# vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward. Both backends write the
# step's KV before `forward` (`forward_includes_kv_cache_update` False: the layer calls
# `do_kv_cache_update`), and `forward` computes causal attention for every row; the rows of
# the active tree plan are then recomputed with the ancestor-only mask
# (`tree_attention.apply_tree_attention`); a no-op without a plan.
def _patch_attention_backends() -> None:
    from vllm.platforms import current_platform

    try:
        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as backend
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl
        else:
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend
            from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as impl
    except ImportError as e:  # e.g. a platform without FlashAttention: trees unavailable
        logger.warning("vllm-subspec: no tree attention on this platform (%s); use tree_width=1", e)
        return
    kv_written_apart = not backend.forward_includes_kv_cache_update
    _wrap(
        impl,
        "forward",
        lambda original: tree_attention_forward(original, kv_written_apart),
        "attention_forward",
    )


def tree_attention_forward(original, kv_written_apart: bool):
    """The backend's `forward` with the active tree plan's rows recomputed. When every row of
    the call is a tree row and the KV was written before `forward` (`kv_written_apart`), the
    backend's causal pass, which would be overwritten whole, is not run."""
    from vllm.v1.attention.backend import AttentionType

    from vllm_subspec.step.tree_attention import active_tree_plan, apply_tree_attention

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        plan = active_tree_plan()
        if plan is None:  # no tree rows (every plain step): the backend alone
            return original(
                self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        if (
            kv_written_apart
            and attn_metadata is not None
            and not args
            and all(v is None for v in kwargs.values())
            and self.attn_type == AttentionType.DECODER
            and getattr(self, "dcp_world_size", 1) == 1
            and plan.num_rows == attn_metadata.num_actual_tokens
        ):
            # every row is a tree row: the backend's pass would be overwritten whole
            apply_tree_attention(self, layer, query, kv_cache, attn_metadata, output)
            return output
        result = original(
            self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        )
        apply_tree_attention(self, layer, query, kv_cache, attn_metadata, output)
        return result

    return forward


# ---- 5. request features SubSpec refuses: one clear error per request --------------------
# Target: vllm.v1.engine.input_processor.InputProcessor._validate_params, where vLLM refuses
# min_p and logit_bias for every speculative method (through SamplingParams.verify). The rule
# is refusals.request_refusal.
def _patch_request_refusals() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def make(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            if ADDITIONAL_CONFIG_KEY in (self.vllm_config.additional_config or {}):
                from vllm.exceptions import VLLMValidationError

                from vllm_subspec.refusals import request_refusal

                reason = request_refusal(params)
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
            logger.error(
                "vllm-subspec supports %s; found %s. SubSpec is disabled (set %s=1 to "
                "try it anyway).",
                supported,
                vllm.__version__,
                ALLOW_UNTESTED_VLLM_ENV,
            )
            return False
        logger.warning(
            "vllm-subspec: vLLM %s is untested (supported: %s); %s=1, so SubSpec's "
            "patches are applied anyway. Compare its output with plain decoding.",
            vllm.__version__,
            supported,
            ALLOW_UNTESTED_VLLM_ENV,
        )
    _patch_create_speculative_config()
    _patch_force_v1_runner()
    _patch_weight_hook()
    _patch_attention_backends()
    _patch_request_refusals()
    logger.debug("vllm-subspec patches applied in pid %d", os.getpid())
    return True
