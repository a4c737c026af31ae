"""What SubSpec refuses, and why: every refusal's condition and message, in three sections:
start-up (the options, the target, the engine configuration: before any weight is loaded), per
request (a request vLLM would accept with speculative decoding), at load (what only the loaded
target tells). Callers gather the facts (from vLLM's config objects, the model, sizes) and call
the function here, which raises (`SubSpecConfigError`, or the error the caller raised before)
or, per request, returns the reason. `REFUSALS` names each one; docs/configuration.md ("What
SubSpec refuses") lists them from it (`markdown_table`), and tests/unit/test_refusals.py keeps
the two equal and every refusal message in this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_subspec import architectures

GiB = 2**30


class SubSpecConfigError(ValueError):
    """A bad SubSpec configuration. Raised before the engine starts (or, for what only the
    loaded target tells, while it loads)."""

    def __init__(self, message: str):
        super().__init__(f"vllm-subspec: {message}")


@dataclass(frozen=True)
class Refusal:
    id: str
    when: str  # one of WHEN
    why: str  # what is refused, and why, in one line


WHEN = ("start-up", "per request", "at load")
_S, _R, _L = WHEN

REFUSALS: tuple[Refusal, ...] = (
    # ---- start-up: the options
    Refusal("unknown-key", _S, "a speculative_config key SubSpec does not define"),
    Refusal(
        "option-value",
        _S,
        "an option value out of its domain or combined with one it "
        "contradicts (every problem listed at once)",
    ),
    Refusal("tree-too-large", _S, "tree_width x tree_depth over the tree's node bound"),
    Refusal(
        "head-start-slots",
        _S,
        "head_start_levels needing more KV slots past a verify than vLLM reserves for the tree",
    ),
    Refusal("draft-model-given", _S, "a 'model' key: the draft is the target itself"),
    # ---- start-up: the target
    Refusal(
        "architecture", _S, "an architecture no family in vllm_subspec/architectures.py serves"
    ),
    Refusal(
        "moe-settings-on-dense",
        _S,
        "a dense architecture name over a checkpoint with mixture-of-experts settings",
    ),
    Refusal(
        "substituted-experts",
        _S,
        "a MoE checkpoint whose pruned experts are constants "
        "remapped inside vLLM's kernel, which the expert substitutes do not follow",
    ),
    Refusal(
        "moe-bits-on-cuda",
        _S,
        "a MoE target on CUDA with bits other than 4 (the routed experts' Triton kernel is 4-bit)",
    ),
    Refusal(
        "pipeline-parallel",
        _S,
        "pipeline parallelism: the draft's passes run every layer on one stage",
    ),
    Refusal(
        "tensor-parallel-shards",
        _S,
        "a tensor-parallel shard of a row-parallel linear that is not whole quantization groups",
    ),
    Refusal(
        "quantized-target",
        _S,
        "a quantized target: substitutes are built from full-precision weights",
    ),
    Refusal(
        "processed-logprobs",
        _S,
        "logprobs_mode processed_*: the verify reports the target's raw logprobs",
    ),
    Refusal(
        "v2-model-runner", _S, "VLLM_USE_V2_MODEL_RUNNER: SubSpec runs on vLLM's V1 model runner"
    ),
    # ---- start-up: the engine
    Refusal(
        "worker-class",
        _S,
        "another worker_cls: vLLM builds SubSpec's runner through SubSpec's worker",
    ),
    Refusal("kernel-device", _S, "a substitute kernel that does not run on this engine's device"),
    Refusal("int4-cpu-dot-flags", _S, "kernel int4_cpu_dot on a CPU without AVX512-BF16"),
    Refusal(
        "moe-extras",
        _S,
        "a MoE target with LoRA, expert parallelism, EPLB, data "
        "parallelism or routed-expert recording, which re-wire or record its routing",
    ),
    Refusal(
        "context-parallel",
        _S,
        "context parallelism: each rank must hold every position of its KV heads",
    ),
    Refusal(
        "quantized-kv-cache",
        _S,
        "a tree with a quantized KV cache: the tree attention reads it without scales",
    ),
    Refusal(
        "sliding-window",
        _S,
        "a tree over sliding-window attention: blocks outside the window can be freed",
    ),
    Refusal(
        "micro-batching",
        _S,
        "a tree with micro-batching: its threads would run tree rows with causal attention",
    ),
    Refusal(
        "shared-head-starts",
        _S,
        "head starts on CUDA beside a MoE target, tensor "
        "parallelism or a KV connector, which the verify's stream shares",
    ),
    Refusal(
        "nothing-offloaded",
        _S,
        "substitute_layers 'offloaded' on CUDA with nothing "
        "offloaded: the draft would be the full-precision target",
    ),
    Refusal(
        "async-scheduling",
        _S,
        "async scheduling: the verify reads the scheduled drafts on the host",
    ),
    Refusal(
        "attention-backend",
        _S,
        "a tree on CUDA with a backend other than FLASH_ATTN, where the tree mask lives",
    ),
    Refusal(
        "backend-per-kind",
        _S,
        "a tree with attention_config.backend_per_kind: every layer must run FLASH_ATTN",
    ),
    Refusal(
        "flash-attention-unsupported",
        _S,
        "a tree on CUDA where FlashAttention cannot run (GPU, dtype, head size)",
    ),
    Refusal(
        "attention-in-cuda-graphs",
        _S,
        "a tree on CUDA whose resolved config (each "
        "worker) captures attention in CUDA graphs, which would skip the tree mask",
    ),
    # ---- per request
    Refusal(
        "thinking-token-budget",
        _R,
        "thinking_token_budget: its forced end is applied by "
        "vLLM's samplers, which the verify replaces",
    ),
    Refusal(
        "logprob-token-ids", _R, "logprob_token_ids: a verified step reports top-k logprobs only"
    ),
    Refusal(
        "whole-vocabulary-logprobs", _R, "logprobs=-1: a verified step reports top-k logprobs only"
    ),
    # ---- at load
    Refusal("layers-out-of-range", _L, "substitute_layers naming a layer the model lacks"),
    Refusal(
        "streamed-layer-unsubstituted",
        _L,
        "a layer the prefetch offloader streams left "
        "out of substitute_layers: the draft would run its prefetch hooks",
    ),
    Refusal(
        "cpu-draft-memory",
        _L,
        "on the CPU backend, substitutes that leave the KV cache no "
        "room for one max_model_len request (nothing built)",
    ),
    Refusal(
        "cpu-kv-memory",
        _L,
        "on the CPU backend, a KV cache that cannot hold one "
        "max_model_len request once the draft is built, dense twins dropped",
    ),
    Refusal(
        "cpu-kv-layout",
        _L,
        "a tree on a CPU attention ISA whose KV layout the tree attention cannot read back",
    ),
)


def markdown_table() -> str:
    """The refusals as docs/configuration.md lists them."""
    rows = ["| id | when | what is refused, and why |", "|---|---|---|"]
    rows += [f"| `{r.id}` | {r.when} | {r.why} |" for r in REFUSALS]
    return "\n".join(rows)


# =============================================================================================
# Start-up: the options (`SubSpecOptions.from_dict`)
# =============================================================================================
AUTO = "auto"  # a shape option left to the shape tuner
SUBSTITUTE_LAYER_MODES = ("offloaded", "all")
BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128, 256)
KERNELS = ("auto", "int4_cpu_dot", "int4_cpu", "gemlite", "reference")
QUANTIZERS = ("hqq", "rtn")
DRAFT_LM_HEADS = ("auto", "quantized", "target")
MAX_DEPTH = 64
MAX_WIDTH = 16
MAX_TREE_NODES = 512


def refuse_unknown_keys(unknown: list[str], known: set[str]) -> None:
    if unknown:
        raise SubSpecConfigError(
            f"unknown speculative_config key(s) {unknown} for method 'subspec'; "
            f"valid keys: {sorted(known | {'method'})}"
        )


def refuse_option_values(raw: dict[str, Any]) -> None:
    problems = option_problems(raw)
    if problems:
        raise SubSpecConfigError("invalid speculative_config: " + "; ".join(problems))


def option_problems(raw: dict[str, Any]) -> list[str]:
    """Every problem with the user's (raw) SubSpec keys."""
    p = []
    get = raw.get
    for name, hi in (
        ("num_speculative_tokens", MAX_DEPTH),
        ("tree_depth", MAX_DEPTH),
        ("tree_width", MAX_WIDTH),
    ):
        v = get(name)
        if (
            v is not None
            and not (name != "num_speculative_tokens" and v == AUTO)
            and (not _is_int(v) or not 1 <= v <= hi)
        ):
            auto = "" if name == "num_speculative_tokens" else f' or "{AUTO}"'
            p.append(f"{name} must be an integer in [1, {hi}]{auto}, got {v!r}")
    levels = get("head_start_levels", 0)
    if not _is_int(levels) or not 0 <= levels <= MAX_DEPTH:
        p.append(f"head_start_levels must be an integer in [0, {MAX_DEPTH}], got {levels!r}")
    elif levels and (get("tree_width") == 1 or get("num_speculative_tokens") is not None):
        p.append(
            'head_start_levels needs a tree (tree_width > 1 or "auto"): a chain has no '
            "KV slots to spare past its verify"
        )
    max_depth = get("max_tree_depth")
    if max_depth is not None:
        if not _is_int(max_depth) or not 1 <= max_depth <= MAX_DEPTH:
            p.append(f"max_tree_depth must be an integer in [1, {MAX_DEPTH}], got {max_depth!r}")
        elif (
            get("tree_depth") not in (None, AUTO)
            or get("tree_width") == 1
            or get("num_speculative_tokens") is not None
        ):
            p.append(
                'max_tree_depth bounds "tree_depth": "auto" only; a fixed tree_depth or a '
                "chain drafts exactly its depth"
            )
    if get("num_speculative_tokens") is not None and (
        get("tree_depth") is not None or get("tree_width") not in (None, 1)
    ):
        p.append(
            "num_speculative_tokens is the chain depth (tree_width=1); for a tree give "
            "tree_width and tree_depth instead"
        )
    layers = get("substitute_layers", "offloaded")
    if isinstance(layers, (list, tuple)):
        if not all(_is_int(i) and i >= 0 for i in layers):
            p.append(f"substitute_layers must list non-negative layer indices, got {layers!r}")
        elif len(set(layers)) != len(layers):
            p.append(f"substitute_layers has duplicate indices: {layers!r}")
    elif layers not in SUBSTITUTE_LAYER_MODES:
        p.append(
            f"substitute_layers must be one of {list(SUBSTITUTE_LAYER_MODES)} or a list of "
            f"layer indices, got {layers!r}"
        )
    bits, group_size = get("bits", 4), get("group_size", 64)
    if bits not in BITS or not _is_int(bits):
        p.append(f"bits must be one of {list(BITS)}, got {bits!r}")
    if group_size not in GROUP_SIZES or not _is_int(group_size):
        p.append(f"group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
    t = get("draft_temperature", 0.2)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 10:
        p.append(f"draft_temperature must be a number in (0, 10], got {t!r}")
    kernel = get("kernel", "auto")
    if kernel not in KERNELS:
        p.append(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
    elif kernel in ("int4_cpu", "int4_cpu_dot") and bits != 4:
        p.append(f"kernel {kernel!r} needs bits=4, got bits={bits}")
    elif kernel == "gemlite" and bits != 4:
        p.append(f"kernel 'gemlite' is wired for bits=4 only, got bits={bits}")
    c = get("substitute_cache")
    if not (c is None or isinstance(c, bool) or (isinstance(c, str) and c.strip())):
        p.append(f"substitute_cache must be true, false or a folder path, got {c!r}")
    if get("draft_lm_head", AUTO) not in DRAFT_LM_HEADS:
        p.append(
            f"draft_lm_head must be one of {list(DRAFT_LM_HEADS)}, got {get('draft_lm_head')!r}"
        )
    m = get("cpu_draft_memory", 0.4)
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 4:
        p.append(
            f"cpu_draft_memory must be a number in [0, 4] (a fraction of the target's "
            f"weight bytes), got {m!r}"
        )
    if get("quantizer", "hqq") not in QUANTIZERS:
        p.append(f"quantizer must be one of {list(QUANTIZERS)}, got {get('quantizer')!r}")
    return p


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def refuse_tree_size(width: int, depth: int) -> None:
    if width * depth > MAX_TREE_NODES:
        raise SubSpecConfigError(
            f"invalid speculative_config: tree_width * tree_depth must be at most "
            f"{MAX_TREE_NODES}, got {width} * {depth}"
        )


def refuse_head_start_slots(levels: int, k: int, d: int) -> None:
    """vLLM reserves k * D slots past a verify; a head start needs its branch (up to D nodes),
    the leaf, the predicted root and levels - 1 levels of k there."""
    if levels and d + 2 + (levels - 1) * k > k * d:
        raise SubSpecConfigError(
            f"invalid speculative_config: head_start_levels {levels} needs "
            f"{d + 2 + (levels - 1) * k} KV slots past a verify of a {k} x {d} tree, which "
            f"reserves {k * d}; lower head_start_levels or deepen the tree"
        )


def refuse_draft_model(model: str | None, target: str) -> None:
    if model is not None and model != target:
        raise SubSpecConfigError(
            f"'model' must be omitted for method 'subspec' (the draft is the target {target!r} "
            f"itself), got {model!r}"
        )


# =============================================================================================
# Start-up: the target
# =============================================================================================
def refuse_target(
    hf_config: Any, pipeline_parallel_size: int, bits: int, on_cpu: Callable[[], bool]
) -> None:
    """Targets SubSpec cannot draft for (bits: the substitutes'; on_cpu: () -> whether vLLM
    runs on its CPU backend, asked only where it decides)."""
    archs = architectures.architectures_of(hf_config)
    moe = [a for a in archs if a in architectures.MOE_ARCHITECTURES]
    if not moe and not any(a in architectures.DENSE_ARCHITECTURES for a in archs):
        raise SubSpecConfigError(
            f"unsupported architecture {archs}; SubSpec supports dense decoder-only models "
            f"{sorted(architectures.DENSE_ARCHITECTURES)} and mixture-of-experts models "
            f"{sorted(architectures.MOE_ARCHITECTURES)}"
        )
    if not moe and any(getattr(hf_config, k, None) for k in architectures.MOE_CONFIG_KEYS):
        raise SubSpecConfigError(
            f"this {archs} checkpoint has mixture-of-experts settings; SubSpec supports "
            f"mixture-of-experts models {sorted(architectures.MOE_ARCHITECTURES)}"
        )
    transform = getattr(hf_config, "compression_config", None) or {}
    transform = transform.get("transform_config") if isinstance(transform, Mapping) else None
    if moe and (
        getattr(hf_config, "approximate_experts", None)
        or (isinstance(transform, Mapping) and transform.get("expert_substitution"))
    ):
        raise SubSpecConfigError(
            f"this {moe[0]} checkpoint replaces pruned experts by constants (approximate_experts "
            "/ expert_substitution, vLLM 0.33's `fused_moe/expert_substitution.py`): its "
            "expert weights are stored compacted and remapped inside vLLM's kernel, which "
            "SubSpec's expert substitutes do not follow. Serve it without --speculative-config"
        )
    if moe and bits != 4 and not on_cpu():
        raise SubSpecConfigError(
            f"mixture-of-experts targets ({moe[0]}) run with SubSpec on CUDA with 4-bit "
            f"substitutes (the routed experts' Triton kernel, docs/moe.md), not bits={bits}; "
            "use bits=4"
        )
    if pipeline_parallel_size != 1:
        raise SubSpecConfigError(
            f"SubSpec does not run with pipeline parallelism (pipeline_parallel_size "
            f"{pipeline_parallel_size}): the draft's passes run every layer on one stage. Use "
            "tensor parallelism (--tensor-parallel-size) instead"
        )


def refuse_tensor_parallel_shards(
    widths: dict[str, int], tensor_parallel_size: int, group_size: int
) -> None:
    """Each rank quantizes its shard of the row-parallel linears (`widths`: their full input
    widths, `architectures.tp_shard_widths`) in groups of `group_size` along their input."""
    bad = {
        name: width // tensor_parallel_size
        for name, width in widths.items()
        if width and (width // tensor_parallel_size) % group_size
    }
    if bad:
        raise SubSpecConfigError(
            f"with tensor_parallel_size {tensor_parallel_size}, each rank's shard of "
            + ", ".join(f"{n} ({w} inputs)" for n, w in bad.items())
            + f" is not a whole number of group_size {group_size} groups; choose a "
            "group_size dividing it (e.g. 32), or another tensor_parallel_size"
        )


def refuse_quantized_target(quantization: str | None) -> None:
    if quantization is not None:
        raise SubSpecConfigError(
            f"the target is quantized ({quantization!r}); SubSpec builds its substitutes from "
            "full-precision linear weights (bf16/fp16/fp32), which a quantized layer does not "
            "keep. Serve the unquantized checkpoint, or drop --speculative-config"
        )


def refuse_logprobs_mode(logprobs_mode: str) -> None:
    if logprobs_mode.startswith("processed"):
        raise SubSpecConfigError(
            f"logprobs_mode {logprobs_mode!r} is not supported by SubSpec (raw_logprobs and "
            "raw_logits are): its verify reports the target's raw logprobs of each emitted "
            "token, as a plain engine's default mode does"
        )


def refuse_v2_model_runner(use_v2_model_runner: bool) -> None:
    if use_v2_model_runner:
        raise SubSpecConfigError(
            "SubSpec needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
        )


# =============================================================================================
# Start-up: the engine configuration (vllm_hooks/engine_rules.py gathers the facts)
# =============================================================================================
def refuse_worker_cls(worker_cls: str, ours: str) -> None:
    if worker_cls not in ("auto", ours):
        raise SubSpecConfigError(
            f"worker_cls {worker_cls!r} cannot be combined with SubSpec, whose "
            f"model runner vLLM builds through its own worker class ({ours}); drop "
            "--worker-cls (worker_extension_cls adds methods to SubSpec's worker)"
        )


def refuse_kernel_device(kernel: str, device: str) -> None:
    """device: "CPU" or "CUDA", where this engine runs."""
    runs_on = {"int4_cpu_dot": "CPU", "int4_cpu": "CPU", "gemlite": "CUDA"}.get(kernel)
    if runs_on not in (None, device):
        raise SubSpecConfigError(
            f"invalid speculative_config: kernel {kernel!r} runs on {runs_on} only, and "
            f"this engine runs on {device}; use kernel 'auto'"
        )


def refuse_int4_cpu_dot(cpu_has_flags: bool) -> None:
    if not cpu_has_flags:
        raise SubSpecConfigError(
            "invalid speculative_config: kernel 'int4_cpu_dot' needs an x86 CPU with "
            "AVX512-BF16 (flags avx512f, avx512bw, avx512vl, avx512_bf16); 'int4_cpu' runs "
            "on any CPU"
        )


def refuse_moe_extras(
    enable_lora: bool,
    expert_parallel: bool,
    eplb: bool,
    data_parallel_size: int,
    return_routed_experts: bool,
) -> None:
    """A MoE target's draft routes with the target's router and runs a `MoERunner`'s place:
    what re-wires or records that routing is not served (docs/moe.md)."""
    extras = {
        "--enable-lora (vLLM wraps the experts for LoRA)": enable_lora,
        "--enable-expert-parallel": expert_parallel,
        "--enable-eplb": eplb,
        "--data-parallel-size > 1": data_parallel_size > 1,
        "--enable-return-routed-experts (the draft's routing would be recorded)": (
            return_routed_experts
        ),
    }
    used = [name for name, on in extras.items() if on]
    if used:
        raise SubSpecConfigError(
            f"mixture-of-experts targets run with SubSpec without {', '.join(used)}; serve "
            "without them, or without --speculative-config"
        )


def refuse_context_parallel(decode: int, prefill: int) -> None:
    """Context parallelism splits a request's KV positions over the ranks; the draft's KV moves
    and the tree's gather read every position of a rank's heads from its own cache."""
    if decode > 1 or prefill > 1:
        raise SubSpecConfigError(
            f"SubSpec does not run with context parallelism (decode {decode}, prefill "
            f"{prefill}): each rank must hold every position of its KV heads. Use tensor "
            "parallelism without --decode-context-parallel-size / "
            "--prefill-context-parallel-size"
        )


def refuse_quantized_kv_cache(kv_dtype: str, quantized: bool) -> None:
    if quantized:
        raise SubSpecConfigError(
            f"kv_cache_dtype {kv_dtype!r} is not supported with tree drafting (the tree "
            "attention reads the cache without quantization scales); use kv_cache_dtype 'auto' "
            "(unquantized) or tree_width=1"
        )


def refuse_sliding_window(window: int | None) -> None:
    if window is not None:
        raise SubSpecConfigError(
            f"the target uses sliding-window attention (window {window}), which tree drafting "
            "does not support (blocks outside the window can be freed); use tree_width=1"
        )


def refuse_micro_batching(use_ubatching: bool) -> None:
    """A tree plan is active in the thread that runs the forward; vLLM's micro-batching runs
    forwards in threads of its own, where tree rows would get causal attention."""
    if use_ubatching:
        raise SubSpecConfigError(
            "tree drafting does not support micro-batching (--enable-dbo / ubatch_size > 1); "
            "drop it or use tree_width=1"
        )


def refuse_shared_head_starts(
    head_start_levels: int, moe: bool, tensor_parallel_size: int, kv_connector: bool
) -> None:
    """On CUDA head starts draft on a stream of their own beside the verify: nothing the two
    share may be written by both (step/head_start.py). A MoE target's fused experts take their
    scratch from one global workspace, tensor parallelism runs collectives on shared
    communicators (two in flight from two streams can deadlock), and a KV connector moves KV
    on its own schedule."""
    if not head_start_levels:
        return
    shared = {
        "a mixture-of-experts target (its experts' workspace is shared)": moe,
        "--tensor-parallel-size > 1 (collectives from two streams)": tensor_parallel_size > 1,
        "--kv-transfer-config (a connector moves KV on its own schedule)": kv_connector,
    }
    used = [name for name, on in shared.items() if on]
    if used:
        raise SubSpecConfigError(
            f"head_start_levels drafts beside the verify on CUDA, which is not safe with "
            f"{', '.join(used)}; drop head_start_levels"
        )


def refuse_nothing_offloaded(
    substitute_layers: Any,
    offload_backend: str,
    offload_group_size: int | None,
    offload_num_in_group: int | None,
    cpu_offload_gb: float | None,
) -> None:
    if substitute_layers != "offloaded":
        return  # explicit layers (or "all"): the user chose what the draft substitutes
    prefetch = (
        offload_backend in ("prefetch", "auto")
        and (offload_group_size or 0) > 0
        and (offload_num_in_group or 0) > 0
    )
    uva = offload_backend in ("uva", "auto") and (cpu_offload_gb or 0) > 0
    if not (prefetch or uva):
        raise SubSpecConfigError(
            "nothing is offloaded (--cpu-offload-gb is 0 and no prefetch offload is set), so "
            "substitute_layers='offloaded' selects no layer and the draft would be the "
            "full-precision target: slower than plain decoding. Offload weights "
            "(e.g. --cpu-offload-gb 10), or set substitute_layers to 'all' or a list of layers"
        )


def refuse_async_scheduling(async_scheduling: bool | None) -> None:
    if async_scheduling:
        raise SubSpecConfigError(
            "async scheduling is not supported by SubSpec (its verify reads the scheduled "
            "draft tokens on the host); drop --async-scheduling"
        )


def refuse_attention_backend(chosen: str | None) -> None:
    """chosen: the attention backend's name the user asked for (None: left to vLLM)."""
    if chosen is not None and chosen != "FLASH_ATTN":
        raise SubSpecConfigError(
            f"tree drafting needs the FLASH_ATTN attention backend (the tree mask lives there), "
            f"got {chosen}; drop the attention backend option or use tree_width=1"
        )


def refuse_backend_per_kind(backend_per_kind: Any) -> None:
    if backend_per_kind:
        raise SubSpecConfigError(
            "attention_config.backend_per_kind is not supported with tree drafting (every "
            "decoder layer must run FLASH_ATTN); drop it or use tree_width=1"
        )


def refuse_flash_attention_config(error: ValueError) -> None:
    """error: why vLLM's backend selector refused FlashAttention for this configuration."""
    raise SubSpecConfigError(
        f"tree drafting on CUDA runs FlashAttention, which cannot run this configuration "
        f"({error}); use dtype bfloat16/float16 on an Ampere or newer GPU, or tree_width=1"
    ) from error


def refuse_attention_in_cuda_graphs(
    attention_outside: bool, breakable: bool, cudagraph_mode: str, splitting_ops: Any
) -> None:
    if not attention_outside or breakable:
        raise SubSpecConfigError(
            f"tree drafting needs attention outside CUDA graphs, but this configuration "
            f"(cudagraph_mode {cudagraph_mode}, splitting_ops {splitting_ops}, "
            f"breakable graphs {bool(breakable)}) captures it; drop "
            "fuse_attn_quant / custom splitting_ops / VLLM_USE_BREAKABLE_CUDAGRAPH, or use "
            "tree_width=1"
        )


# =============================================================================================
# Per request (vllm_hooks/patches.py, inside `InputProcessor._validate_params`)
# =============================================================================================
def request_refusal(params) -> str | None:
    """Why SubSpec refuses a request vLLM would accept with speculative decoding (None: it
    does not): a thinking budget's forced end is applied by vLLM's samplers, which SubSpec's
    verify replaces, and nothing applies it yet; logprobs of chosen token ids or of the
    whole vocabulary, which the verify does not report."""
    if getattr(params, "thinking_token_budget", None) is not None:
        return (
            "thinking_token_budget is not supported with speculative method 'subspec' "
            "(its forced end of thinking would not be applied); drop it, or serve "
            "without --speculative-config"
        )
    # a drafting step's logprobs come from the verify (`SampleMatchVerifier._logprobs`: the
    # top-k form); a step without drafts is vLLM's sampler's: the two would disagree
    if getattr(params, "logprob_token_ids", None):
        return (
            "logprob_token_ids is not supported with speculative method 'subspec' (a "
            "verified step reports top-k logprobs only); ask for logprobs=N, or serve "
            "without --speculative-config"
        )
    if getattr(params, "logprobs", None) == -1:
        return (
            "logprobs=-1 (the whole vocabulary) is not supported with speculative method "
            "'subspec' (a verified step reports top-k logprobs only); ask for logprobs=N, "
            "or serve without --speculative-config"
        )
    return None


# =============================================================================================
# At load
# =============================================================================================
def refuse_layers_out_of_range(bad: list[int], num_layers: int) -> None:
    if bad:
        raise SubSpecConfigError(
            f"substitute_layers {bad} out of range: the model has {num_layers} layers"
        )


def refuse_unsubstituted_streamed(streamed: list[int], prefetching: bool) -> None:
    """streamed: offloaded layers without a substitute; prefetching: whether the prefetch
    offloader streams them (the draft would run their prefetch hooks: read whatever the ring
    put in their slot and start copies of its own; docs/gpu.md, "Prefetch overlap")."""
    if streamed and prefetching:
        raise SubSpecConfigError(
            f"substitute_layers must include every layer the prefetch offloader streams "
            f"from CPU memory; missing {streamed} (use 'offloaded' or 'all')"
        )


CPU_MEMORY_FIXES = (
    "raise gpu_memory_utilization, lower max_model_len, substitute fewer layers "
    '(substitute_layers), or draft with the target\'s lm_head (draft_lm_head: "target")'
)


def refuse_cpu_draft_memory(
    kv_room: int | None, substitute_bytes: int, kv_needed: int, bits: int
) -> None:
    """kv_room: the RAM share vLLM will leave for the KV cache if the draft adds nothing
    (None: unknown); kv_needed: one max_model_len request's KV (draft_model/host_memory.py)."""
    if kv_room is not None and kv_room - substitute_bytes < kv_needed:
        raise SubSpecConfigError(
            f"not enough memory for the draft and the KV cache on the CPU backend: the RAM "
            f"share (gpu_memory_utilization) leaves about {kv_room / GiB:.2f} GiB for the KV "
            f"cache after the target's weights; the draft's {bits}-bit substitutes need "
            f"{substitute_bytes / GiB:.2f} GiB of it, and one {kv_needed / GiB:.3f} GiB "
            f"max_model_len request must fit in what remains. Nothing was built. To fix: "
            f"{CPU_MEMORY_FIXES}"
        )


def refuse_cpu_kv_memory(room: int, need: int, target_bytes: int, draft_bytes: int) -> None:
    """After the draft is built and its dense twins dropped as needed (host_memory.py)."""
    if room < need:
        raise SubSpecConfigError(
            f"not enough memory for the KV cache on the CPU backend: after the target "
            f"({target_bytes / GiB:.2f} GiB of weights, which vLLM repacks) and the "
            f"draft ({draft_bytes / GiB:.2f} GiB), the RAM share "
            f"(gpu_memory_utilization) leaves {room / GiB:.2f} GiB, and one max_model_len "
            f"request needs {need / GiB:.3f} GiB. To fix: {CPU_MEMORY_FIXES}"
        )


def refuse_cpu_kv_layout(isa: str, readable: bool) -> None:
    """readable: whether K/V written by the CPU backend's own kernel read back through
    SubSpec's reader of that ISA (step/paged_kv.py `check_cpu_layout`)."""
    if not readable:
        raise RuntimeError(
            f"vllm-subspec: tree attention cannot read the CPU KV cache layout of ISA {isa!r} "
            "(supported: vec, vec16, amx); use tree_width=1 (chain drafting) on this CPU"
        )
