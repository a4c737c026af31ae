"""Shared test fixtures. End-to-end tests run vLLM's CPU backend on SmolLM2-135M-Instruct.

The tiers: `unit/` (no engine, no subprocess: synthetic inputs, the inner loop, `pytest
tests/unit`), `integration/` (library code under the Triton interpreter or in probe processes,
vLLM config translation, repository checks), `e2e/` (engines), `gpu/` (CUDA only), `support/`
(stubs, shims and probes, importable by name from every tier)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine starts cold: a tuner's costs saved by an earlier test (or run) would make what
# a test drafts depend on what ran before it (tests/unit/test_saved_costs.py tests the saving)
os.environ.setdefault("VLLM_SUBSPEC_TUNER_MEMORY", "0")


def _bind_worker_to_its_core() -> None:
    """Under pytest-xdist (scripts/test.sh: one worker per core), the engines of worker gwN run
    on core N: vLLM's CPU worker otherwise binds every engine to the same core ("auto")."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


_bind_worker_to_its_core()

# The e2e files that take longest run first, so two workers finish together (--dist loadfile
# hands out whole files in collection order).
SLOW_FIRST = ("e2e/test_e2e_tree.py", "e2e/test_e2e_compiled.py",
              "e2e/test_e2e_tree_batches.py", "e2e/test_e2e_context_limit.py",
              "e2e/test_e2e_serve.py", "e2e/test_e2e_greedy.py", "e2e/test_e2e_sampling.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept

from subspec_testing.harness import CPU_ENGINE_KWARGS, shutdown_engine  # noqa: E402

# Same budget for every engine so KV block counts are comparable.
KV_CACHE_BYTES = 256 * 2**20


ENGINE_STARTS: dict[str, int] = {"LLM()": 0, "vllm serve": 0}  # this session's, reported at the end


@pytest.fixture(scope="session", autouse=True)
def count_engine_starts():
    """Counts the engines this session starts in-process (`LLM(...)`) and as servers; the
    terminal summary reports them (the suite's cost is mostly engine starts)."""
    import vllm

    from subspec_testing import serve

    with pytest.MonkeyPatch.context() as mp:
        init, start = vllm.LLM.__init__, serve.start_server

        def counted_init(self, *args, **kwargs):
            ENGINE_STARTS["LLM()"] += 1
            return init(self, *args, **kwargs)

        def counted_start(*args, **kwargs):
            ENGINE_STARTS["vllm serve"] += 1
            return start(*args, **kwargs)

        mp.setattr(vllm.LLM, "__init__", counted_init)
        mp.setattr(serve, "start_server", counted_start)
        yield


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand its counts to the controller
        workeroutput["engine_starts"] = dict(ENGINE_STARTS)


try:  # pytest-xdist's hook, defined only where xdist is installed (pytest checks hook names)
    import xdist  # noqa: F401

    def pytest_testnodedown(node, error):
        for what, n in getattr(node, "workeroutput", {}).get("engine_starts", {}).items():
            ENGINE_STARTS[what] += n
except ImportError:
    pass


def pytest_terminal_summary(terminalreporter):
    if any(ENGINE_STARTS.values()):
        terminalreporter.write_line(
            "engines started: " + ", ".join(f"{n} x {what}" for what, n in ENGINE_STARTS.items())
            + " (probe subprocesses not counted)")


@pytest.fixture(scope="session")
def smollm2():
    from subspec_testing.assets import smollm2_path

    return smollm2_path()


ENGINE_DEFAULTS = dict(CPU_ENGINE_KWARGS, enforce_eager=True,
                       kv_cache_memory_bytes=KV_CACHE_BYTES)


def make_llm(model, speculative_config=None, **overrides):
    from vllm import LLM

    kwargs = dict(ENGINE_DEFAULTS)
    kwargs.update(overrides)
    return LLM(model=model, speculative_config=speculative_config, **kwargs)


def shutdown(llm):
    try:
        shutdown_engine(llm)
    except Exception:  # a test's own failure matters more than a failed teardown
        pass


@pytest.fixture(scope="session")
def plain_references():
    """Plain decoding's outputs, generated once per key for the whole session and kept on disk
    across sessions (subspec_testing/plain_reference.py)."""
    from subspec_testing.plain_reference import PlainReferences, default_root

    return PlainReferences(make_llm, ENGINE_DEFAULTS, default_root())


@pytest.fixture(scope="session")
def feature_matrix(smollm2, plain_references):
    """The request-feature matrix (subspec_testing/request_features.py) on SmolLM2 in fp32:
    (cases, the run with every feature, plain's result of it); each feature binds."""
    from transformers import AutoTokenizer

    from subspec_testing import request_features as rf
    from subspec_testing.assets import chat_prompts

    cases = rf.cases(AutoTokenizer.from_pretrained(smollm2))
    runs = rf.matrix_runs(chat_prompts(smollm2, rf.questions(cases)), cases)
    plain = plain_references.get(smollm2, dict(dtype="float32"), runs)
    rf.assert_features_bind(cases, plain["bound"], plain["unbound"])
    return cases, runs["bound"], plain["bound"]


def num_kv_blocks(llm) -> int:
    return llm.llm_engine.vllm_config.cache_config.num_gpu_blocks


@pytest.fixture(scope="session")
def tiny_llama():
    """A random 4-layer Llama with a 64-token vocabulary (no tokenizer: skip_tokenizer_init)."""
    from subspec_testing.assets import tiny_model_path

    return tiny_model_path()


@pytest.fixture
def vllm_caplog(caplog):
    """caplog for the plugin's loggers (`vllm.vllm_subspec.*`). Once an engine has configured
    vLLM's logging, the "vllm" logger stops propagating to the root, where caplog listens, so
    the handler is attached to it directly."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        vllm_logger.removeHandler(caplog.handler)
