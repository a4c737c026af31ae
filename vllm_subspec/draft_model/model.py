"""The draft model is the target model in "draft mode".

Embedding, final norm, lm_head and every non-substituted decoder layer are the target's own
modules. A substituted layer is a copy of the target layer that shares the target's `Attention`
module (hence its KV cache and its name in vLLM's forward context) and its rotary embedding, owns
copies of its small tensors (norms, biases), and runs its linears through `SubstituteLinear`s.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_subspec.config import SUBSTITUTE_LINEARS, SubSpecConfigError, SubSpecOptions
from vllm_subspec.draft_model.host_memory import (
    HostMemoryPlan,
    fit_kv_cache,
    plan_host_memory,
    resident_bytes,
    return_freed_memory,
    twin_bytes,
    vllm_cpu_weight_growth,
)
from vllm_subspec.draft_model.substitute import (
    SubstituteLinear,
    keeps_dense_twin,
    substitute_from_quantized,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

_SUBSTITUTES_ATTR = "_subspec_substitutes"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _linear_owner(layer: nn.Module, name: str) -> nn.Module:
    return layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp


@dataclass
class SubstituteSet:
    """The substitutes built for one target model, keyed by decoder layer index."""

    num_layers: int = 0  # decoder layers in the target
    layers: dict[int, dict[str, SubstituteLinear]] = field(default_factory=dict)
    lm_head: SubstituteLinear | None = None  # the draft's own output projection, if quantized
    replaced_bytes: int = 0  # bytes of the target linear weights they stand in for
    built: int = 0  # substitutes quantized at this start (the rest came from the cache)
    cache_hits: int = 0
    build_seconds: float = 0.0  # quantizing or loading them, and packing the kernels
    twins: int = 0  # substitutes that keep a dense twin (substitute.Int4CpuKernel)
    target_bytes: int = 0  # the target's parameters when the draft was built

    def drop_twins(self, nbytes: int) -> int:
        """Drop dense twins, last layers first, until nbytes are freed; returns bytes freed."""
        freed = 0
        every = [s for i in sorted(self.layers, reverse=True)
                 for s in reversed(self.layers[i].values())]
        for sub in ([self.lm_head] if self.lm_head is not None else []) + every:
            dense = getattr(sub.kernel, "dense", None)
            if freed >= nbytes:
                break
            if dense is not None:
                freed += dense.numel() * dense.element_size()
                sub.kernel.dense, sub.kernel.dense_from_rows = None, None
                self.twins -= 1
        return freed

    def every(self) -> list[SubstituteLinear]:
        """Every substitute: the layers' in layer order, then the lm_head's."""
        return [s for i in sorted(self.layers) for s in self.layers[i].values()] + \
            ([self.lm_head] if self.lm_head is not None else [])

    def count(self) -> int:
        return sum(map(len, self.layers.values())) + (self.lm_head is not None)

    def nbytes(self) -> int:
        """Everything the draft adds: the layer substitutes and its quantized lm_head."""
        head = self.lm_head.nbytes() if self.lm_head is not None else 0
        return head + self.layer_nbytes()

    def layer_nbytes(self) -> int:
        """The decoder-layer substitutes only: what stands in for `replaced_bytes`."""
        return sum(s.nbytes() for subs in self.layers.values() for s in subs.values())

    def memory_parts(self) -> dict[str, int]:
        """What the draft holds, by part: the layer substitutes' low-bit weights, the dense
        twins kept beside CPU substitutes (`substitute.Int4CpuKernel`), the quantized lm_head's
        low-bit weights (the names of `vllm_hooks.metrics.FIELDS`)."""
        def twin(sub) -> int:
            dense = getattr(sub.kernel, "dense", None)
            return 0 if dense is None else dense.numel() * dense.element_size()

        layers = [s for subs in self.layers.values() for s in subs.values()]
        head = [self.lm_head] if self.lm_head is not None else []
        return {"substitute_bytes": sum(s.nbytes() - twin(s) for s in layers),
                "dense_twin_bytes": sum(twin(s) for s in layers + head),
                "draft_head_bytes": sum(s.nbytes() - twin(s) for s in head)}

    def share(self) -> float:
        """Layer substitute bytes per replaced target byte, like with like (the lm_head is
        an extra copy, not a replacement): 4.5/16 for 4-bit g64 codes with a 16-bit scale
        and zero per group."""
        return self.layer_nbytes() / max(self.replaced_bytes, 1)

    def layout(self, kv_cache_bytes: int) -> str:
        """The start-up summary: which layers are shared, which substituted, what it costs."""
        chosen = sorted(self.layers)
        resident = [i for i in range(self.num_layers) if i not in self.layers]
        head = self.lm_head.nbytes() if self.lm_head is not None else 0
        head_text = f"quantized, {head / 2**30:.3f} GiB" if head else "the target's"
        return (f"vllm-subspec layout: {self.num_layers} layers; resident (shared) "
                f"{_ranges(resident)}; substituted {_ranges(chosen)}; substitutes "
                f"{self.layer_nbytes() / 2**30:.3f} GiB ({100 * self.share():.1f}% of the "
                f"{self.replaced_bytes / 2**30:.3f} GiB they replace); draft lm_head "
                f"{head_text}; "
                f"KV cache {kv_cache_bytes / 2**30:.3f} GiB")

    def warm_up(self, max_num_seqs: int, tree_width: int | tuple[int, ...], dtype: torch.dtype,
                device: torch.device, capture_sizes: list[int] | tuple[int, ...] = ()
                ) -> dict[str, list[int]]:
        """Run every kernel shape once per distinct compile/autotune key (`warm_up_key`) of the
        row counts the drafter can send, so that GemLite's Triton autotuning and compilation
        happen at start-up (before vLLM captures CUDA graphs), never inside a request.
        Returns the row counts run, per linear."""
        one_per_linear: dict[str, SubstituteLinear] = {}  # every layer has the same shapes
        for subs in self.layers.values():
            for name, sub in subs.items():
                one_per_linear.setdefault(name, sub)
        if self.lm_head is not None:
            one_per_linear["lm_head"] = self.lm_head
        ran: dict[str, list[int]] = {}
        with torch.inference_mode():
            for name, sub in one_per_linear.items():
                first: dict = {}
                for m in draft_row_counts(max_num_seqs, tree_width, capture_sizes):
                    first.setdefault(sub.warm_up_key(m), m)
                ran[name] = sorted(first.values())
                for m in ran[name]:
                    sub(torch.zeros(m, sub.in_features, dtype=dtype, device=device))
        if ran:
            logger.info("vllm-subspec: substitute kernels warmed up at %d of the %d row counts "
                        "a draft can have, per linear shape",
                        max(map(len, ran.values())),
                        len(draft_row_counts(max_num_seqs, tree_width, capture_sizes)))
        return ran

    def attach_to(self, model: nn.Module) -> None:
        # A plain attribute (not a submodule): vLLM must not see these in named_parameters().
        model.__dict__[_SUBSTITUTES_ATTR] = self

    @staticmethod
    def of(model: nn.Module) -> SubstituteSet | None:
        return model.__dict__.get(_SUBSTITUTES_ATTR)


def attach_substitutes(model: nn.Module, options: SubSpecOptions, vllm_config,
                       device: torch.device, kv_room=None) -> None:
    """Build the substitutes of the layers `options` selects (by default the ones vLLM's
    offloader put in host memory) and attach them to the freshly loaded target (weight hook).
    kv_room: on vLLM's CPU backend, () -> (bytes the KV cache would get now, or None when set
    explicitly; bytes of one max_model_len request): the draft's host memory is planned
    against it (host_memory.py)."""
    from vllm.model_executor.offloader.base import get_offloader

    from vllm_subspec.draft_model.layer_selection import offloaded_layer_indices

    if SubstituteSet.of(model) is not None:
        return
    layers = decoder_layers(model)
    offloaded = offloaded_layer_indices(layers, vllm_config.offload_config, device,
                                        get_offloader())
    chosen = options.resolve_layers(len(layers), offloaded)
    if options.substitute_layers == "offloaded" and not offloaded and device.type == "cpu":
        # vLLM's CPU backend with nothing offloaded: the full-precision target as its own draft
        # would only add cost, so the default draft there is the model with every layer 4-bit
        chosen = list(range(len(layers)))
        logger.info("vllm-subspec: nothing is offloaded on the CPU backend, so every decoder "
                    "layer gets a substitute (set substitute_layers to choose)")
    streamed = sorted(set(offloaded) - set(chosen))
    if streamed and getattr(get_offloader(), "module_offloaders", None):
        # the draft would run their prefetch hooks: read whatever the ring put in their slot
        # and start copies of its own (docs/gpu.md, "Prefetch overlap")
        raise SubSpecConfigError(
            f"substitute_layers must include every layer the prefetch offloader streams "
            f"from CPU memory; missing {streamed} (use 'offloaded' or 'all')")
    if not chosen:
        logger.warning(
            "vllm-subspec: substitute_layers=%r selected no layer; the draft is the "
            "full-precision target", options.substitute_layers)
    max_rows = max(draft_row_counts(vllm_config.scheduler_config.max_num_seqs, options.widths))
    target_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = _plan_host_memory(model, chosen, options, target_bytes, kv_room) \
        if device.type == "cpu" and kv_room is not None else None
    rss = resident_bytes() if memory is not None else 0
    subs = build_substitutes(model, chosen, options, device, max_rows=max_rows, memory=memory)
    if memory is not None:
        return_freed_memory()  # the solver's freed temporaries, kept by malloc, count as RSS
        logger.info("vllm-subspec: %s (cpu_draft_memory %.2f; dense twins for %d of %d "
                    "substitutes); worker RSS %.2f -> %.2f GiB", memory.summary(),
                    options.cpu_draft_memory, subs.twins, subs.count(), rss / 2**30,
                    resident_bytes() / 2**30)
    subs.target_bytes = target_bytes
    subs.attach_to(model)  # the layout is logged once the KV cache is sized (the proposer)


def _plan_host_memory(model, chosen, options, target_bytes: int, kv_room) -> HostMemoryPlan:
    """The draft's RAM on CPU, planned before anything is built (host_memory.py); raises when
    the substitutes and one max_model_len request cannot both fit."""
    room, need = kv_room()
    if room is not None:  # what vLLM's own weight processing will add comes out of it
        room -= vllm_cpu_weight_growth(model)
    shapes = [tuple(job[3].weight.shape) for job in _jobs(model, chosen, options)]
    return plan_host_memory(shapes, options.cpu_draft_memory, options.bits, options.group_size,
                            target_bytes, room, need)


def after_weights_processed(model: nn.Module, device: torch.device, kv_room=None) -> None:
    """After vLLM's own weight processing (the CPU backend repacks the linears into new
    tensors): return what malloc keeps of the freed weights, so that the KV cache is sized from
    the memory the engine really holds, then make sure one max_model_len request fits it."""
    subs = SubstituteSet.of(model)
    if device.type != "cpu" or subs is None or kv_room is None:
        return
    return_freed_memory()
    fit_kv_cache(subs, kv_room)


def draft_row_counts(max_num_seqs: int, tree_width: int | tuple[int, ...],
                     capture_sizes: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Every row count a draft forward can have (proposer.py): a chain step and a tree's root
    pass run one row per request (b = 1..max_num_seqs), later tree levels k rows per request,
    for each width k a step may use (an auto shape's candidates); with CUDA-graph capture
    sizes, also each count padded to its bucket (the next capture size: the proposer's
    `draft_bucket`)."""
    widths = (tree_width,) if isinstance(tree_width, int) else tree_width
    batches = range(1, max(max_num_seqs, 1) + 1)
    rows = set(batches) | {b * max(k, 1) for b in batches for k in widths}
    return sorted(rows | {capture_bucket(n, capture_sizes) for n in rows})


