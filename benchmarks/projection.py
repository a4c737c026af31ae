"""PROJECTED GPU speed-up of SubSpec over plain offloading, from a measured τ (not a measurement).

The paper's cost model: with offloading, a target forward costs about the same for 1 token or a
few hundred, T_target = t_compute + offloaded_bytes / bandwidth; a SubSpec step is D draft passes
plus one target forward over the tree, minus the weight transfer that overlaps drafting, plus
the step's host work (measured on CPU: benchmarks/step_host.py). So

    speedup = τ · T_target(plain) / (D · t_draft_pass + T_target(SubSpec) - overlap + t_host)

SubSpec's target transfers more than plain offloading under the same memory limit: its 4-bit
substitutes (4.5/16 = 28.1 % of each offloaded layer) take GPU memory that plain offloading uses
to keep layers resident, so offloaded_subspec = excess / (1 - 0.281) where excess = weights -
budget. With vLLM's prefetch offloader (what `--cpu-offload-gb` runs as with SubSpec where the
model has the layers: vllm_hooks/prefetch_plan.py) its `slots` GPU slots and the extra layers'
substitutes cost slots / (1 - 0.281) more offloaded layers, and the copies of the next
verify's first `slots` layers run while the draft drafts:
overlap = min(D · t_draft_pass, slots · layer / bandwidth). With UVA nothing overlaps
(overlap 0, no slots), and each weight is read over PCIe inside the verify's kernels, at best at
the copy bandwidth (`uva_efficiency` 1; see docs/gpu.md). With the paper's setting (Qwen2.5-7B,
15.2 GB bf16, 8 GB card, PCIe 4 at ~25 GB/s, τ 27, D 48, ~11 ms per draft pass) this gives ≈ 9x,
the paper's measured 9.1x.

Head starts (`head_start_levels` m, step/head_start.py) at a hit rate h: a step starts h·m
passes later on average, and the head starts' own m + 1 passes run beside the verify's
transfers; the part of them longer than those transfers adds to the step:
    step = (D - h·m) · t_draft_pass + T_target - overlap + max(0, (m + 1) · t_draft_pass
           - transfer) + t_host.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

HOST_RESULTS = Path(__file__).resolve().parent / "results" / "step_host.json"
SUBSTITUTE_FRACTION = 4.5 / 16  # 4-bit codes + bf16 scale and zero per 64 weights


@dataclasses.dataclass
class GpuSetting:
    name: str = "Qwen2.5-7B, 8 GB, PCIe 4"
    weight_gb: float = 15.2  # bf16 weights of the offloaded model (decoder layers + the rest)
    memory_gb: float = 8.0  # the memory limit
    reserved_gb: float = 1.5  # CUDA context, KV cache, activations, embeddings kept resident
    bandwidth_gbps: float = 25.0  # host-to-device GB/s
    draft_pass_ms: float = 11.0  # one draft pass over k tree rows (paper Fig. 1: ~540 ms / 48)
    target_compute_ms: float = 0.0  # target compute not hidden behind its weight transfer
    layer_gb: float = 0.466  # one decoder layer (Qwen2.5-7B, bf16)
    num_layers: int = 28  # decoder layers (Qwen2.5-7B)
    backend: str = "prefetch"  # SubSpec's offloader: "prefetch" (the default) or "uva"
    slots: int = 2  # the prefetch offloader's GPU slots (prefetch_plan.SLOTS)
    uva_efficiency: float = 1.0  # UVA reads' bandwidth over the copy bandwidth (at best 1)
    host_ms: float = 0.0  # SubSpec's host work per step not hidden behind the device's
    head_start_levels: int = 0  # m (0: no head starts)
    head_start_hit_rate: float = 0.0  # h: the share of steps that start from one

    def _extra_prefetch_gb(self) -> float:
        """What the prefetch plan offloads beyond UVA for the same GPU memory: its slots and
        the extra layers' substitutes (prefetch_plan.plan_prefetch)."""
        return self.slots * self.layer_gb / (1 - SUBSTITUTE_FRACTION)

    def _subspec_uva_gb(self) -> float:
        excess = max(0.0, self.weight_gb - (self.memory_gb - self.reserved_gb))
        return min(self.weight_gb, excess / (1 - SUBSTITUTE_FRACTION))

    def uses_prefetch(self) -> bool:
        """Whether SubSpec's engine runs the prefetch offloader here: asked for, and the plan's
        layers exist (otherwise the engine rule keeps UVA)."""
        return self.backend == "prefetch" and \
            self._subspec_uva_gb() + self._extra_prefetch_gb() <= self.num_layers * self.layer_gb

    def offloaded_gb(self, subspec: bool) -> float:
        if not subspec:
            return max(0.0, self.weight_gb - (self.memory_gb - self.reserved_gb))
        extra = self._extra_prefetch_gb() if self.uses_prefetch() else 0.0
        return self._subspec_uva_gb() + extra

    def target_ms(self, subspec: bool) -> float:
        bandwidth = self.bandwidth_gbps
        if not subspec or not self.uses_prefetch():  # plain offloading is vLLM's UVA
            bandwidth *= self.uva_efficiency
        return self.target_compute_ms + 1e3 * self.offloaded_gb(subspec) / bandwidth

    def overlap_ms(self, draft_ms: float) -> float:
        """Transfer hidden under drafting: the next verify's first layers' copies."""
        if not self.uses_prefetch():
            return 0.0
        return min(draft_ms, 1e3 * self.slots * self.layer_gb / self.bandwidth_gbps)


