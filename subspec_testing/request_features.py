"""The request-feature matrix: every SamplingParams feature vLLM accepts with speculative decoding,
each on a prompt where it changes plain decoding's output, greedy and seeded. A SubSpec engine
must give each request exactly a plain engine's tokens (every completion), logprobs and prompt
logprobs, in one mixed batch.

`matrix_runs` names the plain runs a test needs: the features, and the same requests without the
feature ("unbound"), which prove that each feature binds (changes plain's output, or adds what it
promises: n completions, logprobs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from subspec_testing.plain_reference import PlainRun, output_details

MAX_TOKENS = 32
SAMPLED = dict(temperature=0.8, top_p=0.95)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Case:
    name: str
    question: str
    feature: dict  # SamplingParams fields that make the feature
    changes_tokens: bool = True  # False: it adds completions or logprobs instead
    greedy: bool = True  # False: sampled only (vLLM refuses n > 1 for greedy requests)
    seeded_question: str | None = None  # where the seeded request needs another prompt to bind

    def question_for(self, sampled: bool) -> str:
        return self.seeded_question if sampled and self.seeded_question else self.question


def cases(tokenizer) -> list[Case]:
    from vllm.sampling_params import StructuredOutputsParams as SO

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    digits = sorted({t for d in "0123456789" for t in ids(f" {d}") + ids(d)} | set(ids(",")))
    return [
        Case(
            "min_tokens",
            "Say hi.",
            {"min_tokens": MAX_TOKENS},
            seeded_question="Answer with one word: is fire hot?",
        ),
        Case(
            "bad_words",
            "Write one sentence about a cat and a dog.",
            {"bad_words": [" cat", " dog", " the"]},
        ),
        Case("stop", "Name three fruits and say why each is healthy.", {"stop": ["."]}),
        Case(
            "stop_token_ids",
            "Name three primary colors.",
            {"stop_token_ids": [ids(t)[0] for t in (",", ".", " and")]},
        ),
        Case(
            "ignore_eos",
            "Say hi.",
            {"ignore_eos": True},
            seeded_question="Answer with one word: is ice cold?",
        ),
        Case(
            "allowed_token_ids",
            "What year did the first person walk on the moon?",
            {"allowed_token_ids": digits},
        ),
        Case(
            "penalties",
            "List ten animals.",
            {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3},
        ),
        Case("n", "Give me a name for a pet fish.", {"n": 2}, changes_tokens=False, greedy=False),
        Case(
            "logprobs", "Name three colors of the rainbow.", {"logprobs": 3}, changes_tokens=False
        ),
        Case(
            "prompt_logprobs",
            "What is the capital of France?",
            {"prompt_logprobs": 2},
            changes_tokens=False,
        ),
        Case("json", "Describe a person.", {"structured_outputs": SO(json=PERSON)}),
        Case(
            "regex",
            "What is 6 times 7?",
            {"structured_outputs": SO(regex=r"The answer is [0-9]+\.")},
        ),
        Case(
            "choice",
            "Is the sky blue?",
            {"structured_outputs": SO(choice=["Definitely", "Never", "Sometimes"])},
        ),
        Case(
            "grammar",
            "What is your favourite color?",
            {
                "structured_outputs": SO(
                    grammar='root ::= "Color: " ("red" | "green" | "blue") ". Because " [a-z ]+ "."'
                )
            },
        ),
        Case(
            "structural_tag",
            "Name a big city.",
            {
                "structured_outputs": SO(
                    structural_tag=json.dumps(
                        {
                            "type": "structural_tag",
                            "format": {
                                "type": "sequence",
                                "elements": [
                                    {"type": "const_string", "value": "<city>"},
                                    {
                                        "type": "json_schema",
                                        "json_schema": {
                                            "type": "object",
                                            "properties": {"city": {"type": "string"}},
                                            "required": ["city"],
                                        },
                                    },
                                    {"type": "const_string", "value": "</city>"},
                                ],
                            },
                        }
                    )
                )
            },
        ),
    ]


def params(case: Case, sampled: bool, index: int, bound: bool = True):
    from vllm import SamplingParams

    mode = dict(SAMPLED, seed=1000 + index) if sampled else dict(temperature=0.0)
    return SamplingParams(max_tokens=MAX_TOKENS, **mode, **(case.feature if bound else {}))


def matrix(all_cases: list[Case]) -> list[tuple[Case, bool]]:
    """The matrix's requests in batch order: (case, sampled), greedy ones first."""
    return [(c, s) for s in (False, True) for c in all_cases if s or c.greedy]