def capture_bucket(rows: int, capture_sizes: list[int] | tuple[int, ...]) -> int:
    """`rows` padded to the next CUDA-graph capture size, as vLLM's dispatcher pads a batch
    (`rows` itself past the largest size, or without any)."""
    return next((c for c in sorted(capture_sizes) if c >= rows), rows)


LM_HEAD, LM_HEAD_INDEX = ("lm_head",), -1  # the lm_head's job id and cache index


def _jobs(model: nn.Module, layer_indices: list[int], options: SubSpecOptions):
    """(job id, cache index, linear name, linear) for every linear the draft substitutes."""
    layers = decoder_layers(model)
    jobs = [((i, name), i, name, getattr(_linear_owner(layers[i], name), name))
            for i in layer_indices for name in SUBSTITUTE_LINEARS]
    if "quantized" in options.draft_heads and layer_indices:
        jobs.append((LM_HEAD, LM_HEAD_INDEX, "lm_head", model.lm_head))
    return jobs


def build_substitutes(model: nn.Module, layer_indices: list[int], options: SubSpecOptions,
                      device: torch.device, cache="auto", max_rows: int = 0,
                      memory: HostMemoryPlan | None = None) -> SubstituteSet:
    """Quantize the linears of the chosen layers. Called on freshly loaded target weights.

    cache: a `SubstituteCache`, None (build everything), or "auto": the cache for the model of
    the current vLLM config (`substitute_cache` option), if any. max_rows: the most rows a draft
    pass can send (the CPU kernel's choice per row count, `substitute.Int4CpuKernel`).
    memory: the host-memory plan dense twins must fit (None: no bound)."""
    from vllm_subspec.draft_model.substitute_cache import cache_for_current_model, quantized_weights

    if cache == "auto":
        cache = cache_for_current_model(options)
    start = time.perf_counter()
    subs = SubstituteSet(num_layers=len(decoder_layers(model)))
    jobs = _jobs(model, layer_indices, options)
    for job, linear, qw in quantized_weights(jobs, options, device, cache):
        rows = max_rows
        if keeps_dense_twin(qw, linear.weight.dtype, device, options.kernel, rows):
            if memory is not None and not memory.take_twin(twin_bytes(*qw.shape)):
                rows = 0  # no room for its twin: the int4 kernel at every row count
            else:
                subs.twins += 1
        sub = substitute_from_quantized(
            qw, linear, device, options.kernel,
            name="lm_head" if job == LM_HEAD else f"layers.{job[0]}.{job[1]}", max_rows=rows)
        if job == LM_HEAD:  # an extra copy: the target keeps its own for verification
            subs.lm_head = sub
            continue
        subs.layers.setdefault(job[0], {})[job[1]] = sub
        subs.replaced_bytes += linear.weight.numel() * linear.weight.element_size()
    subs.cache_hits = cache.hits if cache else 0
    subs.built = len(jobs) - subs.cache_hits
    subs.build_seconds = time.perf_counter() - start
    # Substitutes live on the device only: SubSpec adds no host memory to plain offloading.
    stray = [s.source_name for s in subs.every()
             if any(t.device.type != device.type for t in s.tensors())]
    if stray:
        raise RuntimeError(f"vllm-subspec: substitutes not on {device}: {stray}")
    return subs


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not idx:
        return "none"
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def substitute_layer(layer: nn.Module, linears: dict[str, SubstituteLinear],
                     device: torch.device) -> nn.Module:
    """A copy of `layer` on `device` that runs `linears` and shares the target's attention and
    rotary embedding."""
    attn = layer.self_attn
    shared: dict[int, object] = {id(attn.attn): attn.attn}
    if hasattr(attn, "rotary_emb"):
        shared[id(attn.rotary_emb)] = attn.rotary_emb
    for name, sub in linears.items():
        shared[id(getattr(_linear_owner(layer, name), name))] = sub
    # deepcopy with a pre-seeded memo: the shared objects map to themselves (or to their
    # substitute) and are not copied; everything else (norms, activations) is small and copied.
    shared_modules = {id(m) for obj in shared.values() for m in obj.modules()}
    clone = copy.deepcopy(layer, memo=shared)  # (fills the memo with every copied object)
    for m in clone.modules():
        # Offloaders install an instance-level `forward` hook on the target layer; the copy must
        # call its class forward, never the hook (which would fetch the offloaded weights).
        m.__dict__.pop("forward", None)
    # The prefetch offloader keeps an offloaded layer's norms in CPU memory (it serves them from
    # its GPU slots), so the copy moves its own small tensors to the draft's device; the shared
    # modules are left alone (the offloader manages their tensors).
    for m in clone.modules():
        if id(m) in shared_modules:
            continue
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.device != device:
                moved = t.detach().to(device)
                setattr(m, name, nn.Parameter(moved, requires_grad=False)
                        if isinstance(t, nn.Parameter) else moved)
    return clone


