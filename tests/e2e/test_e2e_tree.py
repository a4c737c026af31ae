"""Deep dynamic trees (k = 6) with tree verification: greedy output equals the plain engine's.

fp32 engines, where any difference at all is a bug: fixed shapes, the default (auto) shape and
its tuner's decisions, the GPU start sequence. Batches that preempt and hit the prefix cache,
and bf16 trees: test_e2e_tree_batches.py.
"""

import pytest
from conftest import make_llm, shutdown
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.harness import (
    assert_identical,
    model_costs_decide,
    predict_plain_faster,
    step_stats,
    timed_generate,
)
from subspec_testing.plain_reference import PlainRun
from subspec_testing.request_features import check_engine

pytestmark = pytest.mark.e2e

NUM_PROMPTS, NEW_TOKENS = 10, 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# penalties act on the output so far, which for a tree node includes the node's path
PENALIZED = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
NUM_PENALIZED = 5
FP32 = dict(dtype="float32")


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompts(smollm2, mt_bench_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def plain(smollm2, prompts, plain_references):
    runs = plain_references.get(smollm2, FP32, {
        "greedy": PlainRun(prompts, GREEDY),
        "penalized": PlainRun(prompts[:NUM_PENALIZED], PENALIZED)})
    return runs["greedy"], runs["penalized"]


@pytest.fixture(scope="module")
def tree_6x8(smollm2):
    llm = make_llm(smollm2, {"method": "subspec", "tree_width": 6, "tree_depth": 8,
                             "substitute_layers": "all"}, **FP32)
    yield llm
    shutdown(llm)


def _check_tree_run(llm, prompts, plain, depth: int, penalized: bool) -> None:
    result = timed_generate(llm, prompts, GREEDY)
    plain_greedy, plain_penalized = plain
    assert all(len(t) == NEW_TOKENS for t in result.token_ids)
    assert_identical(result.token_ids, plain_greedy.token_ids[: len(prompts)])
    if penalized:
        run = timed_generate(llm, prompts[:NUM_PENALIZED], PENALIZED)
        unpenalized = [t[:len(p)] for t, p in zip(plain_greedy.token_ids, run.token_ids)]
        assert run.token_ids != unpenalized  # the penalties change the output
        assert_identical(run.token_ids, plain_penalized.token_ids)
    stats = result.stats
    # vLLM counts the tree's 6 * depth nodes as draft tokens; accepted ones form one path
    assert stats.num_draft_tokens == stats.num_drafts * 6 * depth
    assert 3.0 < stats.tau <= depth + 1
    per_depth = stats.accepted_per_position[:depth]
    assert per_depth == sorted(per_depth, reverse=True)  # acceptance is a path from the root
    assert all(a == 0 for a in stats.accepted_per_position[depth:])


def test_deep_tree_greedy_identical(smollm2, prompts, plain):
    llm = make_llm(smollm2, {"method": "subspec", "tree_width": 6, "tree_depth": 16,
                             "substitute_layers": "all"}, **FP32)
    try:  # 4 of the prompts: depth 8's test and the auto shape's run all 10
        _check_tree_run(llm, prompts[:4], plain, 16, penalized=False)
    finally:
        shutdown(llm)


def test_tree_greedy_identical(tree_6x8, prompts, plain):
    _check_tree_run(tree_6x8, prompts, plain, 8, penalized=True)


def test_request_features_in_a_fixed_tree(tree_6x8, feature_matrix):
    """Every request feature (subspec_testing/request_features.py), greedy and seeded, in one
    mixed batch on a 6 x 8 tree: each request's tokens, logprobs and prompt logprobs equal
    plain decoding's (min_tokens and bad_words per node path; structured outputs as chains)."""
    assert len(check_engine(tree_6x8, feature_matrix)) == 29


@pytest.fixture(scope="module")
def default_engine(smollm2):
    """The README's default config ({"method": "subspec"}), fp32: one engine for the tests
    below that use it, in file order (the GPU start walk first, right after start; the test
    that forces plain steps last)."""
    with pytest.MonkeyPatch.context() as mp:  # callable collective_rpc, for its lifetime
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = make_llm(smollm2, {"method": "subspec"}, **FP32)
        yield llm
        shutdown(llm)


def test_gpu_start_sequence_walked_on_cpu_then_lossless(default_engine, prompts, plain):
    """vLLM's GPU engine start, in its order, through the runner's own code on a CPU engine
    (default config): a GPU worker runs `profile_run` at every start, eager or not, before the
    KV cache exists (gpu_worker.py 0.32.0 :653/:693, then `initialize_from_config` :853),
    then CUDA-graph capture (`_warmup_and_capture`, gpu_model_runner.py :6588-6635: the
    drafter's `dummy_run` with is_graph_capturing) and the sampler/tree-step warm-up over
    max_num_seqs rows (gpu_worker.py :1044-1058); then the first steps. The CPU worker runs only
    the profile in compile mode, so an eager CPU engine never walked this. The drafter must
    write no KV in any of it (the old dummy_run wrote through its own slot buffer into the
    placeholder caches: ValueError on CPU, IndexError in FlashAttention), and must run its
    widest logits and top-k in the profiling pass, where vLLM measures peak memory."""
    llm = default_engine  # first user of the shared engine: the walk runs right after start
    walk = llm.collective_rpc(_walk_gpu_start)[0]
    # the first steps must draft (a fresh engine's measured rates decode plainly until its
    # exploration allowance pays a first look): fixed costs with which the tuner drafts
    llm.collective_rpc(model_costs_decide, args=(True,))
    try:
        result = timed_generate(llm, prompts, GREEDY)
    finally:
        llm.collective_rpc(model_costs_decide, args=(False,))
    assert walk["drafter_calls"] == [("profile", False), ("capture", True), ("warm-up", False)]
    assert walk["kv_unchanged_by_warm_ups"]
    # the profiling pass ran the draft's widest pass: max_num_seqs x 6 rows of logits
    assert walk["profile_logits_rows"] == walk["max_num_seqs"] * 6
    assert walk["draft_logits_after_profile"] == []  # only there: not at capture or warm-up
    # the runner profiles max_num_batched_tokens rows; the draft's forward only its own bound,
    # the widest tree level of max_num_seqs requests (padded to a capture size where there
    # are any): start-up time, minutes on CPU otherwise
    profile_forwards = [rows for phase, rows in walk["draft_forward_rows"] if phase == "profile"]
    assert walk["draft_rows_bound"] == walk["max_num_seqs"] * 6
    assert profile_forwards == [walk["warm_up_rows"]]
    assert walk["draft_rows_bound"] <= walk["warm_up_rows"] < walk["profile_batch_rows"]
    assert walk["sampler_warm_up_rows"] == walk["max_num_seqs"]
    # ... and a tree verify's logits (every node of max_num_seqs trees, more rows than the
    # runner's own profile computes) were live in it, with one chunk's fp32 work
    assert walk["verify_rows_bound"] == min(walk["profile_batch_rows"],
                                            walk["max_num_seqs"] * (6 * 32 + 1))
    # and the next step's drafting (its widest level's logits and fp32 log-probabilities) and
    # the verify's draws (per-request int64 penalty counts) peaked while they were held
    assert walk["profile_peak_bytes"] >= walk["verify_logits_bytes"] + max(
        walk["draft_level_bytes"], walk["penalty_counts_bytes"])
    assert_identical(result.token_ids, plain[0].token_ids)
    assert result.stats.tau > 1.5


def _walk_gpu_start(worker) -> dict:
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from subspec_testing.live_bytes import LiveBytes
    from vllm_subspec.vllm_hooks.runner import subspec_of

    runner = subspec_of(worker)
    drafter = runner.drafter
    ctx = runner.vllm_config.compilation_config.static_forward_context
    attn = {n: m for n, m in ctx.items() if isinstance(m, AttentionLayerBase)}
    calls, logits_rows, phase = [], [], ["profile"]
    dummy_run, compute_logits, verifier = drafter.dummy_run, drafter.model.compute_logits, \
        runner.rejection_sampler  # the SampleMatchVerifier

    def recorded_dummy_run(num_tokens, use_cudagraphs=True, is_graph_capturing=False,
                           slot_mappings=None):
        calls.append((phase[0], is_graph_capturing))
        return dummy_run(num_tokens, use_cudagraphs, is_graph_capturing, slot_mappings)

    def recorded_logits(hidden, head=None):
        logits_rows.append(hidden.shape[0])
        return compute_logits(hidden, head)

    sampler_rows = []

    def recorded_verifier(metadata, draft_probs, logits, sampling_metadata):
        sampler_rows.append(len(metadata.num_draft_tokens))
        return verifier(metadata, draft_probs, logits, sampling_metadata)

    drafter.dummy_run, drafter.model.compute_logits = recorded_dummy_run, recorded_logits
    forward_rows = _record_draft_forwards(drafter, lambda: phase[0])
    runner.rejection_sampler = recorded_verifier
    try:
        # 1. before initialize_from_config: every cache is vLLM's placeholder, no KV config
        caches = {n: m.kv_cache for n, m in attn.items()}
        kv_config = runner.kv_cache_config
        for m in attn.values():
            m.kv_cache = torch.tensor([])
        runner.kv_cache_config = None
        try:
            with LiveBytes() as profile_bytes:
                runner.profile_run()
        finally:
            for n, m in attn.items():
                m.kv_cache = caches[n]
            runner.kv_cache_config = kv_config
        profile_rows, profiled = max(logits_rows), len(logits_rows)
        # 2. capture, then the sampler and tree-step warm-up, as a GPU worker runs them
        before = [c.clone() for c in runner.kv_caches]
        phase[0] = "capture"
        runner._dummy_run(8, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True,
                          remove_lora=False, is_graph_capturing=True)
        phase[0] = "warm-up"
        max_reqs = min(runner.scheduler_config.max_num_seqs,
                       runner.scheduler_config.max_num_batched_tokens)
        _, last_hidden = runner._dummy_run(num_tokens=max_reqs, skip_eplb=True,
                                           cudagraph_runtime_mode=CUDAGraphMode.NONE)
        runner._dummy_sampler_run(hidden_states=last_hidden)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
    finally:  # back to the class methods and the runner's verifier
        del drafter.dummy_run, drafter.model.compute_logits, drafter.model.forward
        runner.rejection_sampler = verifier
    return {"drafter_calls": calls, "kv_unchanged_by_warm_ups": unchanged,
            "profile_logits_rows": profile_rows,
            "draft_logits_after_profile": logits_rows[profiled:],
            "max_num_seqs": runner.scheduler_config.max_num_seqs,
            "profile_batch_rows": runner.max_num_tokens,
            "draft_rows_bound": drafter.draft_rows_bound(),
            "warm_up_rows": drafter.warm_up_rows(),
            "profile_peak_bytes": profile_bytes.peak,
            "verify_logits_bytes": drafter.verify_rows_bound() * runner.model_config.get_vocab_size()
            * runner.model_config.dtype.itemsize,
            "verify_rows_bound": drafter.verify_rows_bound(),
            # the widest level: max_num_seqs x 6 rows of logits (dtype) and their fp32 copy
            "draft_level_bytes": runner.scheduler_config.max_num_seqs * 6
            * runner.model_config.get_vocab_size() * (runner.model_config.dtype.itemsize + 4),
            "penalty_counts_bytes": runner.scheduler_config.max_num_seqs
            * (runner.model_config.get_vocab_size() + 1) * 8,
            "draft_forward_rows": forward_rows,
            "sampler_warm_up_rows": max(sampler_rows)}


def test_auto_shape_greedy_identical(default_engine, prompts, plain, monkeypatch):
    """The default config ({"method": "subspec"}: auto width and adaptive depth): each step's
    shape comes from measured costs, requests send trees of different depths to verification
    (vLLM schedules what each gets), and the output is still plain decoding's."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    llm = default_engine
    result = timed_generate(llm, prompts, GREEDY)
    penalized = timed_generate(llm, prompts[:NUM_PENALIZED], PENALIZED)
    tuner = llm.collective_rpc(_tuner_state)[0]
    plain_greedy, plain_penalized = plain
    assert_identical(result.token_ids, plain_greedy.token_ids)
    assert_identical(penalized.token_ids, plain_penalized.token_ids)
    stats = result.stats
    # drafts were accepted, unless the measured rates chose plain decoding or drafting lost
    # against plain's measured rate (on this CPU SmolLM2's plain steps can be faster:
    # docs/shape_tuner.md, "Measured rates")
    assert stats.tau > 2.0 or tuner["measured_plain_wins"] or tuner["drafting_lost"], \
        (stats.tau, tuner)
    # the tuner measured both sides and explored, every width unless the measurements
    # stopped it (a verdict for plain, exploration that lost, or its allowance spent)
    assert tuner["verify_rows_seen"] and tuner["draft_passes_seen"] and tuner["widths_run"]
    assert tuner["widths_run"] == [1, 2, 4, 6] or tuner["measured_plain_wins"] \
        or tuner["exploration_lost"] or tuner["drafting_lost"], tuner
    # vLLM was sent fewer draft tokens than the 6 x 32 it reserves for (where it drafted: the
    # allowance may keep every step of this run plain after earlier tests' measured losses)
    assert stats.num_draft_tokens < stats.num_drafts * 6 * 32 or (
        stats.num_drafts == 0 and (tuner["drafting_lost"] or tuner["measured_plain_wins"]))


def test_request_features_in_the_default_config(default_engine, feature_matrix, monkeypatch):
    """The matrix on `{"method": "subspec"}` (auto shape); min_p and logit_bias are refused
    with vLLM's own message, as for every speculative method. The tuner decides with fixed
    costs with which it drafts (`model_costs_decide`): this machine's measured rates may
    keep a 29-request batch plain, and the matrix must run drafted."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    default_engine.collective_rpc(model_costs_decide, args=(True,))
    try:
        assert len(check_engine(default_engine, feature_matrix)) == 29
    finally:
        default_engine.collective_rpc(model_costs_decide, args=(False,))
    for refused in (dict(min_p=0.1), dict(logit_bias={11: 5.0})):
        with pytest.raises(VLLMValidationError,
                           match="not yet supported with speculative decoding"):
            default_engine.generate(["Hi"], SamplingParams(max_tokens=4, **refused),
                                    use_tqdm=False)


def test_draft_passes_padded_to_graph_buckets_stay_lossless(default_engine, prompts, plain):
    """On CUDA a compiled draft's passes run as captured PIECEWISE graphs: each forward's rows
    padded to the next capture size by vLLM's own `CudagraphDispatcher` (the drafter's
    `draft_bucket`), the padding rows writing no KV and attended by nothing. vLLM's CPU
    backend captures nothing, so here the drafter is given a real dispatcher with PIECEWISE
    keys at capture sizes 1, 2, 4, 8, 16, 24, 32 (past 32: eager, unpadded, as on CUDA past
    the largest size): every draft forward then runs padded, as on CUDA, and the output is
    still plain decoding's."""
    llm = default_engine
    llm.collective_rpc(_pad_draft_passes, args=(True,))
    llm.collective_rpc(model_costs_decide, args=(True,))  # it drafts, whatever the rates say
    try:
        result = timed_generate(llm, prompts, GREEDY)
        buckets = llm.collective_rpc(_draft_buckets_seen)[0]
        capture = llm.collective_rpc(_capture_calls)[0]
    finally:
        llm.collective_rpc(model_costs_decide, args=(False,))
        llm.collective_rpc(_pad_draft_passes, args=(False,))
    assert_identical(result.token_ids, plain[0].token_ids)
    padded = [(n, rows) for n, mode, rows in buckets if mode == "PIECEWISE"]
    assert all(rows == min(c for c in CAPTURE_SIZES if c >= n) for n, rows in padded)
    assert any(rows > n for n, rows in padded)  # some forwards really carried padding
    assert all(mode == "NONE" and rows == n for n, mode, rows in buckets if n > 32)
    # the runner's capture calls (`dummy_run(is_graph_capturing=True)`): a bucket gets one
    # eager forward, then the capturing one, both of its padded rows, writing no KV; a size
    # past the largest bucket captures nothing
    assert capture["forwards"][5] == [("NONE", 8), ("PIECEWISE", 8)]
    assert capture["forwards"][1000] == []
    assert capture["kv_unchanged"]


CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32]


