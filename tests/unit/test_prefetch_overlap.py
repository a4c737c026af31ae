"""OverlappingPrefetchOffloader: vLLM's real PrefetchOffloader / _ModuleOffloader code on CPU.

Only the CUDA calls of vllm/model_executor/offloader/prefetch.py are replaced: `torch.cuda`
streams, events, stream contexts and capture state, and pinned memory, by `Sim`, a recorder
that runs every copy and every weight read immediately (CPU tensors: the data path, from
vLLM's CPU storage through its static buffers to the layer's parameter, is real) and keeps a
vector clock per stream, so that happens-before between a copy and a read is exact under the
stream/event rules. A CUDA graph is modelled as CUDA runs it: capture records the copies and
reads without running them; a replay runs them in order on the replay stream (a graph launch
is ordered after the stream's earlier work and before its later work), and a stream forked
into a capture must be joined before the capture ends. CUDAGraphWrapper's offloader calls
(compilation/cuda_graph.py:309-360) are mirrored by `Runner._graph`.

What is checked, for eager / FULL / PIECEWISE forwards and mixtures of them:
* every weight read sees its own layer (data), after the copy that brought it (RAW), and no
  copy overwrites a slot before every earlier reader of that slot (WAR);
* graph captures contain no copy of the first `s` offloaded layers; those copies run while the
  draft runs (neither ordered before nor after it) — and with vLLM's own offloader they do not;
* eager mode issues no extra copy.
"""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch
from torch import nn

from vllm_subspec.vllm_hooks import prefetch_overlap
from vllm_subspec.vllm_hooks.prefetch_overlap import OverlappingPrefetchOffloader

# ---- the recorder ----------------------------------------------------------------------


class Sim:
    def __init__(self):
        self.vc: dict[str, dict[str, int]] = {}
        self.trace: list[dict] = []
        self.compute = Stream(self, "compute")
        self.current = self.compute
        self.graph: list | None = None  # ops being captured
        self.pending: dict[str, int] = {}  # side streams forked into the capture: last op index
        self.bad_reads: list[tuple[int, int]] = []
        self.n_streams = 0
        self.slots: set[int] = set()  # data_ptr of every static buffer

    # stream state
    def _tick(self, stream) -> dict[str, int]:
        clock = self.vc[stream.name]
        clock[stream.name] += 1
        return dict(clock)

    @staticmethod
    def _merge(into: dict, other: dict) -> None:
        for k, v in other.items():
            into[k] = max(into.get(k, 0), v)

    def op(self, stream, kind, payload=None):
        if self.graph is not None:
            self._capture(stream, kind, payload)
        else:
            self._execute(stream, kind, payload)

    def _execute(self, stream, kind, payload):
        clock = self.vc[stream.name]
        if kind == "record":
            payload.vc, payload.captured = dict(clock), False
        elif kind == "wait_event":
            assert not payload.captured, "eager wait on an event recorded during capture"
            self._merge(clock, payload.vc)
        elif kind == "wait_stream":
            self._merge(clock, self.vc[payload.name])
        elif kind == "copy":
            dst, src = payload
            torch.Tensor.copy_(dst, src)
            self.trace.append(dict(kind="copy", stream=stream.name, slot=dst.data_ptr(),
                                   layer=int(src[0]), vc=self._tick(stream)))
        elif kind == "read":
            param, expected = payload
            seen = int(param.data[0])
            if seen != expected:
                self.bad_reads.append((expected, seen))
            self.trace.append(dict(kind="read", stream=stream.name, slot=param.data_ptr(),
                                   layer=expected, vc=self._tick(stream)))
        else:  # a compute-stream marker: "sample", "draft"
            self.trace.append(dict(kind=kind, stream=stream.name, vc=self._tick(stream)))

    def _capture(self, stream, kind, payload):
        index = len(self.graph)
        self.graph.append((kind, payload))
        if stream is not self.compute:
            self.pending[stream.name] = index
        if kind == "record":
            payload.captured, payload.capture_index = True, index
            payload.capture_stream = stream.name
        elif kind == "wait_event" and stream is self.compute and payload.captured:
            joined = payload.capture_stream
            if self.pending.get(joined, len(self.graph)) <= payload.capture_index:
                del self.pending[joined]
        elif kind == "wait_event":
            assert payload.captured or stream is self.compute, "side stream waits outside"

    @contextlib.contextmanager
    def capture(self):
        self.graph, self.pending = [], {}
        yield
        assert not self.pending, f"unjoined streams at capture end: {self.pending}"
        self.captured, self.graph = self.graph, None

    def replay(self, graph):
        for kind, payload in graph:
            if kind in ("copy", "read"):
                self._execute(self.current, kind, payload)

    def mark(self, kind):
        self.op(self.current, kind)

    # happens-before over the trace
    @staticmethod
    def hb(a, b) -> bool:
        return a["vc"][a["stream"]] <= b["vc"].get(a["stream"], 0)

    def check_hazards(self):
        last_copy, readers = {}, {}
        for e in self.trace:
            if e["kind"] == "copy":
                for r in readers.get(e["slot"], []):
                    assert self.hb(r, e), f"WAR: copy of layer {e['layer']} overwrites a slot " \
                                          f"layer {r['layer']} may still read"
                prev = last_copy.get(e["slot"])
                assert prev is None or self.hb(prev, e), "WAW"
                last_copy[e["slot"]], readers[e["slot"]] = e, []
            elif e["kind"] == "read" and e["slot"] in self.slots:  # (else a resident layer)
                c = last_copy[e["slot"]]
                assert c["layer"] == e["layer"], f"layer {e['layer']} read layer {c['layer']}"
                assert self.hb(c, e), f"RAW: layer {e['layer']} reads before its copy landed"
                readers[e["slot"]].append(e)
        assert not self.bad_reads, self.bad_reads


