"""The draft's host-memory plan on CPU: what the substitutes will take (equal to the kernels'
real tensors), dense twins only within `cpu_draft_memory`, and one clear error, before any
quantization, when the KV cache would not fit."""

import pytest
import torch
from decoder_stub import decoder_stub

import vllm_subspec.draft_model.dense_twin as dense_twin
import vllm_subspec.draft_model.substitute_set as substitute_set
from vllm_subspec.config import SubSpecConfigError, SubSpecOptions
from vllm_subspec.draft_model.host_memory import plan_host_memory, substitute_bytes, twin_bytes
from vllm_subspec.draft_model.kernels import Int4CpuKernel
from vllm_subspec.draft_model.quantize import QuantizedWeight
from vllm_subspec.draft_model.substitute import substitute_from_quantized
from vllm_subspec.draft_model.substitute_set import build_substitutes

CPU = torch.device("cpu")


@pytest.mark.parametrize("bits, shape", [(4, (192, 256)), (4, (40, 128)), (3, (64, 128))])
def test_planned_bytes_are_the_kernels_bytes(bits, shape):
    n, k = shape
    qw = QuantizedWeight(codes=torch.randint(0, 2**bits, (n, k), dtype=torch.uint8),
                         scale=torch.rand(n, k // 64), zero=torch.rand(n, k // 64), bits=bits,
                         group_size=64)
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    sub = substitute_from_quantized(qw, linear, CPU, "auto")  # no max_rows: no twin
    assert sub.nbytes() == substitute_bytes(n, k, bits, 64)
    assert isinstance(sub.kernel, Int4CpuKernel) == (bits == 4 and n % 16 == 0)


def test_the_twin_budget_is_the_smaller_of_the_fraction_and_the_kv_room():
    shapes = [(256, 128)] * 4
    subs = 4 * substitute_bytes(256, 128, 4, 64)
    plan = plan_host_memory(shapes, 0.4, 4, 64, target_bytes=10**6, kv_room=None, kv_needed=0)
    assert plan.substitute_bytes == subs and plan.twin_budget == 400_000 - subs
    tight = plan_host_memory(shapes, 0.4, 4, 64, target_bytes=10**6, kv_room=subs + 50_000,
                             kv_needed=30_000)
    assert tight.twin_budget == 20_000
    assert tight.take_twin(15_000) and not tight.take_twin(15_000) and tight.take_twin(5_000)
    none = plan_host_memory(shapes, 0.0, 4, 64, target_bytes=10**6, kv_room=None, kv_needed=0)
    assert none.twin_budget == 0 and not none.take_twin(1)


def test_no_room_for_the_kv_cache_fails_with_the_numbers_and_the_settings():
    shapes = [(4096, 4096)] * 8
    subs = 8 * substitute_bytes(4096, 4096, 4, 64)
    with pytest.raises(SubSpecConfigError) as e:
        plan_host_memory(shapes, 0.4, 4, 64, target_bytes=2**30, kv_room=subs + 2**20,
                         kv_needed=2**21)
    msg = str(e.value)
    assert f"{subs / 2**30:.2f} GiB" in msg and "gpu_memory_utilization" in msg
    assert "max_model_len" in msg and "substitute_layers" in msg


def test_twins_are_kept_in_layer_order_while_they_fit(monkeypatch):
    """Every shape would want a twin (crossover forced to 2 rows); the budget holds three."""
    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *a: 2)
    model = decoder_stub(2, 128, seed=0)
    options = SubSpecOptions.from_dict({"quantizer": "rtn", "substitute_cache": False,
                                        "draft_lm_head": "target"})
    shapes = [tuple(job[3].weight.shape) for job in substitute_set._jobs(model, [0, 1], options)]
    target = sum(p.numel() * p.element_size() for p in model.parameters())
    wanted = [twin_bytes(*s) for s in shapes]
    budget = sum(wanted[:3]) + 1
    fraction = (budget + sum(substitute_bytes(*s, 4, 64) for s in shapes)) / target
    plan = plan_host_memory(shapes, fraction, 4, 64, target, kv_room=None, kv_needed=0)
    subs = build_substitutes(model, [0, 1], options, CPU, cache=None, max_rows=8, memory=plan)
    kept = [s.kernel.dense is not None for i in sorted(subs.layers)
            for s in subs.layers[i].values()]
    assert kept == [True] * 3 + [False] * 5 and subs.twins == 3
    assert subs.nbytes() == plan.substitute_bytes + plan.twins_bytes <= fraction * target
    unbounded = build_substitutes(model, [0, 1], options, CPU, cache=None, max_rows=8)
    assert unbounded.twins == 8


def _with_twins(monkeypatch):
    monkeypatch.setattr(dense_twin, "dense_crossover", lambda *a: 2)
    model = decoder_stub(2, 128, seed=0)
    options = SubSpecOptions.from_dict({"quantizer": "rtn", "substitute_cache": False,
                                        "draft_lm_head": "target"})
    subs = build_substitutes(model, [0, 1], options, CPU, cache=None, max_rows=8)
    subs.target_bytes = 10**6
    return subs


def test_when_the_kv_cache_would_not_fit_twins_go_first_last_layers_first(monkeypatch):
    import vllm_subspec.draft_model.host_memory as host_memory

    subs = _with_twins(monkeypatch)
    layer1 = list(subs.layers[1].values())
    x = torch.randn(4, layer1[-1].in_features, dtype=torch.bfloat16)
    before = layer1[-1](x)[0]
    one = layer1[-1].kernel.dense.numel() * 2  # the last substitute's twin
    rooms = iter([(-one, 0), (0, 0)])  # short by one twin, then (after dropping) enough
    host_memory.fit_kv_cache(subs, lambda: next(rooms))
    kept = [s.kernel.dense is not None for i in (0, 1) for s in subs.layers[i].values()]
    assert kept == [True] * 7 + [False] and subs.twins == 7
    # a dropped twin: the int4 kernel at every row count, the same HQQ weights
    assert layer1[-1].kernel.dense_from_rows is None
    assert torch.allclose(layer1[-1](x)[0].float(), before.float(), atol=0.05)


def test_when_nothing_can_be_dropped_the_error_names_the_numbers(monkeypatch):
    import vllm_subspec.draft_model.host_memory as host_memory

    subs = _with_twins(monkeypatch)
    with pytest.raises(SubSpecConfigError, match=r"leaves -1\.00 GiB.*needs 0\.062 GiB"):
        host_memory.fit_kv_cache(subs, lambda: (-2**30, 2**26))
    assert subs.twins == 0  # every twin was dropped first
    host_memory.fit_kv_cache(subs, lambda: (None, 2**26))  # explicit KV size: vLLM checks it