def cpu_fused_norms(layers: list[nn.Module]) -> int:
    """Run the two RMSNorms of each of `layers` (the draft's own copies: substituted layers)
    through vLLM's C++ CPU kernels, `torch.ops._C.rms_norm` and `fused_add_rms_norm` (in
    place, as vLLM's CUDA path calls them): one dispatched op a norm where vLLM's CPU forward,
    `forward_native` (layernorm.py 0.32.0 :156-159), dispatches about nine, which in an eager
    draft pass at one row cost more than the norm itself (4 vs 30-38 µs a call measured). Only
    for eager CPU drafts: compiled, inductor fuses the native norm. The kernels round like the
    native norm up to the last bit in bf16 (the draft only proposes). Returns the norms
    switched (none where vLLM's CPU build lacks the kernels)."""
    ops = getattr(torch.ops, "_C", None)
    if ops is None or not (hasattr(ops, "rms_norm") and hasattr(ops, "fused_add_rms_norm")):
        return 0
    from vllm.model_executor.layers.layernorm import RMSNorm

    switched = 0
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None:
                # CustomOp.forward calls it; the weight's detached view, taken once (its
                # storage: the copy's own, loaded once)
                norm._forward_method = functools.partial(_cpu_rms_norm, norm, norm.weight.data)
                switched += 1
    return switched


