"""Per-node request rules (`step/node_constraints.py`) on synthetic trees: min_tokens and
bad_words masks along each node's own path, checked against vLLM's own plain `Sampler` on the
node's context (the request's output + the node's path), and the requests that draft chains.

Tree (k = 2, D = 2; test_verify.py's): node tokens / parents
        0
      /   \\
   1:5     2:6
   /  \\
 3:7  4:8
"""

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm_subspec.refusals import request_refusal as refusal
from vllm_subspec.step.node_constraints import chain_only_reason, constrain
from vllm_subspec.step.tree import StoredTree
from vllm_subspec.step.verify import VerifiedTree, sample_then_match

V, EOS = 16, 7
TOKENS, PARENTS = [0, 5, 6, 7, 8], [-1, 0, 0, 1, 1]
DEPTHS = np.array([0, 1, 1, 2, 2])
PATHS = np.array([[V, V], [5, V], [6, V], [5, 7], [5, 8]])  # each node's path, padded with V
ROWS = torch.zeros(5, dtype=torch.int64)  # every row is request 0's


def constrained(logits, meta, paths=lambda: PATHS):
    """`constrain` over one request's five nodes (no penalties: `test_verify.py` has those)."""
    return constrain(logits, ROWS, ROWS, DEPTHS, paths, meta, None)


def stored() -> StoredTree:
    return StoredTree(list(TOKENS), list(PARENTS), torch.ones(5, 5, dtype=torch.bool), width=2)


def min_tokens_processor(minimum: int, output: list[int], structured=False) -> LogitsProcessors:
    """vLLM's processor with one request added the way the input batch adds it (a BatchUpdate
    holding its SamplingParams and the live output list)."""
    processor = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    params = SamplingParams(min_tokens=minimum, stop_token_ids=[EOS], max_tokens=100,
                            structured_outputs=StructuredOutputsParams(regex="a*")
                            if structured else None)
    processor.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                       added=[(0, params, None, output)]))
    return LogitsProcessors([processor])


def metadata(output: list[int], bad_words=None, minimum: int = 0,
             structured=False) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(1), presence_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1), output_token_ids=[output],
        allowed_token_ids_mask=None, bad_words_token_ids={0: bad_words} if bad_words else {},
        logitsprocs=min_tokens_processor(minimum, output, structured) if minimum
        else LogitsProcessors())


def plain_draw(row: torch.Tensor, history: list[int], **rules) -> int:
    """What vLLM's plain Sampler draws from `row` after generating `history`."""
    out = Sampler()(row[None].clone(), metadata(list(history), **rules))
    return int(out.sampled_token_ids[0, 0])


def walk(logits: torch.Tensor, output: list[int], **rules) -> list[int]:
    """The tokens a tree step emits for one request (sample, then match)."""
    tree = VerifiedTree(stored(), 40, 0, compact=False)
    result = sample_then_match([tree], [4], logits, metadata(list(output), **rules), None)
    return [t for t in result.tokens[0].tolist() if t >= 0]


def logits_with(best: list[int], runner_up: list[int]) -> torch.Tensor:
    torch.manual_seed(0)
    out = torch.randn(5, V) * 0.1
    out[torch.arange(5), torch.tensor(runner_up)] += 3.0
    out[torch.arange(5), torch.tensor(best)] += 4.0
    return out


def assert_plain_along_the_walk(logits, output, emitted, **rules):
    """Each emitted token is the plain Sampler's draw at the node it was drawn at."""
    node, history = 0, list(output)
    for token in emitted:
        assert token == plain_draw(logits[node], history, **rules)
        history.append(token)
        children = [i for i, p in enumerate(PARENTS) if p == node and TOKENS[i] == token]
        if not children:
            break
        node = children[0]


def test_min_tokens_masks_stop_tokens_by_each_nodes_own_length():
    # one token generated, min_tokens 3: rows at depth 0 and 1 (lengths 1, 2) may not stop,
    # depth-2 rows (length 3) may. EOS leads at node 1 and at node 4.
    logits = logits_with(best=[5, EOS, 1, 1, EOS], runner_up=[1, 8, 1, 1, 2])
    rows = constrained(logits, metadata([3], minimum=3))
    assert torch.isneginf(rows[[0, 1, 2], EOS]).all() and torch.isfinite(rows[[3, 4], EOS]).all()
    emitted = walk(logits, [3], minimum=3)
    assert emitted == [5, 8, EOS]  # node 1 draws its runner-up 8; node 4 may stop
    assert_plain_along_the_walk(logits, [3], emitted, minimum=3)
    assert walk(logits, [3]) == [5, EOS, 1]  # the rule binds: without it node 1 stops early