def labels(all_cases: list[Case]) -> list[str]:
    return [f"{c.name}/{'seeded' if s else 'greedy'}" for c, s in matrix(all_cases)]


def questions(all_cases: list[Case]) -> list[str]:
    """The user question of each request of the matrix, in batch order."""
    return [c.question_for(s) for c, s in matrix(all_cases)]


def matrix_runs(prompts: list[str], all_cases: list[Case]) -> dict[str, PlainRun]:
    """The plain runs of the matrix: 'bound' (each request with its feature) and 'unbound'.
    prompts: the chat prompts of `questions(all_cases)`."""
    rows = matrix(all_cases)
    return {
        name: PlainRun(
            list(prompts), [params(c, s, i, bound=name == "bound") for i, (c, s) in enumerate(rows)]
        )
        for name in ("bound", "unbound")
    }


def assert_features_bind(all_cases: list[Case], bound, unbound) -> None:
    """Each feature changes plain's output (or adds its completions / logprobs)."""
    for label, (case, _), b, u, detail in zip(
        labels(all_cases), matrix(all_cases), bound.token_ids, unbound.token_ids, bound.details
    ):
        if case.changes_tokens:
            assert b != u, f"{label}: the feature does not change plain decoding's output"
        elif case.name == "n":
            assert len(detail["completions"]) == 2, label
        elif case.name == "logprobs":
            assert all(len(p) >= 3 for p in detail["logprobs"][0]), label
        else:
            assert detail["prompt_logprobs"] and detail["prompt_logprobs"][-1], label


def assert_matrix_identical(outputs, all_cases: list[Case], plain) -> list[str]:
    """SubSpec's outputs equal plain's: every completion's tokens, logprobs (same tokens, values
    within 1e-3 nats: the verify scores nodes in other batch shapes) and prompt logprobs.
    Returns the labels checked."""
    checked = []
    for label, out, ref in zip(labels(all_cases), outputs, plain.details):
        got = output_details(out)
        assert got["completions"] == ref["completions"], f"{label}: tokens differ from plain"
        for mine, theirs in (
            (got["logprobs"], ref["logprobs"]),
            ([got["prompt_logprobs"]], [ref["prompt_logprobs"]]),
        ):
            for a, b in zip(mine, theirs):
                assert (a is None) == (b is None), label
                for pa, pb in zip(a or [], b or []):
                    assert (pa is None) == (pb is None), label
                    assert [t for t, _ in pa or []] == [t for t, _ in pb or []], label
                    assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(pa or [], pb or [])), (
                        f"{label}: logprobs differ"
                    )
        checked.append(label)
    return checked


def check_engine(llm, feature_matrix) -> list[str]:
    """Run the whole matrix as one mixed batch on `llm`; assert it equals plain and drafted.
    Returns the labels checked."""
    from subspec_testing.metrics import acceptance_stats

    all_cases, run, plain = feature_matrix
    before = acceptance_stats(llm)
    outputs = llm.generate(run.prompts, run.params, use_tqdm=False)
    stats = acceptance_stats(llm) - before
    checked = assert_matrix_identical(outputs, all_cases, plain)
    assert stats.num_drafts > 0 and stats.tau > 1.0, "the matrix ran without speculation"
    return checked
