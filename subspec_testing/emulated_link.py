"""Weight streaming emulated on vLLM's CPU backend (tests and benchmarks only, never a default).

On vLLM's CPU backend nothing streams. This installs, inside a worker process, a link cost on
the TARGET's forwards only: every target forward (prefill, a prefill chunk, a decode step, a
verify) first waits for the bytes of the offloaded decoder layers at an emulated bandwidth,
whatever its rows (1 or 300), then computes. A UVA-like link: each offloaded layer's weights
cross once per target forward. The wait is added to the compute (sum semantics), as in vLLM's
PIECEWISE CUDA graphs, where a piece waits for its copy (issue 55). The draft pays nothing: its
substitutes are resident. Everything else is real (scheduler, batching, chunked prefill, the
shape tuner, τ).

Where the wait is: an instance-level wrapper of the worker's model runner `_model_forward`
(vLLM's call of the target, `SubSpecRunner._model_forward` in a SubSpec engine), plain Python
around the compiled model, so it also waits in vLLM's compiled mode. The draft never calls it
(`VllmDraftPasses._forward` and the head starts call `drafter.model`). A hook on the decoder
layers would not do: the draft's resident layers are the target's own modules.

Which layers: `layer_selection.planned_offload`, vLLM's UVA rule for `cpu_offload_gb`, the
layers SubSpec's default `substitute_layers: "offloaded"` substitutes on CPU; their whole
parameters, as loaded (before the CPU backend packs the linears' weights), are the bytes per
forward. `install_link`, `link_stats`: `collective_rpc` targets
(callables: `VLLM_ALLOW_INSECURE_SERIALIZATION=1`). Every figure from this is "emulated link".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from vllm_subspec.draft_model.layer_selection import planned_offload

FORWARD = "_model_forward"  # the runner's method that calls the target model


@dataclass(frozen=True)
class GpuScenario:
    """The GPU regime the default link reproduces: Qwen2.5-7B on an 8 GB card over PCIe 4
    (docs/gpu.md, "The arithmetic, for Qwen2.5-7B": 28 layers of 0.466 GB bf16, ~25 GB/s;
    26 of 28 layers offloaded under UVA), against the H200's draft pass replayed from one
    CUDA graph at 1 row (benchmarks/results/gpu_components_h200.md: 6.0 ms)."""

    layer_gb: float = 0.466
    num_layers: int = 28
    offloaded_layers: int = 26
    bandwidth_gbps: float = 25.0
    draft_pass_ms: float = 6.0

    def plain_step_s(self) -> float:
        """A plain step: its offloaded layers cross the link (resident compute left out)."""
        return self.offloaded_layers * self.layer_gb / self.bandwidth_gbps

    def ratio(self) -> float:
        """R = plain step / draft pass."""
        return self.plain_step_s() / (self.draft_pass_ms / 1e3)

    def offloaded_share(self) -> float:
        return self.offloaded_layers / self.num_layers


@dataclass
class Calibration:
    """The link that makes (plain compute + link) / draft pass equal `ratio` on this engine."""

    ratio: float  # the target R
    draft_pass_s: float  # measured on this engine
    plain_compute_s: float  # a plain step without the link (measured: the whole decode step)
    link_bytes: int
    link_s: float = 0.0  # seconds per target forward
    bandwidth_gbps: float = 0.0

    def __post_init__(self):
        self.link_s = link_seconds_for_ratio(self.ratio, self.draft_pass_s, self.plain_compute_s)
        self.bandwidth_gbps = self.link_bytes / self.link_s / 1e9

    def achieved(self, plain_step_s: float) -> float:
        """The ratio a measured plain step (link included) gives against the draft pass."""
        return plain_step_s / self.draft_pass_s


def link_seconds_for_ratio(ratio: float, draft_pass_s: float, plain_compute_s: float) -> float:
    """The wait per target forward so that (plain_compute_s + wait) / draft_pass_s = ratio."""
    seconds = ratio * draft_pass_s - plain_compute_s
    if draft_pass_s <= 0 or seconds <= 0:
        raise ValueError(
            f"emulated link: ratio {ratio:.1f} x draft pass {draft_pass_s * 1e3:.2f} ms does not "
            f"exceed the plain compute {plain_compute_s * 1e3:.2f} ms"
        )
    return seconds


def wait(seconds: float) -> None:
    """Wall-clock wait of at least `seconds` (sleep, then a short spin to the deadline)."""
    deadline = time.perf_counter() + seconds
    while (left := deadline - time.perf_counter()) > 0:
        if left > 2e-3:
            time.sleep(left - 1e-3)


@dataclass
class LinkPlan:
    """The layers whose weights cross the link on every target forward, and their bytes."""

    layers: list[int]
    bytes: int
    num_layers: int


def layer_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def as_loaded(layer: nn.Module) -> nn.Module:
    """A meta-device twin of `layer` with its parameters as vLLM loaded them: the CPU backend's
    weight packing (`dispatch_cpu_unquantized_gemm`) leaves a linear an empty `weight`, which
    here gets the linear's (output, input) size per partition again, so `planned_offload`
    sees the bytes it saw at load time."""
    twin = nn.Module()
    for name, p in layer.named_parameters():
        *path, leaf = name.split(".")
        owner, copy = layer, twin
        for part in path:
            owner = getattr(owner, part)
            if not hasattr(copy, part):
                copy.add_module(part, nn.Module())
            copy = getattr(copy, part)
        shape = tuple(p.shape)
        if p.numel() == 0 and hasattr(owner, "output_size_per_partition"):
            shape = (owner.output_size_per_partition, owner.input_size_per_partition)
        meta = torch.empty(shape, dtype=p.dtype, device="meta")
        copy.register_parameter(leaf, nn.Parameter(meta, requires_grad=False))
    return twin


def link_plan(layers: Sequence[nn.Module], offload_config, only: list[int] | None = None):
    """The layers vLLM's offloader would put in host memory (`planned_offload` over the layers
    as loaded), or `only`; their bytes as loaded."""
    loaded = [as_loaded(layer) for layer in layers]
    picked = planned_offload(loaded, offload_config) if only is None else sorted(only)
    return LinkPlan(picked, sum(layer_bytes(loaded[i]) for i in picked), len(layers))


@dataclass
class ForwardRecord:
    forwards: int = 0
    waited_s: float = 0.0
    compute_s: float = 0.0
    # rows -> [forwards, compute seconds, least wall seconds (wait + compute)]
    by_rows: dict[int, list[float]] = field(default_factory=dict)


class LinkedForward:
    """A forward that waits `seconds`, then runs; installed as an instance attribute."""

    def __init__(self, forward: Callable, seconds: float, plan: LinkPlan | None = None):
        self.forward = forward
        self.seconds = seconds
        self.plan = plan
        self.record = ForwardRecord()

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        if self.seconds > 0:
            wait(self.seconds)
        waited = time.perf_counter()
        out = self.forward(*args, **kwargs)
        end = time.perf_counter()
        r = self.record
        r.forwards += 1
        r.waited_s += waited - start
        r.compute_s += end - waited
        entry = r.by_rows.setdefault(_rows(args, kwargs), [0, 0.0, math.inf])
        entry[0] += 1
        entry[1] += end - waited
        entry[2] = min(entry[2], end - start)
        return out


def _rows(args, kwargs) -> int:
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if hasattr(x, "shape"):
            return int(x.shape[0])
    return 0


def install(obj, seconds: float, name: str = FORWARD, plan: LinkPlan | None = None):
    """Wrap `obj.<name>` at instance level (again: set the new wait and plan); returns it."""
    current = vars(obj).get(name)
    if isinstance(current, LinkedForward):
        current.seconds, current.plan = seconds, plan or current.plan
        return current
    linked = LinkedForward(getattr(obj, name), seconds, plan)
    setattr(obj, name, linked)
    return linked


def uninstall(obj, name: str = FORWARD) -> None:
    if isinstance(vars(obj).get(name), LinkedForward):
        delattr(obj, name)


# ---- inside a worker: collective_rpc targets ---------------------------------------------------
def install_link(worker, bandwidth_gbps: float | None, layers: list[int] | None = None) -> dict:
    """Install (or retune) the link on this worker's target forwards: the planned offload's
    layers (or `layers`) at `bandwidth_gbps` (None: no wait, compute still recorded). Returns
    `describe`'s report: layers, bytes, seconds per forward, and the draft's substitutes."""
    from vllm_subspec.draft_model.model import decoder_layers

    runner = worker.model_runner
    plan = link_plan(decoder_layers(runner.get_model()), runner.vllm_config.offload_config, layers)
    seconds = plan.bytes / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0
    install(runner, seconds, plan=plan)
    return describe(worker)


def describe(worker) -> dict:
    """The installed link (layers, bytes, GB/s, seconds per forward), the draft's substituted
    layers (None in a plain engine) and what the target's forwards did (`ForwardRecord`)."""
    from vllm_subspec.vllm_hooks.runner import subspec_of

    linked = vars(worker.model_runner).get(FORWARD)
    if not isinstance(linked, LinkedForward):
        return {"installed": False}
    try:
        substituted: list[int] | None = sorted(subspec_of(worker).drafter.substitutes.layers)
    except TypeError:  # a plain engine's runner
        substituted = None
    plan = linked.plan
    nbytes = plan.bytes if plan else 0
    return {
        "installed": True,
        "layers": plan.layers if plan else [],
        "num_layers": plan.num_layers if plan else 0,
        "bytes": nbytes,
        "seconds_per_forward": linked.seconds,
        "bandwidth_gbps": nbytes / linked.seconds / 1e9 if linked.seconds else math.inf,
        "substituted": substituted,
        "record": asdict(linked.record),
    }


