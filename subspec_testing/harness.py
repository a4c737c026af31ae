"""A timed generation run with acceptance statistics (used by the demo, benchmarks and tests)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from subspec_testing.metrics import AcceptanceStats, acceptance_stats

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


def timed_generate(
    llm, prompts, sampling_params, spec: bool = True, one_at_a_time: bool = False
) -> RunResult:
    """Generate (one sequence per prompt) and report wall time and this run's acceptance.

    one_at_a_time: submit the prompts sequentially (a single user, as in the paper) instead of
    as one batch."""
    before = acceptance_stats(llm) if spec else AcceptanceStats()
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([p], sampling_params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = acceptance_stats(llm) if spec else AcceptanceStats()
    return RunResult(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        texts=[o.outputs[0].text for o in outputs],
        seconds=seconds,
        stats=after - before,
    )


def shutdown_engine(llm) -> None:
    """Stop an `LLM`'s engine core (and its worker processes) now, not at garbage collection,
    so the next engine in this process gets the memory."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def count_identical(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def assert_identical(spec_ids: list[list[int]], plain_ids: list[list[int]]) -> None:
    """Token for token, every request (the fp32 standard); names each first divergence."""
    bad = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(spec_ids, plain_ids)) if a != b}
    assert not bad, f"prompt -> first divergent token: {bad}"
    assert len(spec_ids) == len(plain_ids)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or length mismatch), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class EngineRun:
    timed: RunResult  # the timed workload: speed and τ
    batched: RunResult | None  # all prompts at once, each to max_tokens: the identity check
    draft_seconds: float = 0.0  # time the step session spent drafting during the timed run
    draft_steps: int = 0  # drafter calls (one per decode step, drafting or not)
    draft_passes: int = 0  # draft forwards
    probed: object = None  # what `probe` returned


def _draft_timing(worker):
    """The step session's statistics (`StepStats`), a collective_rpc target."""
    from vllm_subspec.vllm_hooks.runner import subspec_of

    stats = subspec_of(worker).session.stats
    return stats.draft_seconds, stats.draft_steps, stats.draft_passes


def run_engine(
    model: str,
    prompts,
    sampling_params,
    speculative_config=None,
    one_at_a_time: bool = True,
    identity_run: bool = True,
    setup=None,
    probe=None,
    **engine_kwargs,
) -> EngineRun:
    """Start an engine, warm it up, time the prompts (one at a time by default), then generate
    them as one batch (ignore_eos) for the token-identity check, and shut the engine down.
    setup: called with the `LLM` once it has started, before the warm-up; probe: called with it
    after the runs, before the shutdown (its result: `EngineRun.probed`).

    Why two runs: on the CPU backend a decode step of one sequence (M=1 GEMV) and of several
    (M>1 GEMM) round bf16 differently, so plain greedy decoding itself changes with the batch
    shape. Comparing batched runs, where every step has M>1 in both engines, isolates SubSpec.
    """
    import os

    from vllm import LLM

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    kwargs = dict(CPU_ENGINE_KWARGS, enforce_eager=True)
    kwargs.update(engine_kwargs)
    llm = LLM(model=model, speculative_config=speculative_config, **kwargs)
    spec = speculative_config is not None
    timing = (lambda: llm.collective_rpc(_draft_timing)[0]) if spec else (lambda: (0.0, 0, 0))
    try:
        if setup is not None:
            setup(llm)
        timed_generate(llm, prompts[:1], sampling_params, spec=spec)
        before = timing()
        timed = timed_generate(
            llm, prompts, sampling_params, spec=spec, one_at_a_time=one_at_a_time
        )
        after = timing()
        batched = None
        if identity_run:
            full = sampling_params.clone()
            full.ignore_eos = True
            batched = timed_generate(llm, prompts, full, spec=spec)
        probed = probe(llm) if probe is not None else None
        return EngineRun(timed, batched, *(a - b for a, b in zip(after, before)), probed)
    finally:
        shutdown_engine(llm)


