"""draft_model/hqq.py against the hqq package it replaces: the same codes, scales and zeros, bit
for bit, as `HQQLinear.from_weights` built the substitutes before (so cached substitutes and τ
are unchanged), at any thread count."""

import os
import threading

import pytest
import torch

from vllm_subspec.draft_model import hqq as solver
from vllm_subspec.draft_model.quantize import quantize


def _weight(n, k, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if outliers:  # real weights have a few large entries and some constant groups
        w[::7, ::13] *= 40
        w[3, :64] = 0.5
    return w.bfloat16()


def _hqq_package(w, bits, group_size, optimize):
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    cfg = BaseQuantizeConfig(nbits=bits, group_size=group_size, axis=1)
    cfg["weight_quant_params"]["optimize"] = optimize
    layer = HQQLinear.from_weights(w, None, cfg, compute_dtype=torch.bfloat16, device="cpu")
    n, k = w.shape
    codes = layer.unpack(dtype=torch.uint8)[: n * k // group_size].reshape(n, k)
    return codes, layer.meta["scale"].view(n, -1).float(), layer.meta["zero"].view(n, -1).float()


@pytest.mark.parametrize("bits, group_size, optimize, shape, outliers", [
    (4, 64, True, (1536, 576), False),
    (4, 64, True, (960, 320), True),
    (4, 128, True, (256, 512), True),
    (3, 64, True, (192, 256), True),
    (2, 32, True, (128, 256), False),
    (8, 64, True, (128, 128), True),
    (4, 64, False, (960, 320), True),
])
def test_codes_scales_and_zeros_equal_the_hqq_package(bits, group_size, optimize, shape,
                                                      outliers):
    pytest.importorskip("hqq")
    w = _weight(*shape, outliers=outliers)
    ours = quantize(w, bits=bits, group_size=group_size, method="hqq" if optimize else "rtn")
    codes, scale, zero = _hqq_package(w, bits, group_size, optimize)
    assert torch.equal(ours.codes, codes)
    assert torch.equal(ours.scale, scale)
    assert torch.equal(ours.zero, zero)
    if optimize and bits == 4:  # the solve moved the rounded initial zeros
        assert (ours.zero != ours.zero.round()).any()


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    """Several chunks per thread (the chunk is shrunk), solved on one thread and on a pool of
    pinned threads; torch at one thread, as in vLLM's CPU worker, so the pool is used."""
    w = _weight(1024, 512, seed=3, outliers=True)
    monkeypatch.setattr(solver, "CHUNK_ELEMENTS", 64 * 96)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    used = []
    real_step = solver._step
    monkeypatch.setattr(solver, "_step", lambda *a: (used.append(threading.current_thread().name),
                                                     real_step(*a))[1])
    try:
        monkeypatch.setenv(solver.THREADS_ENV, "1")
        one = quantize(w)
        one_threads = set(used)
        used.clear()
        monkeypatch.setenv(solver.THREADS_ENV, "2")
        many = quantize(w)
    finally:
        torch.set_num_threads(before)
    assert one_threads == {threading.current_thread().name}
    if len(solver.usable_cpus()) > 1:
        assert len(set(used)) == 2 and all(n.startswith("subspec-hqq") for n in used)
    for t in ("codes", "scale", "zero"):
        assert torch.equal(getattr(one, t), getattr(many, t)), t


def test_usable_cpus_are_the_process_allowance_not_the_calling_threads_pin():
    allowed = os.sched_getaffinity(0)
    found = {}

    def pinned():
        os.sched_setaffinity(0, {min(allowed)})  # as vLLM's CPU worker pins its thread
        found["cpus"] = solver.usable_cpus()
        found["own"] = os.sched_getaffinity(0)

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    # every core the process was allowed (more under `taskset`: what the cgroup allows), and
    # the calling thread keeps its own pin
    assert found["cpus"] >= allowed and found["own"] == {min(allowed)}