class Stream:
    def __init__(self, sim, name):
        self.sim, self.name = sim, name
        sim.vc[name] = {name: 0}

    def wait_event(self, event):
        self.sim.op(self, "wait_event", event)

    def wait_stream(self, other):
        self.sim.op(self, "wait_stream", other)

    def record_event(self, event=None):
        event = event or Event(self.sim)
        event.record(self)
        return event


class Event:
    def __init__(self, sim):
        self.sim, self.vc, self.captured = sim, {}, False

    def record(self, stream=None):
        self.sim.op(stream or self.sim.current, "record", self)


class SlotTensor(torch.Tensor):
    """vLLM's static GPU buffers: a copy into one goes through the recorder."""

    def copy_(self, src, non_blocking=False):
        SIM.op(SIM.current, "copy", (self, src))
        return self


class FakeCuda:
    def __init__(self, sim):
        self.sim = sim

    def Stream(self, *a, **k):  # noqa: N802
        self.sim.n_streams += 1
        return Stream(self.sim, f"copy{self.sim.n_streams}")

    def Event(self, *a, **k):  # noqa: N802
        return Event(self.sim)

    def current_stream(self, *a):
        return self.sim.current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.sim.current = self.sim.current, s
        try:
            yield
        finally:
            self.sim.current = prev

    def is_current_stream_capturing(self):
        return self.sim.graph is not None


class TorchProxy:
    """`torch` as prefetch.py sees it: CUDA replaced, the layer's device check satisfied, the
    static buffer pool's tensors recorded."""

    def __init__(self, sim):
        self.cuda = FakeCuda(sim)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*a, **k):
        return "accelerator"  # `device != torch.device("cpu")` (prefetch.py _ModuleOffloader)

    @staticmethod
    def empty_strided(*args, **kwargs):
        t = torch.empty_strided(*args, **kwargs)
        if "pin_memory" in kwargs:  # CPU storage
            return t
        SIM.slots.add(t.data_ptr())  # the static buffer pool
        return t.as_subclass(SlotTensor)


SIM: Sim


# ---- a model and a runner ----------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, idx):
        super().__init__()
        self.idx = idx
        self.weight = nn.Parameter(torch.full((4,), float(idx)), requires_grad=False)

    def forward(self, hidden):
        SIM.op(SIM.current, "read", (self.weight, self.idx))
        return hidden + 1


class Ctx:  # a forward context (only its identity matters here)
    pass


