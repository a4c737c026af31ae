"""Bounded server soak: `vllm serve` with SubSpec trees under a KV cache small enough to preempt.

Two real `vllm serve` processes on 127.0.0.1 (SmolLM2-135M-Instruct, float32, eager, same
settings): SubSpec trees, and plain (no speculative config). The openai client (AsyncOpenAI)
sends the SubSpec server a fixed, seeded mix of requests, at most `--concurrency` in flight:

- greedy chat, greedy streamed chat, greedy chat with stop strings, greedy logprobs (chat
  top_logprobs and completions logprobs), greedy completions whose prompt ends near
  max_model_len and that run into it (`ignore_eos`);
- seeded sampled chat (n=1 and n>1), a subset of them sent twice;
- client aborts: streams closed after 0-5 chunks.

Then every greedy and every seeded sampled request goes to the plain server (same
concurrency), and one last greedy request to both. It passes when: no request failed other than
the intentional aborts; no HTTP 5xx in either access log; no traceback / ERROR line in either
server log; both servers are alive and healthy at the end and answer the last request alike;
every greedy answer (text, finish reason, token count; logprob tokens, values within 2e-3) is
the plain server's; every seeded sampled answer is the plain server's (trees draw with plain's
noise, verify.SeededDraws) and each repeated one got the same samples twice; the SubSpec server preempted at least
`--min-preemptions` times (`vllm:num_preemptions_total` on /metrics). Every phase has a request
count and a deadline; the servers are stopped (process group) whatever happens.

Writes benchmarks/results/<name>.{json,md}; exits 1 when the soak fails.

    python -m benchmarks.soak                                 # 200 requests, 32 concurrent
    python -m benchmarks.soak --requests 20 --concurrency 8 --out /tmp/soak_smoke   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


from benchmarks.depth_sweep import RESULTS, environment

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the tests (conftest.py)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PORTS = range(28130, 28160)  # preferred; none of them is in Linux's ephemeral range
LOGPROB_ABS_TOL = 2e-3  # float32 on both servers: the same bound as the serving tests
CYCLE = ["greedy_chat", "sampled", "greedy_stream", "abort", "greedy_logprobs", "near_limit",
         "greedy_chat", "sampled_n", "greedy_stop", "sampled", "greedy_chat", "abort",
         "greedy_stream", "near_limit", "greedy_logprobs", "sampled", "greedy_stop",
         "greedy_chat"]
STOPS = [["."], [","], ["\n"], [" the ", "\n\n"], ["!", "?"]]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests to the SubSpec server")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tree-width", type=int, default=6)
    ap.add_argument("--tree-depth", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-mib", type=float, default=72,
                    help="--kv-cache-memory-bytes of both servers, in MiB (SmolLM2 in float32: "
                    "45 KiB per token, 5.6 MiB per 128-token block; 72 MiB = 12 blocks)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--deadline", type=float, default=3600,
                    help="seconds the SubSpec phase may take (the plain phase gets the same)")
    ap.add_argument("--request-timeout", type=float, default=900)
    ap.add_argument("--min-preemptions", type=int, default=1)
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temp folder, "
                    "kept when the soak fails)")
    ap.add_argument("--out", default=str(RESULTS / "soak"),
                    help="report path without suffix (.json and .md are written)")
    return ap.parse_args(argv)


@dataclass
class Job:
    id: int
    kind: str
    api: str  # "chat" | "completions"
    params: dict
    stream: bool = False
    abort_after: int | None = None  # close the stream after this many chunks
    twin_of: int | None = None  # a repeated seeded request: the id of its first copy

    @property
    def greedy(self) -> bool:
        return self.kind.startswith("greedy") or self.kind == "near_limit"


@dataclass
class Outcome:
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    logprobs: list | None = None  # [(token, logprob), ...] of choice 0
    chunks: int = 0
    aborted: bool = False
    error: str | None = None
    status: int | None = None
    seconds: float = 0.0


def questions(tokenizer, max_tokens: int) -> list[str]:
    from subspec_testing.assets import mt_bench_prompts

    extra = ["Name three primary colors.", "What is the capital of France?",
             "Write a haiku about the sea.", "Explain what a CPU does in one sentence.",
             "List four animals that live in the ocean.", "Give me a short tip for learning "
             "to code.", "Count from one to twenty in words.", "Tell me a story about a robot."]
    return [q for q in extra + mt_bench_prompts(80) if len(tokenizer.encode(q)) <= max_tokens]


def build_jobs(n: int, seed: int, tokenizer, max_model_len: int) -> list[Job]:
    """n requests (repeats included) in a seeded order; greedy kinds are compared with plain."""
    rng = random.Random(seed)
    qs = questions(tokenizer, max_model_len // 3)
    corpus = tokenizer.encode("\n\n".join(qs))
    jobs: list[Job] = []

    def chat(q, **kw):
        return {"messages": [{"role": "user", "content": q}], **kw}

    i = sampled = 0
    while len(jobs) < n:
        kind, q, jid = CYCLE[i % len(CYCLE)], rng.choice(qs), len(jobs)
        mt = rng.randint(24, 96)
        if kind == "greedy_chat":
            job = Job(jid, kind, "chat", chat(q, temperature=0, max_tokens=mt))
        elif kind == "greedy_stream":
            job = Job(jid, kind, "chat", chat(q, temperature=0, max_tokens=mt), stream=True)
        elif kind == "greedy_stop":
            job = Job(jid, kind, "chat", chat(q, temperature=0, max_tokens=mt,
                                              stop=rng.choice(STOPS)))
        elif kind == "greedy_logprobs":
            if rng.random() < 0.5:
                job = Job(jid, kind, "chat", chat(q, temperature=0, max_tokens=mt, logprobs=True,
                                                  top_logprobs=2))
            else:
                job = Job(jid, kind, "completions", {"prompt": q, "temperature": 0,
                                                     "max_tokens": mt, "logprobs": 3})
        elif kind == "near_limit":  # a prompt within 8-120 tokens of the limit, run into it
            length = max_model_len - rng.randint(8, 120)
            start = rng.randrange(0, len(corpus) - length)
            job = Job(jid, kind, "completions", {
                "prompt": corpus[start:start + length], "temperature": 0,
                "max_tokens": max_model_len - length, "extra_body": {"ignore_eos": True}})
        elif kind in ("sampled", "sampled_n"):
            job = Job(jid, kind, "chat", chat(
                q, temperature=rng.choice([0.7, 0.9, 1.0]), top_p=rng.choice([0.9, 1.0]),
                max_tokens=mt, seed=rng.randrange(2**31), n=1 if kind == "sampled" else
                rng.choice([2, 3])))
        elif kind == "abort":
            job = Job(jid, kind, rng.choice(["chat", "completions"]), {}, stream=True,
                      abort_after=rng.randint(0, 5))
            job.params = chat(q, temperature=0, max_tokens=256) if job.api == "chat" else \
                {"prompt": q, "temperature": 0.8, "seed": rng.randrange(2**31), "max_tokens": 256}
        else:
            raise AssertionError(kind)
        jobs.append(job)
        if kind.startswith("sampled"):
            sampled += 1
            if sampled % 2 and len(jobs) < n:  # every other seeded request is sent twice
                jobs.append(Job(len(jobs), kind, job.api, job.params, twin_of=job.id))
        i += 1
    order = list(range(n))
    rng.shuffle(order)
    return [jobs[k] for k in order]


async def run_job(client, model: str, job: Job) -> Outcome:
    import openai

    out = Outcome()
    t = time.perf_counter()
    create = client.chat.completions.create if job.api == "chat" else \
        client.completions.create
    try:
        if not job.stream:
            resp = await create(model=model, **job.params)
            out.texts = [c.message.content if job.api == "chat" else c.text
                         for c in resp.choices]
            out.finish = [c.finish_reason for c in resp.choices]
            out.completion_tokens = resp.usage.completion_tokens
            lp = resp.choices[0].logprobs
            if lp is not None and job.api == "chat":
                out.logprobs = [(e.token, e.logprob) for e in lp.content]
            elif lp is not None:
                out.logprobs = list(zip(lp.tokens, lp.token_logprobs))
        else:
            stream = await create(model=model, stream=True,
                                  stream_options={"include_usage": True}, **job.params)
            texts: dict[int, list[str]] = {}
            finish: dict[int, str | None] = {}
            try:
                if job.abort_after == 0:  # gone before the first chunk
                    out.aborted = True
                    return out
                async for chunk in stream:
                    if job.abort_after is not None and out.chunks >= job.abort_after:
                        out.aborted = True
                        break
                    out.chunks += 1
                    if chunk.usage is not None:
                        out.completion_tokens = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        piece = (c.delta.content or "") if job.api == "chat" else c.text
                        texts.setdefault(c.index, []).append(piece or "")
                        if c.finish_reason is not None:
                            finish[c.index] = c.finish_reason
            finally:
                await stream.close()  # for an abort: the client goes away mid-generation
            if job.abort_after is not None and not out.aborted:
                out.aborted = True  # it finished before the client could close it
            out.texts = ["".join(texts.get(k, [])) for k in sorted(texts)]
            out.finish = [finish.get(k) for k in sorted(texts)]
    except openai.APIStatusError as e:
        out.error, out.status = f"{type(e).__name__}: {e}"[:500], e.status_code
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal here
        out.error = f"{type(e).__name__}: {e}"[:500]
    finally:
        out.seconds = time.perf_counter() - t
    return out


async def run_all(server, model: str, jobs: list[Job], concurrency: int, deadline: float,
                  request_timeout: float) -> tuple[dict[int, Outcome], bool]:
    """Every job once, at most `concurrency` in flight; (outcomes, finished before deadline).
    Jobs still running at the deadline are cancelled (reported as errors)."""
    client = server.async_client(timeout=request_timeout)
    sem = asyncio.Semaphore(concurrency)
    outcomes: dict[int, Outcome] = {}

    async def one(job):
        async with sem:
            outcomes[job.id] = await run_job(client, model, job)

    tasks = [asyncio.create_task(one(j)) for j in jobs]
    done, pending = await asyncio.wait(tasks, timeout=deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for job in jobs:
        outcomes.setdefault(job.id, Outcome(error="cancelled at the deadline"))
    await client.close()
    return outcomes, not pending


def spec_counters(metrics: str) -> dict:
    from subspec_testing.serve import metric_total

    return {k: metric_total(metrics, f"vllm:{k}_total") for k in (
        "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "generation_tokens", "prompt_tokens")}


def counters(server, failures: list[str]) -> dict | None:
    try:
        return spec_counters(server.metrics())
    except OSError as e:  # a dead server: reported, and the soak goes on to its report
        failures.append(f"{server.name} server: /metrics unreadable ({e})")
        return None


def access_5xx(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if re.search(r'HTTP/1\.[01]" 5\d\d', line)]


def compare_greedy(job: Job, ours: Outcome, plain: Outcome) -> str | None:
    if plain.error:
        return f"plain server failed: {plain.error}"
    if ours.texts != plain.texts:
        return f"text differs: subspec {ours.texts!r} vs plain {plain.texts!r}"
    if ours.finish != plain.finish or ours.completion_tokens != plain.completion_tokens:
        return (f"finish/tokens differ: subspec {ours.finish} {ours.completion_tokens} vs "
                f"plain {plain.finish} {plain.completion_tokens}")
    if (ours.logprobs is None) != (plain.logprobs is None):
        return "logprobs present on one server only"
    if ours.logprobs is not None:
        if [t for t, _ in ours.logprobs] != [t for t, _ in plain.logprobs]:
            return "logprob tokens differ"
        gap = max((abs(a - b) for (_, a), (_, b) in zip(ours.logprobs, plain.logprobs)),
                  default=0.0)
        if gap > LOGPROB_ABS_TOL:
            return f"logprobs differ by {gap:.2e} > {LOGPROB_ABS_TOL}"
    if job.kind == "near_limit" and (ours.finish != ["length"] or
                                     ours.completion_tokens != job.params["max_tokens"]):
        return f"did not run into max_model_len: {ours.finish} {ours.completion_tokens}"
    if job.kind == "greedy_stop" and ours.finish == ["stop"] and \
            any(s in ours.texts[0] for s in job.params["stop"]):
        return "a stop string is in the output"
    return None


def soak(args) -> dict:
    from transformers import AutoTokenizer

    from subspec_testing.assets import smollm2_path
    from subspec_testing.serve import log_problems, serving

    model = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    jobs = build_jobs(args.requests, args.seed, tokenizer, args.max_model_len)
    greedy = [j for j in jobs if j.greedy]
    spec = {"method": "subspec", "tree_width": args.tree_width, "tree_depth": args.tree_depth,
            "substitute_layers": "all"}
    settings = dict(max_model_len=args.max_model_len, dtype="float32",
                    kv_cache_bytes=int(args.kv_cache_mib * 2**20),
                    extra_args=["--max-num-seqs", str(args.max_num_seqs)])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="subspec-soak-"))
    failures: list[str] = []
    report = {"command": args.command,
              "environment": environment(), "model": Path(model).name,
              "speculative_config": spec, "server_settings": {
                  "dtype": "float32", "max_model_len": args.max_model_len,
                  "max_num_seqs": args.max_num_seqs, "kv_cache_mib": args.kv_cache_mib,
                  "enforce_eager": True},
              "requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
              "log_dir": str(log_dir)}
    t_start = time.perf_counter()
    with serving(model, {"subspec": spec, "plain": None}, log_dir, ports=PORTS,
                 **settings) as servers:
        sub, plain = servers["subspec"], servers["plain"]
        report["startup_seconds"] = time.perf_counter() - t_start
        kv_tokens = re.search(r"KV cache size: ([\d,]+) tokens", sub.log_text())
        report["kv_cache_tokens"] = int(kv_tokens.group(1).replace(",", "")) if kv_tokens \
            else None
        before = counters(sub, failures)
        t = time.perf_counter()
        ours, in_time = asyncio.run(run_all(sub, model, jobs, args.concurrency, args.deadline,
                                            args.request_timeout))
        report["soak_seconds"] = time.perf_counter() - t
        after = counters(sub, failures)
        if not in_time:
            failures.append(f"the SubSpec phase passed its {args.deadline:.0f} s deadline")
        t = time.perf_counter()
        # the greedy and the seeded sampled requests (interleaved as sent)
        theirs, in_time = asyncio.run(run_all(
            plain, model, [j for j in jobs if j.greedy or j.kind.startswith("sampled")],
            args.concurrency,
            args.deadline, args.request_timeout))
        report["plain_seconds"] = time.perf_counter() - t
        plain_counters = counters(plain, failures) or {"num_preemptions": None}
        if not in_time:
            failures.append(f"the plain phase passed its {args.deadline:.0f} s deadline")
        # the server still answers at the end, as the plain one does
        last = Job(-1, "greedy_chat", "chat", {"messages": [{"role": "user", "content":
               "What is the capital of France?"}], "temperature": 0, "max_tokens": 32})
        final = {s.name: asyncio.run(run_all(s, model, [last], 1, 300, 300))[0][-1]
                 for s in (sub, plain)}
        for s in (sub, plain):
            if not (s.alive() and s.healthy()):
                failures.append(f"the {s.name} server is not alive and healthy at the end")
        if final["subspec"].error or final["subspec"].texts != final["plain"].texts:
            failures.append(f"last request: subspec {final['subspec']} vs plain {final['plain']}")
        logs = {s.name: s.log_text() for s in (sub, plain)}
    report["total_seconds"] = time.perf_counter() - t_start

    # ---- checks
    by_id = {j.id: j for j in jobs}
    errors = {j.id: ours[j.id].error for j in jobs if ours[j.id].error}
    for jid, err in errors.items():
        failures.append(f"request {jid} ({by_id[jid].kind}) failed: {err}")
    for name, text in logs.items():
        for line in log_problems(text)[:20]:
            failures.append(f"{name} server log: {line.strip()[:300]}")
        for line in access_5xx(text)[:20]:
            failures.append(f"{name} server answered 5xx: {line.strip()[:300]}")
    mismatches = []
    for j in greedy:
        if ours[j.id].error:
            continue
        why = compare_greedy(j, ours[j.id], theirs[j.id])
        if why:
            mismatches.append(j.id)
            failures.append(f"greedy request {j.id} ({j.kind}): {why}"[:1500])
    twins = [j for j in jobs if j.twin_of is not None]
    irreproducible = [j.id for j in twins if not ours[j.id].error
                      and not ours[j.twin_of].error and ours[j.id].texts != ours[j.twin_of].texts]
    plain_irreproducible = [j.id for j in twins if theirs[j.id].texts != theirs[j.twin_of].texts
                            or theirs[j.id].error or theirs[j.twin_of].error]
    for jid in irreproducible:
        j = by_id[jid]
        failures.append(f"seeded request {j.twin_of} and its repeat {jid} ({j.kind}, seed "
                        f"{j.params['seed']}) differ: {ours[j.twin_of].texts!r} vs "
                        f"{ours[jid].texts!r}"[:1500])
    sampled = [j for j in jobs if j.kind.startswith("sampled")]
    seeded_differ = [j.id for j in sampled if not ours[j.id].error
                     and ours[j.id].texts != theirs[j.id].texts]
    for jid in seeded_differ:
        failures.append(f"seeded request {jid} ({by_id[jid].kind}, seed "
                        f"{by_id[jid].params['seed']}) differs from plain: {ours[jid].texts!r} "
                        f"vs {theirs[jid].texts!r}"[:1500])
    for j in jobs:  # sampled answers are non-empty, with n of them
        o = ours[j.id]
        if j.kind.startswith("sampled") and not o.error and (
                len(o.texts) != j.params["n"] or not all(o.texts)):
            failures.append(f"sampled request {j.id}: {len(o.texts)} answers for n="
                            f"{j.params['n']} or an empty one")
    delta = {k: after[k] - before[k] for k in after} if before and after else \
        dict.fromkeys(("num_preemptions", "spec_decode_num_drafts", "generation_tokens",
                       "prompt_tokens", "spec_decode_num_accepted_tokens"))
    if delta["num_preemptions"] is None:
        pass  # the server's /metrics failure is already reported
    elif delta["num_preemptions"] < args.min_preemptions:
        failures.append(f"only {delta['num_preemptions']:.0f} preemptions (wanted at least "
                        f"{args.min_preemptions}): the KV cache is not small enough")
    if delta["spec_decode_num_drafts"] is not None and delta["spec_decode_num_drafts"] <= 0:
        failures.append("the SubSpec server drafted nothing")

    kinds = sorted({j.kind for j in jobs})
    served = [j for j in jobs if not ours[j.id].error]
    report.update({
        "passed": not failures,
        "failures": failures,
        "served": len(served),
        "served_plain": sum(not o.error for o in theirs.values()) + 1,
        "aborted": sum(ours[j.id].aborted for j in jobs if j.abort_after is not None),
        "errors": len(errors),
        "by_kind": {k: sum(j.kind == k for j in jobs) for k in kinds},
        "greedy_compared": len(greedy), "greedy_identical": len(greedy) - len(mismatches)
        - sum(1 for j in greedy if ours[j.id].error),
        "seeded_repeats": len(twins), "seeded_reproduced": len(twins) - len(irreproducible)
        - sum(1 for j in twins if ours[j.id].error or ours[j.twin_of].error),
        "seeded_reproduced_plain": len(twins) - len(plain_irreproducible),
        "seeded_compared": len(sampled),
        "seeded_identical": len(sampled) - len(seeded_differ)
        - sum(1 for j in sampled if ours[j.id].error),
        "preemptions": delta["num_preemptions"],
        "preemptions_plain": plain_counters["num_preemptions"],
        "generation_tokens": delta["generation_tokens"],
        "prompt_tokens": delta["prompt_tokens"],
        "tau": 1 + delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_drafts"]
        if delta["spec_decode_num_drafts"] else None,
        "request_seconds_max": max(ours[j.id].seconds for j in jobs),
    })
    report["outcomes"] = {j.id: {"kind": j.kind, **{k: v for k, v in asdict(ours[j.id]).items()
                                                    if k not in ("texts", "logprobs")}}
                          for j in jobs}
    if report["passed"] and not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
        report["log_dir"] = None
    return report


def _n(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(r: dict) -> str:
    s = r["server_settings"]
    verdict = "**PASS**" if r["passed"] else "**FAIL**"
    lines = [
        "# Server soak: `vllm serve` with SubSpec trees under preemption",
        "",
        f"Command: `{r['command']}`. {verdict}.",
        "",
        f"SubSpec server: `{json.dumps(r['speculative_config'])}`; plain server: same settings "
        f"without it. Both: {r['model']}, {s['dtype']}, eager, max_model_len {s['max_model_len']}"
        f", max_num_seqs {s['max_num_seqs']}, KV cache {s['kv_cache_mib']:g} MiB "
        f"({r['kv_cache_tokens']} tokens), 127.0.0.1 only. Client: openai AsyncOpenAI, "
        f"{r['concurrency']} concurrent.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests sent to the SubSpec server | {r['requests']} |",
        f"| served without error | {r['served']} (of which {r['aborted']} aborted by the client"
        f" mid-stream, on purpose) |",
        f"| errors | {r['errors']} |",
        f"| preemptions (`vllm:num_preemptions`) | {_n(r['preemptions'])} (plain server: "
        f"{_n(r['preemptions_plain'])}) |",
        f"| wall time, SubSpec phase | {r['soak_seconds']:.1f} s |",
        f"| wall time, plain phase ({r['served_plain']} requests: the greedy and the "
        f"seeded sampled ones) | "
        f"{r['plain_seconds']:.1f} s |",
        f"| wall time, all (both starts included) | {r['total_seconds']:.1f} s |",
        f"| greedy answers identical to plain | {r['greedy_compared']} compared, "
        f"{r['greedy_identical']} identical |",
        f"| seeded sampled answers identical to plain | {r['seeded_compared']} compared, "
        f"{r['seeded_identical']} identical |",
        f"| seeded requests sent twice, same samples | {r['seeded_repeats']} repeated, "
        f"{r['seeded_reproduced']} reproduced (plain server, same requests: "
        f"{r['seeded_reproduced_plain']}) |",
        f"| tokens generated / prompt tokens | {_n(r['generation_tokens'])} / "
        f"{_n(r['prompt_tokens'])} |",
        f"| τ (tokens per verify step) | {r['tau']:.2f} |" if r["tau"] else "| τ | - |",
        f"| slowest request | {r['request_seconds_max']:.1f} s |",
        "",
        "Mix: " + ", ".join(f"{k} {v}" for k, v in r["by_kind"].items()) + ".",
        "",
        f"Machine: {r['environment']['cpu']}, {r['environment']['cores']} cores; torch "
        f"{r['environment']['torch']}, vLLM {r['environment']['vllm']}; "
        f"{r['environment']['date']}.",
    ]
    if r["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in r["failures"][:50]]
        if r.get("log_dir"):
            lines += ["", f"Server logs: `{r['log_dir']}`."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: str) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.command = "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    args.command = args.command.strip()
    report = soak(args)
    write(report, args.out)
    print(markdown(report))
    return report


if __name__ == "__main__":
    import signal

    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(0 if main()["passed"] else 1)
