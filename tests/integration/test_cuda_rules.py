"""CUDA configuration rules, through the function a CUDA front end calls, on CPU.

`EngineArgs.create_engine_config()` runs unmodified with vLLM's real CudaPlatform whose hardware
queries are answered without a GPU (`fake_cuda_platform`): the final VllmConfig is what a CUDA
engine would get. SubSpec's rules run inside it (the create_speculative_config wrapper).
"""

import json
import re
import shutil

import pytest
from fake_cuda_platform import installed
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_subspec.config import SubSpecConfigError, options_from_vllm_config
from vllm_subspec.vllm_hooks.engine_rules import check_final_config, sliding_window_of
from vllm_subspec.vllm_hooks.executor import SubSpecMultiprocExecutor

TREE = {"method": "subspec", "tree_width": 4, "tree_depth": 3}
CHAIN = {"method": "subspec", "num_speculative_tokens": 4}
OFFLOAD = dict(cpu_offload_gb=0.001)


def cuda_config(monkeypatch, model, spec, capability=(9, 0), devices=1, **kw):
    fake = installed(monkeypatch, capability, devices)
    args = EngineArgs(model=model, speculative_config=dict(spec), max_model_len=512,
                      **{"dtype": "bfloat16", **kw})
    return args.create_engine_config(), fake


def test_tree_engine_config_on_cuda(monkeypatch, tiny_llama):
    cfg, fake = cuda_config(monkeypatch, tiny_llama, TREE, **OFFLOAD)
    assert cfg.scheduler_config.async_scheduling is False  # vLLM's default here is True
    assert cfg.attention_config.backend == AttentionBackendEnum.FLASH_ATTN
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert cfg.compilation_config.is_attention_compiled_piecewise()
    assert cfg.speculative_config.method == "draft_model"
    # no placeholder drafts for a new one-token request (the schedule turns vLLM's padding off)
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size == [(1, 1, 12)]
    # vLLM builds SubSpec's runner through SubSpec's worker (vllm_hooks/runner.py)
    assert cfg.parallel_config.worker_cls == "vllm_subspec.vllm_hooks.runner.SubSpecGPUWorker"
    # one GPU: vLLM's in-process executor, whose draft fetch is a call, not an RPC
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    check_final_config(cfg, options_from_vllm_config(cfg), fake)  # accepted in the worker


def test_chain_keeps_vllm_cuda_defaults(monkeypatch, tiny_llama):
    cfg, fake = cuda_config(monkeypatch, tiny_llama, CHAIN, **OFFLOAD)
    # a chain is verified by sample-then-match too, which reads the drafts on the host
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.attention_config.backend is None
    assert cfg.compilation_config.cudagraph_mode.has_full_cudagraphs()
    # no batch-size schedule: vLLM would turn full graphs off for it, and its padding of new
    # one-token requests keeps a chain's decode batches uniform for them
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size is None
    check_final_config(cfg, options_from_vllm_config(cfg), fake)  # FULL graphs: fine for chains