class Runner:
    def __init__(self, offloader, layers, overlap):
        self.offloader, self.layers, self.overlap = offloader, layers, overlap
        self.graphs: dict = {}

    def _run(self, layers):
        h = torch.zeros(2)
        for layer in layers:
            h = layer(h)

    def _graph(self, key, layers):
        """CUDAGraphWrapper.__call__'s offloader calls (cuda_graph.py:309-325, 358-361)."""
        from vllm.model_executor.offloader.base import get_offloader

        graph = self.graphs.get(key)
        if graph is None:
            get_offloader().sync_prev_onload()
            with SIM.capture():
                self._run(layers)
                get_offloader().join_after_forward()
            self.graphs[key] = SIM.captured
            return
        get_offloader().sync_prev_onload()
        SIM.replay(graph)

    def forward(self, mode, batch=1):
        from vllm.forward_context import override_forward_context

        with override_forward_context(Ctx()):
            if mode == "eager":
                self._run(self.layers)
            elif mode == "full":
                self._graph(("full", batch), self.layers)
            else:  # piecewise: one piece per layer, each joined at its end
                for i, layer in enumerate(self.layers):
                    self._graph(("pw", batch, i), [layer])

    def capture(self, mode, batch=1):
        """vLLM's _warmup_and_capture: an eager warm-up run, then the capture run."""
        self.forward("eager", batch)
        assert ("full", batch) not in self.graphs and ("pw", batch, 0) not in self.graphs
        self.forward(mode, batch)

    def draft_pieces(self, pieces: int, scoped: bool):
        """A draft forward as captured pieces of its own (PIECEWISE, one forward context), in
        the proposer's `drafting()` scope or not: each piece capture/replay calls the
        offloader's sync as CUDAGraphWrapper does. The draft's layers are resident (no read
        of a streamed slot)."""
        from vllm.forward_context import override_forward_context

        scope = self.overlap.drafting() if scoped and self.overlap else contextlib.nullcontext()
        with override_forward_context(Ctx()), scope:
            for i in range(pieces):
                self._graph(("draft", i), [])

    def step(self, mode, batch=1, propose=True, draft_layers=(), draft_pieces=0,
             scoped=True):
        """One engine step: verify forward, sampling, then (unless skipped) the proposer."""
        self.forward(mode, batch)
        SIM.mark("sample")
        if propose:
            if self.overlap is not None:
                self.overlap.start_before_draft()
            SIM.mark("draft")
            self._run([self.layers[i] for i in draft_layers])  # shared offloaded layers
            if draft_pieces:
                self.draft_pieces(draft_pieces, scoped)
            SIM.mark("draft")


@pytest.fixture
def make(monkeypatch):
    from vllm.model_executor.offloader import prefetch
    from vllm.model_executor.offloader.base import set_offloader

    def build(num_layers=6, group=1, in_group=1, step=2, overlap=True, use_ubatching=False):
        """The runner's offloader as SubSpec's runner installs it (overlap) or vLLM's own."""
        global SIM
        SIM = Sim()  # a fresh recorder (and streams) per offloader
        proxy = TorchProxy(SIM)
        monkeypatch.setattr(prefetch, "torch", proxy)
        monkeypatch.setattr(prefetch, "should_pin_memory", lambda: False)
        monkeypatch.setattr(prefetch_overlap, "torch", proxy)
        off = prefetch.PrefetchOffloader(group_size=group, num_in_group=in_group,
                                         prefetch_step=step)  # GPUModelRunner.__init__
        if overlap:  # SubSpecRunner.__init__
            off = OverlappingPrefetchOffloader.replacing(off, use_ubatching)
        set_offloader(off)
        layers = off.wrap_modules(iter([Layer(i) for i in range(num_layers)]))  # the model
        off.post_init()  # GPUModelRunner.load_model, after the drafter
        return Runner(off, layers, off if overlap and off.overlaps else None)

    yield build
    set_offloader(None)


def copies(kind_filter=None, since=0):
    return [e for e in SIM.trace[since:] if e["kind"] == "copy"
            and (kind_filter is None or kind_filter(e))]


def draft_marks():
    return [e for e in SIM.trace if e["kind"] == "draft"]


def concurrent(a, b):
    return not Sim.hb(a, b) and not Sim.hb(b, a)


# ---- tests -----------------------------------------------------------------------------


