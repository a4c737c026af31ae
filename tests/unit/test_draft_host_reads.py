"""Nothing inside a step's draft passes reads the device or copies to it and waits.

On CUDA a host read (`.item()`, `.tolist()`, `.cpu()`, a device tensor in an `if`) waits for the
stream, and so does a plain host-to-device copy (`torch.tensor(list, device=...)`, or a CPU
index tensor indexing a device tensor). Without a GPU, the step code (`step/draft.py`,
`step/tree.py`) runs here over PyTorch's "meta" device standing in for it: meta tensors have no
data, so any host read raises, and a dispatch mode records every operator whose tensors sit on
both the host and the device (a host-to-device copy), which must be non-blocking (from pinned
memory on CUDA: `draft.device_index`). The passes are a stub (`MetaPasses`): the real ones
build vLLM metadata on top of the same code.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm_subspec.step.draft import draft_chain, draft_tree
from vllm_subspec.step.tree import TreeShape
from vllm_subspec.step.tree_attention import TreeRows, active_tree_plan

VOCAB = 50
META = torch.device("meta")


class MetaPasses:
    """`DraftPasses` on the meta device: hidden states and logits without values, roots known
    to the host only through their bounds (as vLLM's `seq_lens_cpu_upper_bound`)."""

    on_device = True

    def __init__(self, bounds: list[int], max_model_len: int = 1000, max_rows: int = 1000):
        self.bounds = bounds
        self.batch_size = len(bounds)
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self.roots_seen = []  # each level pass's tree-row prefix lengths
        self.copies = []  # depths of the frontier masses copied to the host
        self.polls_to_land = 1

    @staticmethod
    def _hidden(rows: int) -> torch.Tensor:
        return torch.empty(rows, 16, device=META)

    def logits(self, hidden, lm_head):
        return torch.empty(hidden.shape[0], VOCAB, device=META)

    def bonus_pass(self, next_token_ids):
        return self._hidden(self.batch_size), torch.empty(self.batch_size, dtype=torch.int64,
                                                          device=META)

    def root_bounds(self, roots):
        return list(self.bounds)

    def chain_pass(self, index, input_ids):
        return self._hidden(input_ids.shape[0])

    def tree_rows(self, row, q_start, request, root, mask):
        return TreeRows(row, q_start, root, mask)

    def level_pass(self, depth, width, tokens, active):
        plan = active_tree_plan()
        self.roots_seen.append([r.prefix_len for r in plan.rows] if plan else None)
        return self._hidden(tokens.shape[0])

    def copy_to_host(self, tensor):
        self.copies.append(tensor.shape[1] - 1)  # the depth of the masses copied
        return LandsLater(tensor.shape, polls=self.polls_to_land)

    def synchronize(self):
        raise AssertionError("a draft step waited for the device")


class LandsLater:
    """`draft.HostCopy` on the meta device: ready at the `polls`-th `ready()` (a copy still in
    flight at the checks before), its value a host tensor of the shape copied."""

    def __init__(self, shape, polls: int):
        self.value = torch.zeros(shape)
        self.polls = polls

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


class HostDeviceTraffic(TorchDispatchMode):
    """Records operators that mix host and device tensors (0-d host tensors are scalars,
    passed by value), and whether their copies are non-blocking. Tensors made from host data
    straight on the device (`torch.tensor(values, device=...)`: a blocking copy below the
    dispatcher) are caught one level up (`_FactoryCopies`)."""

    def __init__(self):
        super().__init__()
        self.blocking, self.non_blocking = [], []
        self._factories = _FactoryCopies(self.blocking)

    def __enter__(self):
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._factories.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)
        device = any(t.device.type == "meta" for t in tensors) or \
            kwargs.get("device") == META
        if host and device:
            (self.non_blocking if kwargs.get("non_blocking") else self.blocking).append(
                str(func))
        return func(*args, **kwargs)


