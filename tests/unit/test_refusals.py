"""Every refusal sits in vllm_subspec/refusals.py, listed in docs/configuration.md from its
`REFUSALS`; the refusal functions on synthetic facts."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_subspec import refusals
from vllm_subspec.refusals import SubSpecConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_subspec"
DOC = ROOT / "docs" / "configuration.md"


def _doc_rows() -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    section = text.split("## What SubSpec refuses", 1)[1].split("\n## ", 1)[0]
    return [tuple(c.strip().strip("`") for c in line.strip("|").split("|"))
            for line in section.splitlines()
            if line.startswith("| `")]


def test_the_doc_lists_every_refusal_of_the_registry():
    assert _doc_rows() == [(r.id, r.when, r.why) for r in refusals.REFUSALS]
    assert refusals.markdown_table() in DOC.read_text()


def test_registry_ids_unique_and_whens_known():
    ids = [r.id for r in refusals.REFUSALS]
    assert len(ids) == len(set(ids))
    assert {r.when for r in refusals.REFUSALS} == set(refusals.WHEN)
    assert all(re.fullmatch(r"[a-z0-9-]+", i) for i in ids)


def _messages() -> set[str]:
    """The literal text of every message refusals.py raises or returns."""
    tree = ast.parse((PACKAGE / "refusals.py").read_text())
    found = set()
    for node in ast.walk(tree):
        value = node.exc if isinstance(node, ast.Raise) else \
            node.value if isinstance(node, ast.Return) else None
        if value is not None:
            for c in ast.walk(value):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and len(c.value) > 25:
                    found.add(c.value)
    return found


def test_no_refusal_outside_refusals_py():
    """No `SubSpecConfigError(...)` is built, and no refusal message is written, elsewhere in
    the package: the other modules gather facts and call refusals.py."""
    messages = _messages()
    assert len(messages) > 30
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "refusals.py":
            continue
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                    node.func, "attr", None)) == "SubSpecConfigError":
                problems.append(f"{rel}:{node.lineno}: builds a SubSpecConfigError")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in messages:
                problems.append(f"{rel}:{node.lineno}: a refusal message: {node.value[:40]!r}")
    assert not problems, "\n".join(problems)


def test_the_config_module_still_exports_the_error():
    from vllm_subspec.config import SubSpecConfigError as from_config

    assert from_config is SubSpecConfigError
    assert str(SubSpecConfigError("x")) == "vllm-subspec: x"


# ---- start-up, on synthetic facts ----------------------------------------------------------
def test_option_domains_and_shape_bounds():
    assert refusals.option_problems({}) == []
    assert refusals.option_problems({"bits": 5, "kernel": "x"}) == [
        "bits must be one of [2, 3, 4, 8], got 5",
        "kernel must be one of ['auto', 'int4_cpu_dot', 'int4_cpu', 'gemlite', 'reference'], "
        "got 'x'"]
    refusals.refuse_tree_size(16, 32)
    with pytest.raises(SubSpecConfigError, match=r"at most 512, got 16 \* 33"):
        refusals.refuse_tree_size(16, 33)
    refusals.refuse_head_start_slots(0, 1, 1)
    refusals.refuse_head_start_slots(2, 4, 8)  # 8 + 2 + 4 <= 32
    with pytest.raises(SubSpecConfigError, match="needs 10 KV slots.*reserves 8"):
        refusals.refuse_head_start_slots(3, 2, 4)
    with pytest.raises(SubSpecConfigError, match="unknown speculative_config key"):
        refusals.refuse_unknown_keys(["x"], {"bits"})
    refusals.refuse_unknown_keys([], {"bits"})
    refusals.refuse_draft_model(None, "t")
    refusals.refuse_draft_model("t", "t")
    with pytest.raises(SubSpecConfigError, match="'model' must be omitted"):
        refusals.refuse_draft_model("other", "t")


def test_target_refusals_ask_the_platform_only_where_it_decides():
    asked = []

    def on_cpu():
        asked.append(1)
        return False

    refusals.refuse_target(SimpleNamespace(architectures=["LlamaForCausalLM"]), 1, 8, on_cpu)
    refusals.refuse_target(SimpleNamespace(architectures=["MixtralForCausalLM"]), 1, 4, on_cpu)
    assert not asked
    with pytest.raises(SubSpecConfigError, match="not bits=8"):
        refusals.refuse_target(SimpleNamespace(architectures=["MixtralForCausalLM"]), 1, 8,
                               on_cpu)
    assert asked
    with pytest.raises(SubSpecConfigError, match="unsupported architecture"):
        refusals.refuse_target(SimpleNamespace(architectures=None), 1, 4, on_cpu)


@pytest.mark.parametrize("call, match", [
    (lambda: refusals.refuse_quantized_target("fp8"), "the target is quantized"),
    (lambda: refusals.refuse_logprobs_mode("processed_logprobs"), "logprobs_mode"),
    (lambda: refusals.refuse_v2_model_runner(True), "V1 model runner"),
    (lambda: refusals.refuse_worker_cls("my.W", "ours.W"), "cannot be combined"),
    (lambda: refusals.refuse_kernel_device("gemlite", "CPU"), "runs on CUDA only"),
    (lambda: refusals.refuse_int4_cpu_dot(False), "AVX512-BF16"),
    (lambda: refusals.refuse_moe_extras(False, False, True, 1, False), "--enable-eplb;"),
    (lambda: refusals.refuse_context_parallel(1, 2), r"\(decode 1, prefill 2\)"),
    (lambda: refusals.refuse_quantized_kv_cache("fp8", True), "kv_cache_dtype 'fp8'"),
    (lambda: refusals.refuse_sliding_window(4096), "window 4096"),
    (lambda: refusals.refuse_micro_batching(True), "micro-batching"),
    (lambda: refusals.refuse_shared_head_starts(1, True, 2, False),
     r"mixture-of-experts target .*, --tensor-parallel-size > 1"),
    (lambda: refusals.refuse_nothing_offloaded("offloaded", "auto", 0, 1, 0), "nothing is"),
    (lambda: refusals.refuse_async_scheduling(True), "async scheduling"),
    (lambda: refusals.refuse_attention_backend("FLASHINFER"), "got FLASHINFER"),
    (lambda: refusals.refuse_backend_per_kind({"x": 1}), "backend_per_kind"),
    (lambda: refusals.refuse_flash_attention_config(ValueError("old GPU")), r"\(old GPU\)"),
    (lambda: refusals.refuse_attention_in_cuda_graphs(False, False, "FULL", []),
     "cudagraph_mode FULL"),
    (lambda: refusals.refuse_attention_in_cuda_graphs(True, True, "PIECEWISE", []),
     "breakable graphs True"),
])
def test_start_up_refusals_raise(call, match):
    with pytest.raises(SubSpecConfigError, match=match):
        call()


def test_start_up_refusals_pass_what_they_serve():
    refusals.refuse_quantized_target(None)
    refusals.refuse_logprobs_mode("raw_logprobs")
    refusals.refuse_v2_model_runner(False)
    refusals.refuse_worker_cls("auto", "ours.W")
    refusals.refuse_worker_cls("ours.W", "ours.W")
    refusals.refuse_kernel_device("gemlite", "CUDA")
    refusals.refuse_kernel_device("auto", "CPU")
    refusals.refuse_moe_extras(False, False, False, 1, False)
    refusals.refuse_context_parallel(1, 1)
    refusals.refuse_quantized_kv_cache("auto", False)
    refusals.refuse_sliding_window(None)
    refusals.refuse_shared_head_starts(0, True, 2, True)
    refusals.refuse_shared_head_starts(1, False, 1, False)
    refusals.refuse_nothing_offloaded("all", "auto", 0, 1, 0)
    refusals.refuse_nothing_offloaded("offloaded", "uva", 0, 1, 2.0)
    refusals.refuse_nothing_offloaded("offloaded", "prefetch", 4, 1, 0)
    refusals.refuse_async_scheduling(None)
    refusals.refuse_attention_backend(None)
    refusals.refuse_attention_backend("FLASH_ATTN")
    refusals.refuse_attention_in_cuda_graphs(True, False, "PIECEWISE", [])


# ---- per request, at load ------------------------------------------------------------------
def test_request_refusal_on_plain_objects():
    assert refusals.request_refusal(SimpleNamespace()) is None
    assert refusals.request_refusal(SimpleNamespace(thinking_token_budget=3)).startswith(
        "thinking_token_budget")


def test_at_load_refusals():
    refusals.refuse_layers_out_of_range([], 3)
    with pytest.raises(SubSpecConfigError, match=r"\[5\] out of range"):
        refusals.refuse_layers_out_of_range([5], 3)
    refusals.refuse_unsubstituted_streamed([3], prefetching=False)
    with pytest.raises(SubSpecConfigError, match=r"missing \[3\]"):
        refusals.refuse_unsubstituted_streamed([3], prefetching=True)
    refusals.refuse_cpu_draft_memory(None, 10, 10, 4)
    refusals.refuse_cpu_draft_memory(30, 10, 20, 4)
    with pytest.raises(SubSpecConfigError, match="Nothing was built"):
        refusals.refuse_cpu_draft_memory(29, 10, 20, 4)
    refusals.refuse_cpu_kv_memory(2, 2, 1, 1)
    with pytest.raises(SubSpecConfigError, match="not enough memory for the KV cache"):
        refusals.refuse_cpu_kv_memory(1, 2, 1, 1)
    refusals.refuse_cpu_kv_layout("vec", True)
    with pytest.raises(RuntimeError, match="ISA 'neon'"):
        refusals.refuse_cpu_kv_layout("neon", False)
