"""SIMULATED serving at GPU costs, driven by the real SubSpec step session and shape tuner (a
model of a GPU, not a measurement): what users of `{"method": "subspec"}` (the default auto
shape) would see against plain offloading, over the first minute and in steady state.

    python -m benchmarks.tuner_simulation --name tuner_simulation_before
    python -m benchmarks.tuner_simulation --name quick --duration 120 --users 1 8 --links pcie5

What runs for real (imported, never copied): `StepSession` (`from_options` for the default
tuner, then the constructor with a virtual `clock`), driven in the model runner's order, one
engine step at a time: `prepare_verify(requests, prompt_tokens)`, `verify_forward()`,
`sample_and_walk(...)` or `sampled_plain()`, then `plan_step(req_ids)` and, for a drafting
plan, `propose(passes, ...)`. Inside them, unchanged: the tuner (`ShapeTuner`: its plan, the
adaptive depth's `drafting_next` / `verify_depths`, every `observe_*`), `RateGuard`, the step
timer, `draft.draft_tree` (top-k growth, frontier masses, the device's every-4-depths reads),
the verify's layout and `verify.sample_then_match` (greedy) with the accepted paths' KV moves
on a small real CPU-layout cache. The session reads nothing but the virtual clock.

What is modelled here:
- the clock: every forward advances it by the GPU cost model below (`GpuCosts`) while the
  session's code runs (a draft pass inside `SimPasses.bonus_pass` / `level_pass`, the target
  inside `verify_forward`, the walk's host time before `sample_and_walk`, vLLM's host time
  between steps); the tuner's own Python time is not counted;
- the draft (`SimPasses`, a `DraftPasses`): no weights; a node's next-token distribution puts
  probability c on one token (its "top child") and spreads 1 - c over the others, so the
  frontier mass of a tree is ~ the product of the c's along its best path. c is drawn per
  request, step and depth around the measured acceptance (`Acceptance`); the draft is
  calibrated: the target accepts depth j of a tree with probability c_j given depth j - 1
  (the Markov walk reproduces the measured P(accepted length >= j) on average). The target's
  logits (`target_logits`) put each request's draws on the path to the best-scored node of its
  sampled accepted depth, so the real walk accepts exactly that path (checked every step:
  `walk_mismatches`);
- the scheduler (`Scheduler`): vLLM v1's token budget (`max_num_batched_tokens`, default
  2048), running requests first in arrival order (a decode asks 1 + its drafts; drafts beyond
  the budget are cut; a request the budget leaves out keeps its drafts and is verified later
  as a chain, as vLLM does: that chain's first node only can be accepted here), then waiting
  requests' prompts, chunked to what is left (chunked prefill); a step mixes decodes and a
  chunk. No KV-capacity limit, no preemption, greedy sampling, no stop strings;
- the trace (`TraceConfig`): 1, 8 or 32 users, CLOSED LOOP: each user sends its next request
  when the previous finishes (after `--think-s`, default 0), its first at t = 0 ("burst") or at
  Poisson arrivals ("staggered", mean gap `--stagger-s`); prompt and reply lengths uniform
  (default 100-2000 and 100-600 tokens) from a generator seeded per (seed, user, request), so
  SubSpec and plain serve the same requests;
- plain offloading: the same trace, scheduler and cost model, every step plain, with plain
  vLLM's own offload for the same GPU memory (fewer layers offloaded: no substitutes to hold)
  and, as a second baseline, with SubSpec's offload (a SubSpec engine that never drafts).

Writes benchmarks/results/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.projection import GpuSetting

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
H200 = RESULTS / "gpu_components_h200.json"  # scripts/gpu_components.py on an H200, 2026-11-28
STEP_HOST = RESULTS / "step_host.json"  # benchmarks/step_host.py (CPU)

# ---- the model: Qwen2.5-7B ---------------------------------------------------------------
NUM_LAYERS = 28  # Qwen2.5-7B decoder layers (its config; docs/gpu.md "The arithmetic")
LAYER_GB = 0.466  # one decoder layer, bf16 (docs/gpu.md; H200 json transfer.layer_mb 466.1)
# parameters of one decoder layer's linears, from the shapes the H200 run timed (qkv
# 4608x3584, o 3584x3584, gate_up 37888x3584, down 3584x18944)
LAYER_PARAMS = 4608 * 3584 + 3584 * 3584 + 37888 * 3584 + 3584 * 18944
LM_HEAD_PARAMS = 152064 * 3584  # vocabulary x hidden (Qwen2.5-7B's config), bf16
MEMORY_GB = 8.0  # the paper's card; projection.GpuSetting: 15.2 GB weights, 1.5 GB reserved
MAX_MODEL_LEN = 32768

# ---- labelled estimates (no measurement behind them) --------------------------------------
VLLM_HOST_S = 0.002  # ESTIMATE: vLLM's own host time a step (schedule, inputs, outputs), both
# engines (SubSpec runs without async scheduling; plain's overlap of it is not modelled)
DRAFT_TFLOPS = 200e12  # ESTIMATE: the 4-bit GemLite GEMM rate past the measured 8 rows
ATTN_FLOOR_S = 0.04e-3  # a layer's attention at the fewest rows (H200: 0.039 ms, 8 x 6 rows)


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), flat outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class GpuCosts:
    """Seconds of the GPU's forwards (a model). Sources: `sources()`; H200 numbers are read
    from benchmarks/results/gpu_components_h200.json (torch 2.11, no vLLM, random weights)."""

    name: str
    link_gbps: float  # host-to-device bandwidth the offloaded layers stream at
    subspec_offloaded: float  # decoder layers in host memory, SubSpec (substitutes resident)
    plain_offloaded: float  # ... plain vLLM for the same GPU memory
    gemm_rows: tuple[float, ...]  # H200 bf16 GEMMs of one decoder layer: rows ...
    gemm_s: tuple[float, ...]  # ... and seconds (the 4 linears summed)
    tree_attn_s_per_row_token: float  # H200 tree kernel, a layer: seconds per query row x ctx
    flat_attn_s_per_row_token: float  # H200 SDPA (stand-in for FlashAttention), a layer
    draft_rows: tuple[float, ...]  # H200 CUDA-graph draft pass (28 substitute layers + bf16
    draft_s: tuple[float, ...]  # lm_head, context 1024): rows, seconds
    hbm_gbps: float  # H200 device memory (d2d copy, read + write)
    host_verify: tuple[tuple[float, ...], tuple[float, ...]]  # batch -> s (CPU, step_host)
    host_pass: tuple[tuple[float, ...], tuple[float, ...]]  # batch -> s a draft pass (CPU)

    @classmethod
    def for_link(
        cls, name: str, link_gbps: float, h200: dict | None = None, host: dict | None = None
    ) -> GpuCosts:
        h200 = _load(H200) if h200 is None else h200
        host = _load(STEP_HOST) if host is None else host
        setting = GpuSetting(memory_gb=MEMORY_GB, bandwidth_gbps=link_gbps, backend="uva")
        rows, secs = _gemm_table(h200)
        tree, flat = _attention_rates(h200)
        passes = h200.get("draft_pass", {}).get("passes") or [
            {"rows": 1, "graph_ms": 5.98},
            {"rows": 8, "graph_ms": 8.27},
        ]
        verify = sorted(
            (r["batch"], r["verify_ms"] / 1e3)
            for r in host.get("verify", [])
            if not r["penalties"] and r["output_len"] == 1000
        ) or [(1, 4e-4)]
        per_pass = sorted((r["batch"], r["ms_per_pass"] / 1e3) for r in host.get("draft", [])) or [
            (1, 6e-5)
        ]
        return cls(
            name=name,
            link_gbps=link_gbps,
            subspec_offloaded=setting.offloaded_gb(subspec=True) / LAYER_GB,
            plain_offloaded=setting.offloaded_gb(subspec=False) / LAYER_GB,
            gemm_rows=tuple(rows),
            gemm_s=tuple(secs),
            tree_attn_s_per_row_token=tree,
            flat_attn_s_per_row_token=flat,
            draft_rows=tuple(float(p["rows"]) for p in passes),
            draft_s=tuple(p["graph_ms"] / 1e3 for p in passes),
            hbm_gbps=h200.get("env", {}).get("d2d_gbps_read_plus_write", 4250.0),
            host_verify=(tuple(b for b, _ in verify), tuple(s for _, s in verify)),
            host_pass=(tuple(b for b, _ in per_pass), tuple(s for _, s in per_pass)),
        )

    # ---- pieces -------------------------------------------------------------------------
    @property
    def link_layer_s(self) -> float:
        return LAYER_GB / self.link_gbps

    @property
    def gemm_flops_per_s(self) -> float:
        """The bf16 rate at the widest measured row count (past it: compute-bound there)."""
        return self.gemm_rows[-1] * 2 * LAYER_PARAMS / self.gemm_s[-1]

    def gemm_layer_s(self, rows: float) -> float:
        """One decoder layer's linears over `rows` rows (H200 bf16; past the widest measured
        row count, at its rate)."""
        if rows > self.gemm_rows[-1]:
            return self.gemm_s[-1] * rows / self.gemm_rows[-1]
        return _interp(rows, list(self.gemm_rows), list(self.gemm_s))

    def lm_head_s(self, rows: float) -> float:
        """ESTIMATE: the bf16 lm_head read from device memory, or its GEMM at the measured
        bf16 rate, whichever is longer."""
        return max(
            2 * LM_HEAD_PARAMS / (self.hbm_gbps * 1e9),
            rows * 2 * LM_HEAD_PARAMS / self.gemm_flops_per_s,
        )

    def forward_s(
        self,
        offloaded: float,
        tree_rows: list[tuple[int, int]],
        flat_rows: list[tuple[int, float]],
        sampled: int,
    ) -> float:
        """A target forward: each offloaded layer streams over the link while its GEMMs run
        (UVA: the slower of the two), each resident layer computes; every layer's attention
        (tree rows: the tree kernel; the rest: FlashAttention, here SDPA's rate) over
        (rows, context) pairs; the lm_head over the sampled rows."""
        rows = sum(r for r, _ in tree_rows) + sum(r for r, _ in flat_rows)
        gemm = self.gemm_layer_s(rows)
        linears = offloaded * max(self.link_layer_s, gemm) + (NUM_LAYERS - offloaded) * gemm
        attention = NUM_LAYERS * (
            ATTN_FLOOR_S
            + self.tree_attn_s_per_row_token * sum(r * c for r, c in tree_rows)
            + self.flat_attn_s_per_row_token * sum(r * c for r, c in flat_rows)
        )
        return linears + attention + self.lm_head_s(sampled)

    def draft_pass_s(self, rows: int, context: float) -> float:
        """A draft pass over `rows` tree rows: the H200's CUDA-graph pass, interpolated between
        its measured row counts (1 and 8); past them each row adds its 4-bit GEMMs (ESTIMATE:
        DRAFT_TFLOPS), its lm_head row and its tree attention at `context` (the kernel's
        measured rate)."""
        if rows <= self.draft_rows[-1]:
            return _interp(rows, list(self.draft_rows), list(self.draft_s))
        extra = rows - self.draft_rows[-1]
        per_row = (
            NUM_LAYERS * 2 * LAYER_PARAMS / DRAFT_TFLOPS
            + 2 * LM_HEAD_PARAMS / self.gemm_flops_per_s
            + NUM_LAYERS * self.tree_attn_s_per_row_token * context
        )
        return self.draft_s[-1] + extra * per_row

    def host_verify_s(self, batch: int) -> float:
        return _interp(batch, list(self.host_verify[0]), list(self.host_verify[1]))

    def host_pass_s(self, batch: int) -> float:
        return _interp(batch, list(self.host_pass[0]), list(self.host_pass[1]))

    def sources(self) -> dict:
        return {
            "link_gbps": f"{self.link_gbps:g} GB/s: "
            + (
                "PCIe 4 x16, ~25 GB/s (docs/gpu.md, projection.py's default)"
                if self.link_gbps < 40
                else "PCIe 5: the H200's measured pinned copy (gpu_components_h200.json transfer)"
            ),
            "offloaded layers": f"SubSpec {self.subspec_offloaded:.2f}, plain vLLM "
            f"{self.plain_offloaded:.2f} of {NUM_LAYERS} ({LAYER_GB} GB each): "
            "benchmarks/projection.py GpuSetting (8 GB card, 15.2 GB weights, 1.5 GB "
            "reserved, substitutes 28.1% of a layer; UVA at 8 GB for both)",
            "link per layer": f"{1e3 * self.link_layer_s:.2f} ms (layer / link; UVA read at "
            "the copy's bandwidth, projection.py's uva_efficiency 1)",
            "resident GEMMs": "H200 bf16 per layer (gpu_components_h200.json gemlite "
            f"bf16_ms, 4 linears summed): {1e3 * self.gemm_s[0]:.3f} ms at 1 row, "
            f"{1e3 * self.gemm_s[-1]:.3f} ms at {self.gemm_rows[-1]:g}; past it at that "
            f"rate ({self.gemm_flops_per_s / 1e12:.0f} TFLOP/s)",
            "tree attention": f"{self.tree_attn_s_per_row_token * 1e12:.3f} ps per row x "
            "context token a layer: the H200 tree kernel at 8 requests x 289 rows, 4096 "
            "context (7.45 ms), + a 0.04 ms floor (its fewest-rows cases)",
            "flat attention": f"{self.flat_attn_s_per_row_token * 1e12:.3f} ps per row x "
            "context token a layer: the H200's SDPA on the same case, standing in for "
            "FlashAttention (decode rows, prefill chunks, chains)",
            "draft pass": f"H200 CUDA-graph pass {1e3 * self.draft_s[0]:.2f} ms at 1 row, "
            f"{1e3 * self.draft_s[-1]:.2f} ms at {self.draft_rows[-1]:g} (linear between); "
            f"past it + {NUM_LAYERS} x 4-bit GEMM rows at {DRAFT_TFLOPS / 1e12:.0f} TFLOP/s "
            "(ESTIMATE), an lm_head row and tree attention at the row's context",
            "lm_head": "ESTIMATE: 1.09 GB bf16 read at the H200's d2d rate, or its GEMM at "
            "the bf16 rate above",
            "host": f"vLLM {1e3 * VLLM_HOST_S:g} ms a step (ESTIMATE); SubSpec's verify walk "
            "and draft-loop host time per pass: benchmarks/results/step_host.json (CPU)",
        }


def _gemm_table(h200: dict) -> tuple[list[float], list[float]]:
    shapes = h200.get("gemlite", {}).get("shapes")
    if not shapes:  # the H200 run's numbers, should the file be missing
        return [1.0, 289.0], [0.1635e-3, 0.2404e-3]
    per_rows: dict[float, float] = {}
    for shape in shapes.values():
        for r in shape["rows"]:
            per_rows[float(r["rows"])] = per_rows.get(float(r["rows"]), 0.0) + r["bf16_ms"] / 1e3
    rows = sorted(per_rows)
    secs, low = [per_rows[r] for r in rows], float("inf")
    for i in range(len(secs) - 1, -1, -1):  # never decreasing in rows (do_bench noise)
        low = min(low, secs[i])
        secs[i] = low
    return rows, secs


def _attention_rates(h200: dict) -> tuple[float, float]:
    """Per (row x context token) of one layer: the tree kernel's and SDPA's, from the H200's
    8-request, 289-row, 4096-context bf16 case."""
    for case in h200.get("tree_attention", {}).get("cases", []):
        if (case["dtype"], case["context"], case["requests"], case["rows"]) == (
            "bfloat16",
            4096,
            8,
            289,
        ):
            work = case["requests"] * case["rows"] * case["context"]
            tree = min(case["unsplit_ms"], case["split_ms"]) / 1e3
            return tree / work, case["sdpa_ms"] / 1e3 / work
    return 7.454e-3 / (8 * 289 * 4096), 0.602e-3 / (8 * 289 * 4096)


LINKS = {"pcie4": 25.0, "pcie5": None}  # None: the H200's measured pinned copy


def link_costs(link: str) -> GpuCosts:
    h200 = _load(H200)
    gbps = LINKS[link] or h200.get("transfer", {}).get("pinned_gbps", 54.8)
    label = {"pcie4": "PCIe 4 (25 GB/s)", "pcie5": f"PCIe 5 ({gbps:.1f} GB/s, H200 measured)"}
    return GpuCosts.for_link(label[link], gbps, h200)


# ---- acceptance ---------------------------------------------------------------------------
ACCEPTANCE_SOURCES = {
    "qwen": (
        "qwen_depth_all.json",
        "Qwen2.5-Coder-1.5B (vLLM CPU backend, 8 MT-Bench first "
        "turns, greedy): tree:6x48 and chain:16 (extended past 16)",
    ),
    "smollm2": (
        "tree_depth.json",
        "SmolLM2-135M (vLLM CPU backend, 10 MT-Bench first turns, greedy): tree:6x48 and chain:48",
    ),
}


def reach_curves(source: str = "qwen", depth: int = 48) -> dict[int, list[float]]:
    """P(accepted length >= j), j = 1..depth, per width 1, 2, 4, 6: widths 1 and 6 measured
    (a chain and a 6-wide tree of the deepest run), 2 and 4 interpolated between them in
    log(width) (ESTIMATE); a curve shorter than `depth` goes on at its last 8 depths' mean
    continuation."""
    data = _load(RESULTS / ACCEPTANCE_SOURCES[source][0])
    runs = {r["config"]: r for r in data.get("runs", [])}

    def curve(kind: str) -> list[float]:
        best = max(
            (r for c, r in runs.items() if c.startswith(kind + ":")), key=lambda r: r["depth"]
        )
        reach = [float(x) for x in best["acceptance_per_depth"][: best["depth"]]]
        for i in range(1, len(reach)):  # a reach never grows with depth
            reach[i] = min(reach[i], reach[i - 1])
        tail = reach[-8:]
        rate = (tail[-1] / tail[0]) ** (1 / max(1, len(tail) - 1)) if tail[0] > 0 else 0.0
        while len(reach) < depth:
            reach.append(reach[-1] * rate)
        return reach[:depth]

    chain, tree = curve("chain"), curve("tree")
    out = {1: chain, 6: tree}
    for w in (2, 4):
        t = math.log(w) / math.log(6)
        out[w] = [c + (x - c) * t for c, x in zip(chain, tree)]
    return out


class Acceptance:
    """Per request, step and depth the chance c_j that the target accepts depth j given depth
    j - 1 (and the draft's belief in it: a calibrated draft): logit(c_j) = logit(h_k(j)) + u
    + e_j, h_k the width's measured continuation, u ~ N(0, sd_request) shared by the tree's
    depths (easy and hard requests), e_j ~ N(0, sd_depth)."""

    def __init__(
        self,
        reach: dict[int, list[float]],
        sd_request: float = 0.5,
        sd_depth: float = 0.3,
        seed: int = 0,
    ):
        self.reach = reach
        self.logit_h = {}
        for w, r in reach.items():
            prev, h = 1.0, []
            for x in r:
                c = x / prev if prev > 0 else 0.0
                c = min(max(c, 0.01), 0.995)
                h.append(math.log(c / (1 - c)))
                prev = x
            self.logit_h[w] = np.asarray(h)
        self.sd_request, self.sd_depth = sd_request, sd_depth
        self.rng = np.random.default_rng(seed)

    def width_for(self, width: int) -> int:
        return min(self.logit_h, key=lambda w: (abs(w - width), w))

    def draw(self, width: int, depth: int) -> np.ndarray:
        """c_1..c_depth for one tree."""
        h = self.logit_h[self.width_for(width)]
        if depth > len(h):
            h = np.concatenate([h, np.full(depth - len(h), h[-1])])
        z = (
            h[:depth]
            + self.rng.normal(0, self.sd_request)
            + self.rng.normal(0, self.sd_depth, depth)
        )
        return 1.0 / (1.0 + np.exp(-z))

    def accepted(self, c: np.ndarray, depth: int) -> int:
        """The target's accepted length of a tree verified to `depth` depths."""
        a = 0
        while a < min(depth, len(c)) and self.rng.random() < c[a]:
            a += 1
        return a


# ---- the trace ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceConfig:
    users: int = 1
    arrival: str = "burst"  # "burst": every user's first request at 0; "staggered": Poisson
    stagger_s: float = 2.0  # mean gap between users' first requests (staggered)
    think_s: float = 0.0  # closed loop: a user's next request this long after its last ends
    prompt: tuple[int, int] = (100, 2000)
    reply: tuple[int, int] = (100, 600)
    seed: int = 0

    def first_arrivals(self) -> list[float]:
        if self.arrival == "burst":
            return [0.0] * self.users
        if self.arrival != "staggered":
            raise ValueError(f"arrival {self.arrival!r}: burst or staggered")
        rng, t, out = random.Random(f"{self.seed}:arrivals"), 0.0, []
        for _ in range(self.users):
            out.append(t)
            t += rng.expovariate(1.0 / self.stagger_s)
        return out

    def lengths(self, user: int, index: int) -> tuple[int, int]:
        """(prompt, reply) tokens of this user's index-th request: the same in every run."""
        rng = random.Random(f"{self.seed}:{user}:{index}")
        return rng.randint(*self.prompt), rng.randint(*self.reply)


@dataclass
class Request:
    req_id: str
    user: int
    index: int
    arrival: float
    prompt: int
    reply: int
    computed: int = 0  # prompt tokens computed
    generated: int = 0  # output tokens
    spec: list[int] = field(default_factory=list)  # drafts for the next step (vLLM's)
    truth: np.ndarray | None = None  # their tree's c_j
    spec_width: int = 0
    first_token: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt

    @property
    def context(self) -> int:
        return self.computed + self.generated


@dataclass
class Scheduled:
    request: Request
    tokens: int  # scheduled this step
    spec: list[int]  # of which drafts (a decode's)
    prefill: bool  # prompt tokens (a chunk of the prompt)


class Scheduler:
    """vLLM v1's scheduling of one step, as far as it matters here (v1/core/sched/scheduler.py
    `schedule`): a token budget and an input budget of `budget` tokens; running requests first,
    in order (a decode: 1 + its drafts; a prefill: what is left of its prompt), each cut to the
    budget left, the input budget also paying `draft_slots` a request (vLLM's draft model: 1);
    scheduled drafts beyond the cut are dropped, an unscheduled request keeps its drafts; then
    waiting requests, first in first out, their first chunk cut to the budget left."""

    def __init__(self, budget: int = 2048, draft_slots: int = 0, max_num_seqs: int = 256):
        self.budget, self.draft_slots, self.max_num_seqs = budget, draft_slots, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cut_drafts = 0  # requests whose drafts the budget cut
        self.left_out = 0  # running requests the budget left out of a step

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        self.running.remove(request)

    def schedule(self) -> list[Scheduled]:
        tokens, inputs, out = self.budget, self.budget, []
        for i, r in enumerate(self.running):
            if tokens <= 0 or inputs <= self.draft_slots:
                self.left_out += len(self.running) - i
                break
            want = r.prompt - r.computed if r.prefilling else 1 + len(r.spec)
            n = min(want, tokens, inputs - self.draft_slots)
            spec = r.spec[: max(0, n - 1)] if not r.prefilling else []
            if not r.prefilling:
                self.cut_drafts += len(spec) < len(r.spec)
                r.spec = []
            out.append(Scheduled(r, n, spec, r.prefilling))
            tokens -= n
            inputs -= n + self.draft_slots
        while (
            self.waiting
            and tokens > 0
            and inputs > self.draft_slots
            and len(self.running) < self.max_num_seqs
        ):
            r = self.waiting.popleft()
            n = min(r.prompt, tokens, inputs - self.draft_slots)
            self.running.append(r)
            out.append(Scheduled(r, n, [], True))
            tokens -= n
            inputs -= n + self.draft_slots
        return out


# ---- the draft (a `DraftPasses`) ------------------------------------------------------------
V = 128  # the stub vocabulary; token V - 1 is never drafted: the target's "reject" draw
REJECT = V - 1


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class _Landed:
    """A device-to-host copy that has landed (`draft.HostCopy`'s interface)."""

    def __init__(self, tensor):
        self.value = tensor.clone()

    def ready(self) -> bool:
        return True


class SimPasses:
    """`step.draft.DraftPasses` without weights, on the virtual clock: a row's hidden state is
    (its request, its node's depth, its token); the logits put the request's belief c at the
    next depth on one token ((token + 1) mod (V - 1)) and the rest on the others (never on
    REJECT). `on_device`: the GPU's path through `draft_tree` (frontier reads every 4 depths,
    a check late; one timing for all passes)."""

    on_device = True

    def __init__(
        self,
        clock: VirtualClock,
        costs: GpuCosts,
        beliefs,
        contexts: list[int],
        temperature: float,
        max_rows: int,
    ):
        import torch

        self.torch = torch
        self.clock, self.costs = clock, costs
        self.beliefs = torch.as_tensor(beliefs, dtype=torch.float32)  # [B, D + 1], col 0 unused
        self.batch_size = len(contexts)
        self.context = float(np.mean(contexts)) if contexts else 0.0
        self.temperature = temperature
        self.max_model_len = MAX_MODEL_LEN
        self.max_rows = max_rows
        self.passes = 0

    def _advance(self, rows: int) -> None:
        self.passes += 1
        self.clock.advance(
            self.costs.draft_pass_s(rows, self.context) + self.costs.host_pass_s(self.batch_size)
        )

    def _hidden(self, requests, depth: int, tokens):
        t = self.torch
        return t.stack(
            [
                t.as_tensor(requests, dtype=t.float32),
                t.full((len(requests),), float(depth)),
                tokens.float(),
            ],
            dim=1,
        )

    def bonus_pass(self, next_token_ids):
        self._advance(self.batch_size)
        roots = self.torch.zeros(self.batch_size, dtype=self.torch.int64)
        return self._hidden(list(range(self.batch_size)), 0, next_token_ids), roots

    def roots_without_pass(self):
        return self.torch.zeros(self.batch_size, dtype=self.torch.int64)

    def root_bounds(self, roots) -> list[int]:
        return roots.tolist()

    def chain_pass(self, index, input_ids):  # chains (a fixed tree_width 1) are not simulated
        raise NotImplementedError

    def tree_rows(self, row, q_start, request, root, mask):
        from vllm_subspec.step.tree_attention import TreeRows

        return TreeRows(row, q_start, root, mask)

    def level_pass(self, depth, width, tokens, active):
        requests = list(range(self.batch_size)) if active is None else list(active)
        self._advance(len(requests) * width)
        return self._hidden([r for r in requests for _ in range(width)], depth, tokens)

    def logits(self, hidden, lm_head):
        t = self.torch
        req, depth, token = hidden[:, 0].long(), hidden[:, 1].long(), hidden[:, 2].long()
        col = (depth + 1).clamp(max=self.beliefs.shape[1] - 1)
        c = self.beliefs[req, col].clamp(1e-4, 1 - 1e-4)
        log_p = t.log((1 - c) / (V - 2))[:, None].expand(-1, V).clone()
        top = (token + 1) % (V - 1)
        log_p[t.arange(len(c)), top] = t.log(c)
        log_p[:, REJECT] = -60.0
        return self.temperature * log_p  # sharpened by 1 / temperature: exactly log_p

    def copy_to_host(self, tensor):
        return _Landed(tensor)

    def synchronize(self) -> None:
        pass


# ---- the verify ----------------------------------------------------------------------------
def best_path(tree, depth: int) -> list[int]:
    """Node indices (root excluded) from the root to the best-scored node at `depth` of a
    `StoredTree` (levels are kept best first)."""
    node, path = (depth - 1) * tree.width + 1 if depth else 0, []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def target_logits(torch, trees: list, num_draft: list[int], paths: list[list[int]]):
    """[sum(num_draft) + B, V] logits whose greedy draws accept exactly `paths`: along a path
    each node's draw is the next node's token, elsewhere REJECT (never a drafted token)."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(num_draft) + 1)])
    logits = torch.zeros(int(starts[-1]), V)
    logits[:, REJECT] = 1.0
    rows, cols = [], []
    for i, (tree, path) in enumerate(zip(trees, paths)):
        prev = 0
        for node in path:
            rows.append(int(starts[i]) + prev)
            cols.append(tree.tokens[node])
            prev = node
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = 2.0
    return logits


def greedy_metadata(batch: int):
    """vLLM's own sampling metadata of a greedy batch without request features."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


class SmallKv:
    """A real CPU-layout KV cache (vLLM CPU backend's vec16) big enough for `rows` requests'
    trees at root 0: where `sample_and_walk` moves the accepted paths' KV."""

    def __init__(self, rows: int, nodes: int):
        import torch
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        from vllm_subspec.step.paged_kv import PagedKv

        self.block = 16
        per = -(-nodes // self.block)
        kv = torch.zeros(rows * per, 1, self.block, 2 * 16)
        impl = object.__new__(CPUAttentionBackendImpl)
        table = torch.arange(rows * per, dtype=torch.int32).reshape(rows, per)
        self.paged = PagedKv([(impl, kv, "vec16")], table, self.block)

    def __call__(self):
        return self.paged


# ---- the runs ------------------------------------------------------------------------------
def default_options():
    """SubSpec's defaults on a CUDA platform (`SubSpecOptions.from_dict({})` there: auto width
    and depth, max depth AUTO_MAX_DEPTH["cuda"], both lm_heads)."""
    from vllm_subspec.config import AUTO_MAX_DEPTH, SubSpecOptions

    return dataclasses.replace(SubSpecOptions(), tree_depth=AUTO_MAX_DEPTH["cuda"])


def default_session(options, clock):
    """`StepSession.from_options`' tuner (the engine's), in a session on the virtual clock."""
    from vllm_subspec.step.session import StepSession

    return StepSession(options, StepSession.from_options(options).tuner, clock=clock)


def price_draft_pass(session, costs: GpuCosts) -> None:
    """What the engine does before its first step (`SubSpecProposer.price_draft_pass`): a draft
    pass timed at 1, k and 4k rows, attention skipped (context 0), into the tuner's
    `CostModel.seed_draft_pass`. Its clock is the engine's start-up, not the trace's."""
    tuner = session.tuner
    if tuner is None or not tuner.model.measure_rates:
        return
    widest = max(session.options.widths)
    for rows in sorted({1, widest, 4 * widest}):
        tuner.model.seed_draft_pass(rows, costs.draft_pass_s(rows, 0.0))


@dataclass
class StepRecord:
    start: float
    end: float
    batch: int
    drafted_verify: bool  # this step verified trees
    rows: int  # the target forward's rows (drafts and prompt chunks included)
    verify_rows: int  # of which decodes' rows: 1 + drafts a request
    nodes: list[int]  # drafted nodes verified, per request with drafts
    widths: list[int]
    accepted: list[int]
    plan_depth: int  # the proposal made at its end (0: plain)
    plan_width: int
    after_prompt: bool  # this step ran prompt tokens (its proposal is the one after them)
    tokens: int


@dataclass
class RunResult:
    token_times: list[tuple[float, int]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    requests_done: int = 0
    latencies: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    walk_mismatches: int = 0
    cut_drafts: int = 0
    left_out: int = 0
    cpu_seconds: float = 0.0


def simulate(
    trace: TraceConfig,
    costs: GpuCosts,
    duration: float,
    subspec: bool,
    offloaded: float | None = None,
    budget: int = 2048,
    session_factory: Callable | None = None,
    acceptance: Acceptance | None = None,
    options=None,
) -> RunResult:
    """One engine serving `trace` for `duration` simulated seconds. subspec: the real step
    session decides every step (`session_factory(options, clock)`, default the engine's
    default); else every step is plain. offloaded: layers in host memory (default: SubSpec's
    or plain vLLM's for the GPU memory)."""
    import torch

    cpu_start = time.process_time()
    if offloaded is None:
        offloaded = costs.subspec_offloaded if subspec else costs.plain_offloaded
    clock = VirtualClock()
    session = kv = None
    if subspec:
        from vllm_subspec.step.session import VerifyRequest

        options = options or default_options()
        session = (session_factory or default_session)(options, clock)
        price_draft_pass(session, costs)
        kv = SmallKv(trace.users, 1 + options.num_draft_tokens)
        acceptance = acceptance or Acceptance(reach_curves(), seed=trace.seed)
    sched = Scheduler(budget, draft_slots=1 if subspec else 0)
    arrivals = sorted((t, u, 0) for u, t in enumerate(trace.first_arrivals()))
    bonus: dict[str, int] = {}
    out = RunResult()
    while clock.now < duration:
        while arrivals and arrivals[0][0] <= clock.now:
            t, u, j = arrivals.pop(0)
            prompt, reply = trace.lengths(u, j)
            sched.add(Request(f"u{u}r{j}", u, j, t, prompt, reply))
        batch = sched.schedule()
        if not batch:
            if not arrivals:
                break
            clock.now = max(clock.now, arrivals[0][0])  # the engine waits for requests
            continue
        start = clock.now
        prompt_step = any(s.prefill for s in batch)
        ids = [s.request.req_id for s in batch]
        drafted = [i for i, s in enumerate(batch) if s.spec]
        tree_rows, flat_rows, trees, paths, widths = [], [], [], [], []
        if session is not None:
            requests, q = [], 0
            for i, s in enumerate(batch):
                if s.spec:
                    requests.append(VerifyRequest(i, s.request.req_id, list(s.spec), 0, q))
                q += s.tokens
            session.prepare_verify(requests, prompt_tokens=prompt_step)
            for i in drafted:
                r, v = batch[i].request, session.verifying[batch[i].request.req_id]
                n = len(batch[i].spec)
                if v.compact:  # its tree: accepted along the best path to the sampled depth
                    depth = (n - 1) // v.tree.width + 1
                    a = acceptance.accepted(r.truth, depth)
                    tree_rows.append((1 + n, r.context))
                else:  # a tree's drafts verified later as a chain: its first node only
                    a = (
                        acceptance.accepted(r.truth[:1], 1)
                        if r.spec_width > 1
                        else acceptance.accepted(r.truth, n)
                    )
                    flat_rows.append((1 + n, r.context))
                trees.append(v.tree)
                paths.append(best_path(v.tree, a) if v.compact else list(range(1, a + 1)))
                widths.append(v.tree.width)
        for s in batch:
            if s.spec and session is not None:
                continue
            ctx = s.request.computed + s.tokens / 2 if s.prefill else s.request.context
            flat_rows.append((s.tokens, ctx))
        sampled = sum(1 + len(s.spec) for s in batch if not s.prefill) + sum(
            1 for s in batch if s.prefill and s.request.computed + s.tokens >= s.request.prompt
        )
        forward = costs.forward_s(offloaded, tree_rows, flat_rows, sampled)
        emitted = {}
        if session is not None:
            with session.verify_forward():
                clock.advance(forward)
            if drafted:
                num_draft = [len(s.spec) for s in batch]
                by_row = dict(zip(drafted, zip(trees, paths)))
                all_trees = [by_row[i][0] if i in by_row else None for i in range(len(batch))]
                all_paths = [by_row[i][1] if i in by_row else [] for i in range(len(batch))]
                logits = target_logits(torch, all_trees, num_draft, all_paths)
                clock.advance(costs.host_verify_s(len(batch)))
                walk = session.sample_and_walk(
                    ids, num_draft, logits, greedy_metadata(len(batch)), None, kv
                )
                for i in drafted:
                    out.walk_mismatches += walk.paths[i] != by_row[i][1]
                    tokens = [t for t in walk.tokens[i].tolist() if t >= 0]
                    emitted[i] = len(tokens)
                    bonus[ids[i]] = tokens[-1]
            else:
                session.sampled_plain()
        else:
            clock.advance(forward)
        step_tokens, finished = 0, []
        for i, s in enumerate(batch):
            r = s.request
            if s.prefill:
                r.computed += s.tokens
                n = 0 if r.prefilling else 1
            else:
                n = emitted.get(i, 1)
            n = min(n, r.reply - r.generated)
            bonus.setdefault(r.req_id, 0)
            if n:
                if r.first_token is None:
                    r.first_token = clock.now
                r.generated += n
                step_tokens += n
            if r.generated >= r.reply:
                finished.append(r)
        clock.advance(VLLM_HOST_S)
        plan_depth = plan_width = 0
        if session is not None:
            plan = session.plan_step(ids)
            plan_depth, plan_width = plan.shape.depth, plan.shape.width
            if plan_depth > 0:
                width, depth = plan_width, plan_depth
                truths = [acceptance.draw(width, depth) for _ in batch]
                beliefs = np.zeros((len(batch), depth + 2), dtype=np.float32)
                for i, c in enumerate(truths):
                    beliefs[i, 1 : depth + 1] = c
                    beliefs[i, depth + 1] = c[-1]
                passes = SimPasses(
                    clock,
                    costs,
                    beliefs,
                    [s.request.context for s in batch],
                    options.draft_temperature,
                    budget,
                )
                drafts = session.propose(
                    passes, ids, torch.tensor([bonus[x] for x in ids]), options.num_draft_tokens
                )
                drafts = drafts.tolist() if torch.is_tensor(drafts) else drafts
                for s, d, c in zip(batch, drafts, truths):
                    r = s.request
                    if not r.prefilling and r not in finished:
                        r.spec, r.truth, r.spec_width = list(d), c, width
        end = clock.now
        out.token_times.append((end, step_tokens))
        out.steps.append(
            StepRecord(
                start,
                end,
                len(batch),
                bool(drafted) and session is not None,
                sum(s.tokens for s in batch),
                sum(s.tokens for s in batch if not s.prefill),
                [len(batch[i].spec) for i in drafted] if session else [],
                widths,
                [len(p) for p in paths],
                plan_depth,
                plan_width,
                prompt_step,
                step_tokens,
            )
        )
        for r in finished:
            sched.finish(r)
            out.requests_done += 1
            out.latencies.append(end - r.arrival)
            out.ttft.append((r.first_token or end) - r.arrival)
            bisect.insort(arrivals, (end + trace.think_s, r.user, r.index + 1))
            bonus.pop(r.req_id, None)
    out.cut_drafts, out.left_out = sched.cut_drafts, sched.left_out
    out.cpu_seconds = time.process_time() - cpu_start
    return out


# ---- the report ----------------------------------------------------------------------------
def rate(run: RunResult, lo: float, hi: float) -> float:
    tokens = sum(n for t, n in run.token_times if lo <= t < hi)
    return tokens / max(hi - lo, 1e-9)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def step_summary(run: RunResult, lo: float, hi: float) -> dict:
    steps = [s for s in run.steps if lo <= s.end < hi]
    n = len(steps)
    plain = [s for s in steps if s.plan_depth == 0]
    verifies = [s for s in steps if s.drafted_verify]
    rows = [s.verify_rows for s in verifies]
    forward_rows = [s.rows for s in verifies]
    nodes = [x for s in verifies for x in s.nodes]
    widths: dict[int, int] = {}
    for s in steps:
        if s.plan_depth:
            widths[s.plan_width] = widths.get(s.plan_width, 0) + 1
    tau = [a + 1 for s in verifies for a in s.accepted]
    return {
        "steps": n,
        "plain_share": len(plain) / n if n else 0.0,
        "plain_after_prompt_share": sum(s.after_prompt for s in plain) / n if n else 0.0,
        "prompt_step_share": sum(s.after_prompt for s in steps) / n if n else 0.0,
        "verify_steps": len(verifies),
        "rows_per_verify": {
            "p10": _pct(rows, 10),
            "median": _pct(rows, 50),
            "p90": _pct(rows, 90),
            "max": max(rows, default=0),
        },
        "forward_rows_per_verify": {
            "median": _pct(forward_rows, 50),
            "p90": _pct(forward_rows, 90),
        },
        "nodes_per_request": {
            "p10": _pct(nodes, 10),
            "median": _pct(nodes, 50),
            "p90": _pct(nodes, 90),
        },
        "plan_widths": widths,
        "plan_depth_median": _pct([s.plan_depth for s in steps if s.plan_depth], 50),
        "tokens_per_tree": statistics.fmean(tau) if tau else 0.0,
        "step_seconds_mean": statistics.fmean([s.end - s.start for s in steps]) if steps else 0,
        "first_draft_at_s": next((s.end for s in run.steps if s.plan_depth), None),
    }


def series(run: RunResult, duration: float, bin_s: float) -> list[float]:
    return [rate(run, b * bin_s, (b + 1) * bin_s) for b in range(int(duration // bin_s))]


def scenario(link: str, users: int, arrival: str, args, reach) -> dict:
    costs = link_costs(link)
    trace = TraceConfig(
        users,
        arrival,
        args.stagger_s,
        args.think_s,
        tuple(args.prompt),
        tuple(args.reply),
        args.seed,
    )
    acceptance = Acceptance(
        reach,
        args.sd_request,
        args.sd_depth,
        seed=args.seed + 1000 * users + (arrival == "staggered"),
    )
    sub = simulate(trace, costs, args.duration, True, budget=args.budget, acceptance=acceptance)
    plain = simulate(trace, costs, args.duration, False, budget=args.budget)
    never = simulate(
        trace, costs, args.duration, False, costs.subspec_offloaded, budget=args.budget
    )
    first, steady, end = args.first_s, args.steady_from, args.duration
    row = {"link": link, "link_name": costs.name, "users": users, "arrival": arrival}
    for label, run in (("subspec", sub), ("plain", plain), ("plain_same_offload", never)):
        row[label] = {
            "first_tok_s": rate(run, 0, first),
            "steady_tok_s": rate(run, steady, end),
            "whole_tok_s": rate(run, 0, end),
            "requests_done": run.requests_done,
            "mean_latency_s": statistics.fmean(run.latencies) if run.latencies else 0,
            "mean_ttft_s": statistics.fmean(run.ttft) if run.ttft else 0,
            "series": series(run, end, args.bin_s),
        }
    s, p = row["subspec"], row["plain"]
    row["speedup_first"] = s["first_tok_s"] / p["first_tok_s"] if p["first_tok_s"] else 0.0
    row["speedup_steady"] = s["steady_tok_s"] / p["steady_tok_s"] if p["steady_tok_s"] else 0.0
    row["first_over_steady"] = (
        row["speedup_first"] / row["speedup_steady"] if row["speedup_steady"] else 0.0
    )
    n = row["plain_same_offload"]
    row["speedup_steady_vs_same_offload"] = (
        s["steady_tok_s"] / n["steady_tok_s"] if n["steady_tok_s"] else 0.0
    )
    row["speedup_first_vs_same_offload"] = (
        s["first_tok_s"] / n["first_tok_s"] if n["first_tok_s"] else 0.0
    )
    row["steps_first"] = step_summary(sub, 0, first)
    row["steps_steady"] = step_summary(sub, steady, end)
    row["walk_mismatches"] = sub.walk_mismatches
    row["cut_drafts"], row["left_out"] = sub.cut_drafts, sub.left_out
    row["cpu_seconds"] = sub.cpu_seconds + plain.cpu_seconds + never.cpu_seconds
    return row


def code_fingerprint() -> dict:
    """Which tuner ran: a digest of the session's and the tuner's sources, and their times."""
    from vllm_subspec.step.tuner.tuner import ShapeTuner

    files = [
        ROOT / "vllm_subspec/step/session.py",
        *sorted((ROOT / "vllm_subspec/step/tuner").glob("*.py")),
    ]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    newest = max(files, key=lambda f: f.stat().st_mtime)
    return {
        "sha256": digest.hexdigest()[:16],
        "files": len(files),
        "newest": f"{newest.relative_to(ROOT)} "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(newest.stat().st_mtime))}",
        "ShapeTuner.plan_step": str(inspect.signature(ShapeTuner.plan_step)),
    }


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        f"# SIMULATED serving at GPU costs: `{result['name']}` (a model, not a measurement)",
        "",
        f"Command: `{result['command']}`",
        "",
        "The real `StepSession` / `ShapeTuner` / `RateGuard` decide every step of a simulated "
        "vLLM engine serving Qwen2.5-7B on an 8 GB card (SubSpec's default config: auto width "
        "and depth, max depth 48), on a virtual clock that a GPU cost model advances; plain = "
        "the same trace with every step plain and plain vLLM's own offload for the same GPU "
        "memory. What runs and what is modelled: `benchmarks/tuner_simulation.py`'s docstring.",
        "",
        f"Trace: closed loop, {a['prompt'][0]}-{a['prompt'][1]} prompt and {a['reply'][0]}-"
        f"{a['reply'][1]} reply tokens (uniform, seed {a['seed']}), think time {a['think_s']} "
        f"s; burst: every user's first request at 0; staggered: Poisson first arrivals, mean "
        f"gap {a['stagger_s']} s. {a['duration']:g} simulated s; first = [0, {a['first_s']:g}) "
        f"s, steady = [{a['steady_from']:g}, {a['duration']:g}) s. Token budget "
        f"(max_num_batched_tokens) {a['budget']}. Acceptance: {result['acceptance_source']}.",
        "",
        f"Tuner code: sha256 {result['code']['sha256']} over {result['code']['files']} files, "
        f"newest {result['code']['newest']}; `ShapeTuner.plan_step"
        f"{result['code']['ShapeTuner.plan_step']}`."
        + (f" {result['note']}" if result.get("note") else ""),
        "",
        "| link | users | arrivals | plain tok/s first / steady | SubSpec tok/s first / steady "
        "| speed-up first | speed-up steady | first / steady | vs never-drafting SubSpec "
        "first / steady | plain steps first / steady (after prompt tokens) | rows per verify "
        "p10 / median / p90 (steady) | tokens per tree (steady) | first draft at |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["scenarios"]:
        f, s = r["steps_first"], r["steps_steady"]
        rows = s["rows_per_verify"] if s["verify_steps"] else f["rows_per_verify"]
        first_draft = (
            f["first_draft_at_s"] if f["first_draft_at_s"] is not None else s["first_draft_at_s"]
        )
        lines.append(
            f"| {r['link_name']} | {r['users']} | {r['arrival']} | "
            f"{r['plain']['first_tok_s']:.1f} / {r['plain']['steady_tok_s']:.1f} | "
            f"{r['subspec']['first_tok_s']:.1f} / {r['subspec']['steady_tok_s']:.1f} | "
            f"{r['speedup_first']:.2f}x | {r['speedup_steady']:.2f}x | "
            f"{r['first_over_steady']:.2f} | {r['speedup_first_vs_same_offload']:.2f}x / "
            f"{r['speedup_steady_vs_same_offload']:.2f}x | "
            f"{f['plain_share']:.0%} ({f['plain_after_prompt_share']:.0%}) / "
            f"{s['plain_share']:.0%} ({s['plain_after_prompt_share']:.0%}) | "
            f"{rows['p10']:.0f} / {rows['median']:.0f} / {rows['p90']:.0f} | "
            f"{s['tokens_per_tree']:.1f} | "
            + (f"{first_draft:.0f} s |" if first_draft is not None else "never |")
        )
    lines += [
        "",
        "- speed-up: SubSpec's tokens/s over plain vLLM's in the same window (tokens users "
        "received: accepted drafts, bonus tokens, prefills' first tokens); first / steady: "
        "the first minute's speed-up over the steady state's.",
        "- vs never-drafting SubSpec: against a SubSpec engine that runs every step plain "
        "(SubSpec's offload: its substitutes leave fewer layers resident, so its plain steps "
        "cost more than plain vLLM's).",
        "- plain steps: the share of SubSpec's steps whose proposal drafted nothing; in "
        "brackets, those after a step that ran prompt tokens (a prefill or a chunk).",
        "- rows per verify: in a step that verified trees, its decoding requests' rows (one "
        "each plus their drafted nodes, after the token budget's cuts; prompt chunks in the "
        "same forward not counted); tokens per tree: emitted tokens per request per verify.",
        "",
        "Cost model (`GpuCosts`; each constant's source):",
        "",
    ]
    for link, sources in result["cost_sources"].items():
        lines.append(f"- {link}:")
        lines += [f"  - {k}: {v}" for k, v in sources.items()]
    lines += [
        "",
        "Scheduler diagnostics (SubSpec): requests whose drafts the token budget cut, "
        "and running requests it left out of a step:",
        "",
    ]
    for r in result["scenarios"]:
        lines.append(
            f"- {r['link']}, {r['users']} users, {r['arrival']}: cut {r['cut_drafts']}"
            f", left out {r['left_out']}; walk mismatches {r['walk_mismatches']}; "
            f"requests completed {r['subspec']['requests_done']} (plain "
            f"{r['plain']['requests_done']}); their mean latency "
            f"{r['subspec']['mean_latency_s']:.1f} s (plain "
            f"{r['plain']['mean_latency_s']:.1f} s)"
        )
    lines += [
        "",
        f"Simulation CPU time: {result['cpu_seconds']:.0f} s ({result['machine']}).",
        "",
        f"![ratio over time]({result['name']}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in result["scenarios"]})
    fig, axes = plt.subplots(1, len(links), figsize=(6.5 * len(links), 4.2), squeeze=False)
    bin_s = result["args"]["bin_s"]
    for ax, link in zip(axes[0], links):
        for r in (x for x in result["scenarios"] if x["link"] == link):
            s, p = r["subspec"]["series"], r["plain"]["series"]
            ratio = [a / b if b else float("nan") for a, b in zip(s, p)]
            t = [(i + 0.5) * bin_s for i in range(len(ratio))]
            ax.plot(
                t,
                ratio,
                label=f"{r['users']} users, {r['arrival']}",
                linestyle="-" if r["arrival"] == "burst" else "--",
            )
        ax.axhline(1.0, color="gray", linewidth=0.8)
        for x in (result["args"]["first_s"], result["args"]["steady_from"]):
            ax.axvline(x, color="gray", linewidth=0.6, linestyle=":")
        ax.set_title(
            f"{r['link_name']}: SubSpec / plain vLLM tokens/s ({bin_s:g} s bins)", fontsize=9
        )
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("speed-up (SIMULATED)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="tuner_simulation")
    ap.add_argument("--duration", type=float, default=360.0, help="simulated seconds")
    ap.add_argument("--first-s", type=float, default=60.0, help="the first window: [0, this)")
    ap.add_argument(
        "--steady-from", type=float, default=180.0, help="the steady window: [this, --duration)"
    )
    ap.add_argument("--note", default="", help="a line for the report's header")
    ap.add_argument("--bin-s", type=float, default=15.0, help="the plot's bins")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--arrivals", nargs="+", default=["burst", "staggered"])
    ap.add_argument("--links", nargs="+", default=["pcie4", "pcie5"], choices=sorted(LINKS))
    ap.add_argument("--acceptance", default="qwen", choices=sorted(ACCEPTANCE_SOURCES))
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--stagger-s", type=float, default=2.0)
    ap.add_argument("--think-s", type=float, default=0.0)
    ap.add_argument("--prompt", type=int, nargs=2, default=[100, 2000])
    ap.add_argument("--reply", type=int, nargs=2, default=[100, 600])
    ap.add_argument("--sd-request", type=float, default=0.5)
    ap.add_argument("--sd-depth", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # a cold engine: no tuner state kept across restarts is read or written
    os.environ["VLLM_SUBSPEC_TUNER_MEMORY"] = "0"
    if args.steady_from >= args.duration:
        raise SystemExit("--steady-from must be below --duration")
    code = code_fingerprint()  # the tuner as imported, before the runs
    reach = reach_curves(args.acceptance)
    rows = []
    for link in args.links:
        for users in args.users:
            for arrival in args.arrivals:
                row = scenario(link, users, arrival, args, reach)
                rows.append(row)
                print(
                    f"{link} {users:>2} users {arrival:9s}: speed-up first "
                    f"{row['speedup_first']:.2f}x, steady {row['speedup_steady']:.2f}x, "
                    f"plain steps {row['steps_first']['plain_share']:.0%} / "
                    f"{row['steps_steady']['plain_share']:.0%} "
                    f"({row['cpu_seconds']:.0f} s CPU)",
                    flush=True,
                )
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            "?",
        )
        if os.path.exists("/proc/cpuinfo")
        else "?"
    )
    result = {
        "name": args.name,
        "command": "python -m benchmarks.tuner_simulation "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "label": "SIMULATED (a model of a GPU, driven by the real tuner; not a measurement)",
        "args": vars(args),
        "acceptance_source": ACCEPTANCE_SOURCES[args.acceptance][1],
        "reach": {str(w): c for w, c in reach.items()},
        "cost_sources": {link_costs(link).name: link_costs(link).sources() for link in args.links},
        "code": code,
        "note": args.note,
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_seconds": sum(r["cpu_seconds"] for r in rows),
        "scenarios": rows,
    }
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}.{{json,md,png}}")
    return result


if __name__ == "__main__":
    main()
