"""The shape tuner's costs kept across restarts (docs/shape_tuner.md, "Kept across restarts"),
on real engines: one SubSpec engine runs past `SAVE_EVERY` planned steps and writes its file
next to its substitute cache; a second engine of the same config starts from it (its tuner
holds the first one's trees before its first step) and decodes the same greedy tokens."""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts

pytestmark = pytest.mark.e2e

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _planned_steps(worker) -> int:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    return subspec_of(worker).session.tuner.policy.steps


def _tuner_trees(worker) -> int:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    tuner = subspec_of(worker).session.tuner
    return sum(a.steps for a in tuner.acceptance.values()) + tuner.model.forward.known


def test_a_restarted_engine_starts_from_the_saved_costs(smollm2, tmp_path, monkeypatch):
    from vllm_subspec.step.tuner.saved_costs import ENV, SAVE_EVERY

    monkeypatch.setenv(ENV, "1")  # (the suite runs with it off: tests/conftest.py)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    spec = {"method": "subspec", "substitute_cache": str(tmp_path)}
    prompt = chat_prompts(smollm2, mt_bench_prompts(1))
    outputs = []
    for start in range(2):
        llm = make_llm(smollm2, spec, dtype="float32")
        try:
            held = llm.collective_rpc(_tuner_trees)[0]
            if start == 0:
                assert held == 0  # a cold start: nothing saved for this config yet
            else:
                assert held > 0  # the first engine's costs and trees, before any step
            outputs.append(list(llm.generate(prompt, LONG, use_tqdm=False)[0].outputs[0]
                                .token_ids))
            assert llm.collective_rpc(_planned_steps)[0] >= SAVE_EVERY
        finally:
            shutdown(llm)
        saved = list((tmp_path / "tuner").glob("tuner-*.json"))
        assert len(saved) == 1, saved  # one file per engine config (both engines': the same)
    assert len(outputs[0]) == LONG.max_tokens
    assert outputs[0] == outputs[1]
