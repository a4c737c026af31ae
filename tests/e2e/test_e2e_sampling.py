"""Sampled (T > 0) requests are lossless: SubSpec's tokens follow the target's distribution.

Tiny random Llama with a 64-token vocabulary, many seeded requests, SubSpec vs the plain engine,
two-sample chi-square per generated position. fp32, so that seeded requests can be held to
plain's exact samples (in bf16 vLLM's attention kernels differ between plain decoding and trees
on AMX CPUs, and 6,000 draws meet a few rounding-level differences). Every shape, a chain
included, is verified by sample-then-match (the runner's rejection-sampler slot holds
`SampleMatchVerifier`), so every emitted token is a draw of plain decoding's own.
"""

from collections import Counter

import pytest
from conftest import make_llm, shutdown
from scipy.stats import chi2_contingency
from vllm import SamplingParams

from subspec_testing.metrics import acceptance_stats
from subspec_testing.plain_reference import PlainRun

pytestmark = pytest.mark.e2e

N, NEW_TOKENS = 1500, 4
PROMPT = {"prompt_token_ids": [5, 9, 13, 2]}
SETTINGS = {"temperature": dict(temperature=1.0), "top_p": dict(temperature=1.0, top_p=0.7)}


DRAFTERS = {
    "chain": {"method": "subspec", "num_speculative_tokens": 3, "substitute_layers": "all"},
    "tree": {"method": "subspec", "tree_width": 4, "tree_depth": 3, "substitute_layers": "all"},
}


def requests(settings) -> PlainRun:
    return PlainRun([PROMPT] * N, [SamplingParams(max_tokens=NEW_TOKENS, seed=i, ignore_eos=True,
                                                  **settings) for i in range(N)])


def sample(llm, settings):
    run = requests(settings)
    outs = llm.generate(run.prompts, run.params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain_samples(tiny_llama, plain_references):
    runs = plain_references.get(tiny_llama, dict(skip_tokenizer_init=True, dtype="float32"),
                                {name: requests(s) for name, s in SETTINGS.items()})
    return {name: run.token_ids for name, run in runs.items()}


def _verifier_class(worker) -> str:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    return type(subspec_of(worker).rejection_sampler).__name__


def _count_draft_rpcs(worker) -> None:
    """Count the worker's RPCs that hand over drafts (instance attributes: the worker's RPC
    loop looks its methods up by name)."""
    counts = {"sample_tokens_and_drafts": 0, "take_draft_token_ids": 0}
    for name in counts:
        def counted(*args, _name=name, _method=getattr(worker, name), **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)
        setattr(worker, name, counted)
    worker.__dict__["draft_rpc_counts"] = counts


def _draft_rpc_counts(worker) -> dict:
    return dict(worker.draft_rpc_counts)


@pytest.fixture(scope="module", params=list(DRAFTERS))
def samples(request, tiny_llama, plain_samples):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
        spec = make_llm(tiny_llama, DRAFTERS[request.param], skip_tokenizer_init=True,
                        dtype="float32")
        try:
            # the documented verify of every shape: sample-then-match, not vLLM's
            # rejection sampler (steps without drafts: vLLM's own sampler, inside it)
            assert spec.collective_rpc(_verifier_class) == ["SampleMatchVerifier"]
            spec.collective_rpc(_count_draft_rpcs)
            spec_samples = {name: sample(spec, s) for name, s in SETTINGS.items()}
            stats = acceptance_stats(spec)
            rpcs = spec.collective_rpc(_draft_rpc_counts)[0]
        finally:
            shutdown(spec)
    return plain_samples, spec_samples, stats, rpcs


def chi_square_p(a: list[int], b: list[int]) -> float:
    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rare = [t for t in set(ca) | set(cb) if t not in common]
    rows = [[ca[t] for t in common] + [sum(ca[t] for t in rare)],
            [cb[t] for t in common] + [sum(cb[t] for t in rare)]]
    rows = [r[:-1] if rows[0][-1] + rows[1][-1] == 0 else r for r in rows]
    return chi2_contingency(rows)[1]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_tokens_follow_target_distribution(samples, name):
    plain, spec, _, _ = samples
    assert all(len(t) == NEW_TOKENS for t in spec[name])
    for pos in range(NEW_TOKENS):
        p = chi_square_p([t[pos] for t in plain[name]], [t[pos] for t in spec[name]])
        assert p > 1e-3, f"{name}: position {pos} differs from plain sampling (p={p:.2g})"
    # the sampled output really is random (many distinct continuations)
    assert len({tuple(t) for t in spec[name]}) > N // 10


def test_top_p_narrows_the_distribution(samples):
    """The prompts are ones where the feature changes plain's output, and SubSpec's samples
    narrow with it too."""
    plain, spec, _, _ = samples
    support = lambda runs: len({t[1] for t in runs})  # noqa: E731
    assert support(plain["top_p"]) < support(plain["temperature"])
    assert support(spec["top_p"]) < support(spec["temperature"])


def test_drafts_are_partly_accepted(samples):
    # Both outcomes of the walk happened: some drafts accepted, some rejected.
    _, _, stats, _ = samples
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("name", list(SETTINGS))
def test_seeded_samples_are_plain_samples(samples, name):
    # Trees and chains draw each emitted token with the noise of plain decoding's draw at that
    # position (verify.SeededDraws), so seeded requests give plain's own samples: fp32 logits
    # differ from plain's by rounding only, which can flip a draw only at an exact near-tie.
    plain, spec, _, _ = samples
    same = sum(a == b for a, b in zip(plain[name], spec[name]))
    assert same == N, f"{name}: {same}/{N} seeded requests equal plain's samples"


def test_drafts_come_back_with_the_sampled_tokens(samples):
    """vLLM's CPU backend runs the multiprocess executor; SubSpec's (vllm_hooks/executor.py)
    gets each step's drafts in the RPC that samples it, so vLLM's own `take_draft_token_ids`
    RPC, one more round trip a step, never runs (the samples above are plain's: the drafts
    reached the scheduler)."""
    rpcs = samples[3]
    assert rpcs["sample_tokens_and_drafts"] > 0
    assert rpcs["take_draft_token_ids"] == 0
