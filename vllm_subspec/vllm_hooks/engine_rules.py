"""How a `{"method": "subspec"}` request becomes a vLLM engine configuration, before it starts.

`translate_speculative_config` turns the user's JSON into vLLM's draft_model config (the draft is
the target) plus `additional_config["subspec"]`; `apply_platform_rules` then sets or refuses the
engine arguments SubSpec depends on. Both run in the front end inside
`EngineArgs.create_speculative_config` (patches.py), which `EngineArgs.create_engine_config`
calls before it builds the SchedulerConfig, AttentionConfig and CompilationConfig from those
arguments. Every refusal is one `SubSpecConfigError`, raised before any weight is loaded; each
worker re-checks the resolved config (`check_final_config`). The functions here gather the facts
from vLLM's config objects; the refusals' conditions and messages are refusals.py's. The rules
and why: docs/gpu.md, "CUDA configuration rules".
"""

from __future__ import annotations

import logging

from vllm_subspec import architectures, refusals
from vllm_subspec.config import (
    ADDITIONAL_CONFIG_KEY,
    SubSpecOptions,
    check_target_supported,
    check_tensor_parallel_shards,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


def translate_speculative_config(
    spec: dict, additional_config: dict | None, target_model_config, target_parallel_config
) -> tuple[dict, dict, SubSpecOptions]:
    """`method` is a pydantic Literal, so "subspec" cannot reach SpeculativeConfig. Validate the
    SubSpec keys, move them to additional_config["subspec"] (which reaches every process), and
    hand vLLM a draft_model config whose "draft" is the target: that gives SubSpec lookahead KV
    slots and the GPU-token drafting path (the verify is SubSpec's `SampleMatchVerifier`, in the
    runner's rejection-sampler slot, for chains and trees alike)."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    spec.pop("method")
    model = spec.pop("model", None)
    options = SubSpecOptions.from_dict(spec)  # rejects unknown keys
    target = target_model_config.model
    refusals.refuse_draft_model(model, target)
    check_target_supported(
        target_model_config.hf_config,
        target_parallel_config.pipeline_parallel_size,
        options.bits,
    )
    check_tensor_parallel_shards(
        target_model_config.hf_config,
        target_parallel_config.tensor_parallel_size,
        options.group_size,
    )
    refusals.refuse_quantized_target(getattr(target_model_config, "quantization", None))
    refusals.refuse_logprobs_mode(str(target_model_config.logprobs_mode))
    import vllm.envs as envs

    refusals.refuse_v2_model_runner(bool(envs.VLLM_USE_V2_MODEL_RUNNER))
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


def apply_platform_rules(
    engine_args, options: SubSpecOptions, target_model_config, target_parallel_config, platform
) -> None:
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
    _refuse_shared_head_starts(engine_args, options, target_model_config, target_parallel_config)
    _offload_through_prefetch(engine_args, target_model_config, options)
    _require_offload(engine_args, options)
    _no_async_scheduling(engine_args)
    if not options.is_tree:
        return
    _pin_flash_attention(engine_args, target_model_config, platform)
    engine_args.compilation_config.cudagraph_mode = tree_cudagraph_mode(
        engine_args.compilation_config.cudagraph_mode
    )


def _refuse_context_parallel(parallel_config) -> None:
    """Context parallelism splits a request's KV positions over the ranks; the draft's KV moves
    and the tree's gather read every position of a rank's heads from its own cache."""
    refusals.refuse_context_parallel(
        getattr(parallel_config, "decode_context_parallel_size", 1),
        getattr(parallel_config, "prefill_context_parallel_size", 1),
    )


def _refuse_moe_extras(engine_args, target_model_config, target_parallel_config) -> None:
    """A MoE target's draft routes with the target's router and runs a `MoERunner`'s place:
    what re-wires or records that routing is not served (docs/moe.md)."""
    if not architectures.is_moe(target_model_config.hf_config):
        return
    refusals.refuse_moe_extras(
        getattr(engine_args, "enable_lora", False),
        target_parallel_config.enable_expert_parallel,
        target_parallel_config.enable_eplb,
        target_parallel_config.data_parallel_size,
        getattr(engine_args, "enable_return_routed_experts", False),
    )


def _refuse_shared_head_starts(
    engine_args, options: SubSpecOptions, target_model_config, target_parallel_config
) -> None:
    """On CUDA head starts draft on a stream of their own beside the verify: nothing the two
    share may be written by both (step/head_start.py). A MoE target's fused experts take their
    scratch from one global workspace, tensor parallelism runs collectives on shared
    communicators (two in flight from two streams can deadlock), and a KV connector moves KV
    on its own schedule."""
    refusals.refuse_shared_head_starts(
        options.head_start_levels,
        architectures.is_moe(target_model_config.hf_config),
        target_parallel_config.tensor_parallel_size,
        getattr(engine_args, "kv_transfer_config", None) is not None,
    )


def subspec_worker_cls(platform) -> str:
    """The worker class vLLM builds SubSpec's model runner through (runner.py)."""
    if platform.is_cpu():
        return "vllm_subspec.vllm_hooks.cpu_runner.SubSpecCPUWorker"
    return "vllm_subspec.vllm_hooks.runner.SubSpecGPUWorker"


def _use_subspec_worker(parallel_config, platform) -> None:
    ours = subspec_worker_cls(platform)
    refusals.refuse_worker_cls(parallel_config.worker_cls, ours)
    parallel_config.worker_cls = ours


def _check_kernel_runs_here(options: SubSpecOptions, platform) -> None:
    refusals.refuse_kernel_device(options.kernel, "CPU" if platform.is_cpu() else "CUDA")
    if options.kernel == "int4_cpu_dot":
        from vllm_subspec.draft_model.int4_dot_cpu import cpu_has_flags

        refusals.refuse_int4_cpu_dot(cpu_has_flags())


def _refuse_micro_batching(parallel_config) -> None:
    """A tree plan is active in the thread that runs the forward; vLLM's micro-batching runs
    forwards in threads of its own, where tree rows would get causal attention."""
    refusals.refuse_micro_batching(parallel_config.use_ubatching)


def _offload_through_prefetch(engine_args, target_model_config, options: SubSpecOptions) -> None:
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
    prefetch_set = (
        engine_args.offload_group_size
        or engine_args.offload_num_in_group != 1
        or engine_args.offload_prefetch_step != 1
    )
    if (
        engine_args.offload_backend != "auto"
        or gb <= 0
        or prefetch_set
        or engine_args.cpu_offload_params
        or engine_args.offload_params
    ):
        if engine_args.offload_backend == "uva" and gb > 0:
            logger.info(
                "vllm-subspec: --offload-backend uva: the verify reads the offloaded "
                "weights over PCIe inside its kernels and nothing overlaps drafting "
                "(docs/gpu.md, 'Prefetch overlap')"
            )
        return
    hf = target_model_config.hf_text_config
    if architectures.is_moe(target_model_config.hf_config):
        logger.info(
            "vllm-subspec: --cpu-offload-gb %g stays on vLLM's UVA offloader for this "
            "mixture-of-experts target: a step reads only the experts it routes to, "
            "where prefetching would stream every expert of a layer every step "
            "(docs/moe.md, 'Offload economics')",
            gb,
        )
        return
    layers = options.substitute_layers
    # with "offloaded", each extra streamed layer adds its substitute back to the GPU
    share = substitute_share(options.bits, options.group_size) if layers == "offloaded" else 0.0
    # --cpu-offload-gb is per GPU, and with tensor parallelism each GPU holds a 1/tp shard of
    # every layer
    tp = max(1, engine_args.tensor_parallel_size or 1)
    plan = plan_prefetch(
        hf.num_hidden_layers,
        decoder_layer_bytes(hf, target_model_config.dtype.itemsize) // tp,
        gb,
        share,
    )
    if plan is None:
        logger.info(
            "vllm-subspec: --cpu-offload-gb %g offloads about every decoder layer; it "
            "stays on vLLM's UVA offloader (prefetch slots would not fit)",
            gb,
        )
        return
    if isinstance(layers, tuple) and not set(plan.offloaded) <= set(layers):
        logger.info(
            "vllm-subspec: --cpu-offload-gb %g stays on vLLM's UVA offloader: the "
            "prefetch offloader would stream layers %s, which substitute_layers does "
            "not substitute",
            gb,
            sorted(set(plan.offloaded) - set(layers)),
        )
        return
    engine_args.offload_backend = "prefetch"
    engine_args.offload_group_size = plan.group_size
    engine_args.offload_num_in_group = plan.num_in_group
    engine_args.offload_prefetch_step = plan.prefetch_step
    engine_args.cpu_offload_gb = 0
    logger.info(plan.describe(gb))


def _require_offload(engine_args, options: SubSpecOptions) -> None:
    refusals.refuse_nothing_offloaded(
        options.substitute_layers,
        engine_args.offload_backend,
        engine_args.offload_group_size,
        engine_args.offload_num_in_group,
        engine_args.cpu_offload_gb,
    )


def _no_placeholder_drafts(engine_args, options: SubSpecOptions, target_parallel_config) -> None:
    """One batch-size schedule of the same budget for every batch size, so the scheduler does
    not pad: `Scheduler.schedule` pads a new request with one token to run (a prompt cached but
    for its last token) with `num_speculative_tokens` placeholder drafts, to keep decode
    batches uniform for full CUDA graphs, which a tree (PIECEWISE) or a CPU engine does not
    capture; SubSpec would verify them: 1 + 192 rows for nothing with the default budget. With
    the schedule set, vLLM would also turn a chain's full graphs off: CUDA chains keep the
    padding. vLLM drops schedules under data parallelism (with a warning): not set there."""
    if target_parallel_config.data_parallel_size == 1:
        engine_args.speculative_config["num_speculative_tokens_per_batch_size"] = [
            (1, 1, options.num_draft_tokens)
        ]


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
        backend == "uni" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
    )
    if (
        not multiprocess
        or parallel_config.nnodes > 1
        or getattr(engine_args, "kv_transfer_config", None) is not None
        or getattr(engine_args, "kv_offloading_size", None) is not None
        or getattr(engine_args, "ec_transfer_config", None) is not None
    ):
        return
    from vllm_subspec.vllm_hooks.executor import SubSpecMultiprocExecutor

    parallel_config.distributed_executor_backend = SubSpecMultiprocExecutor


