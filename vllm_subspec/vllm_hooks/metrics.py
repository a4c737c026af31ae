"""SubSpec's own numbers in vLLM's Prometheus metrics (`/metrics` of `vllm serve`). They live in
the worker (`StepStats`, the substitutes' bytes), and nothing the engine core sends the front end
can carry extra fields (`SchedulerStats` is re-built from its declared fields on decode), so the
two meet in a small memory-mapped file per engine: the worker (`StepMetricsFile`) writes it, the
front end's stat logger (`SubSpecStatLogger`) reads it when Prometheus scrapes. The folder
(`SUBSPEC_METRICS_DIR`, named by `plugin.register`), and where the numbers do not appear:
docs/troubleshooting.md, "SubSpec's own metrics".
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
import uuid

import numpy as np
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

# Not VLLM_-prefixed: vLLM warns about unknown VLLM_* variables
# (`vllm.platforms.interface.Platform.validate_environ`), and a declared one would enter its
# compile-cache key (`vllm.envs.compile_factors`) with a folder name that changes every start.
METRICS_DIR_ENV = "SUBSPEC_METRICS_DIR"

# The file's float64 fields, in order. Totals are since the engine started.
FIELDS = (
    "draft_steps",
    "plain_steps",
    "draft_passes",
    "draft_seconds",
    "verify_seconds",
    "step_seconds",
    "tree_width",
    "tree_depth",
    "substitute_bytes",
    "dense_twin_bytes",
    "draft_head_bytes",
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
# the fields the worker stores after each proposal: `StepStats`' attributes of the same name
_STEP_FIELDS = (
    "draft_steps",
    "plain_steps",
    "draft_passes",
    "draft_seconds",
    "verify_seconds",
    "step_seconds",
    "tree_width",
    "tree_depth",
)


def default_metrics_dir() -> str:
    """A folder name unique to this front end (created only by its stat logger)."""
    return os.path.join(
        tempfile.gettempdir(), f"vllm-subspec-metrics-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )


def metrics_path(directory: str, engine_index: int) -> str:
    return os.path.join(directory, f"engine{engine_index}.f64")


class StepMetricsFile:
    """The worker's end (tensor-parallel rank 0 of each engine): its numbers in a mapped
    float64 array (`FIELDS`), a few stores after each proposal (no syscall, no lock, nothing on
    the device). The front end creates the folder once the engine is up, so the file is opened
    at the first step that finds it (looked for at most every `LOOK_SECONDS`: an offline
    engine, which nobody reads, pays one `stat` per interval and writes nothing)."""

    LOOK_SECONDS = 5.0

    def __init__(
        self,
        directory: str | None,
        engine_index: int,
        draft_bytes: dict[str, int],
        clock=time.monotonic,
    ):
        self.directory, self.engine_index, self.draft_bytes = (
            directory,
            engine_index,
            draft_bytes,
        )  # substitute_bytes, dense_twin_bytes, draft_head_bytes
        self.clock = clock
        self.array: np.ndarray | None = None
        self._next_look = 0.0

    def _open(self) -> bool:
        now = self.clock()
        if not self.directory or now < self._next_look:
            return False
        self._next_look = now + self.LOOK_SECONDS
        if not os.path.isdir(self.directory):
            return False
        self.array = np.memmap(
            metrics_path(self.directory, self.engine_index),
            dtype=np.float64,
            mode="w+",
            shape=(len(FIELDS),),
        )
        for name, value in self.draft_bytes.items():
            self.array[_INDEX[name]] = value
        return True

    def record(self, stats) -> None:
        """stats: the session's `StepStats`: a few stores into the mapped array."""
        a = self.array
        if a is None:
            if not self._open():
                return
            a = self.array
        for field in _STEP_FIELDS:
            a[_INDEX[field]] = getattr(stats, field)


def read_metrics(path: str) -> dict[str, float] | None:
    """One engine's numbers, or None if its worker has not written them (yet)."""
    try:
        values = np.fromfile(path, dtype=np.float64)
    except OSError:
        return None
    if values.size != len(FIELDS):
        return None
    return dict(zip(FIELDS, values.tolist()))