def _cpu_rms_norm(norm: nn.Module, weight: torch.Tensor, x: torch.Tensor,
                  residual: torch.Tensor | None = None):
    # the kernels' limits (csrc/cpu/layernorm.cpp: contiguous rows, one dtype, the hidden size
    # a multiple of their vector width: 8 or 16 elements); anything else: vLLM's own forward
    if not x.is_contiguous() or weight.dtype != x.dtype or x.shape[-1] % 16 or (
            residual is not None and (not residual.is_contiguous()
                                      or residual.dtype != x.dtype)):
        return norm.forward_native(x, residual)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, norm.variance_epsilon)
        return out
    torch.ops._C.fused_add_rms_norm(x, residual, weight, norm.variance_epsilon)
    return x, residual


class DraftModel(nn.Module):
    """Callable like vLLM's CausalLM: forward(input_ids, positions) -> hidden states."""

    def __init__(self, target: nn.Module, substitutes: SubstituteSet, device: torch.device):
        super().__init__()
        # Kept out of the module tree: these are the target's modules, owned by the runner.
        self.__dict__["target"] = target
        base = decoder_layers(target)
        self.__dict__["layers"] = [
            substitute_layer(layer, substitutes.layers[i], device)
            if i in substitutes.layers else layer
            for i, layer in enumerate(base)
        ]
        self.substituted = sorted(substitutes.layers)
        self.__dict__["lm_head"] = substitutes.lm_head

    def embed_input_ids(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.target.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        lm = self.target.model
        hidden = inputs_embeds if inputs_embeds is not None else lm.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = lm.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor, head: str | None = None
                       ) -> torch.Tensor:
        """The draft's logits through `head`: "quantized", its own lm_head, finished as vLLM's
        LogitsProcessor.forward finishes the target's (logits_processor.py 0.32.0: vocabulary
        padding cut, soft cap, scale), or "target", the target's own; None: its own when it
        has one."""
        if head == "quantized" and self.lm_head is None:
            raise ValueError("vllm-subspec: the draft holds no quantized lm_head")
        if self.lm_head is None or head == "target":
            return self.target.compute_logits(hidden_states)
        lp = self.target.logits_processor
        logits = self.lm_head(hidden_states)[0][..., : lp.org_vocab_size]
        if lp.soft_cap is not None:
            logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
        if lp.scale != 1.0:
            logits = logits * lp.scale
        return logits