def measured_host_ms(draft_passes: int, batch: int = 1, output_len: int = 1000,
                     penalties: bool = True, path: Path = HOST_RESULTS) -> float:
    """A step's host work measured on CPU (benchmarks/step_host.py): the verify's, and the draft
    loop's per pass times `draft_passes`; 0 where nothing was measured."""
    if not path.exists():
        return 0.0
    data = json.loads(path.read_text())
    verify = next((r["verify_ms"] for r in data["verify"] if r["batch"] == batch
                   and r["output_len"] == output_len and r["penalties"] == penalties), 0.0)
    per_pass = next((d["ms_per_pass"] for d in data["draft"] if d["batch"] == batch), 0.0)
    return verify + draft_passes * per_pass


def projected_speedup(tau: float, draft_passes: int, gpu: GpuSetting,
                      substitutes: bool = True) -> float:
    """Projected tokens per second relative to plain offloading (see the module docstring).
    `substitutes=False` for drafters that take no GPU memory (ngram, suffix: draft cost ~0)."""
    m = gpu.head_start_levels
    draft_ms = max(0.0, draft_passes - gpu.head_start_hit_rate * m) * gpu.draft_pass_ms
    target_ms = gpu.target_ms(subspec=substitutes)
    # head starts' passes beside the verify: what outlasts its transfers adds to the step
    beside_ms = max(0.0, (m + 1) * gpu.draft_pass_ms - (target_ms - gpu.target_compute_ms)) \
        if m else 0.0
    step_ms = draft_ms + target_ms - gpu.overlap_ms(draft_ms) + beside_ms + gpu.host_ms
    return tau * gpu.target_ms(subspec=False) / step_ms


class ProjectedCost:
    """A cost the tuner is given instead of measuring (tuner.linear_cost.LinearCost's interface):
    `seconds` for any row count; observations are ignored."""

    known = True

    def __init__(self, seconds: float):
        self.seconds = seconds

    def add(self, rows: float, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float]:
        return self.seconds, 0.0

    def __call__(self, rows: float) -> float:
        return self.seconds

    def per_row(self) -> float:
        return 0.0


def give_gpu_costs(worker, draft_pass_s: float, verify_s: float) -> None:
    """A collective_rpc target: the SubSpec tuner of this worker decides with these costs (a
    draft pass, a verify; the rest of a step free) instead of the ones it measures. The two
    lm_heads cost the same there (their difference is part of the pass), so the first drafts
    until their paired acceptance decides."""
    from vllm_subspec.step.tuner.costs import StepCosts
    from vllm_subspec.vllm_hooks.runner import subspec_of

    tuner = subspec_of(worker).session.tuner
    tuner.use_costs(StepCosts({w: ProjectedCost(draft_pass_s) for w in tuner.draft_pass},
                              {w: ProjectedCost(verify_s) for w in tuner.verify},
                              ProjectedCost(0.0)))
    if tuner.lm_heads is not None:
        tuner.lm_heads.use_costs({h: ProjectedCost(0.0) for h in tuner.lm_heads.heads})
        tuner.lm_heads.start_with_cheaper(1)


def settings_grid(bandwidths_gbps=(25.0, 12.0, 50.0), memories_gb=(8.0, 12.0),
                  **fixed) -> list[GpuSetting]:
    """A Qwen2.5-7B-sized setting per (memory limit, host-to-device bandwidth)."""
    return [GpuSetting(f"7B, {m:g} GB, {b:g} GB/s", memory_gb=m, bandwidth_gbps=b, **fixed)
            for m in memories_gb for b in bandwidths_gbps]


# The paper's setting first (8 GB, PCIe 4 ~25 GB/s), then slower/faster links and more memory.
SETTINGS = settings_grid()


