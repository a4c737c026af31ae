"""How a `{"method": "subspec"}` request becomes a vLLM engine configuration, before it starts.

`translate_speculative_config` turns the user's JSON into vLLM's draft_model config (the draft is
the target) plus `additional_config["subspec"]`; `apply_platform_rules` then sets or refuses the
engine arguments SubSpec depends on. Both run in the front end inside
`EngineArgs.create_speculative_config` (patches.py), which `EngineArgs.create_engine_config`
calls before it builds the SchedulerConfig, AttentionConfig and CompilationConfig from those
arguments. Every refusal is one `SubSpecConfigError`, raised before any weight is loaded; each
worker re-checks the resolved config (`check_final_config`). The rules and why: docs/gpu.md,
"CUDA configuration rules".
"""

from __future__ import annotations

import logging

from vllm_subspec.config import (
    ADDITIONAL_CONFIG_KEY,
    SUPPORTED_MOE_ARCHITECTURES,
    SubSpecConfigError,
    SubSpecOptions,
    check_target_supported,
    check_tensor_parallel_shards,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def translate_speculative_config(spec: dict, additional_config: dict | None,
                                 target_model_config, target_parallel_config
                                 ) -> tuple[dict, dict, SubSpecOptions]:
    """`method` is a pydantic Literal, so "subspec" cannot reach SpeculativeConfig. Validate the
    SubSpec keys, move them to additional_config["subspec"] (which reaches every process), and
    hand vLLM a draft_model config whose "draft" is the target: that gives SubSpec lookahead KV
    slots, the GPU-token drafting path and vLLM's rejection sampler."""
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
        target_parallel_config.pipeline_parallel_size,
        options.bits,
    )
    check_tensor_parallel_shards(target_model_config.hf_config,
                                 target_parallel_config.tensor_parallel_size, options.group_size)
    quantization = getattr(target_model_config, "quantization", None)
    if quantization is not None:
        raise SubSpecConfigError(
            f"the target is quantized ({quantization!r}); SubSpec builds its substitutes from "
            "full-precision linear weights (bf16/fp16/fp32), which a quantized layer does not "
            "keep. Serve the unquantized checkpoint, or drop --speculative-config")
    logprobs_mode = str(target_model_config.logprobs_mode)
    if logprobs_mode.startswith("processed"):
        raise SubSpecConfigError(
            f"logprobs_mode {logprobs_mode!r} is not supported by SubSpec (raw_logprobs and "
            "raw_logits are): its verify reports the target's raw logprobs of each emitted "
            "token, as a plain engine's default mode does")
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
        # them and schedules them for verification.
        "num_speculative_tokens": options.num_draft_tokens,
    }
    return vllm_spec, additional, options


def apply_platform_rules(engine_args, options: SubSpecOptions, target_model_config,
                         target_parallel_config, platform) -> None:
    """Set (or refuse) the engine arguments SubSpec needs on `platform` (vLLM's
    current_platform; tests pass a stand-in). Mutates `engine_args` (vLLM's EngineArgs) and
    the ParallelConfig vLLM has built from them (its worker class)."""
    _use_subspec_worker(target_parallel_config, platform)
    _check_kernel_runs_here(options, platform)
    _refuse_moe_extras(engine_args, target_model_config, target_parallel_config)
    _refuse_context_parallel(target_parallel_config)
    if options.is_tree:  # every platform: the tree gather reads raw, unwindowed KV
        _refuse_unreadable_kv(engine_args, target_model_config)
        _refuse_micro_batching(target_parallel_config)
    if options.is_tree or not platform.is_cuda_alike():
        _no_placeholder_drafts(engine_args, options, target_parallel_config)
    if not platform.is_cuda_alike():
        if platform.is_cpu():
            _drafts_with_samples(engine_args, target_parallel_config)
        return  # the CPU platform: no async scheduling, its own attention backend
    _refuse_shared_head_starts(engine_args, options, target_model_config,
                               target_parallel_config)
    _offload_through_prefetch(engine_args, target_model_config, options)
    _require_offload(engine_args, options)
    _no_async_scheduling(engine_args)
    if not options.is_tree:
        return
    _pin_flash_attention(engine_args, target_model_config, platform)
    engine_args.compilation_config.cudagraph_mode = tree_cudagraph_mode(
        engine_args.compilation_config.cudagraph_mode)