def test_it_replaces_only_vllms_prefetch_offloader_and_overlaps_a_shared_ring(make):
    from vllm.model_executor.offloader.base import NoopOffloader

    assert OverlappingPrefetchOffloader.replacing(NoopOffloader()) is None
    runner = make(num_layers=6, step=2)
    assert type(runner.offloader) is OverlappingPrefetchOffloader and runner.overlap is not None
    assert OverlappingPrefetchOffloader.replacing(runner.offloader) is None  # once
    assert make(num_layers=2, step=2).overlap is None  # every layer has its own slot


def test_micro_batching_keeps_vllms_behaviour(make):
    """With micro-batching (two threads running forwards) it issues no copy of its own: the
    same copies, in the same order, as vLLM's own offloader."""
    runs = []
    for overlap in (False, True):
        runner = make(overlap=overlap, use_ubatching=True)
        assert runner.overlap is None
        for mode in ("eager", "full", "eager"):
            runner.step(mode)
        runs.append([(e["stream"].rstrip("0123456789"), e["layer"]) for e in copies()])
    assert runs[0] == runs[1] and runs[0]


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_graph_mode_without_overlap_joins_refills_inside_the_verify(make, mode):
    """vLLM as it is: the refill copies are captured and joined before the graph ends, so none
    of them runs while the draft runs (the defect)."""
    runner = make(overlap=False)
    runner.capture(mode)
    start = len(SIM.trace)
    for _ in range(3):
        runner.step(mode)
    SIM.check_hazards()
    refills = copies(lambda e: e["layer"] < 2, since=start)
    assert len(refills) == 6  # captured in the graph, re-copied by every replay
    assert not any(concurrent(c, d) for c in refills for d in draft_marks())


