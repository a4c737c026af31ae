"""The CUDA schedule of head starts (vllm_hooks/head_start_stream.py) on a vector-clock model of
streams and events: the real `HeadStartStream` drives a model of `torch.cuda` (streams,
events, `wait_event`, stream contexts, with CUDA's ordering rules), and every KV access of a
step is recorded where the runner issues it, with the slots the real `HeadStart` computes:

* compute stream: the branch copies, the verify forward (writes L .. L + n, reads its context),
  the walk's accepted-path move (before the join: the sampling and the walk do not wait for
  the head starts) and the confirmed head starts' move, the next step's drafting;
* head-start stream: the leaf pass, the predicted root's pass and the level passes (each
  writes its nodes' slots and reads the prefix, its frame and the head tree; the model reads
  the whole head tree, a superset of any row's ancestors).

Checked over several steps: every two accesses of one slot from different streams, one a
write, are ordered by happens-before; and the head-start passes are not ordered against the
verify forward (they can overlap it). The checker is shown to fail for a schedule without the
wait for the branch copies, without the join before the walk, and for passes that would read
a verify slot. The draft's weight reads against vLLM's offloader: test_prefetch_overlap.py.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest

from vllm_subspec.step.head_start import HeadStart
from vllm_subspec.vllm_hooks.head_start_stream import HeadStartStream


class Model:
    """Streams with vector clocks; an access ticks its stream and keeps the clock."""

    def __init__(self):
        self.clocks: dict[str, dict[str, int]] = {}
        self.compute = Stream(self, "compute")
        self.current = self.compute
        self.accesses: list[tuple[str, dict[str, int], str, frozenset, str]] = []

    def access(self, kind: str, slots, what: str) -> None:
        clock = self.clocks[self.current.name]
        clock[self.current.name] += 1
        self.accesses.append((self.current.name, dict(clock), kind, frozenset(slots), what))

    @staticmethod
    def hb(a, b) -> bool:
        return a[1][a[0]] <= b[1].get(a[0], 0)

    def races(self) -> list[tuple[str, str]]:
        out = []
        for a, b in itertools.combinations(self.accesses, 2):
            if a[0] != b[0] and "w" in (a[2], b[2]) and a[3] & b[3] \
                    and not (self.hb(a, b) or self.hb(b, a)):
                out.append((a[4], b[4]))
        return out

    def concurrent(self, what_a: str, what_b: str) -> bool:
        a = [x for x in self.accesses if x[4] == what_a]
        b = [x for x in self.accesses if x[4] == what_b]
        return any(not (self.hb(x, y) or self.hb(y, x)) for x in a for y in b)


class Stream:
    def __init__(self, model: Model, name: str):
        self.model, self.name = model, name
        model.clocks[name] = {name: 0}

    def wait_event(self, event) -> None:
        clock = self.model.clocks[self.name]
        for k, v in event.clock.items():
            clock[k] = max(clock.get(k, 0), v)


class Event:
    def __init__(self, model: Model):
        self.model, self.clock = model, {}

    def record(self, stream=None) -> None:
        stream = stream or self.model.current
        self.clock = dict(self.model.clocks[stream.name])


class FakeCuda:
    def __init__(self, model: Model):
        self.model, self.streams = model, 0

    def Stream(self):  # noqa: N802
        self.streams += 1
        return Stream(self.model, f"side{self.streams}")

    def Event(self):  # noqa: N802
        return Event(self.model)

    def current_stream(self):
        return self.model.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.model.current = self.model.current, s
        try:
            yield
        finally:
            self.model.current = before


def head_passes(model: Model, head: HeadStart, levels: int, frame_slots: set[int]) -> None:
    """The head start's passes, as VllmHeadPasses issues them (slots from `head`)."""
    prefix = set(range(head.root))
    nodes = 1 + (levels - 1) * head.width
    model.access("w", {head.leaf_slot}, "head")
    model.access("r", prefix | frame_slots, "head")
    for i in range(nodes):  # the root, then each level's nodes (the whole tree: a superset)
        model.access("w", {head.node_slot(i)}, "head")
        model.access("r", prefix | frame_slots | {head.node_slot(j) for j in range(nodes)},
                     "head")


def run_steps(stream_cls=HeadStartStream, steps: int = 3, hit: bool = True,
              read_verify_slots: bool = False, join: bool = True) -> Model:
    model = Model()
    cuda = FakeCuda(model)
    hs = stream_cls(None, cuda=cuda)
    k, depth, levels, root = 3, 4, 3, 100
    n = k * depth
    for _ in range(steps):
        branch = [0, 2, 5, 8, 11]
        head = HeadStart("a", 0, root, branch, 7, root + n + 1, k)
        src, dst = head.branch_copy()
        # prepare_verify: the branch copies, then the event the head passes wait for
        model.access("r", set(src.tolist()), "branch copy")
        model.access("w", set(dst.tolist()), "branch copy")
        hs.inputs_copied()
        # the verify forward on the compute stream
        model.access("w", set(range(root, root + n + 1)), "verify")
        model.access("r", set(range(root + n + 1)), "verify")
        # once it is queued: the head starts, on their stream
        frame = head.frame()
        frame_slots = {root + j for j in range(len(frame)) if frame[j]}
        if read_verify_slots:
            frame_slots |= set(range(root, root + n + 1))
        with hs.drafting():
            head_passes(model, head, levels, frame_slots)
        # the sampler: the draws, the walk, the accepted path's KV move, then the join before
        # the head starts' drafts are read or moved
        model.access("r", set(), "walk")
        path = branch[1:] if hit else branch[1:3]
        model.access("r", {root + a for a in path}, "accepted move")
        model.access("w", {root + 1 + j for j in range(len(path))}, "accepted move")
        if join:
            hs.join()
        if hit:
            s, d = head.next_tree_copy(levels)
            model.access("r", set(s.tolist()), "next tree copy")
            model.access("w", set(d.tolist()), "next tree copy")
        new_root = root + len(path) + 1
        # the next step's drafting on the compute stream (its tree's slots)
        model.access("w", set(range(new_root, new_root + 1 + n)), "draft")
        model.access("r", set(range(new_root + 1 + n)), "draft")
        root = new_root
    return model


@pytest.mark.parametrize("hit", [True, False])
def test_the_head_start_schedule_orders_every_kv_conflict_and_overlaps_the_verify(hit):
    model = run_steps(hit=hit)
    assert not model.races()
    assert model.concurrent("head", "verify")  # the passes can run while the verify runs
    assert model.concurrent("head", "accepted move")  # ... and while the walk moves KV
    assert any(a[0] != "compute" for a in model.accesses)


class NoWait(HeadStartStream):
    """The passes wait for an event that was never recorded: they are not ordered after the
    branch copies."""

    def inputs_copied(self):
        self._inputs = self.cuda.Event()


def test_the_checker_finds_the_races_of_a_broken_schedule():
    with pytest.raises(RuntimeError, match="before their branch copies"):
        run_steps(type("Unready", (HeadStartStream,), {"inputs_copied": lambda self: None}))
    assert ("branch copy", "head") in run_steps(NoWait).races()
    assert ("head", "next tree copy") in run_steps(join=False).races()
    races = run_steps(read_verify_slots=True).races()
    assert ("verify", "head") in races
