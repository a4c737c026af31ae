"""Runs a plain bf16 engine in-process with vLLM's "vec" CPU attention kernels, the ones SubSpec's
tree engines run (see test_e2e_tree.test_bf16_tree_is_plain_decoding_up_to_proven_near_ties).

On a CPU with AMX tiles vLLM runs bf16 attention with its "amx" kernels, and SubSpec switches
tree engines to "vec" (their KV layout is one tree attention reads: patches.py, patch 8): a
plain reference on "amx" would then differ from the tree engine by the kernels' rounding, not
by anything SubSpec does. On a CPU without AMX "vec" is vLLM's own choice, and this changes
nothing.

Usage: python plain_vec_probe.py MODEL IN_JSON OUT_JSON, IN_JSON = [prompts, max_tokens], with
VLLM_ENABLE_V1_MULTIPROCESSING=0 so that the worker lives in this process and sees the hidden
`torch.cpu._is_amx_tile_supported`.
"""

import json
import sys

import torch


def main(model, in_path, out_path):
    # vLLM picks the "amx" attention ISA for bf16 when this is true (cpu_attn.py :533)
    torch.cpu._is_amx_tile_supported = lambda: False
    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS
    from vllm_subspec.draft_model.model import decoder_layers

    with open(in_path) as f:
        prompts, max_tokens = json.load(f)
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True,
              kv_cache_memory_bytes=256 * 2**20, **CPU_ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    layers = decoder_layers(worker.model_runner.get_model())
    with open(out_path, "w") as f:
        json.dump({"isa": sorted({layer.self_attn.attn.isa for layer in layers}),
                   "prompt_ids": [list(o.prompt_token_ids) for o in outs],
                   "token_ids": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
