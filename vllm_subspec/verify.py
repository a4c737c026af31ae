"""One tree step, verify side, in run order: `TreeStep` owns a request's drafted tree from the moment
the proposer stores it until its accepted path's KV sits in place.

1. `store` (proposer, end of step N): the trees just drafted.
2. `prepare_verify` (after vLLM's `_prepare_inputs`, step N+1): each tree is consumed (verified
   at most once). vLLM laid the root and the scheduled nodes out as a chain: node i in slot L + i
   (kept: slots follow node order) at position L + i (replaced by L + depth(i)). The tree rows
   and their ancestor-only masks form this step's `TreePlan` (a chain's mask is the causal one:
   the backend's own rows stand, so a width-1 tree adds none).
3. `verify_forward` (around vLLM's `_model_forward`): the plan is active, scoped to that forward.
4. `__call__` (in place of vLLM's `RejectionSampler`, same call and output format): "sample, then
   match" on the target's logits at every node, then the KV compaction of each accepted path.

Sample, then match: the target's token is drawn at every node (argmax when greedy; else from the
request's own temperature / top-k / top-p distribution, with its seed); the walk starts at the
root and moves to the child whose token equals the draw at the current node, while there is one.
The draws along the path are emitted, the last one being the bonus token. Drawing at all nodes up
front is the same in distribution as drawing lazily along the walk (each node is visited at most
once), and every emitted token is a draw from the target at its exact context: the output is
plain ancestral sampling from the target whatever the draft proposed. A seeded request's draw at
depth j uses the noise of plain decoding's j-th draw from its generator (`SeededDraws`), so its
output is reproducible and equals a plain engine's seeded output up to numerical near-ties.

KV compaction right after the walk: the accepted nodes' KV (slots L + a_j) moves to L + j, j =
1..m, while the root L is known, every step, whether or not vLLM calls the drafter next (near
max_model_len it does not: `gpu_model_runner.py` 0.32.0 `_input_fits_in_drafter` :4288).

Scheduled drafts with no stored tree (vLLM skipped the drafter and scheduled its all-zero
placeholders, :4456-4466) are verified as what they are: a chain in vLLM's own layout.

Output rows are left-aligned emitted tokens padded with -1, as vLLM's sampler returns, so vLLM's
bookkeeping, scheduler and spec-decode metrics work unchanged (τ = emitted tokens per step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.penalties import apply_all_penalties

from vllm_subspec.tree import StoredTree, TreeBatch, TreeShape, accepted_path
from vllm_subspec.tree_attention import TreeMask, TreePlan, TreeRows, move_kv

PLACEHOLDER = -1
_SAMPLING_EPS = 1e-5


@dataclass
class VerifiedTree:
    """A request's tree in the step being verified."""

    tree: StoredTree
    root: int  # L: logical position of the root (the last step's bonus token)
    req_index: int  # the request's row in this step's batch
    compact: bool  # False for a chain in vLLM's layout: its path is already in place


def chain_tree(draft_token_ids: list[int]) -> StoredTree:
    """Drafts laid out as a chain (node i's parent is i - 1); the root token is never matched."""
    n = len(draft_token_ids)
    return StoredTree([0] + list(draft_token_ids), list(range(-1, n)),
                      torch.ones(n + 1, n + 1, dtype=torch.bool).tril())