class _FactoryCopies(TorchFunctionMode):
    def __init__(self, blocking: list):
        super().__init__()
        self.blocking = blocking

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and \
                torch.device(kwargs.get("device") or "cpu").type == "meta":
            self.blocking.append(func.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("kept", [0, 2])
@pytest.mark.parametrize("case", ["full", "near_max_model_len", "split_levels"])
def test_a_tree_step_reads_nothing_from_the_device_inside_its_passes(case, kept):
    """A fixed-shape tree step over 3 requests: all drafting to the end; one stopping early
    at max_model_len (the active set changes: a new index tensor); levels wider than one
    forward (one index tensor per group). kept: a compared step's hidden states of the first
    requests (`keep_hidden`), kept on the device."""
    shape = TreeShape(3, 4)
    passes = MetaPasses([5, 20, 9], max_model_len={"near_max_model_len": 30}.get(case, 1000),
                        max_rows={"split_levels": 7}.get(case, 1000))
    with HostDeviceTraffic() as traffic:
        draft = draft_tree(passes, torch.zeros(3, dtype=torch.int64, device=META), shape,
                           temperature=1.0, keep_hidden=kept)
    assert draft.tree.tokens.device == META
    if kept:
        assert draft.node_hidden.shape == (kept, 1 + 3 * 4, 16)
        assert draft.node_hidden.device == META
    else:
        assert draft.node_hidden is None
    assert traffic.blocking == []
    assert draft.level_forwards == (6 if case == "split_levels" else 3)
    # the roots of the tree rows stayed on the device: the host never learned them
    assert all(isinstance(p, torch.Tensor) and p.device == META
               for level in passes.roots_seen for p in level)
    if case == "full":
        assert draft.reached == [4, 4, 4] and traffic.non_blocking == []
    if case == "near_max_model_len":  # request 1 (bound 20) stops after depth 3: 20 + 4*3 >= 30
        assert draft.reached == [4, 3, 4]
        assert traffic.non_blocking, "the changed active set was copied to the device"
    if case == "split_levels":  # 3 requests x 3 rows, 7 rows per forward: groups [0, 1], [2]
        assert [len(level) for level in passes.roots_seen] == [2, 1] * 3
        assert len(traffic.non_blocking) == 6  # one index tensor per group and level


def test_a_chain_step_reads_nothing_from_the_device():
    passes = MetaPasses([5, 20])
    with HostDeviceTraffic() as traffic:
        chain = draft_chain(passes, torch.zeros(2, dtype=torch.int64, device=META), 6)
    assert chain.tokens.shape == (2, 6) and chain.tokens.device == META
    assert traffic.blocking == [] and traffic.non_blocking == []


def test_the_meta_device_catches_a_host_read():
    """The check itself: a host read inside a step fails here, as it would sync on CUDA."""
    passes = MetaPasses([5, 20])
    passes.root_bounds = lambda roots: roots.tolist()  # what draft_tree did before
    with pytest.raises(NotImplementedError, match="meta"):
        draft_tree(passes, torch.zeros(2, dtype=torch.int64, device=META), TreeShape(2, 3),
                   temperature=1.0)


@pytest.mark.parametrize("copy", ["host index", "tensor from a list"])
def test_the_traffic_check_catches_a_blocking_copy(copy):
    with HostDeviceTraffic() as traffic:
        x = torch.zeros(4, device=META)
        if copy == "host index":  # a host index into a device tensor: copied, waited for
            x[torch.tensor([0, 2])] = 1.0
        else:  # what draft_tree did when its active set changed
            torch.tensor([0, 2], device=META)
    assert traffic.blocking


@pytest.mark.parametrize("polls", [1, 2])
def test_the_adaptive_stop_reads_landed_masses_without_waiting(polls):
    """An auto depth's `drafting_next` on a device: every 4 depths a non-blocking copy of the
    masses starts, and a later check hands them over once landed (here: at the first or the
    second poll); nothing waits. Request 0 is dropped at the first masses seen, from the
    depth they were taken at, acting that many checks late; the rest draft to the end."""
    shape = TreeShape(2, 16)
    passes = MetaPasses([5, 20, 9])
    passes.polls_to_land = polls
    asked = []

    def drafting_next(log_mass, reached):
        asked.append((log_mass.shape[1] - 1, list(reached)))
        return [i for i, r in enumerate(reached) if r == log_mass.shape[1] - 1 and i != 0]

    with HostDeviceTraffic() as traffic:
        draft = draft_tree(passes, torch.zeros(3, dtype=torch.int64, device=META), shape,
                           temperature=1.0, drafting_next=drafting_next)
    assert traffic.blocking == []
    # a copy starts at each check with none in flight (depths 4, 8, 12 or 4, 12) and is read at
    # the first later check that finds it landed (the last one: no check after it)
    landed = {1: [(4, [4, 4, 4]), (8, [8, 8, 8])], 2: [(4, [4, 4, 4])]}[polls]
    assert asked == landed
    assert passes.copies == ([4, 8, 12] if polls == 1 else [4, 12])
    # request 0 stops at the check that saw depth 4's masses: depth 8 (or 12 if it landed late)
    assert draft.reached == [8 if polls == 1 else 12, 16, 16]


class HostPasses(MetaPasses):
    """`MetaPasses` whose tensors hold values (on the host) while it says it is a device:
    a blocking read returns them; its copies never land."""

    @staticmethod
    def _hidden(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 16)

    def logits(self, hidden, lm_head):
        return torch.zeros(hidden.shape[0], VOCAB)

    def bonus_pass(self, next_token_ids):
        return self._hidden(self.batch_size), torch.tensor(self.bounds)


def test_tensor_parallel_reads_wait_so_every_rank_checks_at_the_same_depths():
    """With blocking reads (tensor parallelism: when a copy lands is one rank's timing) the
    adaptive stop sees each check's own masses, whatever the copies do: the same depths on
    every rank."""
    passes = HostPasses([5, 20, 9])
    passes.polls_to_land = 10 ** 6  # a non-blocking copy would never be read
    asked = []

    def drafting_next(log_mass, reached):
        asked.append(log_mass.shape[1] - 1)
        return [i for i, r in enumerate(reached) if r == log_mass.shape[1] - 1 and i != 0]

    draft = draft_tree(passes, torch.zeros(3, dtype=torch.int64), TreeShape(2, 16),
                       temperature=1.0, drafting_next=drafting_next, blocking_reads=True)
    assert asked == [4, 8, 12] and passes.copies == []
    assert draft.reached == [4, 16, 16]  # request 0 stops at the first check itself
    unshared = []
    draft_tree(passes, torch.zeros(3, dtype=torch.int64), TreeShape(2, 16), temperature=1.0,
               drafting_next=lambda m, r: unshared.append(1) or [0, 1, 2])
    assert unshared == []  # non-blocking: no copy ever landed, so no check was read