def _no_async_scheduling(engine_args) -> None:
    """Every shape is verified by sample-then-match (`SampleMatchVerifier`), which reads the
    scheduled drafts and their counts on the host: async scheduling (on by default for
    draft_model, `VllmConfig.__post_init__`) makes both placeholders, and the runner's
    `num_computed_tokens_cpu`, the tree verify's root position, optimistic until corrected
    after the forward (`GPUModelRunner._update_states`)."""
    refusals.refuse_async_scheduling(engine_args.async_scheduling)
    if engine_args.async_scheduling is None:
        logger.info(
            "vllm-subspec: async scheduling off (the verify reads the scheduled draft "
            "tokens on the host, which async scheduling leaves as placeholders)"
        )
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
    chosen = (
        AttentionConfig.validate_backend_before(engine_args.attention_backend)
        or engine_args.attention_config.backend
    )
    refusals.refuse_attention_backend(None if chosen is None else chosen.name)
    refusals.refuse_backend_per_kind(
        getattr(engine_args.attention_config, "backend_per_kind", None)
    )
    # The call the worker's backend selector makes (`CudaPlatformBase.get_attn_backend_cls`): it
    # refuses GPUs, dtypes and head sizes FlashAttention cannot run, now rather than at model load.
    selector = AttentionSelectorConfig(
        head_size=target_model_config.get_head_size(),
        dtype=target_model_config.dtype,
        kv_cache_dtype=resolved_kv_cache_dtype(engine_args, target_model_config),
        block_size=engine_args.block_size,
    )
    try:
        platform.get_attn_backend_cls(flash, selector, num_heads=None)
    except ValueError as e:
        refusals.refuse_flash_attention_config(e)
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
    refusals.refuse_quantized_kv_cache(kv_dtype, is_quantized_kv_cache(kv_dtype))
    refusals.refuse_sliding_window(sliding_window_of(target_model_config.hf_text_config))


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
        cc.cudagraph_mode == CUDAGraphMode.PIECEWISE and cc.is_attention_compiled_piecewise()
    )
    refusals.refuse_attention_in_cuda_graphs(
        attention_outside,
        bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH),
        cc.cudagraph_mode.name,
        cc.splitting_ops,
    )


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
        logger.warning(
            "vllm-subspec: tree drafting needs attention outside CUDA graphs; "
            "cudagraph_mode %s -> PIECEWISE",
            requested.name,
        )
    return CUDAGraphMode.PIECEWISE
