"""The project's losslessness standard for runs that are not bit-exact by construction.

fp32: SubSpec's greedy output must equal plain decoding token for token. bf16: a different
rounding order (tree rows' attention vs the backend kernel, GEMV vs GEMM) may flip a greedy
argmax where the target's two best tokens are a numerical tie. Each such difference must be
*proven* a near-tie: re-score the common prefix with the target in fp32 and check, at the first
differing position, that SubSpec's token is ranked at most `MAX_RANK` and within `NEAR_TIE_NATS`
of the best log-probability.

Why 0.25 nats: bf16 keeps 8 significant bits, so logits of magnitude 16-32 are rounded in steps
of 0.125; the lm_head output alone can then move two competing logits by half a step each, and
the hidden state feeding it has been rounded at every one of the decoder layers. A gap above two
such steps is not explained by rounding and fails the check.

Why rank 4: the same rounding reorders any tokens within that gap, so a tie can be among more
than two. Measured: on an AMX CPU (bf16 GEMMs whose rounding depends on the row count, plain
decoding's rows vs a tree's verify rows), SubSpec's token ranked 3rd, 0.133 nats below the best
(tests/e2e/test_e2e_tree.py, 2026-11-24); the earlier bound, rank 2, assumed two-way ties.
"""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE_NATS = 0.25
MAX_RANK = 4
TOP_LOGPROBS = 20


@dataclass
class Divergence:
    prompt_index: int
    position: int  # first differing output position
    plain_token: int
    spec_token: int
    gap_nats: float  # fp32 log p(best) - log p(spec token) at that position
    spec_rank: int  # 1 = the fp32 argmax

    @property
    def is_near_tie(self) -> bool:
        return self.spec_rank <= MAX_RANK and self.gap_nats <= NEAR_TIE_NATS


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def rescore_differences(
    fp32_llm,
    prompt_token_ids: list[list[int]],
    spec_ids: list[list[int]],
    plain_ids: list[list[int]],
) -> list[Divergence]:
    """One Divergence per prompt whose outputs differ (a length-only difference counts as none:
    it comes from a stop condition after a difference, or there is none to score).

    fp32_llm: a plain (non-speculative) engine of the same target in float32."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    todo = [
        (i, pos)
        for i, (s, p) in enumerate(zip(spec_ids, plain_ids))
        if (pos := first_difference(s, p)) is not None
    ]
    if not todo:
        return []
    prompts = [
        TokensPrompt(prompt_token_ids=prompt_token_ids[i] + plain_ids[i][:pos]) for i, pos in todo
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS)
    outs = fp32_llm.generate(prompts, params, use_tqdm=False)
    found = []
    for (i, pos), out in zip(todo, outs):
        top = out.outputs[0].logprobs[0]  # token -> Logprob(logprob, rank)
        best = max(lp.logprob for lp in top.values())
        spec_tok = spec_ids[i][pos]
        lp = top.get(spec_tok)
        found.append(
            Divergence(
                prompt_index=i,
                position=pos,
                plain_token=plain_ids[i][pos],
                spec_token=spec_tok,
                gap_nats=float("inf") if lp is None else best - lp.logprob,
                spec_rank=TOP_LOGPROBS + 1 if lp is None else int(lp.rank),
            )
        )
    return found


def assert_lossless(spec_ids, plain_ids, dtype: str, fp32_llm=None, prompt_token_ids=None):
    """fp32: identical. bf16/fp16: every difference is a proven near-tie (needs fp32_llm)."""
    differing = [
        i for i, (s, p) in enumerate(zip(spec_ids, plain_ids)) if first_difference(s, p) is not None
    ]
    if dtype in ("float32", "fp32"):
        assert not differing, f"fp32 outputs differ from plain for prompts {differing}"
        return []
    found = rescore_differences(fp32_llm, prompt_token_ids, spec_ids, plain_ids)
    bad = [d for d in found if not d.is_near_tie]
    assert not bad, f"differences that are not near-ties (fp32 re-score): {bad}"
    return found