def link_stats(worker, reset: bool = False) -> dict:
    """`describe`; reset: start a new `ForwardRecord` after reading it."""
    out = describe(worker)
    linked = vars(worker.model_runner).get(FORWARD)
    if reset and isinstance(linked, LinkedForward):
        linked.record = ForwardRecord()
    return out


# ---- before an engine starts: the cpu_offload_gb that plans a given number of layers ----------
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2}


def config_layer_bytes(model: str, dtype: str) -> tuple[int, int]:
    """(decoder layers, bytes of one) of a dense Llama/Qwen2-style checkpoint's config.json
    (projections and norms; biases left out: they are far below the half layer of slack
    `offload_gb_for_layers` leaves)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    hd = cfg.get("head_dim") or h // heads
    params = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    return cfg["num_hidden_layers"], params * DTYPE_BYTES[dtype]


def offload_gb_for_layers(model: str, dtype: str, layers: int) -> float:
    """`cpu_offload_gb` under which vLLM's UVA rule (`planned_offload`) offloads `layers`
    decoder layers: a budget that ends halfway into the last of them."""
    _, nbytes = config_layer_bytes(model, dtype)
    return (layers - 0.5) * nbytes / 2**30


def scenario_layers(num_layers: int, scenario: GpuScenario | None = None) -> int:
    """The GPU scenario's offloaded share (26 of 28) of a model with `num_layers` layers."""
    return round((scenario or GpuScenario()).offloaded_share() * num_layers)