def test_eager_without_overlap_already_overlaps_the_draft(make):
    runner = make(overlap=False)
    for _ in range(3):
        runner.step("eager")
    SIM.check_hazards()
    drafts = draft_marks()
    refills = [c for c in copies(lambda e: e["layer"] < 2)[2:]]  # after post_init's
    assert len(refills) == 6
    for i, c in enumerate(refills):
        assert concurrent(c, drafts[2 * (i // 2)])


@pytest.mark.parametrize("mode", ["full", "piecewise"])
@pytest.mark.parametrize("num_layers,group,in_group,step", [
    (6, 1, 1, 2), (7, 1, 1, 3), (8, 2, 1, 1), (5, 1, 1, 2), (4, 1, 1, 3), (12, 4, 3, 4)])
def test_graph_mode_refills_overlap_the_draft(make, mode, num_layers, group, in_group, step):
    runner = make(num_layers, group, in_group, step)
    ring = [m.module.idx for m in runner.offloader.module_offloaders]  # decoder layer per index
    n, s = len(ring), step
    runner.capture(mode)
    for graph in runner.graphs.values():  # no copy of a first-s layer is captured
        assert not [p for kind, p in graph if kind == "copy" and int(p[1][0]) in ring[:s]]
    start = len(SIM.trace)
    for _ in range(4):
        runner.step(mode)
    SIM.check_hazards()
    refilled = [j for j in range(s) if j + s < n]
    refills = copies(lambda e: e["layer"] in {ring[j] for j in refilled}, since=start)
    drafts = draft_marks()
    # per refilled slot: one copy at the first graph entry after the capture (the capture is
    # taken to have used the slots), then one before each of the 4 drafts, running with it
    assert len(refills) == len(refilled) * 5
    assert runner.overlap.counts["graph_entry"] == len(refilled)
    assert runner.overlap.counts["before_draft"] == len(refilled) * 4
    for c in refills[len(refilled):]:
        assert any(concurrent(c, d) for d in drafts)
    for c in refills[: len(refilled)]:  # the graph-entry ones are waited for by the verify
        assert not any(concurrent(c, d) for d in drafts)


def test_eager_mode_adds_no_copy(make):
    def run(overlap):
        runner = make(overlap=overlap)
        for _ in range(3):
            runner.step("eager")
        SIM.check_hazards()
        return [(e["layer"]) for e in copies()], runner

    baseline, _ = run(False)
    with_overlap, runner = run(True)
    assert with_overlap == baseline
    assert sum(runner.overlap.counts.values()) == 0


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_skipped_propose_is_covered_at_graph_entry(make, mode):
    runner = make()
    runner.capture(mode)
    runner.step(mode, propose=False)
    runner.step(mode, propose=False)
    runner.step(mode)
    SIM.check_hazards()
    # every forward not preceded by a draft: the first after the capture, and two more
    assert runner.overlap.counts["graph_entry"] == 3 * 2
    assert runner.overlap.counts["before_draft"] == 2


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_eager_forward_after_a_graph_forward(make, mode):
    """A batch larger than any captured size runs eagerly: its first wait fills the slots."""
    runner = make()
    runner.capture(mode)
    runner.step(mode, propose=False)
    runner.step("eager")
    runner.step(mode)
    runner.step("eager", propose=False)
    runner.step(mode)
    SIM.check_hazards()
    assert runner.overlap.counts["eager_wait"] == 2


def test_draft_running_a_shared_offloaded_layer(make):
    """substitute_layers listing fewer layers than are offloaded: the draft runs the target's
    hooked forward of an offloaded layer. vLLM's ring then leaves a slot holding the wrong layer
    for the next verify; with OverlappingPrefetchOffloader every reader gets its layer."""
    runner = make(num_layers=4, step=1, overlap=False)
    runner.step("eager", draft_layers=[2])
    runner.step("eager")
    assert (0, 3) in SIM.bad_reads  # the verify's layer 0 computed with layer 3's weights

    runner = make(num_layers=4, step=1)
    runner.step("eager", draft_layers=[2])
    runner.step("eager")
    runner.capture("full")
    runner.step("full", draft_layers=[1])
    runner.step("full", draft_layers=[3])
    runner.step("full")
    SIM.check_hazards()


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules(make, seed):
    rng = random.Random(seed)
    num_layers, step = rng.choice([(6, 2), (7, 3), (5, 1), (9, 4)])
    runner = make(num_layers=num_layers, step=step)
    for batch in (1, 2):
        runner.capture("full", batch)
        runner.capture("piecewise", batch + 10)
    for _ in range(25):
        kind = rng.choice(["eager", "full", "piecewise"])
        batch = rng.choice([1, 2]) + (10 if kind == "piecewise" else 0)
        draft = rng.sample(range(num_layers), rng.choice([0, 0, 0, 1]))
        runner.step(kind, batch, propose=rng.random() > 0.2, draft_layers=draft)
    SIM.check_hazards()


def test_capture_after_serving_starts(make):
    """A graph captured between served steps (vLLM captures once at start-up, but nothing here
    relies on it)."""
    runner = make()
    for mode, batch in itertools.product(["eager", "full"], [1, 2]):
        if mode != "eager":
            runner.capture(mode, batch)
        runner.step(mode, batch)
    SIM.check_hazards()


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_captured_draft_pieces_neither_wait_for_nor_disturb_the_refills(make, mode):
    """Draft passes replayed as CUDA graphs (each piece's replay calls `sync_prev_onload`):
    inside the proposer's `drafting()` scope the refill copies still run while the whole
    draft runs, and the next verify issues no extra copy. Outside it the draft's first replay
    waits for them (they end before the draft does) and the draft is taken for the next
    target forward (its slot bookkeeping reset: the verify copies the refilled layers again)."""
    def run(scoped):
        runner = make()
        runner.capture(mode)
        start = len(SIM.trace)
        for _ in range(3):
            runner.step(mode, draft_pieces=3, scoped=scoped)
        runner.step(mode, propose=False)
        SIM.check_hazards()
        ends = draft_marks()[1::2]  # the mark after each draft
        refills = copies(lambda e: e["layer"] in (0, 1), since=start)  # 6 layers, s = 2
        overlapped = sum(any(concurrent(c, end) for end in ends) for c in refills)
        return runner.overlap.counts, overlapped

    counts, overlapped = run(scoped=True)
    assert counts["draft_sync_skipped"] == 3 * 3  # every capture (step 1) and replay
    assert counts["before_draft"] == 2 * 3 and overlapped == 2 * 3
    assert counts["graph_entry"] == 2  # only the first verify after the capture
    counts, overlapped = run(scoped=False)
    assert overlapped == 0  # the draft waited for every refill
    assert counts["graph_entry"] > 2  # and took itself for the next target forward