def measured_speedup(tau: float, draft_passes: int, gpu: GpuSetting,
                     substitutes: bool = True) -> float:
    """`projected_speedup` with the step's host work measured on CPU (`measured_host_ms`;
    drafters without substitutes run none of SubSpec's step)."""
    host = measured_host_ms(draft_passes) if substitutes else 0.0
    return projected_speedup(tau, draft_passes, dataclasses.replace(gpu, host_ms=host),
                             substitutes)


def projection_rows(runs: list[dict], settings=SETTINGS) -> list[dict]:
    """One row per measured run: its τ and depth (draft passes per step) -> projected speed-ups
    (`measured_speedup`)."""
    return [{"config": r["config"], "tau": r["tau"], "depth": r["depth"],
             "projected": {s.name: measured_speedup(r["tau"], r["depth"], s,
                                                    r.get("substitutes", True))
                           for s in settings}}
            for r in runs]


def adaptive_depth(acceptance_per_depth: list[float], gpu: GpuSetting) -> dict:
    """The depth the auto shape's cost model settles on for `gpu`, from a measured acceptance
    curve (P(accepted length >= j), j = 1..D, of a deep fixed-depth run): the D maximising
    projected speed-up with τ(D) = 1 + sum_{j<=D} P(>= j). Per-step adaptivity (stopping
    earlier in steps whose tree lost the target) is not modelled, so this is conservative."""
    best = None
    for d in range(1, len(acceptance_per_depth) + 1):
        tau = 1.0 + sum(acceptance_per_depth[:d])
        speedup = measured_speedup(tau, d, gpu)
        if best is None or speedup > best["speedup"]:
            best = {"depth": d, "tau": tau, "speedup": speedup}
    return best


def adaptive_markdown(run: dict, settings=SETTINGS) -> str:
    """PROJECTED: fixed depth `run['depth']` vs the depth the cost model picks, per setting."""
    names = [s.name for s in settings]
    curve = run["acceptance_per_depth"][: run["depth"]]
    lines = ["## PROJECTED: adaptive depth on a GPU (a model, not a measurement)", "",
             f"From {run['config']}'s measured acceptance per depth: the depth the auto shape's "
             "cost model picks for each setting (D*), its τ and draft passes, against the fixed "
             f"depth {run['depth']} (`benchmarks/projection.py` `adaptive_depth`).", "",
             "| setting | fixed: τ, passes, speed-up | adaptive: D*, τ, speed-up | draft passes "
             "saved |", "|---|---|---|---|"]
    for s, name in zip(settings, names):
        fixed = measured_speedup(1.0 + sum(curve), run["depth"], s)
        a = adaptive_depth(curve, s)
        lines.append(f"| {name} | {1.0 + sum(curve):.2f}, {run['depth']}, {fixed:.1f}x | "
                     f"{a['depth']}, {a['tau']:.2f}, {a['speedup']:.1f}x | "
                     f"{1 - a['depth'] / run['depth']:.0%} |")
    return "\n".join(lines) + "\n"


def projection_markdown(rows: list[dict], source: str, settings=SETTINGS) -> str:
    names = [s.name for s in settings]
    lines = [
        "## PROJECTED GPU speed-ups (a model, not a measurement)", "",
        f"τ measured on the CPU backend ({source}); speed-up = τ · T_target(plain) / "
        "(D · t_draft_pass + T_target(SubSpec) − overlap + t_host), `benchmarks/projection.py`. "
        f"Draft pass {settings[0].draft_pass_ms} ms, {settings[0].weight_gb} GB of weights, "
        f"{settings[0].reserved_gb} GB reserved, substitutes {SUBSTITUTE_FRACTION:.1%} of the "
        f"layers they replace; SubSpec offloads through vLLM's prefetch offloader "
        f"({settings[0].slots} slots, its first layers' copies overlapping the draft) where "
        "the model has the plan's layers (not at 8 GB: UVA there, as the engine rule "
        "decides), plain through UVA at the same bandwidth; t_host: the step's host work "
        "measured on CPU (`benchmarks/step_host.py`, one request).", "",
        "| config | τ (measured) | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = " | ".join(f"{r['projected'][n]:.1f}x" for n in names)
        lines.append(f"| {r['config']} | {r['tau']:.2f} | {cells} |")
    paper = measured_speedup(27.08, 48, settings[0])
    lines += ["", f"Sanity check: the paper's τ 27.08 at D=48 projects to {paper:.1f}x in the "
              "first setting; the paper measured 9.1x (RTX 4090, Qwen2.5-7B, 8 GB)."]
    return "\n".join(lines) + "\n"
