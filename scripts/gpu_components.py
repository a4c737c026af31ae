"""SubSpec's GPU components, measured on a bare GPU machine: torch + Triton (+ gemlite), no vLLM.

What a SubSpec step costs on a GPU, piece by piece, for Qwen2.5-7B's shapes (random weights:
kernel costs, not τ): the tree-attention Triton kernel (correctness against a dense fp32
reference, and time beside torch SDPA), GemLite A16W4 linears against bf16 cuBLAS, pinned and
pageable host-to-device copies, UVA reads (a kernel reading pinned host memory, as vLLM's UVA
offloader does) and how much of a copy hides behind draft-like compute on another stream, one
synthetic 28-layer draft pass (eager and CUDA-graph captured: time, kernel launches, host
syncs), the HQQ substitute build of one decoder layer, the routed experts' Triton kernels at
Qwen3-30B-A3B's MoE layer shapes, and `benchmarks/projection.py` fed with these measurements.
Writes gpu_components.{json,md} (dry run: gpu_components_dry_run.*) under
--out, else $GPU_COMPONENTS_OUT, else $OUT, else benchmarks/results; the files are rewritten
after every section, so a run cut short keeps what it measured.

    python scripts/gpu_components.py                 # a GPU machine, ~3-5 minutes on an H100
    python scripts/gpu_components.py --dry-run       # any CPU: tiny shapes, Triton interpreted

gemlite (0.6.0.post2) is optional: without it the linears run `ReferenceKernel` and the report
says so. How to carry it to a machine that cannot install packages: docs/gpu.md, "Component
check".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if "--dry-run" in sys.argv:  # before triton is imported: the CPU runs Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A decoder's shapes (Qwen2.5-7B by default; the dry run's are tiny)."""

    hidden: int = 3584
    intermediate: int = 18944
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    layers: int = 28
    vocab: int = 152064
    page: int = 16  # vLLM's FlashAttention block size
    # the tree attention grid: tree rows, contexts, requests
    tree_rows: tuple = (6, 64, 289)
    contexts: tuple = (512, 4096, 32768)
    requests: tuple = (1, 8)
    linear_rows: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 289)
    draft_rows: tuple = (1, 8)  # rows of one draft pass (a chain; a tree level of width 8)
    draft_context: int = 1024
    draft_tree_slots: int = 32

    def linears(self) -> dict:
        """One decoder layer's linears as SubSpec's substitutes fuse them: [out, in]."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return {"qkv_proj": (q + 2 * kv, self.hidden), "o_proj": (self.hidden, q),
                "gate_up_proj": (2 * self.intermediate, self.hidden),
                "down_proj": (self.hidden, self.intermediate)}

    def layer_params(self) -> int:
        return sum(n * k for n, k in self.linears().values()) + 2 * self.hidden


QWEN25_7B = Shapes()
TINY = Shapes(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=2,
              vocab=1024, tree_rows=(3, 9), contexts=(40, 100), requests=(1, 2),
              linear_rows=(1, 8), draft_rows=(1, 4), draft_context=40, draft_tree_slots=8)

# relative L2 error of the kernel's output against the dense fp32 reference: over the whole
# output, and for the worst (row, head) (a wrong mask at a long context moves the whole output
# by ~1e-2 only: most of the weight is the prefix's; the worst row shows it)
MAX_REL_ERR = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
MAX_ROW_REL_ERR = {torch.bfloat16: 5e-3, torch.float16: 1e-3}


def row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative L2 error of one (row, head) of `out` [T, heads, d]."""
    diff = (out.float() - ref).norm(dim=-1)
    return (diff / ref.norm(dim=-1).clamp(min=1e-12)).max().item()


# --------------------------------------------------------------------------- timing helpers