class TreeStep:
    def __init__(self, runner, mask: TreeMask, tuner=None):
        self.runner = runner
        self.mask = mask  # shared with the target's attention layers (attached at load)
        self.tuner = tuner  # shape_tuner.ShapeTuner of an auto shape: told costs and outcomes
        self._verify_start: float | None = None
        self.verify_seconds: float | None = None  # the last tree verify: forward to walk
        self.drafted: dict[str, StoredTree] = {}  # stored by the proposer, not yet verified
        self.verifying: dict[str, VerifiedTree] = {}  # this step's trees
        self.plan: TreePlan | None = None  # this step's verify rows, until the forward
        # (attention impl, KV cache) of every decoder layer; set by the proposer at load
        self.kv_caches: Callable[[], list[tuple[object, torch.Tensor]]] | None = None

    # ---- 1. after drafting ---------------------------------------------------------------
    def store(self, req_ids: list[str], tree: TreeBatch,
              log_mass: torch.Tensor | None = None) -> None:
        """log_mass: [B, grown + 1] the tree's per-depth log frontier mass on the host, for an
        auto shape's tuner (read once by the proposer); None for a fixed shape."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        masses = log_mass.tolist() if log_mass is not None else [[] for _ in req_ids]
        self.drafted = {rid: StoredTree(tokens[i], parents[i], tree.mask[i], tree.shape.width,
                                        masses[i])
                        for i, rid in enumerate(req_ids)}

    # ---- 2. verify inputs ----------------------------------------------------------------
    def prepare_verify(self, scheduler_output) -> None:
        drafted, self.drafted = self.drafted, {}  # a tree is verified at most once
        self.verifying, self.plan = {}, None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return
        runner, batch = self.runner, self.runner.input_batch
        rows = []
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            scheduled = spec.get(req_id, ())
            n = len(scheduled)
            if n == 0:
                continue
            root = int(batch.num_computed_tokens_cpu[i])
            stored = drafted.get(req_id)
            if stored is None:  # placeholders of a skipped drafter: a chain, vLLM's layout
                self.verifying[req_id] = VerifiedTree(chain_tree(scheduled), root, i, False)
                continue
            q0 = int(runner.query_start_loc.np[i])
            depths = TreeShape(stored.width, n // stored.width + 1).depths()  # this step's k
            runner.positions[q0 + 1: q0 + 1 + n] = (root + depths[1: n + 1]).to(
                runner.positions.device)
            if stored.width > 1:  # a chain's mask is causal: the backend's rows stand
                rows.append(TreeRows(i, q0, root, stored.mask[: n + 1, : n + 1]))
            self.verifying[req_id] = VerifiedTree(stored, root, i, True)
        self.plan = TreePlan(rows) if rows else None

    # ---- 3. the verify forward -----------------------------------------------------------
    @contextlib.contextmanager
    def verify_forward(self):
        plan, self.plan = self.plan, None  # the plan belongs to exactly one forward
        drafted = any(v.compact for v in self.verifying.values())  # chains have no plan rows
        self._verify_start = time.perf_counter() if drafted else None
        with self.mask.active(plan):
            yield

    def take_verify_seconds(self) -> float | None:
        """The last tree verify's time (forward, sampling, walk), once."""
        seconds, self.verify_seconds = self.verify_seconds, None
        return seconds

    # ---- 4. walk, emit, compact ----------------------------------------------------------
    def __call__(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        num_draft = list(metadata.num_draft_tokens)
        req_ids = self.runner.input_batch.req_ids[: len(num_draft)]
        trees = [self.verifying.get(rid) if n else None for rid, n in zip(req_ids, num_draft)]
        rows = torch.tensor([n + 1 for n in num_draft])
        raw_logits = logits
        logits = constrain(logits, rows, trees, num_draft, sampling_metadata)
        # node depths, needed only where a generator's draws are replayed per depth
        seeded_depths = {r: trees[r].tree.depths()[: num_draft[r] + 1] if trees[r] else [0]
                         for r in sampling_metadata.generators}
        draws, seeded = draw_target_tokens(logits, rows, seeded_depths, sampling_metadata,
                                           self.runner.sampler.topk_topp_sampler)
        draws = draws.tolist()

        width = max(num_draft) + 1
        out = torch.full((len(num_draft), width), PLACEHOLDER, dtype=torch.int32)
        # logits row at which each emitted token was drawn (for logprobs); padding reads row 0
        drawn_at = torch.zeros((len(num_draft), width), dtype=torch.int64)
        moves = []
        start = 0
        for i, (v, n) in enumerate(zip(trees, num_draft)):
            target = draws[start: start + n + 1]
            path = accepted_path(v.tree.tokens[: n + 1], v.tree.parents[: n + 1], target) \
                if v is not None else []
            nodes = [0] + path  # emitted token j is the target's draw at nodes[j]
            out[i, : len(nodes)] = torch.tensor([target[a] for a in nodes], dtype=torch.int32)
            drawn_at[i, : len(nodes)] = start + torch.tensor(nodes)
            if i in seeded:  # the generator has made one draw per emitted token, as plain's
                seeded[i].commit(len(nodes))
            start += n + 1
            if v is not None and v.compact and path != list(range(1, len(path) + 1)):
                moves.append((v.req_index, v.root, path))
            if self.tuner is not None and v is not None and v.compact:
                self.tuner.observe_tree(v.tree.width, v.tree.level_log_mass, len(path),
                                        n // v.tree.width)
        if self.tuner is not None and self._verify_start is not None:
            widths = {v.tree.width for v in trees if v is not None and v.compact}
            if len(widths) == 1:  # one step drafts one width; its cost is that width's
                self.verify_seconds = time.perf_counter() - self._verify_start
                self.tuner.observe_verify(widths.pop(), start, self.verify_seconds)
        self._verify_start = None
        self.verifying = {}
        self._compact(moves)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw_logits, drawn_at, out,
                                      sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=logprobs)

    def _compact(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """Move each accepted path's KV (slots L + a_j) to slots L + j, j = 1..m, in every layer,
        so the next step's prefix is contiguous."""
        if not moves:
            return
        kv_caches = self.kv_caches()
        num_reqs = self.runner.input_batch.num_reqs
        # the block table this step's attention metadata was built from
        block_table = self.runner.input_batch.block_table[0].get_device_tensor(num_reqs)
        for req_index, root, path in moves:
            row = block_table[req_index]
            src = root + torch.tensor(path, dtype=torch.int64, device=row.device)
            dst = root + torch.arange(1, len(path) + 1, dtype=torch.int64, device=row.device)
            move_kv(kv_caches, row, src, dst)

    def _logprobs(self, logits, drawn_at, tokens, max_num_logprobs):
        """Logprobs of the emitted tokens (and the top ones) in vLLM's padded spec-decode
        layout: one row per output slot, padding rows filtered out by vLLM's parse_output.
        Raw logprobs (vLLM's default `logprobs_mode`), from the target's logits where each
        token was drawn, as a plain engine reports them."""
        sampler = self.runner.sampler
        rows = logits[drawn_at.flatten().to(logits.device)].float()
        values = rows if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(rows)
        ids = tokens.flatten().clamp(min=0).to(torch.int64).to(logits.device)
        return sampler.gather_logprobs(values, max_num_logprobs, ids)


def constrain(logits: torch.Tensor, rows: torch.Tensor, trees: list[VerifiedTree | None],
              num_draft: list[int], sampling_metadata) -> torch.Tensor:
    """What vLLM's rejection sampler applies to a chain's target logits, per tree node:
    repetition/frequency/presence penalties over the request's output plus the node's path, and
    allowed_token_ids. (Bad words and min_tokens are not applied to tree nodes.)

    logits: [sum(rows), V]; rows: [num_reqs] logits rows per request (its nodes, root first)."""
    allowed = sampling_metadata.allowed_token_ids_mask
    if sampling_metadata.no_penalties and allowed is None:
        return logits
    row_request = torch.repeat_interleave(torch.arange(len(num_draft)), rows).to(logits.device)
    logits = logits.to(torch.float32, copy=True)  # the raw logits stay for logprobs
    if not sampling_metadata.no_penalties:
        histories = []
        for i, (v, n) in enumerate(zip(trees, num_draft)):
            done = list(sampling_metadata.output_token_ids[i])
            histories += [done + (v.tree.path_tokens(r) if v else []) for r in range(n + 1)]
        logits = apply_all_penalties(
            logits, sampling_metadata.prompt_token_ids[row_request],
            sampling_metadata.presence_penalties[row_request],
            sampling_metadata.frequency_penalties[row_request],
            sampling_metadata.repetition_penalties[row_request], histories)
    if allowed is not None:
        logits.masked_fill_(allowed[row_request], float("-inf"))
    return logits


class SeededDraws:
    """A seeded request's generator over one verify step. The draw at a depth-j node is plain
    decoding's j-th sampling draw from this step on: the generator state after j of plain's draws
    is recorded for j = 0..max depth + 1 (each draw made by vLLM's own sampler on a dummy row, so
    it consumes the generator exactly as a plain step does on this platform: one `randint` on
    CPU, `topk_topp_sampler.py` 0.32.0 :343-348; one vocabulary row of `exponential_` in
    `random_sample` :575-576 elsewhere). Once the walk has emitted e tokens, the generator is set
    to the state after e draws. So the emitted tokens use exactly the noise a plain engine would,
    whatever the tree's shape: seeded output is reproducible, and equal to plain seeded output up
    to numerical near-ties of the logits. All nodes at one depth share a draw; that keeps it
    exact in distribution, because the walk visits at most one node per depth."""

    def __init__(self, generator: torch.Generator, num_draws: int, topk_topp_sampler,
                 vocab_size: int, device: torch.device):
        self.generator = generator
        self.states = [generator.get_state()]
        dummy = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_draws):
            topk_topp_sampler(dummy.clone(), {0: generator}, None, None)
            self.states.append(generator.get_state())

    def at_depth(self, depth: int) -> torch.Generator:
        """A generator in the state of plain's draw for a node at `depth`."""
        g = torch.Generator(device=self.generator.device)
        g.set_state(self.states[depth])
        return g

    def commit(self, num_emitted: int) -> None:
        self.generator.set_state(self.states[num_emitted])


def draw_target_tokens(logits: torch.Tensor, rows_per_request: torch.Tensor,
                       seeded_depths: dict[int, list[int]], sampling_metadata,
                       topk_topp_sampler) -> tuple[torch.Tensor, dict[int, SeededDraws]]:
    """One target token per logits row, as vLLM's Sampler.sample draws it (sampler.py 0.32.0
    :247-305): argmax for greedy requests; else temperature, then vLLM's own TopKTopPSampler
    (top-k/top-p and the platform's draw). Seeded requests draw per depth (`SeededDraws`),
    which is returned per request index so the walk can commit the draws it used.

    logits: [rows, V]; rows_per_request: [num_reqs]; seeded_depths: for each seeded request
    (batch index), the depth of each of its rows."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy, {}
    row_request = torch.repeat_interleave(torch.arange(len(rows_per_request)), rows_per_request)
    expand = lambda t: None if t is None else t[row_request.to(t.device)]  # noqa: E731
    temperature = expand(sampling_metadata.temperature)
    is_greedy = temperature < _SAMPLING_EPS
    scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)
    offsets = (torch.cumsum(rows_per_request, 0) - rows_per_request).tolist()
    seeded, row_generators = {}, {}
    for r, gen in sampling_metadata.generators.items():
        a, depths = offsets[r], seeded_depths[r]
        seeded[r] = SeededDraws(gen, max(depths) + 1, topk_topp_sampler, logits.shape[-1],
                                logits.device)
        row_generators.update({a + j: seeded[r].at_depth(d) for j, d in enumerate(depths)})
    sampled, _ = topk_topp_sampler(scaled, row_generators, expand(sampling_metadata.top_k),
                                   expand(sampling_metadata.top_p))
    return torch.where(is_greedy, greedy, sampled), seeded