def test_min_tokens_gives_a_grammar_its_only_token_back():
    """A structured-output row whose grammar allows nothing but a stop token keeps it (vLLM's
    `_mask_stop_token_logits`): plain decoding stops there rather than drawing from -inf."""
    logits = logits_with(best=[5, 1, 1, 1, 1], runner_up=[1, 2, 2, 2, 2])
    logits[1] = float("-inf")
    logits[1, EOS] = 0.5  # node 1's grammar mask leaves only EOS
    rows = constrained(logits, metadata([3], minimum=4, structured=True))
    assert rows[1, EOS] == 0.5 and torch.isneginf(rows[[0, 2], EOS]).all()
    assert plain_draw(logits[1], [3, 5], minimum=4, structured=True) == EOS


def test_min_tokens_already_met_masks_nothing():
    logits = logits_with(best=[5, EOS, 1, 1, 1], runner_up=[1, 8, 1, 1, 1])
    assert walk(logits, [3, 4, 5], minimum=3) == walk(logits, [3, 4, 5])


def test_bad_words_complete_along_each_nodes_path():
    # banned: "5 8" (two tokens) and "6". 8 is banned after 5 (node 1's row), not after 6
    # (node 2's row); 6 is banned everywhere.
    bad = [[5, 8], [6]]
    logits = logits_with(best=[5, 8, 8, 1, 1], runner_up=[6, 7, 2, 1, 1])
    rows = constrained(logits, metadata([], bad_words=bad))
    assert torch.isneginf(rows[1, 8]) and torch.isfinite(rows[2, 8])
    assert torch.isneginf(rows[:, 6]).all()
    emitted = walk(logits, [], bad_words=bad)
    assert emitted == [5, 7, 1]  # node 1 cannot complete "5 8": its runner-up 7 -> node 3
    assert_plain_along_the_walk(logits, [], emitted, bad_words=bad)
    assert walk(logits, []) == [5, 8, 1]  # the rule binds


def test_a_bad_word_started_in_the_committed_output_is_completed_at_the_root():
    logits = logits_with(best=[8, 1, 1, 1, 1], runner_up=[5, 1, 1, 1, 1])
    assert walk(logits, [5], bad_words=[[5, 8]])[0] == 5  # output ends in 5: 8 is banned
    assert walk(logits, [4], bad_words=[[5, 8]])[0] == 8


def test_nothing_to_apply_returns_the_logits_themselves():
    logits = torch.randn(5, V)
    paths = pytest.fail  # never asked for: no rule reads paths
    assert constrained(logits, metadata([]), paths) is logits


def test_requests_a_tree_is_not_exact_for_draft_chains():
    assert chain_only_reason(SamplingParams()) is None
    assert chain_only_reason(SamplingParams(min_tokens=5, bad_words=["x"])) is None
    json = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert chain_only_reason(json) == "structured outputs"


def test_a_thinking_budget_is_refused_per_request():
    """vLLM applies it only in its own samplers, which the verify replaces: refused, clearly."""
    assert refusal(SamplingParams(min_tokens=5, bad_words=["x"])) is None
    reason = refusal(SamplingParams(thinking_token_budget=10))
    assert reason.startswith("thinking_token_budget is not supported")


def test_logprobs_the_verify_does_not_report_are_refused_per_request():
    """A drafted step's logprobs are the verify's top-k form; a plain step's are vLLM's
    sampler's. Asked-for token ids and the whole vocabulary would differ between the two."""
    assert refusal(SamplingParams(logprobs=5)) is None
    assert refusal(SamplingParams(logprob_token_ids=[3, 7])).startswith(
        "logprob_token_ids is not supported")
    assert refusal(SamplingParams(logprobs=-1)).startswith("logprobs=-1")


def test_rows_stay_aligned_after_a_request_without_a_tree():
    """A request with scheduled drafts but no tree (only its root row is drawn from) still
    takes one depth and path per logits row, so the next request's rules land on its rows."""
    first = logits_with(best=[3, 3, 3, 3, 3], runner_up=[1, 1, 1, 1, 1])[:3]
    second = logits_with(best=[5, 8, 8, 1, 1], runner_up=[6, 7, 2, 1, 1])
    meta = metadata([], bad_words=[[5, 8]])
    meta.output_token_ids = [[], []]
    meta.bad_words_token_ids = {1: [[5, 8]]}
    result = sample_then_match([None, VerifiedTree(stored(), 40, 1, compact=False)], [2, 4],
                               torch.cat([first, second]), meta, None)
    assert [t for t in result.tokens[0].tolist() if t >= 0] == [3]
    assert [t for t in result.tokens[1].tolist() if t >= 0] == [5, 7, 1]  # "5 8" banned