class Clock:
    """Median wall time of a callable: CUDA events with the L2 flushed between calls
    (triton.testing.do_bench) on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, dry: bool):
        self.device, self.dry = device, dry

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def ms(self, fn, reps: int = 20) -> float:
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=5, rep=max(25, reps),
                                                 return_mode="median"))
        fn()
        times = []
        for _ in range(2 if self.dry else reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return sorted(times)[len(times) // 2]

    def device_ms(self, fn) -> float:
        """Median device time of `fn` replayed from a CUDA graph (no host launch cost; the L2
        is not flushed); `ms` off CUDA."""
        if self.device.type != "cuda":
            return self.ms(fn)
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))

    def wall_ms(self, fn, reps: int = 10) -> float:
        """Median wall time including the host's launch work (no L2 flush)."""
        fn()
        self.sync()
        times = []
        for _ in range(2 if self.dry else reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(1e3 * (time.perf_counter() - start))
        return sorted(times)[len(times) // 2]


def _runtime_counts(fn, device: torch.device, passes: int) -> dict:
    """Kernel launches, graph launches, host syncs and GPU kernels in `passes` calls of `fn`,
    read from torch.profiler's CUDA runtime/driver events."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            fn()
        torch.cuda.synchronize()
    counts = {"kernel_launches": 0, "graph_launches": 0, "host_syncs": 0, "gpu_kernels": 0}
    for e in prof.events():
        name = e.name
        base = name.split("_v")[0]  # CUPTI may add a version suffix (cudaLaunchKernel_v7000)
        if base in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                    "cudaLaunchKernelExC"):
            counts["kernel_launches"] += 1
        elif base in ("cudaGraphLaunch", "cuGraphLaunch"):
            counts["graph_launches"] += 1
        elif base in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                      "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize"):
            counts["host_syncs"] += 1
        elif getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            counts["gpu_kernels"] += 1
    return counts


def runtime_calls_per_call(fn, device: torch.device, passes: int = 3) -> dict:
    """`_runtime_counts` of `passes` calls less those of a profile around nothing (the
    profiler's and the final synchronize's own), per call."""
    if device.type != "cuda":
        return {}
    base = _runtime_counts(lambda: None, device, passes)
    calls = _runtime_counts(fn, device, passes)
    return {k: (calls[k] - base[k]) / passes for k in calls}


# --------------------------------------------------------------------------- sections

def section_env(ctx) -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": str(ctx.device),
           "dry_run": ctx.dry, "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    try:
        import gemlite

        out["gemlite"] = gemlite.__version__
    except Exception as e:  # noqa: BLE001 - gemlite raises various errors without CUDA
        out["gemlite"] = None
        out["gemlite_error"] = f"{type(e).__name__}: {e}"[:200]
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(gpu=props.name, sms=props.multi_processor_count,
                   memory_gb=props.total_memory / 1e9)
        n = 1 << 29  # 1 GiB of bf16
        src = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
        dst = torch.empty_like(src)
        ms = ctx.clock.ms(lambda: dst.copy_(src))
        out["d2d_gbps_read_plus_write"] = 2 * src.nbytes / ms / 1e6
        del src, dst
    return out


def random_tree_mask(rows: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, slots] bool: the last `rows` of `slots` tree slots, each row seeing its ancestors
    (a random tree over the slots) and itself."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, slots)]
    mask = torch.zeros(slots, slots, dtype=torch.bool)
    for i in range(slots):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask[slots - rows:]


def paged_cache(num_tokens: int, shapes: Shapes, dtype, device, gen):
    """A FlashAttention-shaped cache [blocks, kv_heads, page, 2*d] holding `num_tokens` random
    K/V per request in shuffled blocks, and its `FlashAttentionLayout`."""
    from vllm_subspec.step.paged_kv import FlashAttentionLayout

    blocks = num_tokens // shapes.page
    cache = torch.randn(blocks, shapes.kv_heads, shapes.page, 2 * shapes.head_dim,
                        device=device, dtype=dtype)
    return cache, FlashAttentionLayout(cache, shapes.head_dim)


def dense_reference(query, layout, table, rows_list, scale):
    """fp32 attention of each request's tree rows over its prefix + visible tree slots."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    groups = query.shape[1] // layout.kv_heads
    page = layout.block_size
    for r in rows_list:
        n = r.prefix_len + r.tree_mask.shape[1]
        pos = torch.arange(n, device=query.device)
        blk = table[r.req_index, pos // page].long()
        k = layout.keys[blk, pos % page].float()  # [n, kv, d]
        v = layout.values[blk, pos % page].float()
        q = query[r.q_start: r.q_start + r.tree_mask.shape[0]].float()  # [rows, h, d]
        k = k.repeat_interleave(groups, 1)
        v = v.repeat_interleave(groups, 1)
        s = torch.einsum("rhd,nhd->hrn", q, k) * scale
        visible = torch.ones(q.shape[0], n, dtype=torch.bool, device=query.device)
        visible[:, r.prefix_len:] = r.tree_mask.to(query.device)
        s = s.masked_fill(~visible[None], float("-inf"))
        out[r.q_start: r.q_start + q.shape[0]] = torch.einsum(
            "hrn,nhd->rhd", torch.softmax(s, -1), v)
    return out


def section_tree_attention(ctx) -> dict:
    from vllm_subspec.step.tree_attention import TreeRows
    from vllm_subspec.step.tree_attention_triton import tree_attention_into, tree_rows_layout

    sh, dev = ctx.shapes, ctx.device
    gen = torch.Generator().manual_seed(0)
    scale = sh.head_dim ** -0.5
    results, timing = [], []
    try:
        import flash_attn  # noqa: F401

        flash = "importable (not timed here: its paged kernels take no tree mask)"
    except Exception:  # noqa: BLE001
        flash = "not importable on this machine"
    for context in sh.contexts:
        for n_req in sh.requests:
            ctx.check_time()
            per_req = -(-(context + max(sh.tree_rows)) // sh.page) * sh.page
            for dtype in (torch.bfloat16, torch.float16):
                cache, layout = paged_cache(n_req * per_req, sh, dtype, dev, gen)
                table = torch.randperm(n_req * per_req // sh.page, generator=gen).to(
                    torch.int32).view(n_req, -1).to(dev)
                for rows in sh.tree_rows:
                    slots = rows
                    reqs = [TreeRows(i, i * rows, context - slots,
                                     random_tree_mask(rows, slots, gen)) for i in range(n_req)]
                    query = torch.randn(n_req * rows, sh.heads, sh.head_dim, device=dev,
                                        dtype=dtype)
                    ref = dense_reference(query, layout, table, reqs, scale)
                    groups = sh.heads // sh.kv_heads
                    row = {"dtype": str(dtype).split(".")[-1], "context": context,
                           "requests": n_req, "rows": rows}
                    for label, sms in (("unsplit", 1), ("split", None)):
                        lay = tree_rows_layout(reqs, dev, groups, sh.kv_heads, per_req, sms)
                        out = torch.zeros_like(query)
                        call = (lambda out=out, lay=lay: tree_attention_into(
                            out, query, layout.keys, layout.values, table, lay, scale,
                            upcast=dev.type != "cuda"))
                        call()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        worst = row_rel_err(out, ref)
                        row[f"{label}_splits"] = lay.num_splits
                        row[f"{label}_rel_err"] = err
                        row[f"{label}_row_rel_err"] = worst
                        row[f"{label}_ok"] = bool(torch.isfinite(out).all()) and \
                            err < MAX_REL_ERR[dtype] and worst < MAX_ROW_REL_ERR[dtype]
                        if dtype == torch.bfloat16:
                            row[f"{label}_ms"] = ctx.clock.device_ms(call)
                    if dtype == torch.bfloat16:
                        row["sdpa_ms"] = sdpa_ms(ctx, query, layout, table, reqs, scale)
                    results.append(row)
                del cache, layout
    ok = all(r["unsplit_ok"] and r["split_ok"] for r in results)
    return {"ok": ok, "flash_attn": flash, "cases": results, "max_rel_err": MAX_REL_ERR_STR,
            "max_row_rel_err": {str(k).split(".")[-1]: v for k, v in MAX_ROW_REL_ERR.items()}}


MAX_REL_ERR_STR = {str(k).split(".")[-1]: v for k, v in MAX_REL_ERR.items()}


def sdpa_ms(ctx, query, layout, table, reqs, scale) -> float:
    """torch SDPA on the same rows, K/V gathered contiguous beforehand (the gather not timed),
    with the tree mask as a boolean mask: what a backend without a tree kernel would run."""
    n_req, rows = len(reqs), reqs[0].tree_mask.shape[0]
    n = reqs[0].prefix_len + reqs[0].tree_mask.shape[1]
    pos = torch.arange(n, device=query.device)
    blk = table[:, pos // layout.block_size].long()  # [R, n]
    k = layout.keys[blk, pos % layout.block_size].transpose(1, 2).contiguous()  # [R, kv, n, d]
    v = layout.values[blk, pos % layout.block_size].transpose(1, 2).contiguous()
    q = query.view(n_req, rows, *query.shape[1:]).transpose(1, 2)  # [R, h, rows, d]
    mask = torch.ones(n_req, 1, rows, n, dtype=torch.bool, device=query.device)
    for i, r in enumerate(reqs):
        mask[i, 0, :, r.prefix_len:] = r.tree_mask.to(query.device)
    groups = query.shape[1] // layout.kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return ctx.clock.device_ms(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale))


def kernel_configs(dry: bool) -> list:
    """The tree kernel's tile and launch alternatives the sweep times (the default first)."""
    from vllm_subspec.step.tree_attention_triton import DEFAULT_CONFIG, KernelConfig

    if dry:  # the interpreter: one of each kind of change
        return [DEFAULT_CONFIG, KernelConfig(block_n=64, k_rows=True, prefix_phase=True),
                KernelConfig(block_m=128, num_warps=4)]
    alternatives = [KernelConfig(block_m=bm, block_n=bn, num_warps=w, k_rows=kr,
                                 prefix_phase=True)
                    for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)
                    for kr in (False, True)]
    phase = dataclasses.replace(DEFAULT_CONFIG, prefix_phase=True)
    same = dataclasses.replace(phase, num_warps=DEFAULT_CONFIG.warps(128))  # phase, spelled out
    return [DEFAULT_CONFIG, phase] + [c for c in alternatives if c != same]


def section_tree_attention_configs(ctx) -> dict:
    """Each `KernelConfig` on a verify's and a draft level's shapes (bf16): correct against
    the dense fp32 reference (within both error bounds), and its device time (CUDA-graph
    replays); the fastest correct one overall (least summed time relative to the default) is
    reported as `best` (the draft pass, which runs before, uses the default)."""
    from vllm_subspec.step.tree_attention import TreeRows
    from vllm_subspec.step.tree_attention_triton import tree_attention_into, tree_rows_layout

    sh, dev, dtype = ctx.shapes, ctx.device, torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    scale = sh.head_dim ** -0.5
    big, small = max(sh.tree_rows), min(sh.tree_rows)
    mid_ctx, long_ctx = sh.contexts[-2], sh.contexts[-1]
    many = max(sh.requests)
    cases = [(1, big, mid_ctx), (1, big, long_ctx), (many, big, mid_ctx), (1, small, mid_ctx),
             (1, small, long_ctx), (many, small, mid_ctx)]
    configs = kernel_configs(ctx.dry)
    times = {c: [] for c in configs}
    errors = {c: 0.0 for c in configs}
    failures = {}
    groups = sh.heads // sh.kv_heads
    for n_req, rows, context in cases:
        ctx.check_time()
        per_req = -(-(context + rows) // sh.page) * sh.page
        cache, layout = paged_cache(n_req * per_req, sh, dtype, dev, gen)
        table = torch.randperm(n_req * per_req // sh.page, generator=gen).to(
            torch.int32).view(n_req, -1).to(dev)
        reqs = [TreeRows(i, i * rows, context - rows, random_tree_mask(rows, rows, gen))
                for i in range(n_req)]
        query = torch.randn(n_req * rows, sh.heads, sh.head_dim, device=dev, dtype=dtype)
        ref = dense_reference(query, layout, table, reqs, scale)
        for c in configs:
            if c in failures:
                continue
            try:
                lay = tree_rows_layout(reqs, dev, groups, sh.kv_heads, per_req, config=c)
                out = torch.zeros_like(query)
                call = (lambda out=out, lay=lay: tree_attention_into(
                    out, query, layout.keys, layout.values, table, lay, scale,
                    upcast=dev.type != "cuda"))
                call()
                err = max(((out.float() - ref).norm() / ref.norm()).item() / MAX_REL_ERR[dtype],
                          row_rel_err(out, ref) / MAX_ROW_REL_ERR[dtype])
                errors[c] = max(errors[c], err)  # as a fraction of the bounds
                times[c].append(ctx.clock.device_ms(call))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                failures[c] = f"{type(e).__name__}: {e}"[:200]
        del cache, layout
    ok = {c for c in configs if c not in failures and errors[c] < 1.0
          and len(times[c]) == len(cases)}
    base = times[configs[0]]
    score = {c: sum(t / b for t, b in zip(times[c], base)) / len(cases) for c in ok}
    best = min(score, key=score.get) if score else configs[0]
    return {"cases": [{"requests": r, "rows": n, "context": x} for r, n, x in cases],
            "configs": [{"config": dataclasses.asdict(c), "ms": times[c],
                         "error_of_bound": errors[c], "correct": c in ok,
                         "mean_time_vs_default": score.get(c), "error": failures.get(c)}
                        for c in configs],
            "best": dataclasses.asdict(best), "default": dataclasses.asdict(configs[0])}


def random_quantized(n: int, k: int, device, gen=None):
    """A 4-bit, group-64 `QuantizedWeight` with random codes (kernel costs do not depend on
    the values)."""
    from vllm_subspec.draft_model.quantize import QuantizedWeight

    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scale = torch.rand(n, k // 64, device=device) * 0.01 + 1e-3
    zero = torch.rand(n, k // 64, device=device) * 15
    return QuantizedWeight(codes=codes, scale=scale, zero=zero, bits=4, group_size=64)


def substitute_kernel(ctx, qw, dtype):
    """GemLite where it runs; else (no gemlite, or its first build failed: recorded, and
    every later section says so) `ReferenceKernel`."""
    from vllm_subspec.draft_model.kernels import GemliteKernel, ReferenceKernel

    if ctx.gemlite:
        try:
            return GemliteKernel(qw, dtype)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ctx.gemlite = False
            ctx.results.setdefault("env", {})["gemlite_build_error"] = \
                f"{type(e).__name__}: {e}"[:300]
    return ReferenceKernel(qw, dtype)


def section_gemlite(ctx) -> dict:
    sh, dev, dtype = ctx.shapes, ctx.device, torch.bfloat16
    bw = ctx.results.get("env", {}).get("d2d_gbps_read_plus_write")
    out = {"kernel": "gemlite A16W4 (HQQ, group 64)" if ctx.gemlite else
           "ReferenceKernel (dequantize + matmul: no gemlite here)", "shapes": {}}
    if ctx.gemlite:
        out["autotune"] = gemlite_configs(ctx)
    for name, (n, k) in sh.linears().items():
        ctx.check_time()
        qw = random_quantized(n, k, dev)
        kernel = substitute_kernel(ctx, qw, dtype)
        dense = qw.dequantize(dtype)
        del qw
        packed_bytes = n * k // 2 + 2 * (n * k // 64) * 2  # codes + bf16 scale and zero
        rows_out = []
        for m in sh.linear_rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            start = time.perf_counter()
            y = kernel(x)
            ctx.clock.sync()
            first_s = time.perf_counter() - start
            err = ((y.float() - F.linear(x, dense).float()).norm()
                   / F.linear(x, dense).float().norm()).item()
            t4 = ctx.clock.device_ms(lambda: kernel(x))
            t16 = ctx.clock.device_ms(lambda: F.linear(x, dense))
            row = {"rows": m, "w4a16_ms": t4, "bf16_ms": t16, "first_call_s": first_s,
                   "w4a16_eager_ms": ctx.clock.ms(lambda: kernel(x)),
                   "bf16_eager_ms": ctx.clock.ms(lambda: F.linear(x, dense)),
                   "rel_err_vs_dequantized": err,
                   "w4a16_gbps": packed_bytes / t4 / 1e6, "bf16_gbps": 2 * n * k / t16 / 1e6}
            if bw:  # a linear's weight reads against the copy's read + write traffic
                row["w4a16_of_d2d"] = row["w4a16_gbps"] / bw
                row["bf16_of_d2d"] = row["bf16_gbps"] / bw
            rows_out.append(row)
        out["shapes"][name] = {"out_in": [n, k], "packed_mb": packed_bytes / 1e6,
                               "rows": rows_out}
        del kernel, dense
    if not ctx.gemlite:
        out["kernel"] = ("ReferenceKernel (dequantize + matmul): gemlite failed: "
                         + ctx.results.get("env", {}).get("gemlite_build_error", "?")) \
            if "autotune" in out else out["kernel"]
    return out


def gemlite_configs(ctx) -> str:
    """GemLite loads its shipped autotune configs by device name (gemlite.core:
    get_default_cache_config); a GPU without a file of its own (an H200) autotunes every new
    shape. Here an H200 takes the H100's file, so each call compiles but does not autotune."""
    from gemlite import core

    name = torch.cuda.get_device_properties(ctx.device).name.lower().replace(" ", "_")
    root = Path(core.__file__).parent / "configs"
    own = [p for p in root.glob("*.json") if p.stem in name]
    if own:
        return f"gemlite's own {own[0].name} (by device name)"
    h100 = root / "h100.json"
    if "h200" in name and h100.exists() and core.GemLiteLinear.load_config(str(h100)):
        return "no file for this device; loaded gemlite's h100.json"
    return "no file for this device: gemlite autotunes ('fast') at each first call"


def section_transfer(ctx) -> dict:
    """One decoder layer's bf16 weights host->device: pinned and pageable copies, UVA reads
    (a Triton kernel reading pinned host memory through its device mapping, as vLLM's UVA
    offloader's weights are read), and a copy on a second stream beside draft-like compute."""
    if ctx.device.type != "cuda":
        return {"skipped": "no CUDA device (host-to-device copies need one)"}
    sh, dev = ctx.shapes, ctx.device
    n = sh.layer_params()
    host = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    host.normal_()
    pageable = torch.empty(n, dtype=torch.bfloat16)
    gpu = torch.empty(n, dtype=torch.bfloat16, device=dev)
    nbytes = host.nbytes
    out = {"layer_mb": nbytes / 1e6}
    out["pinned_ms"] = ctx.clock.wall_ms(lambda: gpu.copy_(host, non_blocking=True))
    out["pinned_gbps"] = nbytes / out["pinned_ms"] / 1e6
    out["pageable_ms"] = ctx.clock.wall_ms(lambda: gpu.copy_(pageable), reps=3)
    out["pageable_gbps"] = nbytes / out["pageable_ms"] / 1e6
    try:
        gpu.zero_()
        uva_read(host, gpu)
        assert torch.equal(gpu.cpu(), host), "the UVA read copied wrong values"
        out["uva_read_ms"] = ctx.clock.wall_ms(lambda: uva_read(host, gpu))
        out["uva_read_gbps"] = nbytes / out["uva_read_ms"] / 1e6
        out["uva_efficiency"] = out["uva_read_gbps"] / out["pinned_gbps"]
    except Exception as e:  # noqa: BLE001
        out["uva_error"] = f"{type(e).__name__}: {e}"[:300]
    # overlap: the copy on a side stream while the default stream replays draft-like compute
    # from a CUDA graph (4-bit linears at 8 rows, the tree width; replayed, so the GPU and not
    # the host's launches sets its time), sized by device time to about the copy's length
    qw = random_quantized(sh.hidden, sh.intermediate, dev)
    kernel = substitute_kernel(ctx, qw, torch.bfloat16)
    x = torch.randn(8, sh.intermediate, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def captured(calls: int):
        kernel(x)  # compiled and tuned before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                kernel(x)
        return graph

    def timed(fn) -> float:  # device ms on the default stream, by events
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    probe = captured(16)
    probe.replay()
    per_call = sorted(timed(probe.replay) for _ in range(5))[2] / 16
    calls = max(1, int(out["pinned_ms"] / max(per_call, 1e-4)))
    graph = captured(calls)
    graph.replay()

    def copy():
        with torch.cuda.stream(side):
            gpu.copy_(host, non_blocking=True)

    def both():
        copy()
        graph.replay()
        torch.cuda.current_stream().wait_stream(side)

    def compute_during_copy():
        copy()
        ms = timed(graph.replay)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return ms

    t_copy = ctx.clock.wall_ms(copy)
    t_compute = sorted(timed(graph.replay) for _ in range(5))[2]
    t_both = ctx.clock.wall_ms(both)
    during = sorted(compute_during_copy() for _ in range(5))[2]
    out["overlap"] = {"compute_calls": calls, "copy_ms": t_copy, "compute_ms": t_compute,
                      "both_ms": t_both,
                      "hidden_fraction": (t_copy + t_compute - t_both) / min(t_copy, t_compute),
                      "compute_ms_during_copy": during,
                      "compute_slowdown_during_copy": during / t_compute}
    return out


def uva_read(host: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = host[:] by a kernel on the GPU reading pinned host memory (Triton resolves a
    pinned CPU tensor's pointer to its device mapping, cuPointerGetAttribute)."""
    import triton

    n = host.numel()
    block = 8192
    _uva_copy_kernel[(triton.cdiv(n, block),)](host, dst, n, BLOCK=block)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _uva_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
except ImportError:  # pragma: no cover - triton is a dependency of torch on Linux
    pass


class DraftLayer:
    """One draft decoder layer: substitutes for every linear, RMSNorm, RoPE, the K/V write into
    its paged cache and tree attention (what SubSpec's draft runs for an offloaded layer)."""

    def __init__(self, ctx, cache_tokens: int):
        sh, dev, dtype = ctx.shapes, ctx.device, torch.bfloat16
        self.sh = sh
        self.linears = {name: substitute_kernel(ctx, random_quantized(n, k, dev), dtype)
                        for name, (n, k) in sh.linears().items()}
        self.norms = [torch.ones(sh.hidden, device=dev, dtype=dtype) for _ in range(2)]
        blocks = cache_tokens // sh.page
        self.cache = torch.randn(blocks, sh.kv_heads, sh.page, 2 * sh.head_dim, device=dev,
                                 dtype=dtype)
        from vllm_subspec.step.paged_kv import FlashAttentionLayout

        self.layout = FlashAttentionLayout(self.cache, sh.head_dim)

    def __call__(self, h, cos, sin, slots_blk, slots_off, table, rows):
        from vllm_subspec.step.tree_attention_triton import tree_attention_into

        sh = self.sh
        q_size, kv_size = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
        x = rms_norm(h, self.norms[0])
        q, k, v = self.linears["qkv_proj"](x).split([q_size, kv_size, kv_size], -1)
        q = rope(q.reshape(-1, sh.heads, sh.head_dim), cos, sin)
        k = rope(k.reshape(-1, sh.kv_heads, sh.head_dim), cos, sin)
        self.layout.keys[slots_blk, slots_off] = k
        self.layout.values[slots_blk, slots_off] = v.reshape(-1, sh.kv_heads, sh.head_dim)
        attn = torch.empty_like(q)
        tree_attention_into(attn, q, self.layout.keys, self.layout.values, table, rows,
                            sh.head_dim ** -0.5, upcast=h.device.type != "cuda")
        h = h + self.linears["o_proj"](attn.reshape(-1, q_size))
        x = rms_norm(h, self.norms[1])
        gate, up = self.linears["gate_up_proj"](x).chunk(2, -1)
        return h + self.linears["down_proj"](F.silu(gate) * up)


def rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


def section_draft_pass(ctx) -> dict:
    """A synthetic draft pass of `layers` substitute layers + the bf16 lm_head and a top-k, at
    each of `draft_rows` rows (one request at context `draft_context`), eager and, on CUDA,
    captured in a CUDA graph."""
    from vllm_subspec.step.tree_attention import TreeRows
    from vllm_subspec.step.tree_attention_triton import tree_rows_layout

    sh, dev, dtype = ctx.shapes, ctx.device, torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    cache_tokens = -(-(sh.draft_context + sh.draft_tree_slots) // sh.page) * sh.page
    build = time.perf_counter()
    layers = []
    for _ in range(sh.layers):
        ctx.check_time()
        layers.append(DraftLayer(ctx, cache_tokens))
    lm_head = torch.randn(sh.vocab, sh.hidden, device=dev, dtype=dtype) * 0.02
    out = {"layers": sh.layers, "build_s": time.perf_counter() - build,
           "substitute_gb": sum(t.nbytes for layer in layers for lin in layer.linears.values()
                                for t in lin.tensors()) / 1e9,
           "context": sh.draft_context, "tree_slots": sh.draft_tree_slots, "passes": [],
           "tree_config": dataclasses.asdict(ctx.tree_config)}
    table = torch.arange(cache_tokens // sh.page, dtype=torch.int32, device=dev)[None]
    for rows in sh.draft_rows:
        ctx.check_time()
        mask = random_tree_mask(rows, sh.draft_tree_slots, gen)
        prefix = sh.draft_context
        plan = tree_rows_layout([TreeRows(0, 0, prefix, mask)], dev, sh.heads // sh.kv_heads,
                                sh.kv_heads, cache_tokens, config=ctx.tree_config)
        pos = torch.arange(prefix + sh.draft_tree_slots - rows, prefix + sh.draft_tree_slots,
                           device=dev)
        inv = 1.0 / (10000 ** (torch.arange(0, sh.head_dim, 2, device=dev).float()
                               / sh.head_dim))
        freqs = pos[:, None].float() * inv[None]
        cos, sin = freqs.cos()[:, None].to(dtype), freqs.sin()[:, None].to(dtype)
        blk, off = (pos // sh.page).long(), (pos % sh.page).long()
        h0 = torch.randn(rows, sh.hidden, device=dev, dtype=dtype)
        static = {"h": h0.clone()}

        def draft_pass():
            h = static["h"]
            for layer in layers:
                h = layer(h, cos, sin, blk, off, table, plan)
            logits = F.linear(rms_norm(h, layers[0].norms[0]), lm_head)
            static["top"] = torch.topk(logits.float(), 8, dim=-1)
            return static["top"]

        row = {"rows": rows, "splits": plan.num_splits}
        row["eager_ms"] = ctx.clock.wall_ms(draft_pass)
        row["eager_calls"] = runtime_calls_per_call(draft_pass, dev)
        if dev.type == "cuda":
            try:
                draft_pass()  # the split workspace and every kernel exist before capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    draft_pass()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    graph_top = draft_pass()  # the graph's own output tensors
                row["graph_ms"] = ctx.clock.wall_ms(graph.replay)
                row["graph_calls"] = runtime_calls_per_call(graph.replay, dev)
                eager_top = draft_pass()[1].clone()
                graph_top[1].fill_(-1)
                graph.replay()
                torch.cuda.synchronize()
                row["graph_matches_eager"] = bool(torch.equal(graph_top[1], eager_top))
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        out["passes"].append(row)
    del layers, lm_head
    return out


def section_hqq_build(ctx) -> dict:
    """HQQ's solver (draft_model/hqq.py, 4 bits, group 64) and the kernel's packing for one
    decoder layer, its bf16 weights already on the device."""
    from vllm_subspec.draft_model.quantize import quantize

    sh, dev = ctx.shapes, ctx.device
    sizes = {"q_proj": (sh.heads * sh.head_dim, sh.hidden),
             "k_proj": (sh.kv_heads * sh.head_dim, sh.hidden),
             "v_proj": (sh.kv_heads * sh.head_dim, sh.hidden),
             "o_proj": (sh.hidden, sh.heads * sh.head_dim),
             "gate_proj": (sh.intermediate, sh.hidden), "up_proj": (sh.intermediate, sh.hidden),
             "down_proj": (sh.hidden, sh.intermediate)}
    out = {"per_linear_s": {}}
    solve = pack = 0.0
    for name, (n, k) in sizes.items():
        ctx.check_time()
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        ctx.clock.sync()
        start = time.perf_counter()
        qw = quantize(w, 4, 64, "hqq")
        ctx.clock.sync()
        mid = time.perf_counter()
        kernel = substitute_kernel(ctx, qw, torch.bfloat16)
        ctx.clock.sync()
        end = time.perf_counter()
        err = ((qw.dequantize(torch.float32) - w.float()).norm() / w.float().norm()).item()
        out["per_linear_s"][name] = {"solve": mid - start, "pack": end - mid, "rel_err": err}
        solve += mid - start
        pack += end - mid
        del w, qw, kernel
    out.update(layer_solve_s=solve, layer_pack_s=pack,
               model_s_26_layers=26 * (solve + pack))
    return out


def section_projection(ctx) -> dict:
    """benchmarks/projection.py with the measured components (each input's source named)."""
    from benchmarks.projection import GpuSetting, measured_speedup

    r = ctx.results
    transfer = r.get("transfer", {})
    passes = {p["rows"]: p for p in r.get("draft_pass", {}).get("passes", [])}
    widest = passes.get(max(passes)) if passes else None
    if ctx.dry and widest:  # the code path, with stand-ins for what a CPU cannot measure
        transfer = {"pinned_gbps": 25.0, "layer_mb": 2 * ctx.shapes.layer_params() / 1e6}
    if not transfer.get("pinned_gbps") or not widest:
        return {"skipped": "needs the transfer and draft-pass sections' measurements"}
    draft_ms = widest.get("graph_ms", widest["eager_ms"])
    bandwidth = transfer["pinned_gbps"]
    layer_gb = transfer["layer_mb"] / 1e3
    sources = {
        "bandwidth_gbps": f"measured: pinned copy of one layer, {bandwidth:.1f} GB/s",
        "uva_efficiency": (f"measured: UVA kernel read / pinned copy, "
                           f"{transfer.get('uva_efficiency', 1.0):.2f}"
                           if "uva_efficiency" in transfer else "assumed 1 (not measured)"),
        "draft_pass_ms": (f"measured: {'graph' if 'graph_ms' in widest else 'eager'} draft "
                          f"pass at {widest['rows']} rows, {draft_ms:.2f} ms"),
        "layer_gb": f"from the shapes: {layer_gb:.3f} GB",
        "tau, D": "the paper's Qwen2.5-7B figures (τ 27.08 at D 48): not measured here",
        "host_ms": "benchmarks/results/step_host.json (measured on CPU)",
        "weights, memory": "the paper's setting: 15.2 GB of weights, 8 and 12 GB cards",
    }
    rows = []
    for memory in (8.0, 12.0):
        for backend in ("uva", "prefetch"):
            for link, gbps in (("measured link", bandwidth), ("PCIe 4 (25 GB/s)", 25.0)):
                setting = GpuSetting(
                    f"{memory:g} GB, {link}, {backend}", memory_gb=memory, bandwidth_gbps=gbps,
                    draft_pass_ms=draft_ms, layer_gb=layer_gb, backend=backend,
                    uva_efficiency=min(1.0, transfer.get("uva_efficiency", 1.0)))
                rows.append({"setting": setting.name,
                             "runs_prefetch": setting.uses_prefetch(),
                             "speedup": measured_speedup(27.08, 48, setting)})
    label = (f"PROJECTED from components measured on {r['env'].get('gpu')}" if not ctx.dry
             else "DRY RUN: stand-in numbers (25 GB/s, CPU draft pass), not a projection")
    return {"label": label,
            "sources": sources, "rows": rows}


def section_moe_experts(ctx) -> dict:
    """The routed experts' Triton kernels (draft_model/experts_triton.py) at Qwen3-30B-A3B's
    layer shapes (128 experts, top-8, hidden 2048, intermediate 768; tiny in the dry run):
    correct against the same 4-bit experts dequantized in fp32, device time replayed from a
    CUDA graph (so the routing layout and both launches are checked to capture), and the
    expert bytes a pass touches."""
    from vllm_subspec.draft_model.experts import (
        TritonExpertKernel,
        expert_tensors,
        routed_experts,
    )

    dev = ctx.device
    hidden, inter, experts, top_k = (128, 64, 8, 2) if ctx.dry else (2048, 768, 128, 8)
    dtype = torch.float16 if ctx.dry else torch.bfloat16  # (the interpreter's bf16 is raw bits)
    def fp16_meta(q):  # HQQ's scale and zero as the CUDA build keeps them
        return dataclasses.replace(q, scale=q.scale.half(), zero=q.zero.half())

    q13 = [fp16_meta(random_quantized(2 * inter, hidden, dev)) for _ in range(experts)]
    q2 = [fp16_meta(random_quantized(hidden, inter, dev)) for _ in range(experts)]

    def stacked(qs):
        per = [expert_tensors(TritonExpertKernel, q, dtype) for q in qs]
        return [torch.stack(ts).contiguous() for ts in zip(*per)]

    w13, w2 = stacked(q13), stacked(q2)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in w13 + w2)  # one expert's
    gen = torch.Generator().manual_seed(0)
    cases = []
    for m in ((1, 5) if ctx.dry else (1, 8, 64, 289)):
        ctx.check_time()
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                           for _ in range(m)]).to(torch.int32).to(dev)
        weights = torch.softmax(torch.randn(m, top_k, generator=gen), -1).to(dev)
        x = torch.randn(m, hidden, generator=gen).to(dev, dtype)

        def run():
            return routed_experts(x, weights, ids, w13, w2, TritonExpertKernel.name, 64, 4)

        out = run().float()
        ref = torch.zeros(m, hidden, device=dev)
        used = torch.unique(ids).tolist()
        for e in used:
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            h = x[rows].float() @ q13[e].dequantize(torch.float32).T
            h = F.silu(h[:, :inter]) * h[:, inter:]
            ref.index_add_(0, rows, (h @ q2[e].dequantize(torch.float32).T)
                           * weights[rows, slots, None])
        err = ((out - ref).norm() / ref.norm()).item()
        ms = ctx.clock.device_ms(run)
        case = {"rows": m, "experts_touched": len(used), "rel_err": err, "ms": ms,
                "gbps": len(used) * expert_bytes / ms / 1e6}
        if dev.type == "cuda":  # one capture, replayed: the same output as eager
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = run()
            graph.replay()
            ctx.clock.sync()
            case["graph_equals_eager"] = bool(torch.equal(captured.float(), out))
        cases.append(case)
    bound = MAX_REL_ERR[dtype]
    return {"shapes": {"hidden": hidden, "intermediate": inter, "experts": experts,
                       "top_k": top_k, "dtype": str(dtype).split(".")[-1]},
            "expert_mb": expert_bytes / 1e6, "max_rel_err": bound,
            "ok": all(c["rel_err"] < bound and c.get("graph_equals_eager", True)
                      for c in cases), "cases": cases}


# the order they run in: the sweep last but the projection (it compiles ~50 kernels; what the
# projection needs comes first, so a run cut short by --budget-s loses the sweep's tail only)
SECTIONS = {"env": section_env, "tree_attention": section_tree_attention,
            "gemlite": section_gemlite, "transfer": section_transfer,
            "draft_pass": section_draft_pass, "hqq_build": section_hqq_build,
            "moe_experts": section_moe_experts,
            "tree_attention_configs": section_tree_attention_configs,
            "projection": section_projection}


# --------------------------------------------------------------------------- the run

class OutOfTime(Exception):
    pass


@dataclasses.dataclass
class Context:
    device: torch.device
    dry: bool
    shapes: Shapes
    clock: Clock
    deadline: float
    gemlite: bool = False
    tree_config: object = None  # the tree kernel's KernelConfig the draft pass uses
    results: dict = dataclasses.field(default_factory=dict)

    def check_time(self):
        if time.monotonic() > self.deadline:
            raise OutOfTime("the run's time budget is spent")


def gemlite_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import gemlite  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def output_dir(arg: str | None) -> Path:
    for value in (arg, os.environ.get("GPU_COMPONENTS_OUT"), os.environ.get("OUT")):
        if value:
            return Path(value)
    return REPO / "benchmarks" / "results"


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"# GPU components: {env.get('gpu', 'CPU dry run (tiny shapes, Triton interpreted)')}",
             "", f"`python scripts/gpu_components.py{' --dry-run' if env.get('dry_run') else ''}`"
             f"; torch {env.get('torch')}, Triton {env.get('triton')}, gemlite "
             f"{env.get('gemlite')}; no vLLM (kernel costs with random weights, not τ).", ""]
    if "d2d_gbps_read_plus_write" in env:
        lines.append(f"Device memory: a device-to-device copy moves "
                     f"{env['d2d_gbps_read_plus_write']:.0f} GB/s (read + written); "
                     f"{env.get('sms')} SMs.\n")
    for name, sec in results.items():
        if name == "env":
            continue
        lines.append(f"## {name}")
        if "error" in sec:
            lines.append(f"\nFAILED: `{sec['error']}`\n")
            continue
        if "skipped" in sec:
            lines.append(f"\nSkipped: {sec['skipped']}\n")
            continue
        lines.append("")
        lines += SECTION_MD.get(name, lambda s: [f"```\n{json.dumps(s, indent=1)}\n```"])(sec)
        lines.append(f"\n({sec.get('seconds', 0):.1f} s)\n")
    return "\n".join(lines) + "\n"


def _tree_md(sec):
    lines = [f"Correct against the dense fp32 reference: **{'all' if sec['ok'] else 'NOT all'}"
             f"** ({len(sec['cases'])} cases, bf16 and fp16, unsplit and split; bounds "
             f"{sec['max_rel_err']}, the worst (row, head) {sec.get('max_row_rel_err')}). "
             f"FlashAttention: {sec['flash_attn']}.", "",
             "| dtype | context | requests | rows | splits | rel. err unsplit / split | "
             "Triton unsplit ms | Triton split ms | SDPA ms |", "|---|---|---|---|---|---|---|---|---|"]
    for c in sec["cases"]:
        lines.append(
            f"| {c['dtype']} | {c['context']} | {c['requests']} | {c['rows']} | "
            f"{c['split_splits']} | {c['unsplit_rel_err']:.1e} / {c['split_rel_err']:.1e} | "
            + " | ".join(f"{c[k]:.3f}" if k in c else "" for k in
                         ("unsplit_ms", "split_ms", "sdpa_ms")) + " |")
    return lines


def _configs_md(sec):
    cases = ", ".join(f"{c['requests']}x{c['rows']} rows @ {c['context']}" for c in sec["cases"])
    lines = [f"Cases (requests x tree rows @ context, bf16): {cases}. Device ms per case "
             "(CUDA-graph replays). Best overall: `" + json.dumps(sec["best"]) + "`.", "",
             "| block_m | block_n | warps | stages | K rows | prefix phase | correct | vs default "
             "| ms per case |", "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(sec["configs"], key=lambda c: c["mean_time_vs_default"] or 1e9):
        k = c["config"]
        vs = f"{c['mean_time_vs_default']:.2f}" if c["mean_time_vs_default"] else \
            (c["error"] or "-")
        lines.append(f"| {k['block_m']} | {k['block_n']} | {k['num_warps'] or 'auto'} | "
                     f"{k['num_stages'] or 'auto'} | {k['k_rows']} | {k['prefix_phase']} | "
                     f"{c['correct']} | {vs} | "
                     + " / ".join(f"{t:.3f}" for t in c["ms"]) + " |")
    return lines


def _gemlite_md(sec):
    lines = [f"Kernel: {sec['kernel']}. Autotune: {sec.get('autotune', '-')}.", "",
             "Device times from CUDA-graph replays (`triton.testing.do_bench_cudagraph`: no "
             "host launch cost, L2 not flushed); eager: one call launched from Python "
             "(`do_bench`, L2 flushed), where the host's launch work can dominate.", "",
             "| linear [out, in] | rows | 4-bit ms | bf16 ms | 4-bit GB/s | bf16 GB/s | "
             "4-bit / bf16 time | eager 4-bit / bf16 ms | first call s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in sec["shapes"].items():
        for r in s["rows"]:
            lines.append(f"| {name} {s['out_in']} | {r['rows']} | {r['w4a16_ms']:.4f} | "
                         f"{r['bf16_ms']:.4f} | {r['w4a16_gbps']:.0f} | {r['bf16_gbps']:.0f} | "
                         f"{r['w4a16_ms'] / r['bf16_ms']:.2f} | {r['w4a16_eager_ms']:.3f} / "
                         f"{r['bf16_eager_ms']:.3f} | {r['first_call_s']:.2f} |")
    return lines


def _transfer_md(sec):
    o = sec["overlap"]
    lines = [f"One decoder layer, {sec['layer_mb']:.0f} MB bf16: pinned copy "
             f"{sec['pinned_gbps']:.1f} GB/s ({sec['pinned_ms']:.1f} ms), pageable "
             f"{sec['pageable_gbps']:.1f} GB/s."]
    if "uva_read_gbps" in sec:
        lines.append(f"UVA read (a kernel reading pinned host memory): {sec['uva_read_gbps']:.1f}"
                     f" GB/s, {sec['uva_efficiency']:.2f} of the pinned copy.")
    else:
        lines.append(f"UVA read: failed ({sec.get('uva_error')}).")
    lines.append(f"Copy on a second stream beside {o['compute_calls']} 4-bit linears replayed "
                 f"from a CUDA graph: copy {o['copy_ms']:.1f} ms, compute {o['compute_ms']:.1f} "
                 f"ms (events), both {o['both_ms']:.1f} ms: {o['hidden_fraction']:.0%} of the "
                 f"shorter hidden; the compute took {o['compute_ms_during_copy']:.1f} ms during "
                 f"the copy ({o['compute_slowdown_during_copy']:.2f}x alone).")
    return lines


def _draft_md(sec):
    lines = [f"Tree kernel config: `{json.dumps(sec['tree_config'])}`.",
             f"{sec['layers']} substitute layers ({sec['substitute_gb']:.2f} GB) + bf16 lm_head,"
             f" one request at context {sec['context']}, {sec['tree_slots']} tree slots; built "
             f"in {sec['build_s']:.1f} s.", "",
             "| rows | splits | eager ms | graph ms | eager launches / syncs | graph launches "
             "/ syncs | graph = eager |", "|---|---|---|---|---|---|---|"]
    for p in sec["passes"]:
        e, g = p.get("eager_calls", {}), p.get("graph_calls", {})
        lines.append(
            f"| {p['rows']} | {p['splits']} | {p['eager_ms']:.2f} | "
            f"{p['graph_ms']:.2f} | " if "graph_ms" in p else
            f"| {p['rows']} | {p['splits']} | {p['eager_ms']:.2f} | {p.get('graph_error', '-')} | ")
        lines[-1] += (f"{e.get('kernel_launches', '-')} / {e.get('host_syncs', '-')} | "
                      f"{g.get('kernel_launches', '-')} (+{g.get('graph_launches', '-')} graph)"
                      f" / {g.get('host_syncs', '-')} | {p.get('graph_matches_eager', '-')} |")
    return lines


def _hqq_md(sec):
    return [f"One decoder layer: HQQ solve {sec['layer_solve_s']:.2f} s, packing "
            f"{sec['layer_pack_s']:.2f} s; 26 layers ≈ {sec['model_s_26_layers']:.0f} s.", "",
            "| linear | solve s | pack s | rel. err |", "|---|---|---|---|"] + [
        f"| {k} | {v['solve']:.3f} | {v['pack']:.3f} | {v['rel_err']:.3f} |"
        for k, v in sec["per_linear_s"].items()]


def _moe_md(sec):
    sh = sec["shapes"]
    lines = [f"{sh['experts']} experts, top-{sh['top_k']}, hidden {sh['hidden']}, intermediate "
             f"{sh['intermediate']}, {sh['dtype']}; {sec['expert_mb']:.2f} MB an expert (4-bit "
             f"codes, fp16 scale and zero). Correct against the dequantized experts in fp32 "
             f"(bound {sec['max_rel_err']}) and replayed from a CUDA graph as eager: "
             f"**{'all' if sec['ok'] else 'NOT all'}**. Device ms from CUDA-graph replays.",
             "",
             "| rows | experts touched | rel. err | ms | GB/s of touched experts | "
             "graph replay = eager |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['rows']} | {c['experts_touched']} | {c['rel_err']:.1e} | {c['ms']:.3f} | "
              f"{c['gbps']:.0f} | {c.get('graph_equals_eager', '-')} |" for c in sec["cases"]]
    return lines


def _projection_md(sec):
    lines = [f"**{sec['label']}** (a model, not a measurement).", ""]
    lines += [f"- {k}: {v}" for k, v in sec["sources"].items()]
    lines += ["", "| setting | SubSpec runs prefetch | projected speed-up |", "|---|---|---|"]
    lines += [f"| {r['setting']} | {r['runs_prefetch']} | {r['speedup']:.1f}x |"
              for r in sec["rows"]]
    return lines


SECTION_MD = {"tree_attention": _tree_md, "tree_attention_configs": _configs_md, "gemlite": _gemlite_md, "transfer": _transfer_md,
              "draft_pass": _draft_md, "hqq_build": _hqq_md, "moe_experts": _moe_md,
              "projection": _projection_md}


def main(argv=None) -> int:
    torch.manual_seed(0)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, Triton interpreted (CI)")
    p.add_argument("--out", help="output folder (default $GPU_COMPONENTS_OUT, $OUT, "
                   "benchmarks/results)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new work after this many seconds")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset of " + ",".join(SECTIONS))
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cpu" and not args.dry_run:
        print("[gpu_components] no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    ctx = Context(device, args.dry_run, TINY if args.dry_run else QWEN25_7B,
                  Clock(device, args.dry_run), time.monotonic() + args.budget_s)
    ctx.gemlite = gemlite_usable(device)
    from vllm_subspec.step.tree_attention_triton import DEFAULT_CONFIG

    ctx.tree_config = DEFAULT_CONFIG
    out_dir = output_dir(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu_components_dry_run" if args.dry_run else "gpu_components"
    wanted = ["env"] + [s for s in args.sections.split(",") if s and s != "env"]
    failed = False
    for name in wanted:
        start = time.monotonic()
        print(f"[gpu_components] {name} ...", flush=True)
        try:
            ctx.check_time()
            ctx.results[name] = SECTIONS[name](ctx)
        except OutOfTime as e:
            ctx.results[name] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - the report records it; the rest still runs
            traceback.print_exc()
            ctx.results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            failed = True
        ctx.results[name]["seconds"] = time.monotonic() - start
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (out_dir / f"{stem}.json").write_text(json.dumps(ctx.results, indent=1))
        (out_dir / f"{stem}.md").write_text(markdown(ctx.results))
        print(f"[gpu_components] {name}: {ctx.results[name]['seconds']:.1f} s", flush=True)
    if not args.dry_run and "draft_pass" in ctx.results and "passes" in ctx.results["draft_pass"]:
        try:  # the figure beside the report (matplotlib, where the machine has it)
            from benchmarks.plots import plot_gpu_components

            plot_gpu_components(ctx.results, out_dir / f"{stem}.png")
        except Exception as e:  # noqa: BLE001
            print(f"[gpu_components] no plot: {type(e).__name__}: {e}", file=sys.stderr)
    kernels_ok = all(ctx.results.get(name, {}).get("ok", True)
                     for name in ("tree_attention", "moe_experts"))
    print((out_dir / f"{stem}.md").read_text())
    return 1 if failed or not kernels_ok else 0


if __name__ == "__main__":
    sys.exit(main())
