"""The OpenAI server with SubSpec: a real `vllm serve` subprocess on loopback, the `openai` client.

Two servers with the same settings (float32, so that greedy output does not depend on how the
server happens to batch concurrent requests): plain, and SubSpec with a small tree. Greedy
requests must get exactly the plain server's text and tokens; everything else (streaming, stop
strings, n>1, seeds, logprobs, disconnects, over-long prompts) must behave as on a plain server.
"""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from subspec_testing.serve import metric_total, serving

pytestmark = pytest.mark.e2e

SUBSPEC = {"method": "subspec", "tree_width": 4, "tree_depth": 6, "substitute_layers": "all"}
MAX_MODEL_LEN = 1024
QUESTIONS = [
    "Name three primary colors.", "What is the capital of France?",
    "Write a haiku about the sea.", "Explain what a CPU does in one sentence.",
    "List four animals that live in the ocean.", "How many days are in a leap year?",
    "Give me a short tip for learning to code.", "What does a bee make?",
]


@pytest.fixture(scope="module")
def servers(smollm2, tmp_path_factory):
    """(plain, subspec) OpenAI clients; both servers start in parallel."""
    logs = tmp_path_factory.mktemp("serve")
    # a tool-call parser: vLLM needs one for tool_choice="required" (hermes: SmolLM2's format)
    with serving(smollm2, {"plain": None, "subspec": SUBSPEC}, logs,
                 max_model_len=MAX_MODEL_LEN, kv_cache_bytes=256 * 2**20,
                 extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as procs:
        yield {name: s.client() for name, s in procs.items()}, smollm2, \
            procs["subspec"].base, logs


def chat(client, model, question, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], **kw)


