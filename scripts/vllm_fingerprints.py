"""Source fingerprints of the vLLM functions vllm-subspec patches or relies on.

A fingerprint is the sha256 of `ast.dump(node, include_attributes=False)` of the function's (or
class's) definition, with every docstring inside it removed: comments, docstrings, formatting and
line numbers do not count, any change to the code does. The .py files are parsed, never imported,
so this works on CUDA-only modules and on an unpacked wheel. tests/unit/test_vllm_fingerprints.py
checks the installed vLLM against tests/data/vllm_fingerprints.json and 0.33.0 against 0.32.0.

    python scripts/vllm_fingerprints.py                      # print, installed vLLM
    python scripts/vllm_fingerprints.py --write 0.32.0       # record the installed vLLM
    python scripts/vllm_fingerprints.py --root /tmp/vllm033/src/vllm --write 0.33.0
    python scripts/vllm_fingerprints.py --inventory          # rewrite docs/vllm_inventory.md

--root is the `vllm` package directory (the one holding __init__.py), e.g. an unpacked wheel's
(`pip download --no-deps vllm==X -d D && unzip D/vllm-X-*.whl -d D/src`: D/src/vllm).
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "vllm_fingerprints.json"
INVENTORY = ROOT / "docs" / "vllm_inventory.md"

# "module:qualname". The first blocks are what SubSpec wraps or overrides (patches.py's `_wrap`
# targets, the methods its subclasses of vLLM's classes override); the rest are the symbols in
# docs/gpu.md's "vLLM 0.33.0 vs 0.32.0" table (in its row order), including the functions that
# hold the code regions the table cites.
NAMES: tuple[str, ...] = (
    # patches.py: every _wrap(owner, attr) target
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config",  # 1
    "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",  # 2
    "vllm.model_executor.model_loader.base_loader:process_weights_after_loading",  # 3 (utils')
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",  # 4 (CUDA)
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",  # 4 (CPU)
    "vllm.v1.engine.input_processor:InputProcessor._validate_params",  # 5
    # runner.py, cpu_runner.py: SubSpec's model runners and workers
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata",
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata",  # its fields, for a step without drafts
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_cumsum_and_arange",  # ... its indices
    "vllm.utils.torch_utils:async_tensor_h2d",  # ... and their copy
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
    # head starts: their scratch slots are the lookahead vLLM reserves past a verify
    "vllm.config.vllm:VllmConfig.num_lookahead_tokens",
    "vllm.v1.worker.block_table:BlockTable.append_row",  # ... counted in num_blocks_per_row
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner",
    "vllm.v1.worker.gpu_worker:Worker.init_device",  # calls _make_model_runner
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device",
    # SubSpecWorker runs a step's two calls on a fresh chunk of Python's frame stack
    "vllm.v1.worker.gpu_worker:Worker.execute_model",
    # executor.py: SubSpec's multiprocess executor brings each step's drafts with its samples
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model",
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.sample_tokens",
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.take_draft_token_ids",
    # proposer.py, prefetch_overlap.py, draft_model/model.py: the other subclasses
    "vllm.v1.spec_decode.draft_model:DraftModelProposer.__init__",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader.__init__",
    "vllm.model_executor.offloader.base:create_offloader",  # the settings SubSpec copies
    "vllm.model_executor.layers.layernorm:RMSNorm.__init__",
    "vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
    # docs/gpu.md table
    "vllm.engine.arg_utils:EngineArgs.create_engine_config",  # calls patch 1 before the configs
    "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",  # calls patch 3
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update",
    # the layer writes KV before `forward` (`forward_includes_kv_cache_update` False): patch 4
    # skips the backend's pass when every row is a tree row
    "vllm.model_executor.layers.attention.attention:Attention.forward",
    # no placeholder drafts for a new one-token request: engine_rules' batch-size schedule
    # sets `dynamic_sd_lookup`, which turns the scheduler's uniform-decode padding off
    "vllm.v1.core.sched.scheduler:Scheduler.__init__",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.spec_decode.dynamic.utils:build_dynamic_sd_schedule_lookup",
    "vllm.config.vllm:VllmConfig._maybe_override_dynamic_sd_cudagraph_mode",  # (trees: no FULL)
    "vllm.config.vllm:VllmConfig._maybe_disable_dynamic_sd_for_data_parallel",
    # one RPC a step: the engine core samples, then takes the drafts (post_step), and the
    # worker's RPC loop finds `sample_tokens_and_drafts` by name
    "vllm.v1.engine.core:EngineCore.step",
    "vllm.v1.engine.core:EngineCore.post_step",
    "vllm.v1.executor.abstract:Executor.get_class",
    "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc",
    "vllm.v1.worker.gpu_worker:Worker.sample_tokens",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.__init__",  # picks the ISA
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder._set_isa_to_layers",
    "vllm.v1.attention.backends.cpu_attn:_get_attn_isa",
    "vllm.v1.kv_cache_interface:create_kv_cache_views",
    "vllm.v1.kv_cache_interface:compute_layout_strides",
    "vllm.v1.kv_cache_layout:KVCacheLayout",
    "vllm.v1.worker.utils:allocate_kv_cache",
    "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups",
    "vllm.v1.kv_cache_interface:is_quantized_kv_cache",
    "vllm.utils.torch_utils:is_quantized_kv_cache",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader._start_prefetch",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader._wait_for_layer",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader.sync_prev_onload",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader.join_after_forward",
    "vllm.model_executor.offloader.prefetch:PrefetchOffloader.post_init",
    "vllm.model_executor.offloader.prefetch:_ModuleOffloader.start_onload_to_static",
    "vllm.compilation.cuda_graph:CUDAGraphWrapper.__call__",
    "vllm.config.vllm:VllmConfig.__post_init__",  # async-scheduling default
    "vllm.config.vllm:VllmConfig._get_v1_model_runner_unsupported_features",  # must stay empty
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config",  # CPU forces async off
    "vllm.platforms.cuda:_get_backend_priorities",
    "vllm.config.attention:AttentionConfig.validate_backend_before",
    "vllm.v1.attention.selector:AttentionSelectorConfig",
    "vllm.utils.torch_utils:resolve_kv_cache_dtype_string",
    "vllm.config.compilation:CompilationConfig.is_attention_compiled_piecewise",
    "vllm.config.compilation:CompilationConfig.set_splitting_ops_for_attn_fusion",  # → FULL
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    "vllm.compilation.decorators:support_torch_compile",  # the compiled draft
    "vllm.compilation.backends:set_model_tag",
    "vllm.v1.spec_decode.draft_model:DraftModelProposer",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.__init__",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.load_model",
    ("vllm.v1.spec_decode.llm_base_proposer:"
     "SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata"),
    ("vllm.v1.spec_decode.llm_base_proposer:"
     "SpecDecodeBaseProposer._update_positions_dependent_metadata"),
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._get_slot_mapping",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.initialize_attn_backend",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.initialize_cudagraph_keys",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.dummy_run",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
    # SampleMatchVerifier takes the rejection sampler's place
    "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
    # verify.draw_target_tokens draws as vLLM's Sampler does, through its TopKTopPSampler
    "vllm.v1.sample.sampler:Sampler.sample",
    "vllm.v1.sample.sampler:Sampler.apply_temperature",
    "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu",
    "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
    "vllm.v1.sample.ops.topk_topp_sampler:random_sample",
    # DraftModel.compute_logits finishes the draft's own lm_head's logits as these do
    "vllm.model_executor.layers.logits_processor:LogitsProcessor.__init__",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits",
    # draft_model/experts.py: SubstituteExperts runs in a MoERunner's place and reads its
    # router, gate, scaling factor, raw expert weights and all-reduce rule
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.__init__",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.forward",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._maybe_reduce_final_output",
    "vllm.model_executor.layers.fused_moe.router.fused_moe_router:FusedMoERouter.select_experts",
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
     "UnquantizedFusedMoEMethod.create_weights"),
)

# Every vLLM method whose code SubSpec replaces, or runs code in place of: (fingerprinted name,
# how, by what). tests/unit/test_vllm_fingerprints.py checks that patches.py's `_wrap` targets
# and every method SubSpec's subclasses of vLLM's classes override are all here, and that
# docs/vllm_inventory.md is this table rendered.
_PATCH = "wrapped in place (vllm_hooks/patches.py"
_RUNNER = "overridden by SubSpec's runner (vllm_hooks/runner.py)"
REPLACED: tuple[tuple[str, str, str], ...] = (
    ("vllm.engine.arg_utils:EngineArgs.create_speculative_config", f"{_PATCH} #1)",
     "engine_rules.translate_speculative_config, apply_platform_rules"),
    ("vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features", f"{_PATCH} #2)",
     "adds SubSpec to the V1-runner-only features"),
    ("vllm.model_executor.model_loader.base_loader:process_weights_after_loading",
     f"{_PATCH} #3)", "a SubSpec runner's target: SubSpecRunner.target_weights_loaded around "
     "the original"),
    ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward", f"{_PATCH} #4)",
     "tree_attention.apply_tree_attention after the original; the original not run when "
     "every row is a tree row (CPU)"),
    ("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward", f"{_PATCH} #4)",
     "tree_attention.apply_tree_attention after the original; the original not run when "
     "every row is a tree row (CUDA)"),
    ("vllm.v1.engine.input_processor:InputProcessor._validate_params", f"{_PATCH} #5)",
     "the original, then refusals.request_refusal (SubSpec engines)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__", _RUNNER,
     "the original, then the session, drafter, verifier and offloader"),
    ("vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__", _RUNNER,
     "the original, then the session, drafter, verifier and offloader (CPU)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", _RUNNER,
     "the original, its weight hook handing the target to this runner"),
    ("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", _RUNNER,
     "the original, its weight hook handing the target to this runner (CPU)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs", _RUNNER,
     "the original, then SampleMatchVerifier.prepare_verify"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata", _RUNNER,
     "with drafts: the original; without: the original's result for that batch size, "
     "cached, with new logits indices (SampleMatchVerifier.no_draft_metadata)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata", _RUNNER,
     "the original; its drafter metadata kept for the verify's head starts"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward", _RUNNER,
     "the original inside SampleMatchVerifier.verify_forward"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", _RUNNER,
     "the original, then the verify's head starts (SubSpecProposer.draft_head_starts)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter", _RUNNER,
     "True whenever there is a batch (trees stop per request); chains: the original"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids", _RUNNER,
     "StepSession.plan_step first; a plain plan: SubSpecProposer.plain_step, else the "
     "original"),
    ("vllm.v1.worker.gpu_worker:Worker._make_model_runner",
     "overridden by SubSpecGPUWorker (vllm_hooks/runner.py)", "SubSpecGPUModelRunner"),
    ("vllm.v1.worker.gpu_worker:Worker.execute_model",
     "overridden by SubSpecWorker (vllm_hooks/runner.py), GPU and CPU",
     "the original, its frames on a fresh stack chunk (stack_chunk.call_on_fresh_chunk)"),
    ("vllm.v1.worker.gpu_worker:Worker.sample_tokens",
     "overridden by SubSpecWorker (vllm_hooks/runner.py), GPU and CPU",
     "the original, its frames on a fresh stack chunk (stack_chunk.call_on_fresh_chunk)"),
    ("vllm.v1.worker.cpu_worker:CPUWorker.init_device",
     "overridden by SubSpecCPUWorker (vllm_hooks/cpu_runner.py)",
     "the original with its module's CPUModelRunner bound to SubSpecCPUModelRunner"),
    ("vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model",
     "overridden by SubSpecMultiprocExecutor (vllm_hooks/executor.py), the CPU executor",
     "forgets the last step's drafts, then the original"),
    ("vllm.v1.executor.multiproc_executor:MultiprocExecutor.sample_tokens",
     "overridden (vllm_hooks/executor.py)",
     "blocking: one RPC to SubSpecWorker.sample_tokens_and_drafts; else the original"),
    ("vllm.v1.executor.multiproc_executor:MultiprocExecutor.take_draft_token_ids",
     "overridden (vllm_hooks/executor.py)",
     "the drafts that came with the samples; none came: the original"),
    ("vllm.v1.spec_decode.draft_model:DraftModelProposer.__init__",
     "overridden (the runner's drafter is a SubSpecProposer, vllm_hooks/proposer.py)",
     "the original, then the session and the offloader"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.load_model",
     "overridden (vllm_hooks/proposer.py)",
     "SubSpecProposer.load_model: wraps the target, loads nothing"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
     "overridden (vllm_hooks/proposer.py)", "SubSpecProposer.propose -> StepSession.propose"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.dummy_run",
     "overridden (vllm_hooks/proposer.py)", "SubSpecProposer.dummy_run"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.initialize_attn_backend",
     "overridden (vllm_hooks/proposer.py)", "the original, then a layout log line"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.initialize_cudagraph_keys",
     "overridden (vllm_hooks/proposer.py)",
     "the original with `draft_cudagraph_mode` (NONE without compiled pieces)"),
    ("vllm.model_executor.offloader.prefetch:PrefetchOffloader.__init__",
     "overridden by OverlappingPrefetchOffloader (vllm_hooks/prefetch_overlap.py), which "
     "SubSpec's runner sets in place of vLLM's", "the original, then its bookkeeping"),
    ("vllm.model_executor.offloader.prefetch:PrefetchOffloader._start_prefetch",
     "overridden (vllm_hooks/prefetch_overlap.py)",
     "the original, but not captured for the first slots' refills"),
    ("vllm.model_executor.offloader.prefetch:PrefetchOffloader._wait_for_layer",
     "overridden (vllm_hooks/prefetch_overlap.py)", "eager refills first, then the original"),
    ("vllm.model_executor.offloader.prefetch:PrefetchOffloader.sync_prev_onload",
     "overridden (vllm_hooks/prefetch_overlap.py)",
     "skipped while drafting; refills at a graph forward's entry, then the original"),
    ("vllm.model_executor.offloader.prefetch:PrefetchOffloader.post_init",
     "overridden (vllm_hooks/prefetch_overlap.py)", "the original, then the slots' layers"),
    ("vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
     "replaced in the draft's own copies of substituted layers, eager CPU only "
     "(draft_model/model.py CpuFusedRMSNorm)",
     "vLLM's C++ rms_norm / fused_add_rms_norm; the original where they do not apply"),
    ("vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
     "the runner's rejection_sampler slot, every shape (vllm_hooks/runner.py)",
     "SampleMatchVerifier.__call__ -> StepSession.sample_and_walk"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.forward",
     "replaced in the draft's own copies of substituted MoE layers (draft_model/model.py "
     "substitute_layer)",
     "SubstituteExperts.forward: the target's router, 4-bit experts, the all-reduce rule of "
     "MoERunner._maybe_reduce_final_output"),
)


def render_inventory(data: dict) -> str:
    """docs/vllm_inventory.md: REPLACED with each method's recorded fingerprints."""
    versions = sorted(data)
    lines = ["# Every vLLM method SubSpec replaces", "",
             "Generated by `python scripts/vllm_fingerprints.py --inventory` from `REPLACED` "
             "there; `tests/unit/test_vllm_fingerprints.py` fails when this file, the code or "
             "the recorded fingerprints (`tests/data/vllm_fingerprints.json`: sha256 of the "
             "function's AST without docstrings) disagree.", "",
             "| vLLM method | how | SubSpec's code | " + " | ".join(
                 f"{v} fingerprint" for v in versions) + " |",
             "|---|---|---|" + "---|" * len(versions)]
    for name, how, what in REPLACED:
        shas = [(data[v].get(name) or {}).get("sha", "absent")[:12] for v in versions]
        lines.append(f"| `{name}` | {how} | {what} | " + " | ".join(f"`{s}`" for s in shas)
                     + " |")
    return "\n".join(lines) + "\n"