def _refuse_context_parallel(parallel_config) -> None:
    """Context parallelism splits a request's KV positions over the ranks; the draft's KV moves
    and the tree's gather read every position of a rank's heads from its own cache."""
    dcp = getattr(parallel_config, "decode_context_parallel_size", 1)
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1)
    if dcp > 1 or pcp > 1:
        raise SubSpecConfigError(
            f"SubSpec does not run with context parallelism (decode {dcp}, prefill {pcp}): "
            "each rank must hold every position of its KV heads. Use tensor parallelism "
            "without --decode-context-parallel-size / --prefill-context-parallel-size")


def _refuse_moe_extras(engine_args, target_model_config, target_parallel_config) -> None:
    """A MoE target's draft routes with the target's router and runs a `MoERunner`'s place:
    what re-wires or records that routing is not served (docs/moe.md)."""
    archs = getattr(target_model_config.hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_MOE_ARCHITECTURES for a in archs):
        return
    extras = {
        "--enable-lora (vLLM wraps the experts for LoRA)": getattr(engine_args, "enable_lora",
                                                                   False),
        "--enable-expert-parallel": target_parallel_config.enable_expert_parallel,
        "--enable-eplb": target_parallel_config.enable_eplb,
        "--data-parallel-size > 1": target_parallel_config.data_parallel_size > 1,
        "--enable-return-routed-experts (the draft's routing would be recorded)": getattr(
            engine_args, "enable_return_routed_experts", False),
    }
    used = [name for name, on in extras.items() if on]
    if used:
        raise SubSpecConfigError(
            f"mixture-of-experts targets run with SubSpec without {', '.join(used)}; serve "
            "without them, or without --speculative-config")


def _refuse_shared_head_starts(engine_args, options: SubSpecOptions, target_model_config,
                               target_parallel_config) -> None:
    """On CUDA head starts draft on a stream of their own beside the verify: nothing the two
    share may be written by both (step/head_start.py). A MoE target's fused experts take their
    scratch from one global workspace, tensor parallelism runs collectives on shared
    communicators (two in flight from two streams can deadlock), and a KV connector moves KV
    on its own schedule."""
    if not options.head_start_levels:
        return
    archs = getattr(target_model_config.hf_config, "architectures", None) or []
    shared = {
        "a mixture-of-experts target (its experts' workspace is shared)": any(
            a in SUPPORTED_MOE_ARCHITECTURES for a in archs),
        "--tensor-parallel-size > 1 (collectives from two streams)":
            target_parallel_config.tensor_parallel_size > 1,
        "--kv-transfer-config (a connector moves KV on its own schedule)":
            getattr(engine_args, "kv_transfer_config", None) is not None,
    }
    used = [name for name, on in shared.items() if on]
    if used:
        raise SubSpecConfigError(
            f"head_start_levels drafts beside the verify on CUDA, which is not safe with "
            f"{', '.join(used)}; drop head_start_levels")


def subspec_worker_cls(platform) -> str:
    """The worker class vLLM builds SubSpec's model runner through (runner.py)."""
    if platform.is_cpu():
        return "vllm_subspec.vllm_hooks.cpu_runner.SubSpecCPUWorker"
    return "vllm_subspec.vllm_hooks.runner.SubSpecGPUWorker"


def _use_subspec_worker(parallel_config, platform) -> None:
    ours = subspec_worker_cls(platform)
    if parallel_config.worker_cls not in ("auto", ours):
        raise SubSpecConfigError(
            f"worker_cls {parallel_config.worker_cls!r} cannot be combined with SubSpec, whose "
            f"model runner vLLM builds through its own worker class ({ours}); drop "
            "--worker-cls (worker_extension_cls adds methods to SubSpec's worker)")
    parallel_config.worker_cls = ours


def _check_kernel_runs_here(options: SubSpecOptions, platform) -> None:
    device = "CPU" if platform.is_cpu() else "CUDA"
    runs_on = {"int4_cpu_dot": "CPU", "int4_cpu": "CPU", "gemlite": "CUDA"}.get(options.kernel)
    if runs_on not in (None, device):
        raise SubSpecConfigError(
            f"invalid speculative_config: kernel {options.kernel!r} runs on {runs_on} only, and "
            f"this engine runs on {device}; use kernel 'auto'")
    if options.kernel == "int4_cpu_dot":
        from vllm_subspec.draft_model.int4_dot_cpu import cpu_has_flags

        if not cpu_has_flags():
            raise SubSpecConfigError(
                "invalid speculative_config: kernel 'int4_cpu_dot' needs an x86 CPU with "
                "AVX512-BF16 (flags avx512f, avx512bw, avx512vl, avx512_bf16); 'int4_cpu' runs "
                "on any CPU")


