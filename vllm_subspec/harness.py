"""A timed generation run with acceptance statistics (used by the demo, benchmarks and tests)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from vllm_subspec.metrics import AcceptanceStats, acceptance_stats

# CPU-backend engine settings shared by the demo, benchmarks and tests.
CPU_ENGINE_KWARGS = dict(
    gpu_memory_utilization=0.3,  # on CPU: the share of RAM for the engine
    max_model_len=2048,
    seed=0,
    disable_log_stats=False,  # keep vLLM's metrics (get_metrics) on
)


@dataclass
class RunResult:
    token_ids: list[list[int]]
    texts: list[str]
    seconds: float
    stats: AcceptanceStats

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0


def timed_generate(llm, prompts, sampling_params, spec: bool = True) -> RunResult:
    """Generate (one sequence per prompt) and report wall time and this run's acceptance."""
    before = acceptance_stats(llm) if spec else AcceptanceStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = acceptance_stats(llm) if spec else AcceptanceStats()
    return RunResult(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        texts=[o.outputs[0].text for o in outputs],
        seconds=seconds,
        stats=after - before,
    )


def count_identical(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or length mismatch), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_engine(model: str, prompts, sampling_params, speculative_config=None,
               **engine_kwargs) -> RunResult:
    """Start an engine, warm it up on one prompt, time the workload, shut the engine down."""
    from vllm import LLM

    kwargs = dict(CPU_ENGINE_KWARGS, enforce_eager=True)
    kwargs.update(engine_kwargs)
    llm = LLM(model=model, speculative_config=speculative_config, **kwargs)
    spec = speculative_config is not None
    try:
        timed_generate(llm, prompts[:1], sampling_params, spec=spec)
        return timed_generate(llm, prompts, sampling_params, spec=spec)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