# Where a name went when vLLM moved it (looked up only when the listed module lacks it).
MOVED: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups": (
        "vllm.v1.core.kv_cache_planning:get_kv_cache_config_from_groups",),  # 0.33.0
}

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def installed_root() -> Path:
    """The installed `vllm` package directory, found without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed; pass --root")
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "vllm":
        return None
    base = root.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _strip_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        if isinstance(n, (*_DEFS, ast.Module)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                n.body = n.body[1:]
    return node


def _find_in(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last definition of `name` directly in `body` (def, class or assignment)."""
    found = None
    for stmt in body:
        if isinstance(stmt, _DEFS):
            names = [stmt.name]
        elif isinstance(stmt, ast.Assign):
            names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names = [stmt.target.id]
        else:
            continue
        if name in names:
            found = stmt
    return found


def _imported_from(tree: ast.Module, module: str, name: str) -> str | None:
    """`pkg.mod:name` when `module` has a top-level `from pkg.mod import name`."""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    src = stmt.module
                    if stmt.level:  # relative: from the module's package upwards
                        pkg = module.split(".")[:-stmt.level]
                        src = ".".join(pkg + ([stmt.module] if stmt.module else []))
                    return f"{src}:{alias.name}"
    return None


def locate(root: Path, qualified: str, _depth: int = 0) -> tuple[Path, ast.AST] | None:
    """(file, node) of `module:qualname`, following a re-export for a top-level name."""
    module, qualname = qualified.split(":")
    path = _module_file(root, module)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    head, *rest = qualname.split(".")
    node = _find_in(tree.body, head)
    if node is None:
        source = _imported_from(tree, module, head)
        if source is None or _depth > 4:
            return None
        return locate(root, ".".join([source, *rest]), _depth + 1)
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return None
        node = _find_in(node.body, part)
        if node is None:
            return None
    return path, node


