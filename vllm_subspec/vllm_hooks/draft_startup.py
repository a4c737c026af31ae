"""What the drafter (`SubSpecProposer`, proposer.py) does once, at engine start-up: builds the
substitutes around vLLM's weight processing (`build_substitutes`), finds the attention layers
its passes write through (`draft_attention_layers`), warms GemLite's kernels up on CUDA
(`warm_up_kernels`), times the lm_heads for the tuner (`time_lm_heads`), finds the file the
tuner's costs are kept in across restarts (`saved_tuner_costs`) and, in vLLM's
profiling pass, allocates a step's widest temporaries (`allocate_peak_temporaries`: the
verify's from step/verify.py, the draft level's from step/tree.py). docs/gpu.md,
"Engine start-up".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from vllm_subspec.config import SubSpecOptions
from vllm_subspec.draft_model.gemlite_tuning import gemlite_autotune_kept
from vllm_subspec.draft_model.model import decoder_layers
from vllm_subspec.draft_model.substitute_cache import cache_root, gemlite_autotune_path
from vllm_subspec.draft_model.substitute_set import (
    SubstituteSet,
    build_substitute_set,
    settle_host_memory,
)
from vllm_subspec.step.tree import sharpened_log_probs, widest_level
from vllm_subspec.step.tuner.lm_head_choice import COMPARED_REQUESTS
from vllm_subspec.step.tuner.saved_costs import SavedCosts
from vllm_subspec.step.verify import draws_at_widest
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream


def build_substitutes(
    target: nn.Module, options: SubSpecOptions, vllm_config, device: torch.device, process_weights
) -> SubstituteSet:
    """From the target's raw weights, before vLLM processes them (`process_weights()`;
    the CPU backend repacks linears there); on CPU the draft's host memory is planned
    against the KV cache vLLM's CPU worker will size."""
    from vllm_subspec.vllm_hooks.cpu_memory import kv_room_and_need

    kv_room = (lambda: kv_room_and_need(vllm_config)) if device.type == "cpu" else None
    substitutes = build_substitute_set(target, options, vllm_config, device, kv_room)
    process_weights()
    if kv_room is not None:
        settle_host_memory(substitutes, kv_room)
    return substitutes


def draft_attention_layers(vllm_config, target: nn.Module) -> set[str]:
    """The names of the target's decoder attention layers that hold KV (the draft's passes
    write through them): vLLM's `_draft_attn_layer_names` for the drafter."""
    target_attn = {id(layer.self_attn.attn) for layer in decoder_layers(target)}
    all_attn = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    names = {
        name
        for name, module in all_attn.items()
        if id(module) in target_attn and module.get_kv_cache_spec(vllm_config) is not None
    }
    if len(names) != len(target_attn):
        raise RuntimeError("vllm-subspec: could not map every decoder layer to its attention")
    return names


def warm_up_kernels(
    substitutes: SubstituteSet, options: SubSpecOptions, vllm_config, device: torch.device
) -> None:
    """On CUDA: GemLite compiles per row-count bucket, so its kernels are warmed up now, with
    the autotuning of earlier starts (kept in the substitute cache's folder), at the draft's
    row counts and the buckets draft graphs pad to."""
    kernels = [s.kernel for s in substitutes.every()]
    with gemlite_autotune_kept(gemlite_autotune_path(options, kernels, device)):
        substitutes.warm_up(
            vllm_config.scheduler_config.max_num_seqs,
            options.widths,
            vllm_config.model_config.dtype,
            device,
            vllm_config.compilation_config.cudagraph_capture_sizes or (),
        )


def time_lm_heads(
    heads,
    compute_logits: Callable,
    widest: int,
    max_rows: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 3,
) -> None:
    """Each of `heads`' lm_heads (the tuner's `LmHeadChoice`) timed at 1, k and 4k rows (k:
    `widest`, the widest width; at most `max_rows`) for the tuner's choice between them; at
    load, where waiting for the device costs nothing."""
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for rows in sorted({1, min(widest, max_rows), min(4 * widest, max_rows)}):
        hidden = torch.rand(rows, hidden_size, dtype=dtype, device=device)
        for head in heads.heads:
            compute_logits(hidden, head)  # first call: kernels' one-off work
            wait()
            start = time.perf_counter()
            for _ in range(repeats):
                compute_logits(hidden, head)
            wait()
            heads.observe_cost(head, rows, (time.perf_counter() - start) / repeats)
    heads.start_with_cheaper(widest)