def test_requested_full_graphs_become_piecewise(monkeypatch, tiny_llama):
    cfg, _ = cuda_config(monkeypatch, tiny_llama, TREE,
                         compilation_config={"cudagraph_mode": "FULL"}, **OFFLOAD)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("kw, fragment", [
    (dict(async_scheduling=True), "async scheduling is not supported by SubSpec"),
    (dict(attention_backend="FLASHINFER"), "got FLASHINFER"),
    (dict(attention_backend="TRITON_ATTN"), "got TRITON_ATTN"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8' is not supported with tree drafting"),
    (dict(dtype="float32"), "dtype not supported"),
])
def test_tree_refusals(monkeypatch, tiny_llama, kw, fragment):
    with pytest.raises(SubSpecConfigError, match=re.escape(fragment)):
        cuda_config(monkeypatch, tiny_llama, TREE, **{**OFFLOAD, **kw})


def test_explicit_flash_attention_is_accepted(monkeypatch, tiny_llama):
    for kw in (dict(attention_backend="FLASH_ATTN"), dict(attention_backend="auto"),
               dict(attention_config={"backend": "FLASH_ATTN"})):
        cfg, _ = cuda_config(monkeypatch, tiny_llama, TREE, **OFFLOAD, **kw)
        assert cfg.attention_config.backend == AttentionBackendEnum.FLASH_ATTN


def test_pre_ampere_gpu_is_refused_for_trees(monkeypatch, tiny_llama):
    with pytest.raises(SubSpecConfigError, match="compute capability not supported"):
        cuda_config(monkeypatch, tiny_llama, TREE, capability=(7, 5), dtype="float16", **OFFLOAD)


def test_nothing_offloaded_is_refused_on_cuda(monkeypatch, tiny_llama):
    for spec in (TREE, CHAIN):
        with pytest.raises(SubSpecConfigError, match="nothing is offloaded"):
            cuda_config(monkeypatch, tiny_llama, spec)
    # either offload backend, or an explicit layer choice, is accepted
    cuda_config(monkeypatch, tiny_llama, TREE, offload_backend="prefetch", offload_group_size=2,
                offload_num_in_group=1)
    cuda_config(monkeypatch, tiny_llama, {**TREE, "substitute_layers": "all"})


@pytest.mark.parametrize("compilation", [
    {"pass_config": {"fuse_attn_quant": True}},  # PIECEWISE -> FULL (compilation.py :1253)
    {"splitting_ops": ["vllm::unified_kv_cache_update"]},  # attention inside the pieces
])
def test_attention_captured_in_graphs_is_refused_in_the_worker(monkeypatch, tiny_llama,
                                                               compilation):
    cfg, fake = cuda_config(monkeypatch, tiny_llama, TREE, compilation_config=compilation,
                            **OFFLOAD)
    with pytest.raises(SubSpecConfigError, match="needs attention outside CUDA graphs"):
        check_final_config(cfg, options_from_vllm_config(cfg), fake)


def test_sliding_window_detection():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert sliding_window_of(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    assert sliding_window_of(Qwen2Config(sliding_window=4096, use_sliding_window=True,
                                         max_window_layers=0)) == 4096
    assert sliding_window_of(LlamaConfig()) is None
    assert sliding_window_of(MistralConfig(sliding_window=4096)) == 4096


@pytest.mark.parametrize("engine_kw, env, expected", [
    ({}, {}, SubSpecMultiprocExecutor),
    ({"distributed_executor_backend": "mp"}, {}, SubSpecMultiprocExecutor),
    ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "uni"),  # in-process: no RPC to save
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, {},
     "mp"),  # connectors merge every worker's output, and vLLM checks for "mp" by name
    ({"kv_offloading_size": 1.0}, {}, "mp"),  # KV offloading makes a connector later
])
def test_the_cpu_executor_brings_drafts_with_samples_where_vllm_runs_multiprocess(
        monkeypatch, tiny_llama, engine_kw, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = EngineArgs(model=tiny_llama, speculative_config=dict(CHAIN), max_model_len=512,
                      **engine_kw).create_engine_config()
    plain = EngineArgs(model=tiny_llama, max_model_len=512, **engine_kw).create_engine_config()
    # the executor vLLM's own rules pick for the plain engine is replaced by SubSpec's only
    # where it is the multiprocess one
    assert plain.parallel_config.distributed_executor_backend == \
        ("uni" if expected == "uni" else "mp")
    assert spec.parallel_config.distributed_executor_backend == expected
    if expected is SubSpecMultiprocExecutor:
        assert issubclass(Executor.get_class(spec), MultiprocExecutor)


def test_sliding_window_target_refused(monkeypatch, tmp_path, tiny_llama):
    model = tmp_path / "swa"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(sliding_window=256, layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SubSpecConfigError, match="sliding-window attention .window 256"):
        cuda_config(monkeypatch, str(model), TREE, **OFFLOAD)


def test_cpu_platform_is_untouched(tiny_llama):
    cfg = EngineArgs(model=tiny_llama, speculative_config=dict(TREE), max_model_len=512) \
        .create_engine_config()
    assert cfg.attention_config.backend is None  # the CPU backend; no offload needed
    assert cfg.parallel_config.worker_cls == \
        "vllm_subspec.vllm_hooks.cpu_runner.SubSpecCPUWorker"
    # where vLLM runs its multiprocess executor, SubSpec's: the drafts come with the samples
    assert cfg.parallel_config.distributed_executor_backend is SubSpecMultiprocExecutor
    # no CUDA graphs here: a chain gets the schedule too (no placeholder drafts)
    chain = EngineArgs(model=tiny_llama, speculative_config=dict(CHAIN), max_model_len=512) \
        .create_engine_config()
    assert chain.speculative_config.num_speculative_tokens_per_batch_size == [(1, 1, 4)]


@pytest.mark.parametrize("platform, kernel", [("cpu", "gemlite"), ("cuda", "int4_cpu"),
                                              ("cuda", "int4_cpu_dot")])
def test_a_kernel_of_the_other_platform_is_refused_before_the_engine_starts(
        monkeypatch, tiny_llama, platform, kernel):
    spec = {**TREE, "kernel": kernel}
    with pytest.raises(SubSpecConfigError, match=f"kernel '{kernel}' runs on"):
        if platform == "cuda":
            cuda_config(monkeypatch, tiny_llama, spec, **OFFLOAD)
        else:
            EngineArgs(model=tiny_llama, speculative_config=spec, max_model_len=512) \
                .create_engine_config()


def test_micro_batching_is_refused_for_trees(monkeypatch, tiny_llama):
    """A tree plan is active in the thread running the forward; micro-batching runs forwards
    in threads of its own."""
    with pytest.raises(SubSpecConfigError, match="does not support micro-batching"):
        cuda_config(monkeypatch, tiny_llama, TREE, enable_dbo=True, **OFFLOAD)


def test_a_user_worker_class_is_refused(tiny_llama):
    with pytest.raises(SubSpecConfigError, match="cannot be combined with SubSpec"):
        EngineArgs(model=tiny_llama, speculative_config=dict(TREE), max_model_len=512,
                   worker_cls="vllm.v1.worker.cpu_worker.CPUWorker").create_engine_config()


def test_backend_per_kind_is_refused_for_trees(monkeypatch, tiny_llama):
    with pytest.raises(SubSpecConfigError, match="backend_per_kind is not supported"):
        cuda_config(monkeypatch, tiny_llama, TREE, **OFFLOAD,
                    attention_config={"backend_per_kind": {"full_attention": "FLASH_ATTN"}})


def test_breakable_cuda_graphs_are_refused_in_the_worker(monkeypatch, tiny_llama):
    cfg, fake = cuda_config(monkeypatch, tiny_llama, TREE, **OFFLOAD)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(SubSpecConfigError, match="breakable graphs True"):
        check_final_config(cfg, options_from_vllm_config(cfg), fake)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_unreadable_kv_is_refused_for_trees_on_every_platform(monkeypatch, tmp_path, tiny_llama,
                                                              platform):
    """fp8 KV (no scales in the tree gather) and sliding windows (ignored by the tree rows):
    refused for trees on the CPU backend too; chains are unaffected."""
    model = tmp_path / "swa"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(sliding_window=256, layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (model / "config.json").write_text(json.dumps(cfg))

    def config(model, spec, **kw):
        if platform == "cuda":
            return cuda_config(monkeypatch, str(model), spec, **OFFLOAD, **kw)[0]
        return EngineArgs(model=str(model), speculative_config=dict(spec), max_model_len=512,
                          **kw).create_engine_config()

    with pytest.raises(SubSpecConfigError, match="sliding-window attention .window 256"):
        config(model, TREE)
    with pytest.raises(SubSpecConfigError, match="kv_cache_dtype 'fp8' is not supported"):
        config(tiny_llama, TREE, kv_cache_dtype="fp8")
    assert config(model, CHAIN).speculative_config.method == "draft_model"


def test_tensor_parallel_engine_config_on_cuda(monkeypatch):
    """TP=2 on CUDA: SubSpec's worker and rules apply, and `--cpu-offload-gb N` (per GPU) is
    planned against each GPU's shard of a layer: more layers than TP=1 for the same N."""
    from transformers import AutoConfig

    from subspec_testing.assets import tiny_model_path
    from vllm_subspec.vllm_hooks.prefetch_plan import decoder_layer_bytes

    model = tiny_model_path(num_layers=16)
    gb = 2 * decoder_layer_bytes(AutoConfig.from_pretrained(model), 2) / 2**30  # two layers
    plans = {}
    for tp in (1, 2):
        cfg, _ = cuda_config(monkeypatch, model, TREE, devices=2, cpu_offload_gb=gb,
                             tensor_parallel_size=tp)
        assert cfg.parallel_config.tensor_parallel_size == tp
        assert cfg.parallel_config.worker_cls.startswith("vllm_subspec.")
        prefetch = cfg.offload_config.prefetch
        if cfg.offload_config.offload_backend == "prefetch":
            plans[tp] = sum(i % prefetch.offload_group_size
                            >= prefetch.offload_group_size - prefetch.offload_num_in_group
                            for i in range(16))
    assert 0 < plans[1] < plans[2]


def test_cpu_offload_gb_runs_through_the_prefetch_offloader(monkeypatch, tiny_llama):
    """The README's `--cpu-offload-gb N` (offload backend "auto") becomes vLLM's prefetch
    offloader, freeing at least N GB net of its slots; an explicit `uva` stays UVA."""
    from transformers import AutoConfig

    from vllm_subspec.vllm_hooks.prefetch_plan import decoder_layer_bytes, substitute_share

    gb = decoder_layer_bytes(AutoConfig.from_pretrained(tiny_llama), 2) / 2**30  # one layer
    cfg, _ = cuda_config(monkeypatch, tiny_llama, TREE, cpu_offload_gb=gb)
    offload = cfg.offload_config
    assert offload.offload_backend == "prefetch" and offload.uva.cpu_offload_gb == 0
    prefetch = offload.prefetch
    hf = cfg.model_config.hf_text_config
    layer = decoder_layer_bytes(hf, cfg.model_config.dtype.itemsize)
    offloaded = [i for i in range(hf.num_hidden_layers)
                 if i % prefetch.offload_group_size
                 >= prefetch.offload_group_size - prefetch.offload_num_in_group]
    share = substitute_share(4, 64)  # each offloaded layer's substitute stays on the GPU
    assert (len(offloaded) * (1 - share) - prefetch.offload_prefetch_step) * layer \
        >= gb * 2**30 * (1 - share) - 1
    assert prefetch.offload_prefetch_step == 2
    # substitute_layers: "all", or a list with every streamed layer, still stream; a list
    # missing one would be refused at load under prefetch, so it stays on UVA
    for layers, backend in (("all", "prefetch"), ([0, 1, 2, 3], "prefetch"), ([0], "auto"),
                            ([], "auto")):
        chosen, _ = cuda_config(monkeypatch, tiny_llama, {**TREE, "substitute_layers": layers},
                                cpu_offload_gb=gb)
        assert chosen.offload_config.offload_backend == backend, layers
    # any prefetch setting of the user's: vLLM's choice (UVA here), the setting untouched
    stepped, _ = cuda_config(monkeypatch, tiny_llama, TREE, cpu_offload_gb=gb,
                             offload_prefetch_step=4)
    assert stepped.offload_config.offload_backend == "auto"
    assert stepped.offload_config.prefetch.offload_prefetch_step == 4
    uva, _ = cuda_config(monkeypatch, tiny_llama, TREE, cpu_offload_gb=gb,
                         offload_backend="uva")
    assert uva.offload_config.offload_backend == "uva"
    assert uva.offload_config.uva.cpu_offload_gb == gb
    # a parameter filter (UVA's, or the prefetch one vLLM ignores under UVA): as the user set it
    for params in (dict(cpu_offload_params={"mlp"}), dict(offload_params={"mlp"})):
        kept, _ = cuda_config(monkeypatch, tiny_llama, TREE, cpu_offload_gb=gb, **params)
        assert kept.offload_config.offload_backend == "auto"
        assert kept.offload_config.uva.cpu_offload_gb == gb
    # more than the layers can give with two slots: vLLM's UVA offloader, as asked
    everything, _ = cuda_config(monkeypatch, tiny_llama, TREE, cpu_offload_gb=100)
    assert everything.offload_config.offload_backend == "auto"
    assert everything.offload_config.uva.cpu_offload_gb == 100


def test_moe_target_on_cuda_drafts_and_stays_on_uva(monkeypatch):
    """A mixture-of-experts target on CUDA: SubSpec's worker and rules apply, and
    `--cpu-offload-gb N` stays on vLLM's UVA offloader (a step reads only the routed experts);
    substitutes other than 4-bit are refused (the experts' Triton kernel is 4-bit)."""
    from transformers import AutoConfig

    from subspec_testing.assets import tiny_moe_path
    from vllm_subspec.vllm_hooks.prefetch_plan import decoder_layer_bytes

    model = tiny_moe_path("MixtralForCausalLM", num_layers=8)
    # two layers by the dense count: what a dense target of these shapes streams by prefetch
    gb = 2 * decoder_layer_bytes(AutoConfig.from_pretrained(model), 2) / 2**30
    cfg, fake = cuda_config(monkeypatch, model, TREE, cpu_offload_gb=gb)
    assert cfg.parallel_config.worker_cls == "vllm_subspec.vllm_hooks.runner.SubSpecGPUWorker"
    assert cfg.offload_config.offload_backend == "auto"
    assert cfg.offload_config.uva.cpu_offload_gb == gb
    check_final_config(cfg, options_from_vllm_config(cfg), fake)
    with pytest.raises(SubSpecConfigError, match="4-bit substitutes.*not bits=8"):
        cuda_config(monkeypatch, model, {**TREE, "bits": 8}, cpu_offload_gb=gb)
    tp2, fake = cuda_config(monkeypatch, model, TREE, devices=2, tensor_parallel_size=2,
                            cpu_offload_gb=gb)  # with tensor parallelism too
    assert tp2.parallel_config.tensor_parallel_size == 2
    assert tp2.parallel_config.worker_cls.startswith("vllm_subspec.")
    check_final_config(tp2, options_from_vllm_config(tp2), fake)


def test_head_starts_are_refused_where_the_verify_shares_more_than_kv(monkeypatch, tiny_llama):
    """Head starts draft beside the verify on CUDA: accepted for a dense target on one GPU;
    refused, before the engine starts, for a MoE target (one experts' workspace), tensor
    parallelism (collectives from two streams) and a KV connector."""
    from transformers import AutoConfig

    from subspec_testing.assets import tiny_model_path, tiny_moe_path
    from vllm_subspec.vllm_hooks.prefetch_plan import decoder_layer_bytes

    head = {**TREE, "head_start_levels": 2}
    cfg, fake = cuda_config(monkeypatch, tiny_llama, head, **OFFLOAD)
    assert options_from_vllm_config(cfg).head_start_levels == 2
    check_final_config(cfg, options_from_vllm_config(cfg), fake)
    moe = tiny_moe_path("MixtralForCausalLM", num_layers=8)
    gb = 2 * decoder_layer_bytes(AutoConfig.from_pretrained(moe), 2) / 2**30
    with pytest.raises(SubSpecConfigError, match="mixture-of-experts"):
        cuda_config(monkeypatch, moe, head, cpu_offload_gb=gb)
    dense = tiny_model_path(num_layers=16)
    gb = 2 * decoder_layer_bytes(AutoConfig.from_pretrained(dense), 2) / 2**30
    with pytest.raises(SubSpecConfigError, match="tensor-parallel-size"):
        cuda_config(monkeypatch, dense, head, devices=2, tensor_parallel_size=2,
                    cpu_offload_gb=gb)
    with pytest.raises(SubSpecConfigError, match="kv-transfer-config"):
        cuda_config(monkeypatch, tiny_llama, head, **OFFLOAD, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_both"})
    # the same engines without head starts are accepted
    cuda_config(monkeypatch, moe, TREE, cpu_offload_gb=2 * decoder_layer_bytes(
        AutoConfig.from_pretrained(moe), 2) / 2**30)