# name, kind, help; `SubSpecCollector.collect` yields them in this order
_COUNTERS = (
    ("draft_steps", "Steps that asked SubSpec's drafter (each a proposal for the whole batch)."),
    ("plain_steps", "Of those, steps that drafted nothing: plain decoding was predicted faster."),
    ("draft_passes", "Draft forwards run."),
    ("draft_seconds", "Wall time spent drafting."),
    ("verify_seconds", "Wall time of tree verifies (the target's forward through the walk)."),
    ("step_seconds", "Wall time of the steps that asked the drafter (idle gaps left out)."),
)
_GAUGES = (
    (
        "tree_width",
        "Nodes per depth of the last drafted step's tree (1: a chain; 0: the step "
        "drafted nothing).",
    ),
    ("tree_depth", "Depth of the last drafted step's deepest verified tree (0: none)."),
)


class SubSpecCollector:
    """Reads every engine's file at scrape time (a prometheus_client custom collector)."""

    def __init__(self, directory: str, engine_indexes: list[int], model_name: str):
        self.directory, self.engine_indexes, self.model_name = directory, engine_indexes, model_name

    def describe(self):
        return []  # names are not reserved: a later front end in this process replaces us

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["model_name", "engine"]
        counters = {
            n: CounterMetricFamily(f"vllm:subspec_{n}", h, labels=labels) for n, h in _COUNTERS
        }
        gauges = {n: GaugeMetricFamily(f"vllm:subspec_{n}", h, labels=labels) for n, h in _GAUGES}
        share = GaugeMetricFamily(
            "vllm:subspec_draft_time_share",
            "Drafting's share of step time since start (draft_seconds / step_seconds).",
            labels=labels,
        )
        draft_bytes = GaugeMetricFamily(
            "vllm:subspec_draft_bytes",
            "Memory the draft adds to the target, by part (substitutes: the substituted "
            "layers' low-bit weights; dense_twins: CPU-only bf16 copies for small batches; "
            "lm_head: the draft's quantized output projection).",
            labels=labels + ["part"],
        )
        for engine in self.engine_indexes:
            values = read_metrics(metrics_path(self.directory, engine))
            if values is None:
                continue
            at = [self.model_name, str(engine)]
            for n, family in counters.items():
                family.add_metric(at, values[n])
            for n, family in gauges.items():
                family.add_metric(at, values[n])
            share.add_metric(
                at,
                values["draft_seconds"] / values["step_seconds"]
                if values["step_seconds"] > 0
                else 0.0,
            )
            for part, field in (
                ("substitutes", "substitute_bytes"),
                ("dense_twins", "dense_twin_bytes"),
                ("lm_head", "draft_head_bytes"),
            ):
                draft_bytes.add_metric(at + [part], values[field])
        yield from counters.values()
        yield from gauges.values()
        yield share
        yield draft_bytes


class SubSpecStatLogger(AggregateStatLoggerBase):
    """vLLM's stat-logger plugin (`vllm.stat_logger_plugins`: `subspec_metrics`), built once
    per front end for all its engines: creates the metrics folder (removed at exit if it made
    it) and registers a collector that reads each engine's file at every scrape, so values are
    never stale. For an engine without SubSpec it does nothing."""

    def __init__(self, vllm_config, engine_indexes: list[int]):
        from vllm_subspec.config import ADDITIONAL_CONFIG_KEY

        self.collector = None
        if ADDITIONAL_CONFIG_KEY not in (vllm_config.additional_config or {}):
            return
        directory = os.environ.get(METRICS_DIR_ENV)
        if not directory:
            logger.warning(
                "vllm-subspec: %s is unset in the front end; SubSpec's metrics are not exported",
                METRICS_DIR_ENV,
            )
            return
        if not os.path.exists(directory):  # remove at exit only what this front end made
            os.makedirs(directory)
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        from prometheus_client import REGISTRY

        for old in list(REGISTRY._collector_to_names):  # as vLLM's unregister_vllm_metrics
            if isinstance(old, SubSpecCollector):
                REGISTRY.unregister(old)
        self.collector = SubSpecCollector(
            directory, list(engine_indexes), vllm_config.model_config.served_model_name
        )
        REGISTRY.register(self.collector)

    def record(
        self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0
    ) -> None:
        pass  # the collector reads the engines' files when Prometheus scrapes

    def log_engine_initialized(self) -> None:
        pass
