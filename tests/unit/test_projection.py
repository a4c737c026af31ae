"""benchmarks/projection.py: the paper's cost model with the offload backend, the overlap and
the step's host work (docs/gpu.md, "Prefetch overlap" and "Projection")."""

import dataclasses
import json

import pytest

from benchmarks.projection import GpuSetting, measured_host_ms, projected_speedup

PAPER = GpuSetting()  # Qwen2.5-7B, 8 GB, PCIe 4 at 25 GB/s, 11 ms per draft pass


def test_the_papers_tau_projects_near_the_papers_measurement():
    assert 8.0 < projected_speedup(27.08, 48, PAPER) < 10.5  # the paper measured 9.1x


def test_prefetch_hides_its_first_layers_and_pays_for_slots_and_substitutes():
    """docs/gpu.md, "Prefetch overlap": at the same GPU memory the prefetch plan streams
    2 / (1 - 0.281) layers more than UVA and hides 2 under drafting, so at equal bandwidth it is
    a little behind UVA, and ahead once UVA's in-kernel reads are slower than the copies."""
    prefetch = dataclasses.replace(PAPER, memory_gb=12.0)  # 8 GB leaves no room for its layers
    uva = dataclasses.replace(prefetch, backend="uva")
    assert prefetch.uses_prefetch() and not uva.uses_prefetch()
    draft_ms = 48 * PAPER.draft_pass_ms
    assert prefetch.overlap_ms(draft_ms) == pytest.approx(
        1e3 * prefetch.slots * prefetch.layer_gb / prefetch.bandwidth_gbps)
    assert uva.overlap_ms(draft_ms) == 0.0
    assert prefetch.overlap_ms(1.0) == 1.0  # never more than the draft it hides under
    at_par = projected_speedup(27.08, 48, prefetch) / projected_speedup(27.08, 48, uva)
    assert 0.97 < at_par < 1.0
    for efficiency in (0.5, 0.8, 0.9):  # break-even near 0.95 here
        slow = dict(uva_efficiency=efficiency)
        assert projected_speedup(27.08, 48, dataclasses.replace(prefetch, **slow)) > \
            projected_speedup(27.08, 48, dataclasses.replace(uva, **slow))
    # where the plan's layers do not exist the engine keeps UVA, and so does the model
    assert not PAPER.uses_prefetch()
    assert projected_speedup(27.08, 48, PAPER) == projected_speedup(
        27.08, 48, dataclasses.replace(PAPER, backend="uva"))


def test_host_work_is_read_from_the_step_host_results(tmp_path):
    assert measured_host_ms(48, path=tmp_path / "missing.json") == 0.0
    path = tmp_path / "step_host.json"
    path.write_text(json.dumps({
        "verify": [{"batch": 1, "output_len": 1000, "penalties": True, "verify_ms": 1.5},
                   {"batch": 8, "output_len": 1000, "penalties": True, "verify_ms": 4.0}],
        "draft": [{"batch": 1, "ms_per_pass": 0.1}, {"batch": 8, "ms_per_pass": 0.3}]}))
    assert measured_host_ms(48, path=path) == pytest.approx(1.5 + 48 * 0.1)
    assert measured_host_ms(10, batch=8, path=path) == pytest.approx(4.0 + 10 * 0.3)
    slower = dataclasses.replace(PAPER, host_ms=measured_host_ms(48, path=path))
    assert projected_speedup(27.08, 48, slower) < projected_speedup(27.08, 48, PAPER)


# ---- MoE offload economics (benchmarks/moe_offload.py) ----------------------------------------
def test_moe_offload_bytes_per_backend():
    from benchmarks.moe_offload import (QWEN3_30B_A3B, economics, experts_touched,
                                        offloaded_layers, step_bytes)

    q = QWEN3_30B_A3B
    assert abs((q.layers * q.layer_bytes + q.embedding_bytes) / 1e9 - 61.1) < 0.1  # its size
    assert experts_touched(q, 1) == q.top_k  # a decode step reads its k routed experts
    touched = [experts_touched(q, n) for n in (1, 2, 8, 64, 289)]
    assert touched == sorted(touched) and q.experts - touched[-1] < 1e-3
    off = offloaded_layers(q, 24.0, 0.28, 4.0)
    assert 0 < off <= q.layers
    # prefetch streams every expert whatever the tokens; UVA reads what the routing touches
    assert step_bytes(q, "prefetch", 1, off) == step_bytes(q, "prefetch", 289, off)
    for n in (1, 8, 289):
        assert step_bytes(q, "uva", n, off) <= step_bytes(q, "prefetch", n, off)
    report = economics(q, 24.0, 25.0, 0.28, 4.0)
    taus = [row["uva_break_even_tau"] for row in report["rows"]]
    assert taus[0] == 1.0 and taus == sorted(taus)  # wider verifies need more accepted tokens
    assert report["rows"][-1]["uva_break_even_tau"] == report["rows"][-1][
        "prefetch_break_even_tau"]  # once every expert is touched, both stream everything


def test_head_starts_save_their_confirmed_passes_and_pay_what_outlasts_the_verify():
    off = projected_speedup(27.08, 48, PAPER)
    assert projected_speedup(27.08, 48, dataclasses.replace(
        PAPER, head_start_levels=16, head_start_hit_rate=0.0)) == off  # no hit: no change
    half = dataclasses.replace(PAPER, head_start_levels=16, head_start_hit_rate=0.5)
    full = dataclasses.replace(PAPER, head_start_levels=16, head_start_hit_rate=1.0)
    assert off < projected_speedup(27.08, 48, half) < projected_speedup(27.08, 48, full)
    # passes longer than the verify's transfers: the excess is paid
    deep = dataclasses.replace(PAPER, head_start_levels=47, head_start_hit_rate=1.0,
                               bandwidth_gbps=250.0)
    free = dataclasses.replace(deep, head_start_levels=0, head_start_hit_rate=0.0)
    verify_ms = deep.target_ms(subspec=True)
    assert 48 * deep.draft_pass_ms > verify_ms
    step_free = 27.08 * deep.target_ms(subspec=False) / projected_speedup(27.08, 48, free)
    step_deep = 27.08 * deep.target_ms(subspec=False) / projected_speedup(27.08, 48, deep)
    assert step_deep == pytest.approx(step_free - 47 * deep.draft_pass_ms
                                      + 48 * deep.draft_pass_ms - verify_ms
                                      + free.overlap_ms(48 * deep.draft_pass_ms)
                                      - deep.overlap_ms(1 * deep.draft_pass_ms))
