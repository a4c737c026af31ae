"""Runs a bf16 SubSpec tree engine in-process on a CPU that claims AMX tiles (see
test_e2e_tree.test_bf16_tree_on_an_amx_cpu_runs_the_vec_kernels).

Usage: python cpu_isa_probe.py MODEL OUT_JSON, with VLLM_ENABLE_V1_MULTIPROCESSING=0 so that the
worker lives in this process and sees the faked `torch.cpu._is_amx_tile_supported`.
"""

import json
import sys

import torch


def main(model, out_path):
    # vLLM picks the "amx" attention ISA for bf16 when this is true (cpu_attn.py :544)
    torch.cpu._is_amx_tile_supported = lambda: True
    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS
    from vllm_subspec.draft_model.model import decoder_layers

    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              speculative_config={"method": "subspec", "tree_width": 4, "tree_depth": 3,
                                  "substitute_layers": "all"},
              **dict(CPU_ENGINE_KWARGS, max_model_len=256))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 9, 13, 2]}], params, use_tqdm=False)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    layers = decoder_layers(worker.model_runner.get_model())
    with open(out_path, "w") as f:
        json.dump({"isa": sorted({layer.self_attn.attn.isa for layer in layers}),
                   "token_ids": list(outs[0].outputs[0].token_ids)}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:3])