def _pad_draft_passes(worker, on: bool) -> None:
    """Swap the drafter's dispatcher for vLLM's own with PIECEWISE keys (on) and back; record
    every draft forward's bucket meanwhile."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_subspec.vllm_hooks.runner import subspec_of

    drafter = subspec_of(worker).drafter
    if not on:
        drafter.cudagraph_dispatcher = drafter.saved_dispatcher
        del drafter.draft_bucket, drafter.saved_dispatcher
        return
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=CAPTURE_SIZES, max_cudagraph_capture_size=CAPTURE_SIZES[-1],
        splitting_ops=list(CompilationConfig._attention_ops))
    dispatcher = CudagraphDispatcher(SimpleNamespace(
        compilation_config=compilation, num_speculative_tokens=1, lora_config=None,
        scheduler_config=subspec_of(worker).scheduler_config))
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
    drafter.saved_dispatcher, drafter.cudagraph_dispatcher = \
        drafter.cudagraph_dispatcher, dispatcher
    bucket, drafter.buckets_seen = type(drafter).draft_bucket, []

    def recorded(num_tokens, use_cudagraphs=True):
        mode, rows = bucket(drafter, num_tokens, use_cudagraphs)
        drafter.buckets_seen.append((num_tokens, mode.name, rows))
        return mode, rows

    drafter.draft_bucket = recorded


def _record_draft_forwards(drafter, tag) -> list:
    """Record (tag(), rows) for every forward of the drafter's model, until
    `del drafter.model.forward` puts the class's forward back."""
    forward, seen = drafter.model.forward, []

    def recorded(input_ids, positions, *args, **kwargs):
        seen.append((tag(), input_ids.shape[0]))
        return forward(input_ids, positions, *args, **kwargs)

    drafter.model.forward = recorded
    return seen