def test_chat_greedy_matches_plain_and_metrics_report_tau(servers):
    clients, model, base, _ = servers
    replies = {name: chat(c, model, QUESTIONS[0], temperature=0, max_tokens=64)
               for name, c in clients.items()}
    assert replies["subspec"].choices[0].message.content.strip()
    assert replies["subspec"].choices[0].message.content == \
        replies["plain"].choices[0].message.content
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    counter = lambda name: float(re.search(  # noqa: E731
        rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} (\S+)", text, re.M).group(1))
    drafts, accepted = counter("num_drafts"), counter("num_accepted_tokens")
    assert drafts > 0 and accepted > 0
    assert 1 < 1 + accepted / drafts <= 1 + SUBSPEC["tree_depth"]  # τ within (1, D + 1]
    # SubSpec's own numbers, read from the worker when Prometheus scrapes
    ours = lambda name, **kw: metric_total(text, f"vllm:subspec_{name}", **kw)  # noqa: E731
    assert ours("draft_steps_total") >= drafts > 0
    assert ours("draft_passes_total") >= ours("draft_steps_total")
    assert ours("plain_steps_total") == 0  # a fixed shape always drafts
    assert ours("tree_width") == SUBSPEC["tree_width"]
    assert 1 <= ours("tree_depth") <= SUBSPEC["tree_depth"]
    assert 0 < ours("draft_time_share") < 1
    assert 0 < ours("draft_seconds_total") < ours("step_seconds_total")
    assert ours("draft_bytes", part="substitutes") > 0
    # a fixed shape drafts with the target's lm_head (draft_lm_head "auto"): no head of its own
    assert ours("draft_bytes", part="lm_head") == 0
    plain_base = str(clients["plain"].base_url).rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(plain_base + "/metrics", timeout=10) as r:
        assert "vllm:subspec_" not in r.read().decode()  # a plain engine exports none


def test_eight_concurrent_greedy_clients_get_the_plain_text(servers):
    clients, model, _, _ = servers

    def ask_all(client):
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            return list(pool.map(lambda q: chat(client, model, q, temperature=0, max_tokens=64)
                                 .choices[0].message.content, QUESTIONS))

    assert ask_all(clients["subspec"]) == ask_all(clients["plain"])


def test_completions_streaming_equals_non_streaming(servers):
    clients, model, _, _ = servers
    kw = dict(model=model, prompt="The three laws of robotics are", temperature=0,
              max_tokens=48)
    whole = clients["subspec"].completions.create(**kw)
    pieces = [c.choices[0].text for c in clients["subspec"].completions.create(stream=True, **kw)]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].text
    assert whole.choices[0].text == clients["plain"].completions.create(**kw).choices[0].text
    stream = chat(clients["subspec"], model, QUESTIONS[2], temperature=0, max_tokens=48,
                  stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat(clients["plain"], model, QUESTIONS[2], temperature=0,
                            max_tokens=48).choices[0].message.content


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_json_mode_and_tool_calls_equal_plain(servers):
    """Structured outputs through the OpenAI API (grammar masks in the scheduler; the tree
    engine drafts such requests as chains): JSON mode, a JSON schema, tool_choice "required"
    and a named tool, streamed and not, give the plain server's text."""
    import json

    clients, model, _, _ = servers
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    asks = {
        "json_object": dict(response_format={"type": "json_object"}),
        "json_schema": dict(response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": person}}),
        "required": dict(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"),
        "named": dict(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={
            "type": "function", "function": {"name": "get_weather"}}),
    }
    question = "What is the weather like in Paris right now? Describe a person too."
    jobs = [(name, server) for name in asks for server in clients]
    with ThreadPoolExecutor(len(jobs)) as pool:  # fp32: batching does not change greedy output
        replies = dict(zip(jobs, pool.map(
            lambda job: chat(clients[job[1]], model, question, temperature=0, max_tokens=128,
                             **asks[job[0]]).choices[0], jobs)))
    finished = 0
    for name in asks:
        ours, theirs = replies[name, "subspec"], replies[name, "plain"]
        assert ours.finish_reason == theirs.finish_reason, name
        assert ours.message.content == theirs.message.content, name
        calls = [(c.function.name, c.function.arguments) for c in ours.message.tool_calls or []]
        assert calls == [(c.function.name, c.function.arguments)
                         for c in theirs.message.tool_calls or []], name
        if ours.finish_reason in ("stop", "tool_calls"):  # complete, so it parses
            finished += 1
            if name == "named":
                assert [n for n, _ in calls] == ["get_weather"]
            for text in [a for _, a in calls] or [ours.message.content]:
                assert isinstance(json.loads(text), (dict, list)), name
    assert finished >= 1, finished  # SmolLM2 fills JSON strings at length: not all close
    stream = chat(clients["subspec"], model, question, temperature=0, max_tokens=128,
                  stream=True, **asks["json_schema"])
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == replies["json_schema", "plain"].message.content


def test_stop_strings_and_max_tokens(servers):
    clients, model, _, _ = servers
    kw = dict(model=model, prompt="Count: one, two, three,", temperature=0, max_tokens=64)
    stopped = {n: c.completions.create(stop=[" six"], **kw).choices[0]
               for n, c in clients.items()}
    assert stopped["subspec"].finish_reason == "stop"
    assert " six" not in stopped["subspec"].text
    assert stopped["subspec"].text == stopped["plain"].text
    capped = clients["subspec"].completions.create(**dict(kw, max_tokens=5))
    assert capped.usage.completion_tokens == 5
    assert capped.choices[0].finish_reason == "length"


def test_n_and_seeds(servers):
    clients, model, _, _ = servers
    kw = dict(temperature=0.9, max_tokens=32, n=3, seed=1234)
    first = chat(clients["subspec"], model, QUESTIONS[4], **kw)
    again = chat(clients["subspec"], model, QUESTIONS[4], **kw)
    texts = [c.message.content for c in first.choices]
    assert len(texts) == 3 and all(texts)
    assert texts == [c.message.content for c in again.choices]  # same seed, same samples
    other = chat(clients["subspec"], model, QUESTIONS[4], **dict(kw, seed=4321))
    assert [c.message.content for c in other.choices] != texts


def test_logprobs_match_plain(servers):
    clients, model, _, _ = servers
    kw = dict(model=model, prompt="The capital of Italy is", temperature=0, max_tokens=24,
              logprobs=3)
    got = {n: c.completions.create(**kw).choices[0].logprobs for n, c in clients.items()}
    assert got["subspec"].tokens == got["plain"].tokens
    for ours, theirs in zip(got["subspec"].token_logprobs, got["plain"].token_logprobs):
        assert ours == pytest.approx(theirs, abs=2e-3)
    for ours, theirs in zip(got["subspec"].top_logprobs, got["plain"].top_logprobs):
        assert len(ours) == 3
        assert set(ours) == set(theirs)
    reply = chat(clients["subspec"], model, QUESTIONS[1], temperature=0, max_tokens=16,
                 logprobs=True, top_logprobs=2)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_server_survives_disconnect_and_overlong_prompt(servers):
    import openai

    clients, model, _, _ = servers
    client = clients["subspec"]
    stream = client.completions.create(model=model, prompt="Tell me a long story.",
                                       temperature=0, max_tokens=400, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-generation
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="word " * (MAX_MODEL_LEN + 50),
                                  max_tokens=8)
    assert err.value.status_code == 400
    reply = chat(client, model, QUESTIONS[5], temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == \
        chat(clients["plain"], model, QUESTIONS[5], temperature=0, max_tokens=32) \
        .choices[0].message.content


def test_startup_log_reports_the_layout(servers):
    *_, logs = servers
    lines = [line for line in (logs / "subspec.log").read_text().splitlines()
             if "vllm-subspec layout:" in line]
    assert len(lines) == 1, lines
    # CPU backend, substitute_layers "all": every layer substituted, KV cache as configured
    assert "30 layers; resident (shared) none; substituted 0-29; substitutes " in lines[0]
    kv_gib = float(re.search(r"KV cache ([0-9.]+) GiB$", lines[0]).group(1))
    assert 0.2 < kv_gib <= 0.25  # --kv-cache-memory-bytes 256 MiB, in whole blocks
