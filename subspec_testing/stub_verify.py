"""One verify step on stand-ins for vLLM's runner (no engine): the real `StepSession` and
`SampleMatchVerifier`, synthetic trees, logits and a CPU-layout KV cache. For the verify's
launch-count test and the host-overhead benchmark."""

from __future__ import annotations

from types import SimpleNamespace

import torch

# k = 2, D = 3: node tokens / parents, level-ordered (7 nodes)
TOKENS = [0, 5, 6, 7, 8, 9, 10]
PARENTS = [-1, 0, 0, 2, 2, 3, 3]
BS, KV_HEADS, HEAD_DIM = 16, 2, 32


def sampling(batch: int, output_len: int, vocab: int, penalties: bool = True):
    """vLLM's SamplingMetadata of `batch` sampled requests, `output_len` tokens out so far."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    g = torch.Generator().manual_seed(output_len)
    outputs = [torch.randint(0, vocab, (output_len,), generator=g).tolist() for _ in range(batch)]
    return SamplingMetadata(
        temperature=torch.full((batch,), 0.8),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((batch,), 0.9),
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=not penalties,
        prompt_token_ids=torch.randint(0, vocab, (batch, 12), generator=g),
        frequency_penalties=torch.full((batch,), 0.2 if penalties else 0.0),
        presence_penalties=torch.full((batch,), 0.1 if penalties else 0.0),
        repetition_penalties=torch.full((batch,), 1.05 if penalties else 1.0),
        output_token_ids=outputs,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def verify_step(batch: int, vocab: int = 64):
    """(verifier, scheduled drafts, logits) of one step over `batch` 7-node trees whose walks
    accept nodes 2 and 4 (so every request's KV moves); call `run_verify` on them."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.sample.sampler import Sampler

    from vllm_subspec.config import SubSpecOptions
    from vllm_subspec.step.session import StepSession
    from vllm_subspec.step.tree import StoredTree
    from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream
    from vllm_subspec.vllm_hooks.verifier import SampleMatchVerifier

    session = StepSession(SubSpecOptions.from_dict({"tree_width": 2, "tree_depth": 3}))
    req_ids = [f"r{i}" for i in range(batch)]
    session.pending = {
        r: StoredTree(list(TOKENS), list(PARENTS), torch.ones(7, 7, dtype=torch.bool), width=2)
        for r in req_ids
    }
    kv = torch.randn(4 * batch, KV_HEADS, BS, 2 * HEAD_DIM)
    table = torch.arange(4 * batch, dtype=torch.int32).reshape(batch, 4)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=req_ids,
            num_reqs=batch,
            num_computed_tokens_cpu=[20] * batch,
            block_table=[SimpleNamespace(get_device_tensor=lambda n: table[:n], block_size=BS)],
        ),
        positions=torch.zeros(7 * batch, dtype=torch.int64),
        query_start_loc=SimpleNamespace(np=[7 * i for i in range(batch + 1)]),
        sampler=Sampler(),
        max_num_reqs=7 * max(batch, 8),
    )  # one chunk holds every row
    impl = object.__new__(CPUAttentionBackendImpl)
    logits = torch.randn(7 * batch, vocab) * 0.01
    for i in range(batch):  # the root draws 6 (node 2), node 2 draws 8 (node 4), then 1
        logits[7 * i, 6] = logits[7 * i + 2, 8] = logits[7 * i + 4, 1] = 50.0
    verifier = SampleMatchVerifier(
        runner,
        session,
        lambda: [(impl, kv, "vec16")],
        HeadStartStream(torch.device("cpu")),
        lm_head_logits=None,
    )
    return verifier, {r: TOKENS[1:] for r in req_ids}, logits


def scheduler_output(drafts: dict, prompt_tokens: dict | None = None):
    """vLLM's SchedulerOutput of a step scheduling these drafts (req_id -> draft tokens, one
    bonus token each) and these prompt tokens (req_id -> count)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_spec_decode_tokens = drafts
    out.num_scheduled_tokens = {r: 1 + len(d) for r, d in drafts.items()}
    out.num_scheduled_tokens.update(prompt_tokens or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def run_verify(verifier, scheduled, logits, sampling_metadata):
    """prepare_verify, then the verifier's call, as the runner makes them in one step."""
    verifier.prepare_verify(scheduler_output(scheduled))
    return verifier(
        SimpleNamespace(num_draft_tokens=[len(d) for d in scheduled.values()]),
        None,
        logits,
        sampling_metadata,
    )
