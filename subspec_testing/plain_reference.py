"""Plain decoding's outputs for the e2e tests, generated once per key and shared: by every test of
a pytest session (in memory) and across sessions (on disk, under the substitute cache's root),
keyed on everything that decides them: the model's weight files, the engine arguments, the
prompts, each request's SamplingParams, and the vLLM and torch versions and the CPU's matrix
ISA (AMX or not). A reference is plain vLLM's own output (no SubSpec code runs in a plain
engine), so reusing one cannot hide a SubSpec bug; `VLLM_SUBSPEC_PLAIN_CACHE=0` turns the disk
copy off.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from subspec_testing.harness import RunResult
from subspec_testing.metrics import AcceptanceStats

DISK_ENV = "VLLM_SUBSPEC_PLAIN_CACHE"


@dataclass
class PlainRun:
    """One generate call: prompts and their SamplingParams (one, or one per prompt)."""

    prompts: list
    params: object


def _cpu_isa() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0].split()
    except (OSError, IndexError):
        return "unknown"
    return "+".join(f for f in ("amx_tile", "avx512f", "avx2") if f in flags)


def _versions() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "isa": _cpu_isa()}


def _model_id(model: str) -> str:
    from vllm_subspec.draft_model.substitute_cache import weight_fingerprint

    return weight_fingerprint(Path(model)) or model


def run_key(model: str, engine_kwargs: dict, run: PlainRun) -> str:
    params = run.params if isinstance(run.params, list) else [run.params]
    blob = json.dumps(
        {
            "model": _model_id(model),
            "engine": sorted(engine_kwargs.items()),
            "prompts": run.prompts,
            "params": [repr(p) for p in params],
            **_versions(),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class PlainReferences:
    """`get(model, engine_kwargs, runs)`: each named run's RunResult (token ids and texts),
    from memory, disk or one plain engine that generates every run not found."""

    def __init__(self, make_llm, engine_defaults: dict, root: Path | None):
        self.make_llm = make_llm  # (model, **engine_kwargs) -> LLM
        self.engine_defaults = engine_defaults  # what make_llm adds: part of every key
        self.root = root  # None: memory only
        self.memory: dict[str, dict] = {}
        self.engines_started = 0

    def _load(self, key: str) -> dict | None:
        if key in self.memory:
            return self.memory[key]
        path = None if self.root is None else self.root / f"{key}.json"
        if path is not None and path.exists():
            self.memory[key] = json.loads(path.read_text())
        return self.memory.get(key)

    def _store(self, key: str, value: dict) -> None:
        self.memory[key] = value
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f"{key}.json.tmp"
            tmp.write_text(json.dumps(value))
            tmp.replace(self.root / f"{key}.json")

    def get(self, model: str, engine_kwargs: dict, runs: dict[str, PlainRun]) -> dict:
        engine = {**self.engine_defaults, **engine_kwargs}
        keys = {name: run_key(model, engine, run) for name, run in runs.items()}
        found = {name: self._load(key) for name, key in keys.items()}
        missing = [name for name, value in found.items() if value is None or "details" not in value]
        if missing:
            from subspec_testing.harness import shutdown_engine

            # no stat loggers: vLLM's Prometheus logger unregisters every vLLM metric when it
            # starts, which would blank a SubSpec engine's still-running acceptance counters
            llm = self.make_llm(model, **{**engine_kwargs, "disable_log_stats": True})
            self.engines_started += 1
            try:
                blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
                for name in missing:
                    outs = llm.generate(runs[name].prompts, runs[name].params, use_tqdm=False)
                    found[name] = {
                        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                        "texts": [o.outputs[0].text for o in outs],
                        "details": [output_details(o) for o in outs],
                        "kv_blocks": blocks,
                    }
                    self._store(keys[name], found[name])
            finally:
                shutdown_engine(llm)
        return {
            name: PlainResult(
                v["token_ids"], v["texts"], 0.0, AcceptanceStats(), v["kv_blocks"], v["details"]
            )
            for name, v in found.items()
        }


@dataclass
class PlainResult(RunResult):
    kv_blocks: int = 0  # the plain engine's KV blocks
    details: list[dict] | None = None  # output_details of each request


def _ranked(position) -> list[list]:
    return sorted([int(t), float(lp.logprob)] for t, lp in position.items())


def output_details(output) -> dict:
    """What a request's RequestOutput says beyond its first completion's tokens: every
    completion (n > 1), each one's logprobs and the prompt's logprobs ([token, logprob] pairs
    per position; None where not requested)."""
    prompt = output.prompt_logprobs
    return {
        "completions": [list(c.token_ids) for c in output.outputs],
        "logprobs": [
            None if c.logprobs is None else [_ranked(p) for p in c.logprobs] for c in output.outputs
        ],
        "prompt_logprobs": None
        if prompt is None
        else [None if p is None else _ranked(p) for p in prompt],
    }


def default_root() -> Path | None:
    if os.environ.get(DISK_ENV, "1") == "0":
        return None
    from vllm_subspec.draft_model.substitute_cache import default_root as cache_root

    return cache_root().parent / "plain-references"