def _capture_calls(worker) -> dict:
    import torch
    from vllm.forward_context import get_forward_context

    from vllm_subspec.vllm_hooks.runner import subspec_of

    runner = subspec_of(worker)
    drafter = runner.drafter
    before = [c.clone() for c in runner.kv_caches]
    seen = _record_draft_forwards(
        drafter, lambda: get_forward_context().cudagraph_runtime_mode.name)
    forwards = {}
    try:
        for size in (5, 1000):
            drafter.dummy_run(size, is_graph_capturing=True)
            forwards[size], seen[:] = list(seen), []
    finally:
        del drafter.model.forward
    return {"forwards": forwards,
            "kv_unchanged": all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))}


def _draft_buckets_seen(worker) -> list:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    return subspec_of(worker).drafter.buckets_seen


def test_auto_pauses_drafting_losslessly(default_engine, prompts, plain):
    """Where plain decoding is predicted faster, auto drafts nothing (empty draft lists: vLLM
    runs plain decoding steps) but for its probe steps (backing off); switching between
    plain steps and tree steps keeps the output plain decoding's. The tuner is given a cost
    model in which a draft pass costs a second and a verify a millisecond
    (`ShapeTuner.use_costs`); the steps are counted by the session's `StepStats`."""
    llm = default_engine  # its last user: the tuner is changed for good here
    try:
        timed_generate(llm, prompts[:2], GREEDY)  # explores every width (earlier tests did)
        before = llm.collective_rpc(predict_plain_faster)[0]
        result = timed_generate(llm, prompts, GREEDY)
        after = llm.collective_rpc(step_stats)[0]
    finally:  # before the module's next engine starts (the fixture's teardown is then a no-op)
        shutdown(llm)
    assert_identical(result.token_ids, plain[0].token_ids)
    plain_steps = after["plain_steps"] - before["plain_steps"]
    drafting = after["draft_steps"] - before["draft_steps"] - plain_steps
    assert plain_steps > 3 * drafting > 0, (plain_steps, drafting)


