"""The compile-mode tier: SubSpec in vLLM's default mode, the one `vllm serve` and `LLM()` users
get without `--enforce-eager`.

On the CPU backend that mode compiles the model with inductor and runs `profile_run` at start-up
(`cpu_model_runner.warming_up_model`), before the KV cache exists: the start-up path a GPU
engine runs at every start. Every other e2e module runs eager engines, which skip it. Here, fp32
and against a plain engine in the same mode: a chain, a fixed tree, greedy and seeded sampling
through `LLM`, and the README's quick-start configuration (`{"method": "subspec"}`) through
`LLM()` and through `vllm serve` with the openai client. The server compiles on the other core
while the in-process engines run.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import (
    assert_identical,
    draft_compile_state,
    model_costs_decide,
    timed_generate,
)
from subspec_testing.plain_reference import PlainRun
from subspec_testing import serve
from subspec_testing.serve import stop_server, wait_healthy

pytestmark = pytest.mark.e2e

COMPILED = dict(dtype="float32", enforce_eager=False)
NUM_PROMPTS, NEW_TOKENS, SAMPLED_TOKENS = 6, 64, 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = dict(temperature=0.8, top_p=0.95, max_tokens=SAMPLED_TOKENS)
MAX_MODEL_LEN = 1024


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(seed=100 + i, **SAMPLED) for i in range(n)]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompts(smollm2, mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """The quick start as a user runs it: `vllm serve MODEL --speculative-config
    '{"method": "subspec"}'`, no --enforce-eager. Started before the in-process engines (the
    `plain` fixture asks for it), so it compiles on the other core meanwhile."""
    log = tmp_path_factory.mktemp("serve") / "subspec.log"
    proc = serve.start_server("subspec", smollm2, log, {"method": "subspec"}, eager=False,
                              max_model_len=MAX_MODEL_LEN, kv_cache_bytes=256 * 2**20)
    yield proc
    stop_server(proc)


@pytest.fixture(scope="module")
def plain(smollm2, prompts, server, plain_references):
    runs = plain_references.get(smollm2, dict(max_model_len=MAX_MODEL_LEN, **COMPILED), {
        "greedy": PlainRun(prompts, GREEDY), "seeded": PlainRun(prompts, seeded(len(prompts)))})
    greedy, sampled = runs["greedy"], runs["seeded"]
    return greedy.token_ids, sampled.token_ids, sampled.texts, greedy.texts


def run_compiled(smollm2, prompts, spec, sampled: bool, model_costs: bool = False):
    """model_costs: an auto shape decides with fixed costs with which it drafts
    (`model_costs_decide`; a fresh engine's measured rates decode its first ~150 steps plainly)."""
    from vllm.config import CompilationMode

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
        llm = make_llm(smollm2, spec, max_model_len=MAX_MODEL_LEN, **COMPILED)
        try:
            assert llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
            if model_costs:
                llm.collective_rpc(model_costs_decide, args=(True,))
            greedy = timed_generate(llm, prompts, GREEDY)
            # the draft forward is compiled too (at start-up, in vLLM's warm-up), in one graph
            state = llm.collective_rpc(draft_compile_state)[0]
            assert state == {"cls": "CompiledDraftModel", "do_not_compile": False,
                             "compiled": True, "graph_breaks": 0, "structure_keyed": True,
                             "engine_config_untouched": True}, \
                state
            outs = llm.generate(prompts, seeded(len(prompts)), use_tqdm=False) \
                if sampled else []
        finally:
            shutdown(llm)
    return greedy, [list(o.outputs[0].token_ids) for o in outs]


def test_chain_compiled_greedy_identical(smollm2, prompts, plain):
    greedy, _ = run_compiled(smollm2, prompts, {"method": "subspec", "num_speculative_tokens": 4,
                                                "substitute_layers": "all"}, sampled=False)
    assert_identical(greedy.token_ids, plain[0])
    assert greedy.stats.tau > 1.5


def test_tree_compiled_greedy_and_seeded_identical(smollm2, prompts, plain):
    """A fixed 6x8 tree: greedy is plain's token for token; seeded sampled requests draw plain's
    own samples (sample-then-match with plain's noise per depth, verify.SeededDraws)."""
    greedy, sampled = run_compiled(smollm2, prompts, {
        "method": "subspec", "tree_width": 6, "tree_depth": 8, "substitute_layers": "all"},
        sampled=True)
    assert_identical(greedy.token_ids, plain[0])
    assert greedy.stats.tau > 3.0
    plain_sampled = plain[1]
    greedy_prefix = [g[:len(s)] for g, s in zip(plain[0], plain_sampled)]
    assert plain_sampled != greedy_prefix  # the sampling really changes the output
    assert_identical(sampled, plain_sampled)


def test_quick_start_llm_compiled_greedy_and_seeded_identical(smollm2, prompts, plain):
    """The README's `LLM(..., speculative_config={"method": "subspec"})`, default mode: the
    auto shape (deciding with fixed costs with which it drafts: `model_costs_decide`), greedy
    and seeded sampled requests as plain's."""
    greedy, sampled = run_compiled(smollm2, prompts, {"method": "subspec"}, sampled=True,
                                   model_costs=True)
    assert_identical(greedy.token_ids, plain[0])
    assert_identical(sampled, plain[1])
    assert greedy.stats.num_drafts > 0  # it drafted (auto may also decode plainly)


def completion(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, **kw).choices[0].text


def test_quick_start_server_compiled_matches_plain(smollm2, prompts, plain, server):
    """`vllm serve` with the README's speculative config, compiled: greedy and seeded
    completions give the plain engine's text, requests in flight together; chat and streaming
    answer; the start-up ran vLLM's profiling pass (compile mode)."""
    wait_healthy(server)
    client = server.client(timeout=600)
    _, _, plain_sampled_texts, plain_greedy_texts = plain
    with ThreadPoolExecutor(len(prompts)) as pool:
        greedy = list(pool.map(lambda p: completion(client, smollm2, p, temperature=0,
                                                    max_tokens=NEW_TOKENS,
                                                    extra_body={"ignore_eos": True}), prompts))
        sampled = list(pool.map(
            lambda ip: completion(client, smollm2, ip[1], seed=100 + ip[0], **SAMPLED),
            enumerate(prompts)))
    assert greedy == plain_greedy_texts
    assert sampled == plain_sampled_texts
    stream = client.chat.completions.create(
        model=smollm2, messages=[{"role": "user", "content": "Name three primary colors."}],
        temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()
    log = server.log_text()
    assert "Warming up model for the compilation" in log  # compile mode: the profiling pass
    assert "[subspec_draft_" in log  # the draft compiled under its own tag, at start-up
    assert "vllm-subspec layout:" in log