def _refuse_micro_batching(parallel_config) -> None:
    """A tree plan is active in the thread that runs the forward; vLLM's micro-batching runs
    forwards in threads of its own, where tree rows would get causal attention."""
    if parallel_config.use_ubatching:
        raise SubSpecConfigError(
            "tree drafting does not support micro-batching (--enable-dbo / ubatch_size > 1); "
            "drop it or use tree_width=1")


def _offload_through_prefetch(engine_args, target_model_config,
                              options: SubSpecOptions) -> None:
    """`--cpu-offload-gb N` with the offload backend left to "auto": as much GPU memory left as
    UVA would leave, offloaded through vLLM's prefetch offloader (`prefetch_plan`), whose copies
    of the next verify's first layers run while the draft drafts. Kept as vLLM chooses: a
    mixture-of-experts target (UVA reads only routed experts), an explicit backend, any
    prefetch setting, a parameter filter, explicit `substitute_layers` that miss a layer the
    plan would stream, and a plan the model has too few layers for."""
    from vllm_subspec.vllm_hooks.prefetch_plan import (
        decoder_layer_bytes,
        plan_prefetch,
        substitute_share,
    )

    gb = engine_args.cpu_offload_gb or 0
    prefetch_set = engine_args.offload_group_size or engine_args.offload_num_in_group != 1 \
        or engine_args.offload_prefetch_step != 1
    if engine_args.offload_backend != "auto" or gb <= 0 or prefetch_set \
            or engine_args.cpu_offload_params or engine_args.offload_params:
        if engine_args.offload_backend == "uva" and gb > 0:
            logger.info("vllm-subspec: --offload-backend uva: the verify reads the offloaded "
                        "weights over PCIe inside its kernels and nothing overlaps drafting "
                        "(docs/gpu.md, 'Prefetch overlap')")
        return
    hf = target_model_config.hf_text_config
    archs = getattr(target_model_config.hf_config, "architectures", None) or []
    if any(a in SUPPORTED_MOE_ARCHITECTURES for a in archs):
        logger.info("vllm-subspec: --cpu-offload-gb %g stays on vLLM's UVA offloader for this "
                    "mixture-of-experts target: a step reads only the experts it routes to, "
                    "where prefetching would stream every expert of a layer every step "
                    "(docs/moe.md, 'Offload economics')", gb)
        return
    layers = options.substitute_layers
    # with "offloaded", each extra streamed layer adds its substitute back to the GPU
    share = substitute_share(options.bits, options.group_size) if layers == "offloaded" \
        else 0.0
    # --cpu-offload-gb is per GPU, and with tensor parallelism each GPU holds a 1/tp shard of
    # every layer
    tp = max(1, engine_args.tensor_parallel_size or 1)
    plan = plan_prefetch(hf.num_hidden_layers,
                         decoder_layer_bytes(hf, target_model_config.dtype.itemsize) // tp, gb,
                         share)
    if plan is None:
        logger.info("vllm-subspec: --cpu-offload-gb %g offloads about every decoder layer; it "
                    "stays on vLLM's UVA offloader (prefetch slots would not fit)", gb)
        return
    if isinstance(layers, tuple) and not set(plan.offloaded) <= set(layers):
        logger.info("vllm-subspec: --cpu-offload-gb %g stays on vLLM's UVA offloader: the "
                    "prefetch offloader would stream layers %s, which substitute_layers does "
                    "not substitute", gb, sorted(set(plan.offloaded) - set(layers)))
        return
    engine_args.offload_backend = "prefetch"
    engine_args.offload_group_size = plan.group_size
    engine_args.offload_num_in_group = plan.num_in_group
    engine_args.offload_prefetch_step = plan.prefetch_step
    engine_args.cpu_offload_gb = 0
    logger.info(plan.describe(gb))


def _require_offload(engine_args, options: SubSpecOptions) -> None:
    if options.substitute_layers != "offloaded":
        return  # explicit layers (or "all"): the user chose what the draft substitutes
    prefetch = engine_args.offload_backend in ("prefetch", "auto") and \
        (engine_args.offload_group_size or 0) > 0 and (engine_args.offload_num_in_group or 0) > 0
    uva = engine_args.offload_backend in ("uva", "auto") and (engine_args.cpu_offload_gb or 0) > 0
    if not (prefetch or uva):
        raise SubSpecConfigError(
            "nothing is offloaded (--cpu-offload-gb is 0 and no prefetch offload is set), so "
            "substitute_layers='offloaded' selects no layer and the draft would be the "
            "full-precision target: slower than plain decoding. Offload weights "
            "(e.g. --cpu-offload-gb 10), or set substitute_layers to 'all' or a list of layers")


