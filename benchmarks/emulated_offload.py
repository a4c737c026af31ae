"""SubSpec against plain decoding under an EMULATED weight-streaming link (vLLM's CPU backend).

On a CPU nothing streams, so SubSpec never runs in its own regime there. Here every target
forward of both engines waits for the bytes of the decoder layers vLLM's UVA rule would offload
under `--cpu-offload-gb` (the layers SubSpec's default `substitute_layers: "offloaded"`
substitutes) at an emulated bandwidth, the same for 1 row or 300; draft passes wait for nothing
(subspec_testing/emulated_link.py). Everything else is real: vLLM's scheduler, batching, chunked
prefill, SubSpec's tuner, τ. Every figure is labelled "emulated link".

The link: a GPU ratio R = (plain step) / (draft pass) of Qwen2.5-7B at 8 GB over PCIe 4 (26 of
28 layers of 0.466 GB at 25 GB/s) against the H200's CUDA-graph draft pass (6.0 ms): R = 80.8
(`GpuScenario`). A calibration engine (a fixed SubSpec chain, 1x8, no wait) times this engine's
draft pass d (session seconds per draft forward, 1 row); the plain engine's one untimed request
without the wait times its decode step c; the link then waits R * d - c per target forward
(bandwidth = the offloaded layers' bytes over that).
`--ratio` sets a smaller R (labelled "reduced ratio"). The achieved ratio is plain's measured
one-request step over d.

Configs, each on a fresh engine (the first request shows the cold start): plain (no
speculative_config, the same cpu_offload_gb and link), the default `{"method": "subspec"}`,
and the best fixed shape of a sweep (`{"method": "subspec", "tree_width": w, "tree_depth": d}`,
each shape on its own engine, timed on `--sweep-prompts` single requests). Workloads, on
AsyncLLM (requests as asyncio tasks, so arrivals are on time while a step runs): "single"
(`--prompts` requests one after another; first = the first request, steady = the rest),
"concurrent" (`--concurrency` requests at once, `--rounds` rounds), "staggered" (`--concurrency`
requests arriving every `--stagger-steps` plain steps, `--rounds` rounds; first = round 1,
steady = later rounds). Greedy; token identity against plain's same request is counted (fp32
for SmolLM2: exact). Writes benchmarks/results/<name>.{json,md,png}.

    python -m benchmarks.emulated_offload --model smollm2 --name emulated_offload_smollm2_before
    python -m benchmarks.emulated_offload --model qwen-coder-1.5b --kv-cache-gb 2 --ratio 20 \\
        --prompts 2 --max-tokens 48 --concurrency 4 --rounds 1 --widths 4 6 --depths 16 \\
        --name emulated_offload_qwen
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time

from benchmarks.cpu_speed import mixed_prompts
from benchmarks.depth_sweep import RESULTS, environment, model_path, stream_gbps

CALIBRATION_SHAPE = {"method": "subspec", "tree_width": 1, "tree_depth": 8}
WORKLOADS = ("single", "concurrent", "staggered")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="emulated_offload")
    ap.add_argument("--dtype", default=None, help="default: float32 for smollm2, else bfloat16")
    ap.add_argument(
        "--offloaded-layers",
        type=int,
        default=None,
        help="decoder layers vLLM's UVA rule offloads (default: the GPU scenario's "
        "26/28 share of the model's layers)",
    )
    ap.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="plain step / draft pass to emulate (default: the GPU scenario's R)",
    )
    ap.add_argument("--prompts", type=int, default=3, help="single: requests one at a time")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="concurrent and staggered rounds")
    ap.add_argument(
        "--stagger-steps",
        type=float,
        default=4.0,
        help="staggered: plain steps (link + compute) between two arrivals",
    )
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--sweep-prompts", type=int, default=2)
    ap.add_argument("--best", default=None, help="WxD: skip the sweep, use this fixed shape")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument(
        "--calibrate-only",
        action="store_true",
        help="start the calibration engine, print the link, stop",
    )
    ap.add_argument(
        "--compiled", action="store_true", help="vLLM's default mode (compiled) instead of eager"
    )
    return ap.parse_args()


def engine_kwargs(args, offload_gb: float, max_num_seqs: int) -> dict:
    from subspec_testing.harness import CPU_ENGINE_KWARGS

    return dict(
        CPU_ENGINE_KWARGS,
        dtype=args.dtype,
        enforce_eager=not args.compiled,
        cpu_offload_gb=offload_gb,
        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16384,
    )


class _Metrics:
    """`acceptance_stats`' view of vLLM's metrics (one engine in the process at a time)."""

    def get_metrics(self):
        from vllm.v1.metrics.reader import get_metrics_snapshot

        return get_metrics_snapshot()


async def _snapshot(engine, spec: bool) -> dict:
    from subspec_testing import emulated_link
    from subspec_testing.harness import step_stats
    from subspec_testing.metrics import acceptance_stats

    link = (await engine.collective_rpc(emulated_link.link_stats))[0]["record"]
    return {
        "stats": acceptance_stats(_Metrics()) if spec else None,
        "link": link,
        "steps": (await engine.collective_rpc(step_stats))[0] if spec else None,
        "time": time.perf_counter(),
    }


def _delta(before: dict, after: dict) -> dict:
    out = {
        "seconds": after["time"] - before["time"],
        "target_forwards": after["link"]["forwards"] - before["link"]["forwards"],
    }
    if before["stats"] is not None:
        st = after["stats"] - before["stats"]
        out.update(tau=st.tau, drafts=st.num_drafts)
        b, a = before["steps"], after["steps"]
        d = {
            k: a[k] - b[k] for k in ("draft_steps", "plain_steps", "draft_passes", "draft_seconds")
        }
        out.update(
            steps=d["draft_steps"],
            drafting_steps=d["draft_steps"] - d["plain_steps"],
            draft_passes=d["draft_passes"],
            draft_seconds=d["draft_seconds"],
        )
    return out


async def _request(engine, prompt: str, params, rid: str, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    final, first = None, None
    async for out in engine.generate(prompt, params, request_id=rid):
        final = out
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
    return {
        "token_ids": list(final.outputs[0].token_ids),
        "start": start,
        "first": first,
        "end": time.perf_counter(),
    }


def decode_step_s(reqs: list[dict]) -> float:
    """Seconds per decode step of requests run alone: after the first token, per token."""
    steps = [(r["end"] - r["first"]) / (len(r["token_ids"]) - 1) for r in reqs]
    return sum(steps) / len(steps)


async def _round(engine, spec, prompts, params, tag, interval=0.0) -> dict:
    before = await _snapshot(engine, spec)
    reqs = await asyncio.gather(
        *(_request(engine, p, params, f"{tag}-{i}", i * interval) for i, p in enumerate(prompts))
    )
    out = _delta(before, await _snapshot(engine, spec))
    tokens = sum(len(r["token_ids"]) for r in reqs)
    out.update(
        tokens=tokens,
        token_ids=[r["token_ids"] for r in reqs],
        requests=[{k: r[k] for k in ("start", "first", "end")} for r in reqs],
        span=max(r["end"] for r in reqs) - min(r["start"] for r in reqs),
    )
    out["tokens_per_second"] = tokens / out["span"]
    return out


async def _calibrate_plain(engine, plan_layers, calibrate) -> tuple[dict, float]:
    """A plain engine's decode step without a wait (one request, not timed): the link is
    then R x draft pass - that step. Returns (the calibration, its bandwidth)."""
    from subspec_testing import emulated_link

    ratio, draft_pass_s, prompt, params = calibrate
    await engine.collective_rpc(emulated_link.install_link, args=(None, plan_layers))
    warm = await _request(engine, prompt, params, "calibration", 0.0)
    report = (await engine.collective_rpc(emulated_link.link_stats, args=(True,)))[0]
    cal = emulated_link.Calibration(ratio, draft_pass_s, decode_step_s([warm]), report["bytes"])
    return cal.__dict__, cal.bandwidth_gbps


async def _run(label, spec, model, kw, link_gbps, plan_layers, workloads, calibrate=None) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from subspec_testing import emulated_link

    start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, speculative_config=spec, **kw))
    started = time.perf_counter() - start
    try:
        calibration = None
        if calibrate is not None:
            calibration, link_gbps = await _calibrate_plain(engine, plan_layers, calibrate)
        link = (
            await engine.collective_rpc(emulated_link.install_link, args=(link_gbps, plan_layers))
        )[0]
        result = {
            "label": label,
            "config": spec,
            "engine_start_s": started,
            "link": link,
            "calibration": calibration,
            "workloads": {},
        }
        for name, rounds in workloads:
            result["workloads"][name] = [
                await _round(engine, spec is not None, prompts, params, f"{name}{i}", interval)
                for i, (prompts, params, interval) in enumerate(rounds)
            ]
        result["link_after"] = (await engine.collective_rpc(emulated_link.link_stats))[0]
        return result
    finally:
        engine.shutdown()
        gc.collect()


def run_engine(label, spec, model, kw, link_gbps, plan_layers, workloads, calibrate=None):
    r = asyncio.run(_run(label, spec, model, kw, link_gbps, plan_layers, workloads, calibrate))
    for name, rounds in r["workloads"].items():
        print(
            f"[emulated_offload] {label} {name}: "
            + ", ".join(
                f"{x['tokens_per_second']:.2f} tok/s"
                + (
                    f" (τ {x['tau']:.2f}, {x['drafting_steps']}/{x['steps']} drafting)"
                    if "tau" in x
                    else ""
                )
                for x in rounds
            ),
            flush=True,
        )
    return r


def draft_pass(model, kw, prompts, params) -> dict:
    """This engine's draft pass without a wait: a fixed 1x8 chain's session seconds per draft
    forward (1 row each) over one request, after a short warm-up."""
    from vllm import SamplingParams

    warm = SamplingParams(temperature=0.0, max_tokens=8)
    r = run_engine(
        "calibration (no wait)",
        CALIBRATION_SHAPE,
        model,
        kw,
        None,
        None,
        [("warm-up", [([prompts[0]], warm, 0.0)]), ("timed", [([prompts[1]], params, 0.0)])],
    )
    timed = r["workloads"]["timed"][0]
    r["draft_pass_s"] = timed["draft_seconds"] / timed["draft_passes"]
    return r


def _plan_rounds(args, prompts, params, plain_step_s):
    c = args.concurrency
    out = []
    for name in args.workloads:
        if name == "single":
            out.append((name, [([p], params, 0.0) for p in prompts[: args.prompts]]))
        elif name == "concurrent":
            out.append((name, [(prompts[:c], params, 0.0)] * args.rounds))
        else:
            out.append(
                (
                    name,
                    [(prompts[c : 2 * c], params, args.stagger_steps * plain_step_s)] * args.rounds,
                )
            )
    return out


def main():
    args = parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable rpc
    from vllm import SamplingParams

    from subspec_testing.assets import chat_prompts
    from subspec_testing.emulated_link import (
        GpuScenario,
        config_layer_bytes,
        offload_gb_for_layers,
        scenario_layers,
    )

    model = model_path(args.model)
    args.dtype = args.dtype or ("float32" if args.model == "smollm2" else "bfloat16")
    num_layers, _ = config_layer_bytes(model, args.dtype)
    want = args.offloaded_layers or scenario_layers(num_layers)
    offload_gb = offload_gb_for_layers(model, args.dtype, want)
    scenario = GpuScenario()
    ratio = args.ratio or scenario.ratio()
    prompts = chat_prompts(model, mixed_prompts(max(2 * args.concurrency, args.prompts, 2)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kw = engine_kwargs(args, offload_gb, max(args.concurrency, 1))
    t0 = time.perf_counter()
    bandwidth_before = stream_gbps()

    chain = draft_pass(model, kw, prompts, params)
    d = chain["draft_pass_s"]
    layers = chain["link"]["layers"]
    print(
        f"[emulated_offload] draft pass {d * 1e3:.2f} ms (R {ratio:.1f}: plain step "
        f"{ratio * d:.3f} s); {len(layers)} layers planned ({chain['link']['bytes'] / 1e9:.3f} "
        f"GB), substituted {chain['link']['substituted'] == layers}",
        flush=True,
    )
    if args.calibrate_only:
        return
    rounds = _plan_rounds(args, prompts, params, ratio * d)
    plain = run_engine(
        "plain", None, model, kw, None, layers, rounds, calibrate=(ratio, d, prompts[1], params)
    )
    c = plain["calibration"]
    gbps = c["bandwidth_gbps"]
    print(
        f"[emulated_offload] calibration: R {ratio:.1f}, draft pass {d * 1e3:.2f} ms, plain "
        f"step without the link {c['plain_compute_s'] * 1e3:.1f} ms -> link {c['link_s']:.3f} s "
        f"per forward = {gbps:.3f} GB/s over {len(layers)} layers "
        f"({c['link_bytes'] / 1e9:.3f} GB)",
        flush=True,
    )
    single = plain["workloads"].get("single")
    achieved = None
    if single:
        step = decode_step_s([r for x in single for r in _requests(x)])
        achieved = step / d
        print(
            f"[emulated_offload] achieved ratio (plain one-request decode step {step:.3f} s / "
            f"draft pass): {achieved:.1f} (target {ratio:.1f})",
            flush=True,
        )

    sweep = []
    if args.best:
        w, d = (int(x) for x in args.best.lower().split("x"))
        best = {"method": "subspec", "tree_width": w, "tree_depth": d}
    else:
        sweep_rounds = [("single", [([p], params, 0.0) for p in prompts[: args.sweep_prompts]])]
        for w in args.widths:
            for d in args.depths:
                spec = {"method": "subspec", "tree_width": w, "tree_depth": d}
                sweep.append(run_engine(f"{w}x{d}", spec, model, kw, gbps, layers, sweep_rounds))
        best = max(sweep, key=lambda r: _rate(r["workloads"]["single"]))["config"]
    default = run_engine("default", {"method": "subspec"}, model, kw, gbps, layers, rounds)
    fixed = run_engine(
        f"best fixed {best['tree_width']}x{best['tree_depth']}",
        best,
        model,
        kw,
        gbps,
        layers,
        rounds,
    )

    report = {
        "command": "python -m benchmarks.emulated_offload " + " ".join(sys.argv[1:]),
        "model": model,
        "dtype": args.dtype,
        "mode": "compiled" if args.compiled else "eager",
        "max_tokens": args.max_tokens,
        "environment": environment(),
        "memory_gbps": {"before": bandwidth_before, "after": stream_gbps()},
        "scenario": {
            **scenario.__dict__,
            "ratio": scenario.ratio(),
            "plain_step_s": scenario.plain_step_s(),
        },
        "ratio": ratio,
        "reduced_ratio": ratio < scenario.ratio() - 1e-9,
        "cpu_offload_gb": offload_gb,
        "offloaded_layers_wanted": want,
        "calibration": c,
        "achieved_ratio": achieved,
        "link": {
            k: plain["link"][k]
            for k in ("layers", "num_layers", "bytes", "seconds_per_forward", "bandwidth_gbps")
        },
        "substituted": chain["link"]["substituted"],
        "args": vars(args),
        "total_seconds": None,
        "engines": {
            "calibration": chain,
            "plain": plain,
            "default": default,
            "best": fixed,
            "sweep": sweep,
        },
    }
    report["table"] = table(report)
    report["total_seconds"] = time.perf_counter() - t0
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def _ms_per_pass(rounds: list[dict]) -> float | None:
    passes = sum(r["draft_passes"] for r in rounds)
    return 1e3 * sum(r["draft_seconds"] for r in rounds) / passes if passes else None


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _requests(round_: dict) -> list[dict]:
    return [dict(r, token_ids=t) for r, t in zip(round_["requests"], round_["token_ids"])]


def _rate(rounds: list[dict]) -> float:
    return sum(r["tokens"] for r in rounds) / max(sum(r["span"] for r in rounds), 1e-9)


def _tau(rounds: list[dict]) -> float | None:
    drafts = sum(r.get("drafts", 0) for r in rounds)
    if not drafts:
        return None
    return sum(r["tau"] * r["drafts"] for r in rounds) / drafts


def _identical(rounds: list[dict], plain: list[dict]) -> tuple[int, int]:
    from subspec_testing.harness import count_identical

    same = sum(count_identical(r["token_ids"], p["token_ids"]) for r, p in zip(rounds, plain))
    return same, sum(len(p["token_ids"]) for p in plain)


def table(report: dict) -> list[dict]:
    """One row per (config, workload, first | steady): tok/s, ratio to plain, τ, identity."""
    eng = report["engines"]
    rows = []
    for key in ("default", "best"):
        e = eng[key]
        for name, rounds in e["workloads"].items():
            plain = eng["plain"]["workloads"][name]
            for part, sl in (("first", slice(0, 1)), ("steady", slice(1, None))):
                sub, pl = rounds[sl], plain[sl]
                if not sub:
                    continue
                same, n = _identical(sub, pl)
                rows.append(
                    {
                        "config": e["label"],
                        "workload": name,
                        "part": part,
                        "tokens_per_second": _rate(sub),
                        "plain_tokens_per_second": _rate(pl),
                        "ratio": _rate(sub) / _rate(pl),
                        "tau": _tau(sub),
                        "drafting_steps": sum(r["drafting_steps"] for r in sub),
                        "steps": sum(r["steps"] for r in sub),
                        "draft_ms_per_pass": _ms_per_pass(sub),
                        "identical": f"{same}/{n}",
                    }
                )
    plain_single = eng["plain"]["workloads"].get("single", [])
    for s in eng["sweep"]:
        sub = s["workloads"]["single"]
        pl = plain_single[: len(sub)]
        same, n = _identical(sub, pl)
        rows.append(
            {
                "config": f"sweep {s['label']}",
                "workload": "single",
                "part": "all",
                "tokens_per_second": _rate(sub),
                "plain_tokens_per_second": _rate(pl),
                "ratio": _rate(sub) / _rate(pl) if pl else None,
                "tau": _tau(sub),
                "drafting_steps": sum(r["drafting_steps"] for r in sub),
                "steps": sum(r["steps"] for r in sub),
                "draft_ms_per_pass": _ms_per_pass(sub),
                "identical": f"{same}/{n}",
            }
        )
    return rows


def markdown(report: dict) -> str:
    link, c, s = report["link"], report["calibration"], report["scenario"]
    ratio_label = "reduced ratio" if report["reduced_ratio"] else "the GPU scenario's ratio"
    link_cell = (
        f"{link['bandwidth_gbps']:.3f} GB/s, {link['seconds_per_forward']:.3f} s/fwd, "
        f"{len(link['layers'])}/{link['num_layers']} layers"
    )
    achieved = report["achieved_ratio"]
    lines = [
        f"# SubSpec vs plain under an EMULATED link: {os.path.basename(report['model'])}, "
        f"{report['mode']}, {report['dtype']}",
        "",
        f"`{report['command']}`",
        "",
        f"**Emulated link** (subspec_testing/emulated_link.py): every target forward, of both "
        f"engines, waits {link['seconds_per_forward']:.3f} s for layers {link['layers'][0]}-"
        f"{link['layers'][-1]} ({len(link['layers'])} of {link['num_layers']}, "
        f"{link['bytes'] / 1e9:.3f} GB: vLLM's UVA rule at `cpu_offload_gb` "
        f"{report['cpu_offload_gb']:.3f}) at {link['bandwidth_gbps']:.3f} GB/s, then computes "
        "(sum semantics); draft passes wait for nothing. SubSpec substituted layers "
        f"{_span(report['substituted'])}. Nothing here ran on a GPU.",
        "",
        f"Calibration ({ratio_label}): GPU R = {s['offloaded_layers']} x {s['layer_gb']} GB / "
        f"{s['bandwidth_gbps']} GB/s / {s['draft_pass_ms']} ms = {s['ratio']:.1f}; emulated R = "
        f"{report['ratio']:.1f}. This engine's draft pass {c['draft_pass_s'] * 1e3:.2f} ms "
        f"(a fixed 1x8 chain's session seconds per draft forward, 1 row, no wait); the plain "
        f"engine's one-request decode step without the link {c['plain_compute_s'] * 1e3:.1f} ms "
        f"(one untimed request before its workloads) -> link {c['link_s']:.3f} s = R x pass - "
        "plain step. "
        + (
            f"Achieved: plain's one-request decode step under the link / draft pass = "
            f"{achieved:.1f}."
            if achieved
            else ""
        ),
        "",
        f"Greedy, ≤{report['max_tokens']} tokens a request, mixed MT-Bench first turns; "
        f"{report['environment']['cpu']}, {report['environment']['date']}, single-core memory "
        f"bandwidth {report['memory_gbps']['before']:.1f} / {report['memory_gbps']['after']:.1f}"
        " GB/s before / after. Fresh engine per config, no warm-up: each config's first "
        'workload\'s "first" is the first request after start-up. single: requests one at a '
        "time (first = request 1, steady = the rest); concurrent: all at once, per round; "
        "staggered: arrivals every "
        f"{report['args']['stagger_steps']:g} plain steps (first = round 1). Identity: token "
        "ids equal to plain's same request.",
        "",
        "| config | workload | part | tok/s (emulated link) | plain tok/s | ratio | τ | "
        "steps drafting | ms / draft pass | identical | link |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["table"]:
        ratio = f"**{r['ratio']:.2f}x**" if r["ratio"] is not None else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        lines.append(
            f"| {r['config']} | {r['workload']} | {r['part']} | "
            f"{r['tokens_per_second']:.2f} | {r['plain_tokens_per_second']:.2f} | "
            f"{ratio} | {tau} | {r['drafting_steps']}/{r['steps']} | "
            f"{_num(r['draft_ms_per_pass'])} | {r['identical']} | {link_cell} |"
        )
    lines += [
        "",
        "Engine starts (s): "
        + ", ".join(f"{e['label']} {e['engine_start_s']:.0f}" for e in _engines(report))
        + ".",
        f"Whole run: {report['total_seconds'] or 0:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def _engines(report):
    eng = report["engines"]
    return [eng["calibration"], eng["plain"], *eng["sweep"], eng["default"], eng["best"]]


def _span(layers) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]} ({len(layers)})"
    return ", ".join(map(str, layers))


def plot(report: dict, path) -> None:
    from benchmarks.plots import _pyplot

    plt = _pyplot()
    rows = [r for r in report["table"] if not r["config"].startswith("sweep")]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [
        f"{r['config'].replace('best fixed ', '')}\n{r['workload']} {r['part']}" for r in rows
    ]
    ax.bar(
        range(len(rows)),
        [r["ratio"] for r in rows],
        color=["C0" if r["config"] == "default" else "C1" for r in rows],
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("SubSpec / plain tok/s")
    link = report["link"]
    ax.set_title(
        f"{os.path.basename(report['model'])}, EMULATED link "
        f"{link['bandwidth_gbps']:.2f} GB/s ({link['seconds_per_forward']:.2f} s/fwd, "
        f"{len(link['layers'])} layers), R {report['ratio']:.0f}"
        + (" (reduced ratio)" if report["reduced_ratio"] else ""),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
