"""Runs a SubSpec engine in-process with an auditor on the draft's KV writes (see test_kv_rule).

Usage: python kv_rule_probe.py MODEL PROMPTS_JSON OUT_JSON. Must run with
VLLM_ENABLE_V1_MULTIPROCESSING=0 so the worker (and its proposer) live in this process.
"""

import json
import sys

import torch

from vllm_subspec.draft_model.model import DraftModel
from vllm_subspec.vllm_hooks import draft_passes
from vllm_subspec.vllm_hooks.proposer import SubSpecProposer

AUDIT = {"checks": 0, "violations": 0}
_current = {}


def audit_positions(forward):
    def wrapped(self, input_ids, positions, *args, **kwargs):
        p = _current.get("last_verified")
        if p is not None:  # inside propose: every draft position must be > last verified
            AUDIT["checks"] += 1
            AUDIT["violations"] += int((positions[: p.numel()] <= p).sum())
        return forward(self, input_ids, positions, *args, **kwargs)
    return wrapped


def audit_metadata(method):
    def wrapped(drafter, *args, **kwargs):
        cad, last_verified = method(drafter, *args, **kwargs)
        _current["last_verified"] = last_verified.clone()
        return cad, last_verified
    return wrapped


def redraft_last_accepted(method):
    """The bug the rule forbids: re-run the last accepted token through the draft first."""
    def wrapped(drafter, cad, num_rejected):
        cad, last_verified = method(drafter, cad, num_rejected)
        cad.seq_lens -= 1
        return cad, last_verified - 1
    return wrapped


def main(model, prompts_path, out_path):
    from vllm import LLM, SamplingParams

    from subspec_testing.harness import CPU_ENGINE_KWARGS

    with open(prompts_path) as f:
        prompts, max_tokens = json.load(f)
    DraftModel.forward = audit_positions(DraftModel.forward)
    honest_meta = draft_passes.bonus_token_metadata
    draft_passes.bonus_token_metadata = audit_metadata(honest_meta)
    llm = LLM(model=model, speculative_config={"method": "subspec", "num_speculative_tokens": 4,
              "substitute_layers": "all"}, enforce_eager=True, enable_prefix_caching=False,
              dtype="float32", **CPU_ENGINE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    result = {}
    for mode in ("honest", "redraft"):
        if mode == "redraft":
            honest_propose = SubSpecProposer.propose

            def propose(self, *args, **kw):  # the first draft input becomes the accepted token
                kw = dict(kw)
                idx = kw["token_indices_to_sample"]
                if idx is None:
                    idx = kw["common_attn_metadata"].query_start_loc[1:] - 1
                kw["next_token_ids"] = kw["target_token_ids"][idx.long()]
                return honest_propose(self, *args, **kw)

            SubSpecProposer.propose = propose
            # the auditor keeps recording the true last verified position
            draft_passes.bonus_token_metadata = redraft_last_accepted(
                audit_metadata(honest_meta))
        AUDIT.update(checks=0, violations=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[mode] = dict(AUDIT, token_ids=[list(o.outputs[0].token_ids) for o in outs])
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
