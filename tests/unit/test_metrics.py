"""SubSpec's Prometheus metrics: the worker's mapped file and the front end's collector, each
end against the other, and the stat-logger plugin as vLLM's front end builds it."""

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from subspec_testing.serve import metric_total
from vllm_subspec.step.session import StepStats
from vllm_subspec.vllm_hooks import metrics
from vllm_subspec.vllm_hooks.metrics import (
    METRICS_DIR_ENV,
    StepMetricsFile,
    SubSpecCollector,
    SubSpecStatLogger,
    read_metrics,
)

PARTS = {"substitute_bytes": 800, "dense_twin_bytes": 300, "draft_head_bytes": 50}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def scrape(directory, engines=(0,)) -> str:
    registry = CollectorRegistry()
    registry.register(SubSpecCollector(str(directory), list(engines), "m"))
    return generate_latest(registry).decode()


def test_the_worker_writes_and_the_collector_reads_at_scrape_time(tmp_path):
    writer = StepMetricsFile(str(tmp_path), 1, PARTS)
    stats = StepStats(draft_steps=10, plain_steps=3, draft_passes=42, draft_seconds=0.5,
                      verify_seconds=0.7, step_seconds=2.0, tree_width=4, tree_depth=9)
    writer.record(stats)
    text = scrape(tmp_path, engines=(0, 1))  # engine 0 wrote nothing: no samples for it
    at = dict(model_name="m", engine="1")
    assert metric_total(text, "vllm:subspec_draft_steps_total", **at) == 10
    assert metric_total(text, "vllm:subspec_plain_steps_total", **at) == 3
    assert metric_total(text, "vllm:subspec_draft_passes_total", **at) == 42
    assert metric_total(text, "vllm:subspec_step_seconds_total", **at) == 2.0
    assert metric_total(text, "vllm:subspec_tree_width", **at) == 4
    assert metric_total(text, "vllm:subspec_tree_depth", **at) == 9
    assert metric_total(text, "vllm:subspec_draft_time_share", **at) == 0.25
    assert metric_total(text, "vllm:subspec_draft_bytes", part="dense_twins") == 300
    assert metric_total(text, "vllm:subspec_draft_bytes", part="lm_head") == 50
    assert 'engine="0"' not in text
    # the next step's numbers are what the next scrape sees: no caching on either side
    stats.draft_steps, stats.tree_width, stats.tree_depth = 11, 0, 0
    writer.record(stats)
    text = scrape(tmp_path, engines=(1,))
    assert metric_total(text, "vllm:subspec_draft_steps_total") == 11
    assert metric_total(text, "vllm:subspec_tree_width") == 0
    assert read_metrics(str(tmp_path / "engine1.f64"))["substitute_bytes"] == 800


def test_the_worker_opens_the_file_once_the_front_end_made_the_folder(tmp_path):
    folder, clock = tmp_path / "made-later", Clock()
    writer = StepMetricsFile(str(folder), 0, PARTS, clock=clock)
    writer.record(StepStats(draft_steps=1))
    assert writer.array is None and not folder.exists()  # nobody reads: nothing written
    folder.mkdir()
    clock.now += StepMetricsFile.LOOK_SECONDS / 2
    writer.record(StepStats(draft_steps=2))
    assert writer.array is None  # looked for at most once per interval
    clock.now += StepMetricsFile.LOOK_SECONDS
    writer.record(StepStats(draft_steps=3))
    assert read_metrics(str(folder / "engine0.f64"))["draft_steps"] == 3
    assert StepMetricsFile(None, 0, PARTS).record(StepStats()) is None  # no folder named


def config(subspec: bool):
    return SimpleNamespace(additional_config={"subspec": {}} if subspec else {},
                           model_config=SimpleNamespace(served_model_name="m"))


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch):
    folder = tmp_path / "frontend"
    monkeypatch.setenv(METRICS_DIR_ENV, str(folder))
    yield folder
    for c in list(REGISTRY._collector_to_names):
        if isinstance(c, SubSpecCollector):
            REGISTRY.unregister(c)


def test_the_stat_logger_plugin_serves_subspec_engines_only(metrics_dir):
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    assert issubclass(SubSpecStatLogger, AggregateStatLoggerBase)  # built once per front end
    plain = SubSpecStatLogger(config(False), [0])
    assert plain.collector is None and not metrics_dir.exists()
    first = SubSpecStatLogger(config(True), [0])
    assert metrics_dir.is_dir()  # created once the engines are up: workers start writing
    StepMetricsFile(str(metrics_dir), 0, PARTS).record(StepStats(draft_steps=5))
    second = SubSpecStatLogger(config(True), [0])  # a new front end in the same process
    mine = [c for c in REGISTRY._collector_to_names if isinstance(c, SubSpecCollector)]
    assert mine == [second.collector] and first.collector is not second.collector
    text = generate_latest(REGISTRY).decode()
    assert metric_total(text, "vllm:subspec_draft_steps_total") == 5  # once, not twice
    second.record(None, None)  # vLLM's per-batch call: nothing to do
    second.log_engine_initialized()


def test_register_names_one_folder_that_child_processes_inherit(monkeypatch):
    from vllm_subspec import plugin

    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    monkeypatch.setattr(plugin.patches, "apply_all", lambda: None)
    plugin.register()
    import os

    named = os.environ[METRICS_DIR_ENV]
    assert not os.path.exists(named)  # named, not created: only a front end creates it
    plugin.register()  # a child process: inherited, kept
    assert os.environ[METRICS_DIR_ENV] == named
    assert metrics.default_metrics_dir() != named  # unique per front end


def test_the_front_end_removes_only_a_folder_it_made(tmp_path, monkeypatch, metrics_dir):
    removed = []
    monkeypatch.setattr(metrics.atexit, "register", lambda f, path, **kw: removed.append(path))
    SubSpecStatLogger(config(True), [0])
    assert removed == [str(metrics_dir)]  # made here: removed at exit
    mine = tmp_path / "users-own"
    (mine / "keep").mkdir(parents=True)
    monkeypatch.setenv(METRICS_DIR_ENV, str(mine))
    SubSpecStatLogger(config(True), [0])
    assert removed == [str(metrics_dir)]  # a folder that existed is left alone