def test_requests_drop_out_of_later_draft_passes_losslessly(smollm2, prompts, plain,
                                                             monkeypatch):
    """A request whose tree no longer pays stops drafting while the rest of the batch goes on
    (the passes after it run over fewer requests: their own metadata, slots and tree rows).
    Forced here: every step plans a 6x8 tree, and at every depth the first request still
    drafting drops out, down to one; each request then sends its own depth to verification,
    and the output stays plain's."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable collective_rpc
    llm = make_llm(smollm2, {"method": "subspec", "tree_width": 6, "tree_depth": "auto",
                             "substitute_layers": "all"}, **FP32)
    try:
        llm.collective_rpc(_drop_one_request_per_depth)
        result = timed_generate(llm, prompts, GREEDY)
        dropped = llm.collective_rpc(_drop_outs_seen)[0]
    finally:
        shutdown(llm)
    assert_identical(result.token_ids, plain[0].token_ids)
    assert dropped["passes_after_a_drop_out"] > 20, dropped


def _drop_one_request_per_depth(worker) -> None:
    from vllm_subspec.step.tuner.policy import StepPlan
    from vllm_subspec.step.tree import TreeShape
    from vllm_subspec.vllm_hooks.runner import subspec_of

    tuner = subspec_of(worker).session.tuner
    tuner.drop_outs_seen = {"passes_after_a_drop_out": 0}

    def drafting_next(log_mass, width, reached):
        d = log_mass.shape[1] - 1
        candidates = [i for i, r in enumerate(reached) if r == d]
        going = candidates[1:] if len(candidates) > 1 else candidates
        if len(going) < len(reached):
            tuner.drop_outs_seen["passes_after_a_drop_out"] += 1
        return going

    tuner.plan_step = lambda batch_size, after_prompt=False: StepPlan(
        TreeShape(6, 8), adaptive=True, full_depth=False)
    tuner.drafting_next = drafting_next


def _drop_outs_seen(worker) -> dict:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    return subspec_of(worker).session.tuner.drop_outs_seen


def _tuner_state(worker) -> dict:
    from vllm_subspec.vllm_hooks.runner import subspec_of

    tuner = subspec_of(worker).session.tuner
    buckets = (1, 2, 4, 8, 16, 32, 64)
    return {"verify_rows_seen": any(v.known for v in tuner.verify.values()),
            "draft_passes_seen": any(d.known for d in tuner.draft_pass.values()),
            "widths_run": sorted(w for w, a in tuner.acceptance.items() if a.steps),
            "measured_plain_wins": any(tuner.guard.verdict(b) is False for b in buckets),
            "exploration_lost": any(tuner.guard.exploration_loses(b) for b in buckets),
            "drafting_lost": any(lost > 0 for lost in tuner.guard.lost.values())}
