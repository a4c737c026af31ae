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
    SubSpecConfigError,
    SubSpecOptions,
    check_target_supported,
    options_from_vllm_config,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

TESTED_VLLM = ((0, 32), (0, 34))  # [min, max): 0.32.0 ran end to end, 0.33 diffed
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
# Target: vllm.engine.arg_utils.EngineArgs.create_speculative_config (0.32.0 :2060, 0.33 :2100).
# `method` is a pydantic Literal, so "subspec" cannot reach SpeculativeConfig. We validate the
# SubSpec keys, move them to additional_config["subspec"] (which reaches every process), and hand
# vLLM a draft_model config whose "draft" is the target: that gives SubSpec k lookahead KV slots,
# the GPU-token drafting path and vLLM's rejection sampler. Only the target's HF config is read.
def translate_speculative_config(spec: dict, additional_config: dict | None,
                                 target_model_config, target_parallel_config
                                 ) -> tuple[dict, dict, SubSpecOptions]:
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    spec.pop("method")
    model = spec.pop("model", None)
    options = SubSpecOptions.from_dict(spec)  # rejects unknown keys
    target = target_model_config.model
    if model is not None and model != target:
        raise SubSpecConfigError(
            f"'model' must be omitted for method 'subspec' (the draft is the target {target!r} "
            f"itself), got {model!r}"
        )
    check_target_supported(
        target_model_config.hf_config,
        target_parallel_config.tensor_parallel_size,
        target_parallel_config.pipeline_parallel_size,
    )
    logprobs_mode = str(target_model_config.logprobs_mode)
    if options.is_tree and logprobs_mode.startswith("processed"):
        raise SubSpecConfigError(
            f"logprobs_mode {logprobs_mode!r} is not supported with tree drafting "
            "(raw_logprobs and raw_logits are); use tree_width=1")
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise SubSpecConfigError(
            "SubSpec needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
        )
    additional = dict(additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = options.to_dict()
    vllm_spec = {
        "method": "draft_model",
        "model": target,
        # vLLM sees the tree's D*k nodes as that many draft tokens: it reserves KV slots for
        # them and schedules them for verification (see tree_verify hooks below).
        "num_speculative_tokens": options.num_draft_tokens,
    }
    return vllm_spec, additional, options


def tree_cudagraph_mode(requested):
    """Trees need PIECEWISE CUDA graphs: attention must run outside the graphs, since the tree
    mask is applied in the attention backend's Python forward (patch 6), which a FULL graph's
    replay would skip. vLLM makes the same override for KV connectors (config/vllm.py)."""
    from vllm.config import CUDAGraphMode

    if requested is not None and not requested.has_full_cudagraphs():
        return requested  # NONE or PIECEWISE: already safe
    if requested is not None:
        logger.warning("vllm-subspec: tree drafting needs attention outside CUDA graphs; "
                       "cudagraph_mode %s -> PIECEWISE", requested.name)
    return CUDAGraphMode.PIECEWISE


def _patch_create_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == METHOD:
                from vllm.platforms import current_platform

                self.speculative_config, self.additional_config, options = \
                    translate_speculative_config(spec, self.additional_config,
                                                 target_model_config, target_parallel_config)
                if options.is_tree and current_platform.is_cuda_alike():
                    self.compilation_config.cudagraph_mode = tree_cudagraph_mode(
                        self.compilation_config.cudagraph_mode)
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
                attach_substitutes(model, options, vllm_config, torch.device(target_device))
            return original(model, model_config, target_device)

        return process_weights_after_loading

    _wrap(base_loader, "process_weights_after_loading", make, "weight_hook")


def attach_substitutes(model, options, vllm_config, device: torch.device) -> None:
    from vllm.model_executor.offloader.base import get_offloader

    from vllm_subspec.draft_model import SubstituteSet, build_substitutes, decoder_layers
    from vllm_subspec.layer_selection import offloaded_layer_indices

    if SubstituteSet.of(model) is not None:
        return
    layers = decoder_layers(model)
    offloaded = offloaded_layer_indices(layers, vllm_config.offload_config, device,
                                        get_offloader())
    chosen = options.resolve_layers(len(layers), offloaded)
    if not chosen:
        logger.warning(
            "vllm-subspec: substitute_layers=%r selected no layer (no weights are offloaded); "
            "the draft is the full-precision target", options.substitute_layers)
    subs = build_substitutes(model, chosen, options, device)
    subs.attach_to(model)  # the layout is logged once the KV cache is sized (the proposer)


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
                from vllm_subspec.proposer import SubSpecProposer

                self.drafter = SubSpecProposer(vllm_config, device, runner=self)
                if options.is_tree:  # trees are verified by sample-then-match, not vLLM's chain
                    from vllm_subspec.verify import TreeVerifier

                    self.rejection_sampler = TreeVerifier(self, self.drafter.tree_state)

        return __init__

    _wrap(GPUModelRunner, "__init__", make, "model_runner")


# ---- 5. tree verification inputs: depth-based positions, ancestor-only mask ---------------
# Target: vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs (0.32.0 :1920). vLLM
# lays a request's draft tokens out as a chain (slot and position L + i); after it has computed
# the slot mapping, SubSpec rewrites the positions of tree nodes to L + depth and activates the
# tree mask for the verify forward (`SubSpecProposer.prepare_verify`).
def _patch_prepare_inputs() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def _prepare_inputs(self, scheduler_output, *args, **kwargs):
            out = original(self, scheduler_output, *args, **kwargs)
            drafter = getattr(self, "drafter", None)
            if getattr(getattr(drafter, "options", None), "is_tree", False):
                drafter.prepare_verify(self, scheduler_output)
            return out

        return _prepare_inputs

    _wrap(GPUModelRunner, "_prepare_inputs", make, "prepare_inputs")


# ---- 6. tree attention inside vLLM's attention backends ---------------------------------
# Targets: vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward (0.32.0 :344)
# and, on CUDA, vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward. The backend
# writes KV and computes causal attention; the rows of tree requests are then recomputed with
# the ancestor-only mask (`tree_attention.apply_tree_attention`); a no-op without a tree plan.
def _patch_attention_backends() -> None:
    from vllm.platforms import current_platform

    from vllm_subspec.tree_attention import apply_tree_attention

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
# Target: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens (0.32.0 :581, 0.33 :648).
# On CPU its kernel (`vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`) writes into an int64
# *copy* of a float/int32 output and never copies back, so per-token temperature/top-k/top-p are
# uninitialised memory and every T>0 speculative step samples from garbage (upstream #55005).
def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    out = x.new_zeros(num_tokens)
    expanded = torch.repeat_interleave(x, counts)
    out[: expanded.numel()] = expanded[:num_tokens]
    return out


def _patch_cpu_expand() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler

    _wrap(rejection_sampler, "expand_batch_to_tokens", lambda original: expand_batch_to_tokens,
          "cpu_expand")


def vllm_version_supported(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    lo, hi = TESTED_VLLM
    return lo <= (major, minor) < hi


def apply_all() -> bool:
    """Apply every patch. Returns False (patching nothing) on an untested vLLM."""
    import vllm

    if not vllm_version_supported(vllm.__version__):
        logger.error(
            "vllm-subspec supports vLLM >=%d.%d,<%d.%d; found %s. SubSpec is disabled.",
            *TESTED_VLLM[0], *TESTED_VLLM[1], vllm.__version__)
        return False
    _patch_create_speculative_config()
    _patch_force_v1_runner()
    _patch_weight_hook()
    _patch_model_runner()
    _patch_prepare_inputs()
    _patch_attention_backends()
    _patch_cpu_expand()
    logger.debug("vllm-subspec patches applied in pid %d", os.getpid())
    return True