def fingerprint(root: Path, qualified: str) -> dict | None:
    """{"sha", "line", "file"} (file relative to root's parent), or None when absent."""
    for candidate in (qualified, *MOVED.get(qualified, ())):
        found = locate(root, candidate)
        if found is not None:
            path, node = found
            dump = ast.dump(_strip_docstrings(node), include_attributes=False)
            return {"sha": hashlib.sha256(dump.encode()).hexdigest(), "line": node.lineno,
                    "file": path.relative_to(root.parent).as_posix()}
    return None


def fingerprints(root: Path, names=NAMES) -> dict[str, dict | None]:
    return {name: fingerprint(root, name) for name in names}


def normalise_version(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0'."""
    return version.split("+")[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, help="vllm package directory (default: installed)")
    p.add_argument("--write", metavar="VERSION",
                   help=f"record under this vLLM version in {DATA.relative_to(ROOT)}")
    p.add_argument("--inventory", action="store_true",
                   help=f"rewrite {INVENTORY.relative_to(ROOT)} from the recorded fingerprints")
    args = p.parse_args(argv)
    if args.inventory:
        INVENTORY.write_text(render_inventory(json.loads(DATA.read_text())))
        print(f"wrote {INVENTORY}")
        return 0
    root = (args.root or installed_root()).resolve()
    if not (root / "__init__.py").is_file():
        p.error(f"{root} is not a package directory (no __init__.py); pass .../vllm")
    prints = fingerprints(root)
    missing = [n for n, fp in prints.items() if fp is None]
    for name, fp in prints.items():
        where = f"{fp['file']}:{fp['line']}  {fp['sha'][:12]}" if fp else "ABSENT"
        print(f"{name}  {where}")
    if missing:
        print(f"{len(missing)} absent in {root}: {', '.join(missing)}", file=sys.stderr)
    if args.write:
        data = json.loads(DATA.read_text()) if DATA.exists() else {}
        data[normalise_version(args.write)] = prints
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n")
        print(f"wrote {normalise_version(args.write)} to {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