def predict_plain_faster(worker) -> dict:
    """Give the SubSpec session's shape tuner a cost model in which a draft pass costs a second
    and a verify a millisecond (`ShapeTuner.use_costs`), so it chooses plain decoding but for
    its probe steps; returns the session's `StepStats` as a dict (a collective_rpc target)."""
    from vllm_subspec.step.tuner.costs import StepCosts
    from vllm_subspec.step.tuner.linear_cost import LinearCost

    class Fixed(LinearCost):  # `seconds` whatever the rows; observations ignored
        known = True

        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def add(self, rows, seconds):
            pass

        def coefficients(self):
            return self.seconds, 0.0

    from vllm_subspec.vllm_hooks.runner import subspec_of

    tuner = subspec_of(worker).session.tuner
    tuner.use_costs(
        StepCosts(
            {w: Fixed(1.0) for w in tuner.draft_pass},
            {w: Fixed(1e-3) for w in tuner.verify},
            Fixed(0.0),
        )
    )
    return step_stats(worker)


# The tuner's costs kept aside while `model_costs_decide` is on, per worker process.
_MEASURED_COSTS: dict[int, tuple] = {}


def model_costs_decide(worker, on: bool) -> None:
    """On: the auto shape's tuner decides with fixed costs alone (`ShapeTuner.use_costs`): a
    draft pass as SmolLM2's on this CPU, a verify whose fixed part is large (as with
    offloading), so its model drafts moderate shapes (a chain of 2-3 at 29 requests), and a
    test of what drafting must keep exact really drafts whatever this machine's measured
    rates say.
    Off: its own costs and measured rates back. A collective_rpc target."""
    from vllm_subspec.step.tuner.costs import StepCosts
    from vllm_subspec.step.tuner.linear_cost import LinearCost
    from vllm_subspec.vllm_hooks.runner import subspec_of

    class Line(LinearCost):  # seconds = a + b * rows; observations ignored
        known = True

        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b

        def add(self, rows, seconds):
            pass

        def coefficients(self):
            return self.a, self.b

    tuner = subspec_of(worker).session.tuner
    if on:
        _MEASURED_COSTS[id(tuner)] = (tuner.model.costs, tuner.model.measure_rates)
        tuner.use_costs(
            StepCosts(
                {w: Line(0.006, 0.0015) for w in tuner.draft_pass},
                {w: Line(0.3, 0.0004) for w in tuner.verify},
                Line(0.002, 0.0),
            )
        )
    elif id(tuner) in _MEASURED_COSTS:
        tuner.model.costs, tuner.model.measure_rates = _MEASURED_COSTS.pop(id(tuner))


def step_stats(worker) -> dict:
    """The SubSpec session's `StepStats` as a dict (a collective_rpc target)."""
    import dataclasses

    from vllm_subspec.vllm_hooks.runner import subspec_of

    return dataclasses.asdict(subspec_of(worker).session.stats)


def draft_compile_state(worker) -> dict:
    """How the worker's draft forward runs (a collective_rpc target): its class, whether vLLM's
    compile decorator compiles it (`do_not_compile`: eager) and has (`compiled`), and dynamo's
    graph-break count in the worker process (fullgraph compiles raise on a break instead), and
    whether the draft's structure is in the config vLLM keys its compile artifacts on (the draft's
    own, not the engine's)."""
    from torch._dynamo.utils import counters

    from vllm_subspec.vllm_hooks.draft_compile import STRUCTURE_KEY
    from vllm_subspec.vllm_hooks.runner import subspec_of

    runner = subspec_of(worker)
    model = runner.drafter.model
    return {
        "cls": type(model).__name__,
        "do_not_compile": model.do_not_compile,
        "compiled": getattr(model, "compiled", False),
        "graph_breaks": sum(counters["graph_break"].values()),
        "structure_keyed": STRUCTURE_KEY in model.vllm_config.additional_config,
        "engine_config_untouched": STRUCTURE_KEY
        not in (runner.vllm_config.additional_config or {}),
    }
