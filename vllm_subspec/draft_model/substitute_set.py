"""The substitutes built for one target: which layers get one, building them (or loading them
from the substitute cache) from the target's own weights, and what they cost in memory.

Design: docs/substitutes.md, "Building the substitute set".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_subspec import refusals
from vllm_subspec.config import SubSpecOptions
from vllm_subspec.draft_model.experts import (
    ExpertWeight,
    SubstituteExperts,
    expert_kernel,
    expert_tensors,
    expert_weights,
    moe_runner,
)
from vllm_subspec.draft_model.host_memory import (
    HostMemoryPlan,
    fit_kv_cache,
    plan_host_memory,
    resident_bytes,
    return_freed_memory,
    twin_bytes,
    vllm_cpu_weight_growth,
)
from vllm_subspec.draft_model.model import decoder_layers, layer_linear, layer_linear_names
from vllm_subspec.draft_model.quantize import QuantizedWeight
from vllm_subspec.draft_model.row_buckets import draft_row_counts
from vllm_subspec.draft_model.substitute import (
    SubstituteLinear,
    keeps_dense_twin,
    substitute_from_quantized,
)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level


@dataclass
class SubstituteSet:
    """The substitutes built for one target model, keyed by decoder layer index (held by the
    drafter, `SubSpecProposer.substitutes`; nothing is stored on the target)."""

    num_layers: int = 0  # decoder layers in the target
    layers: dict[int, dict[str, SubstituteLinear]] = field(default_factory=dict)
    experts: dict[int, SubstituteExperts] = field(default_factory=dict)  # sparse MoE layers'
    lm_head: SubstituteLinear | None = None  # the draft's own output projection, if quantized
    replaced_bytes: int = 0  # bytes of the target linear weights they stand in for
    built: int = 0  # substitutes quantized at this start (the rest came from the cache)
    cache_hits: int = 0
    build_seconds: float = 0.0  # quantizing or loading them, and packing the kernels
    twins: int = 0  # substitutes that keep a dense twin (kernels.Int4CpuKernel)
    target_bytes: int = 0  # the target's parameters when the draft was built

    def drop_twins(self, nbytes: int) -> int:
        """Drop dense twins, last layers first, until nbytes are freed; returns bytes freed."""
        freed = 0
        every = [
            s for i in sorted(self.layers, reverse=True) for s in reversed(self.layers[i].values())
        ]
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
        return [s for i in sorted(self.layers) for s in self.layers[i].values()] + (
            [self.lm_head] if self.lm_head is not None else []
        )

    def count(self) -> int:
        return sum(map(len, self.layers.values())) + (self.lm_head is not None)

    def nbytes(self) -> int:
        """Everything the draft adds: the layer substitutes and its quantized lm_head."""
        head = self.lm_head.nbytes() if self.lm_head is not None else 0
        return head + self.layer_nbytes()

    def layer_nbytes(self) -> int:
        """The decoder-layer substitutes only (routed experts included): what stands in for
        `replaced_bytes`."""
        return (
            sum(s.nbytes() for subs in self.layers.values() for s in subs.values())
            + self.expert_nbytes()
        )

    def expert_nbytes(self) -> int:
        """The routed experts' substitutes (sparse MoE layers)."""
        return sum(e.nbytes() for e in self.experts.values())

    def memory_parts(self) -> dict[str, int]:
        """What the draft holds, by part: the layer substitutes' low-bit weights, the dense
        twins kept beside CPU substitutes (`kernels.Int4CpuKernel`), the quantized lm_head's
        low-bit weights (the names of `vllm_hooks.metrics.FIELDS`)."""

        def twin(sub) -> int:
            dense = getattr(sub.kernel, "dense", None)
            return 0 if dense is None else dense.numel() * dense.element_size()

        layers = [s for subs in self.layers.values() for s in subs.values()]
        head = [self.lm_head] if self.lm_head is not None else []
        return {
            "substitute_bytes": sum(s.nbytes() - twin(s) for s in layers) + self.expert_nbytes(),
            "dense_twin_bytes": sum(twin(s) for s in layers + head),
            "draft_head_bytes": sum(s.nbytes() - twin(s) for s in head),
        }

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
        return (
            f"vllm-subspec layout: {self.num_layers} layers; resident (shared) "
            f"{_ranges(resident)}; substituted {_ranges(chosen)}; substitutes "
            f"{self.layer_nbytes() / 2**30:.3f} GiB ({100 * self.share():.1f}% of the "
            f"{self.replaced_bytes / 2**30:.3f} GiB they replace); draft lm_head "
            f"{head_text}; "
            f"KV cache {kv_cache_bytes / 2**30:.3f} GiB"
        )

    def warm_up(
        self,
        max_num_seqs: int,
        tree_width: int | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        capture_sizes: list[int] | tuple[int, ...] = (),
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
            logger.info(
                "vllm-subspec: substitute kernels warmed up at %d of the %d row counts "
                "a draft can have, per linear shape",
                max(map(len, ran.values())),
                len(draft_row_counts(max_num_seqs, tree_width, capture_sizes)),
            )
        return ran


def build_substitute_set(
    model: nn.Module, options: SubSpecOptions, vllm_config, device: torch.device, kv_room=None
) -> SubstituteSet:
    """The substitutes of the layers `options` selects (by default the ones vLLM's offloader
    put in host memory), from the freshly loaded target (`SubSpecProposer.build_substitutes`).
    kv_room: on vLLM's CPU backend, () -> (bytes the KV cache would get now, or None when set
    explicitly; bytes of one max_model_len request): the draft's host memory is planned
    against it (host_memory.py)."""
    from vllm.model_executor.offloader.base import get_offloader

    from vllm_subspec.draft_model.layer_selection import offloaded_layer_indices

    layers = decoder_layers(model)
    offloaded = offloaded_layer_indices(layers, vllm_config.offload_config, device, get_offloader())
    chosen = options.resolve_layers(len(layers), offloaded)
    if options.substitute_layers == "offloaded" and not offloaded and device.type == "cpu":
        # vLLM's CPU backend with nothing offloaded: the full-precision target as its own draft
        # would only add cost, so the default draft there is the model with every layer 4-bit
        chosen = list(range(len(layers)))
        logger.info(
            "vllm-subspec: nothing is offloaded on the CPU backend, so every decoder "
            "layer gets a substitute (set substitute_layers to choose)"
        )
    streamed = sorted(set(offloaded) - set(chosen))
    refusals.refuse_unsubstituted_streamed(
        streamed, bool(streamed and getattr(get_offloader(), "module_offloaders", None))
    )
    if not chosen:
        logger.warning(
            "vllm-subspec: substitute_layers=%r selected no layer; the draft is the "
            "full-precision target",
            options.substitute_layers,
        )
    max_rows = max(draft_row_counts(vllm_config.scheduler_config.max_num_seqs, options.widths))
    target_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = (
        _plan_host_memory(model, chosen, options, target_bytes, kv_room)
        if device.type == "cpu" and kv_room is not None
        else None
    )
    rss = resident_bytes() if memory is not None else 0
    subs = build_substitutes(model, chosen, options, device, max_rows=max_rows, memory=memory)
    if memory is not None:
        return_freed_memory()  # the solver's freed temporaries, kept by malloc, count as RSS
        logger.info(
            "vllm-subspec: %s (cpu_draft_memory %.2f; dense twins for %d of %d "
            "substitutes); worker RSS %.2f -> %.2f GiB",
            memory.summary(),
            options.cpu_draft_memory,
            subs.twins,
            subs.count(),
            rss / 2**30,
            resident_bytes() / 2**30,
        )
    subs.target_bytes = target_bytes
    return subs


def _plan_host_memory(model, chosen, options, target_bytes: int, kv_room) -> HostMemoryPlan:
    """The draft's RAM on CPU, planned before anything is built (host_memory.py); raises when
    the substitutes and one max_model_len request cannot both fit."""
    room, need = kv_room()
    if room is not None:  # what vLLM's own weight processing will add comes out of it
        room -= vllm_cpu_weight_growth(model)
    shapes = [tuple(job[3].weight.shape) for job in _jobs(model, chosen, options)]
    return plan_host_memory(
        shapes, options.cpu_draft_memory, options.bits, options.group_size, target_bytes, room, need
    )


def settle_host_memory(subs: SubstituteSet, kv_room) -> None:
    """On CPU, after vLLM's own weight processing (it repacks the linears into new tensors):
    return what malloc keeps of the freed weights, so the KV cache is sized from the memory
    the engine really holds, then make sure one max_model_len request fits it."""
    return_freed_memory()
    fit_kv_cache(subs, kv_room)


LM_HEAD, LM_HEAD_INDEX = ("lm_head",), -1  # the lm_head's job id and cache index
EXPERT_PREFIX = "experts."  # routed experts' job names: experts.{e}.w13, experts.{e}.w2


def _jobs(model: nn.Module, layer_indices: list[int], options: SubSpecOptions):
    """(job id, cache index, linear name, linear) for every linear the draft substitutes (a
    routed expert's fused gate/up and down weights count as linears)."""
    layers = decoder_layers(model)
    jobs: list[tuple[tuple, int, str, Any]] = [
        ((i, name), i, name, layer_linear(layers[i], name))
        for i in layer_indices
        for name in layer_linear_names(layers[i])
    ]
    for i in layer_indices:
        moe = moe_runner(layers[i])
        if moe is None:
            continue
        for e in range(expert_weights(moe[2])[0].shape[0]):
            for which in ("w13", "w2"):
                name = f"{EXPERT_PREFIX}{e}.{which}"
                jobs.append(((i, name), i, name, ExpertWeight(moe[2], e, which)))
    if "quantized" in options.draft_lm_heads and layer_indices:
        jobs.append((LM_HEAD, LM_HEAD_INDEX, "lm_head", model.lm_head))
    return jobs


def build_substitutes(
    model: nn.Module,
    layer_indices: list[int],
    options: SubSpecOptions,
    device: torch.device,
    cache="auto",
    max_rows: int = 0,
    memory: HostMemoryPlan | None = None,
) -> SubstituteSet:
    """Quantize the linears of the chosen layers (and the lm_head for a quantized draft head),
    from freshly loaded target weights. cache: a `SubstituteCache`, None (build everything), or
    "auto": the cache for the current vLLM config's model (`substitute_cache` option), if any.
    max_rows: the most rows a draft pass can send (the CPU kernel's choice per row count,
    `kernels.Int4CpuKernel`). memory: the host-memory plan dense twins must fit (None: no
    bound)."""
    from vllm_subspec.draft_model.substitute_cache import cache_for_current_model, quantized_weights

    if cache == "auto":
        cache = cache_for_current_model(options)
    start = time.perf_counter()
    subs = SubstituteSet(num_layers=len(decoder_layers(model)))
    jobs = _jobs(model, layer_indices, options)
    layers = decoder_layers(model)
    routed: dict[int, _RoutedLayer] = {}  # a layer's experts, packed as they come
    for job, linear, qw in quantized_weights(jobs, options, device, cache):
        if job != LM_HEAD and job[1].startswith(EXPERT_PREFIX):
            i = job[0]
            subs.replaced_bytes += linear.weight.numel() * linear.weight.element_size()
            layer = routed.setdefault(i, _RoutedLayer(moe_runner(layers[i])[2]))
            if layer.add(job[1], qw, device, options.kernel):
                subs.experts[i] = routed.pop(i).build(f"layers.{i}.experts")
            continue
        rows = max_rows
        if keeps_dense_twin(qw, linear.weight.dtype, device, options.kernel, rows):
            if memory is not None and not memory.take_twin(twin_bytes(*qw.shape)):
                rows = 0  # no room for its twin: the int4 kernel at every row count
            else:
                subs.twins += 1
        sub = substitute_from_quantized(
            qw,
            linear,
            device,
            options.kernel,
            name="lm_head" if job == LM_HEAD else f"layers.{job[0]}.{job[1]}",
            max_rows=rows,
        )
        if job == LM_HEAD:  # an extra copy: the target keeps its own for verification
            subs.lm_head = sub
            continue
        subs.layers.setdefault(job[0], {})[job[1]] = sub
        subs.replaced_bytes += linear.weight.numel() * linear.weight.element_size()
    subs.cache_hits = cache.hits if cache else 0
    subs.built = len(jobs) - subs.cache_hits
    subs.build_seconds = time.perf_counter() - start
    # Substitutes live on the draft's device only: on CUDA, SubSpec adds no host memory to
    # plain offloading (on the CPU backend, host memory is the device: host_memory.py).
    built: list[Any] = [*subs.every(), *subs.experts.values()]
    stray = [s.source_name for s in built if any(t.device.type != device.type for t in s.tensors())]
    if stray:
        raise RuntimeError(f"vllm-subspec: substitutes not on {device}: {stray}")
    return subs


class _RoutedLayer:
    """One layer's routed experts while they are quantized: each expert packed for the layer's
    kernel as soon as its pair of weights is in (so at most one expert's codes are held), then
    stacked into the `SubstituteExperts`."""

    def __init__(self, runner: nn.Module) -> None:
        self.runner = runner
        self.dtype = expert_weights(runner)[0].dtype
        self.count = expert_weights(runner)[0].shape[0]
        self.kernel: Any = None  # the kernel class, chosen with the first pair
        self.waiting: dict[int, dict[str, QuantizedWeight]] = {}
        self.packed: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.meta: tuple[int, int] | None = None  # (group size, bits)

    def add(self, name: str, qw: QuantizedWeight, device: torch.device, kernel: str) -> bool:
        """Take expert weight `name` (experts.{e}.w13 / .w2); True once every expert is in."""
        _, e, which = name.split(".")
        pair = self.waiting.setdefault(int(e), {})
        pair[which] = qw
        if len(pair) == 2:
            del self.waiting[int(e)]
            if self.kernel is None:
                self.kernel = expert_kernel(pair["w13"], pair["w2"], device, kernel)
                self.meta = (qw.group_size, qw.bits)
            self.packed[int(e)] = {
                w: expert_tensors(self.kernel, q, self.dtype) for w, q in pair.items()
            }
        return len(self.packed) == self.count

    def build(self, source_name: str) -> SubstituteExperts:
        assert self.meta is not None  # set with the first expert's pair
        group_size, bits = self.meta
        order = range(self.count)
        return SubstituteExperts(
            self.runner,
            [self.packed[e]["w13"] for e in order],
            [self.packed[e]["w2"] for e in order],
            self.kernel,
            group_size,
            bits,
            source_name=source_name,
        )


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