def saved_tuner_costs(
    options: SubSpecOptions, vllm_config, substitutes: SubstituteSet, device: torch.device
) -> SavedCosts | None:
    """The file this engine's tuner keeps its costs in across restarts, next to the
    substitute cache (None: the cache is off, or `saved_costs.ENV` is "0"), keyed on what
    sets the costs: the model, its dtype and parallelism, the offload settings, compilation,
    the substituted layers and kernels, the tuner's shapes, this machine and the versions."""
    import vllm

    import vllm_subspec

    root = cache_root(options.substitute_cache)
    if root is None or not SavedCosts.enabled():
        return None
    mc, pc, oc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.offload_config
    key = {
        "model": str(mc.model),
        "revision": mc.revision,
        "dtype": str(mc.dtype),
        "tensor_parallel": pc.tensor_parallel_size,
        "offload": [  # (sets sorted: their order is not stable across processes)
            oc.offload_backend,
            oc.uva.cpu_offload_gb,
            sorted(oc.uva.cpu_offload_params),
            oc.prefetch.offload_group_size,
            oc.prefetch.offload_num_in_group,
            oc.prefetch.offload_prefetch_step,
            sorted(oc.prefetch.offload_params),
        ],
        "compilation": [int(vllm_config.compilation_config.mode), mc.enforce_eager],
        "substituted": sorted(substitutes.layers),
        "kernels": sorted({s.kernel.name for s in substitutes.every()}),
        "widths": list(options.widths),
        "max_depth": options.tree_depth,
        "lm_heads": list(options.draft_lm_heads),
        "machine": _machine(device),
        "versions": [vllm_subspec.__version__, vllm.__version__, torch.__version__],
    }
    return SavedCosts(root / "tuner", key)


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # the CPU's model name (a core's speed sets every cost on the CPU backend)
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def time_draft_pass(
    run_pass: Callable[[int], None],
    rows: list[int],
    device: torch.device,
    observe: Callable[[int, float], None],
    repeats: int = 2,
) -> None:
    """A draft pass (`run_pass(r)`: the draft's forward and logits over r rows, attention
    skipped) timed at each of `rows`, for the tuner to price its first steps before any is
    timed (`CostModel.seed_draft_pass`); once, before the first step (waits for the device)."""
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in rows:
        run_pass(r)  # first call: kernels' one-off work
        wait()
        start = time.perf_counter()
        for _ in range(repeats):
            run_pass(r)
        wait()
        observe(r, (time.perf_counter() - start) / repeats)


def allocate_peak_temporaries(
    options: SubSpecOptions,
    vllm_config,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    draft_rows: int,
    verify_rows: int,
    draw_rows: int,
    compute_logits: Callable,
    head_stream: HeadStartStream,
    topk_topp_sampler,
) -> None:
    """What a step allocates past its forwards, at its widest, for vLLM's memory profile:
    the verify's logits (`verify_rows` rows), which the runner holds through the next
    drafting, and, while they are held, first the draft's widest level past its layers
    (`_widest_draft_level`), then the verify's draws (`verify.draws_at_widest`: the step's
    per-request penalty counts, one chunk of `draw_rows` rows in fp32 with its counts and
    masks, vLLM's top-k/top-p sampler); with head starts, a second widest level held
    throughout (they draft beside the verify). draft_rows: the drafter's buffer rows;
    compute_logits: the draft's. docs/gpu.md, "Engine start-up"."""
    sc = vllm_config.scheduler_config
    k = max(options.widths)
    batch = min(sc.max_num_seqs, max(1, draft_rows // k))
    vocab = vllm_config.model_config.get_vocab_size()
    verify_logits = torch.rand(verify_rows, vocab, dtype=dtype, device=device)
    compared = (
        min(COMPARED_REQUESTS, sc.max_num_seqs)
        if options.is_tree and len(options.draft_lm_heads) > 1
        else 0
    )
    head_start = _widest_draft_level(
        options,
        batch,
        k,
        compared * (options.num_draft_tokens + 1),
        hidden_size,
        dtype,
        device,
        compute_logits,
        head_stream,
    )
    draws_at_widest(verify_logits, sc.max_num_seqs, min(draw_rows, verify_rows), topk_topp_sampler)
    del head_start


def _widest_draft_level(
    options: SubSpecOptions,
    batch: int,
    k: int,
    compared_rows: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    compute_logits: Callable,
    head_stream: HeadStartStream,
):
    """The draft's widest level past its layers, for `batch` requests of width k: its logits,
    `tree.widest_level` over them (sharpened fp32 log-probabilities, top-k over k x V
    candidates), beside a compared step's kept hidden states (`compared_rows`); all freed on
    return but, with head starts, a head start's widest level (logits and fp32
    log-probabilities), allocated on their stream and returned to be held."""
    node_hidden = torch.empty(compared_rows, hidden_size, dtype=dtype, device=device)
    hidden = torch.rand(batch * k, hidden_size, dtype=dtype, device=device)
    head_start = None
    if options.head_start_levels and k > 1:
        # head starts draft beside the verify, on a stream whose blocks the caching
        # allocator keeps apart
        with head_stream.profiling():
            head_logits = compute_logits(hidden)
            head_start = (head_logits, sharpened_log_probs(head_logits, options.draft_temperature))
    logits = compute_logits(hidden)
    if k > 1:  # a chain's argmax adds nothing beyond its logits
        widest_level(logits, batch, k, options.draft_temperature)
    del node_hidden, hidden, logits
    return head_start