def _no_placeholder_drafts(engine_args, options: SubSpecOptions,
                           target_parallel_config) -> None:
    """One batch-size schedule of the same budget for every batch size, so the scheduler does
    not pad: `Scheduler.schedule` pads a new request with one token to run (a prompt cached but
    for its last token) with `num_speculative_tokens` placeholder drafts, to keep decode
    batches uniform for full CUDA graphs, which a tree (PIECEWISE) or a CPU engine does not
    capture; SubSpec would verify them: 1 + 192 rows for nothing with the default budget. With
    the schedule set, vLLM would also turn a chain's full graphs off: CUDA chains keep the
    padding. vLLM drops schedules under data parallelism (with a warning): not set there."""
    if target_parallel_config.data_parallel_size == 1:
        engine_args.speculative_config["num_speculative_tokens_per_batch_size"] = [
            (1, 1, options.num_draft_tokens)]


def _drafts_with_samples(engine_args, parallel_config) -> None:
    """On a CPU vLLM runs its multiprocess executor (`CpuPlatform.check_and_update_config`
    turns "uni" into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0), whose engine core asks for
    each step's drafts in an RPC of its own (~0.25 ms a step on 2 cores); SubSpec's executor
    (executor.py) brings them with the sampled tokens. Not over several nodes (vLLM allows
    only its named backends there), nor with a KV or encoder-cache connector, KV offloading
    included (vLLM checks for "mp" by name there, and merges every worker's output); another
    backend a user names (ray, a class) stays."""
    import os

    backend = parallel_config.distributed_executor_backend
    multiprocess = backend == "mp" or (
        backend == "uni" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1")
    if not multiprocess or parallel_config.nnodes > 1 \
            or getattr(engine_args, "kv_transfer_config", None) is not None \
            or getattr(engine_args, "kv_offloading_size", None) is not None \
            or getattr(engine_args, "ec_transfer_config", None) is not None:
        return
    from vllm_subspec.vllm_hooks.executor import SubSpecMultiprocExecutor

    parallel_config.distributed_executor_backend = SubSpecMultiprocExecutor


def _no_async_scheduling(engine_args) -> None:
    """Every shape is verified by sample-then-match (`SampleMatchVerifier`), which reads the
    scheduled drafts and their counts on the host: async scheduling (on by default for
    draft_model, `VllmConfig.__post_init__`) makes both placeholders, and the runner's
    `num_computed_tokens_cpu`, the tree verify's root position, optimistic until corrected
    after the forward (`GPUModelRunner._update_states`)."""
    if engine_args.async_scheduling:
        raise SubSpecConfigError(
            "async scheduling is not supported by SubSpec (its verify reads the scheduled "
            "draft tokens on the host); drop --async-scheduling")
    if engine_args.async_scheduling is None:
        logger.info("vllm-subspec: async scheduling off (the verify reads the scheduled draft "
                    "tokens on the host, which async scheduling leaves as placeholders)")
    engine_args.async_scheduling = False


def _pin_flash_attention(engine_args, target_model_config, platform) -> None:
    """Trees run FLASH_ATTN: the ancestor-only mask is applied in `FlashAttentionImpl.forward`
    only (patches.py); another backend (FlashInfer is Blackwell's default,
    `vllm.platforms.cuda._get_backend_priorities`) would run causal attention over the tree."""
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    flash = AttentionBackendEnum.FLASH_ATTN
    # vLLM's own parser of the option ("auto" -> None, names -> enum), as
    # `EngineArgs.create_engine_config` applies it
    chosen = AttentionConfig.validate_backend_before(engine_args.attention_backend) \
        or engine_args.attention_config.backend
    if chosen is not None and chosen != flash:
        raise SubSpecConfigError(
            f"tree drafting needs the FLASH_ATTN attention backend (the tree mask lives there), "
            f"got {chosen.name}; drop the attention backend option or use tree_width=1")
    if getattr(engine_args.attention_config, "backend_per_kind", None):
        raise SubSpecConfigError(
            "attention_config.backend_per_kind is not supported with tree drafting (every "
            "decoder layer must run FLASH_ATTN); drop it or use tree_width=1")
    # The call the worker's backend selector makes (`CudaPlatformBase.get_attn_backend_cls`): it
    # refuses GPUs, dtypes and head sizes FlashAttention cannot run, now rather than at model load.
    selector = AttentionSelectorConfig(
        head_size=target_model_config.get_head_size(), dtype=target_model_config.dtype,
        kv_cache_dtype=resolved_kv_cache_dtype(engine_args, target_model_config),
        block_size=engine_args.block_size)
    try:
        platform.get_attn_backend_cls(flash, selector, num_heads=None)
    except ValueError as e:
        raise SubSpecConfigError(
            f"tree drafting on CUDA runs FlashAttention, which cannot run this configuration "
            f"({e}); use dtype bfloat16/float16 on an Ampere or newer GPU, or tree_width=1"
        ) from e
    if chosen is None:
        if engine_args.attention_config.backend is None:
            engine_args.attention_backend = flash
        logger.info("vllm-subspec: attention backend pinned to FLASH_ATTN for tree drafting")


def resolved_kv_cache_dtype(engine_args, target_model_config) -> str:
    """The KV cache dtype vLLM will use: "auto" can resolve to a checkpoint's own KV
    quantization (`vllm.utils.torch_utils.resolve_kv_cache_dtype_string`, which
    `EngineArgs.create_engine_config` calls)."""
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    return resolve_kv_cache_dtype_string(engine_args.kv_cache_dtype, target_model_config)


def _refuse_unreadable_kv(engine_args, target_model_config) -> None:
    # vllm.v1.kv_cache_interface's version: vllm.utils.torch_utils' is gone in 0.33
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    kv_dtype = resolved_kv_cache_dtype(engine_args, target_model_config)
    if is_quantized_kv_cache(kv_dtype):
        raise SubSpecConfigError(
            f"kv_cache_dtype {kv_dtype!r} is not supported with tree drafting (the tree "
            "attention reads the cache without quantization scales); use kv_cache_dtype 'auto' "
            "(unquantized) or tree_width=1")
    window = sliding_window_of(target_model_config.hf_text_config)
    if window is not None:
        raise SubSpecConfigError(
            f"the target uses sliding-window attention (window {window}), which tree drafting "
            "does not support (blocks outside the window can be freed); use tree_width=1")


def check_final_config(vllm_config, options: SubSpecOptions, platform) -> None:
    """Checked in each worker on the resolved config: options applied after our front-end rule
    can still put attention inside CUDA graphs, where the tree mask would be skipped:
    `pass_config.fuse_attn_quant` (turns PIECEWISE into FULL,
    `CompilationConfig.set_splitting_ops_for_attn_fusion`), a user `splitting_ops` list without
    the attention op, or breakable CUDA graphs (which also wrap the drafter,
    `GPUModelRunner.load_model`)."""
    if not (options.is_tree and platform.is_cuda_alike()):
        return
    import vllm.envs as envs
    from vllm.config import CUDAGraphMode

    cc = vllm_config.compilation_config
    attention_outside = cc.cudagraph_mode == CUDAGraphMode.NONE or (
        cc.cudagraph_mode == CUDAGraphMode.PIECEWISE and cc.is_attention_compiled_piecewise())
    if not attention_outside or envs.VLLM_USE_BREAKABLE_CUDAGRAPH:
        raise SubSpecConfigError(
            f"tree drafting needs attention outside CUDA graphs, but this configuration "
            f"(cudagraph_mode {cc.cudagraph_mode.name}, splitting_ops {cc.splitting_ops}, "
            f"breakable graphs {bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)}) captures it; drop "
            "fuse_attn_quant / custom splitting_ops / VLLM_USE_BREAKABLE_CUDAGRAPH, or use "
            "tree_width=1")


def sliding_window_of(hf_text_config) -> int | None:
    """The window of a target whose layers really use one. Per-layer `layer_types` decide when
    present (vLLM's `LlamaAttention.__init__` reads them); else the config's `sliding_window`, which
    transformers sets to None for Qwen2 when `use_sliding_window` is false."""
    window = getattr(hf_text_config, "sliding_window", None)
    layer_types = getattr(hf_text_config, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    return window


def tree_cudagraph_mode(requested):
    """Trees need PIECEWISE CUDA graphs: attention must run outside the graphs, since the tree
    mask is applied in the attention backend's Python forward, which a FULL graph's replay
    would skip. vLLM makes the same override for KV connectors (`VllmConfig.__post_init__`)."""
    from vllm.config import CUDAGraphMode

    if requested is not None and not requested.has_full_cudagraphs():
        return requested  # NONE or PIECEWISE: already safe
    if requested is not None:
        logger.warning("vllm-subspec: tree drafting needs attention outside CUDA graphs; "
                       "cudagraph_mode %s -> PIECEWISE", requested.name)
    return CUDAGraphMode.PIECEWISE
