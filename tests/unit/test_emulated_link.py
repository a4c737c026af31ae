"""The emulated link (subspec_testing/emulated_link.py) without an engine: its wait on a real
small module stack's target forward and not on a draft path through the same layers, the
layers it reads from vLLM's offload config, and the calibration arithmetic."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm.config.offload import OffloadConfig, UVAOffloadConfig

from subspec_testing import emulated_link as el
from vllm_subspec.draft_model.layer_selection import planned_offload

CFG = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=6,
)


class Layer(nn.Module):
    """A decoder layer's parameter shapes (Llama), as vLLM's fused linears hold them."""

    def __init__(self, h, inter, heads, kv, hd):
        super().__init__()
        self.qkv_proj = nn.Linear(h, (heads + 2 * kv) * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))

    def forward(self, x):
        a = x + self.o_proj(self.qkv_proj(x)[:, : self.o_proj.in_features])
        g, u = self.gate_up_proj(a).chunk(2, -1)
        return a + self.down_proj(torch.nn.functional.silu(g) * u)


class Target(nn.Module):
    def __init__(self, cfg=CFG):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            Layer(
                cfg["hidden_size"],
                cfg["intermediate_size"],
                cfg["num_attention_heads"],
                cfg["num_key_value_heads"],
                cfg["head_dim"],
            )
            for _ in range(cfg["num_hidden_layers"])
        )

    def forward(self, input_ids):
        for layer in self.model.layers:
            input_ids = layer(input_ids)
        return input_ids


class Runner:
    """What `install_link` reads of vLLM's model runner."""

    def __init__(self, target, offload_config):
        self._target = target
        self.vllm_config = SimpleNamespace(offload_config=offload_config)

    def get_model(self):
        return self._target

    def _model_forward(self, input_ids=None, **kwargs):
        return self._target(input_ids)


def draft_forward(target, x):
    """A draft's resident layers are the target's own modules: called outside the runner."""
    for layer in target.model.layers:
        x = layer(x)
    return x


def uva(gb):
    return OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=gb))


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


@torch.inference_mode()
def test_the_target_waits_the_same_for_1_or_300_rows_and_the_draft_not_at_all():
    target = Target()
    layer_bytes = el.layer_bytes(target.model.layers[0])
    worker = SimpleNamespace(model_runner=Runner(target, uva(3.5 * layer_bytes / 2**30)))
    one, many = torch.randn(1, 64), torch.randn(300, 64)
    compute = {
        n: min(timed(draft_forward, target, x) for _ in range(3))
        for n, x in ((1, one), (300, many))
    }
    link = 0.2
    bandwidth = 4 * layer_bytes / link / 1e9  # 4 layers' bytes take 200 ms
    report = el.install_link(worker, bandwidth)
    assert report["layers"] == [0, 1, 2, 3] and report["bytes"] == 4 * layer_bytes
    assert report["seconds_per_forward"] == pytest.approx(link)
    assert report["substituted"] is None  # not a SubSpec runner
    runner = worker.model_runner
    for n, x in ((1, one), (300, many)):
        took = timed(runner._model_forward, input_ids=x)
        assert link <= took < link + compute[n] + 0.1, n  # (slack for a loaded machine)
        # the draft's path through the same (shared) layers pays no link
        assert timed(draft_forward, target, x) < link / 2
    record = el.link_stats(worker)["record"]
    assert record["forwards"] == 2
    assert 2 * link <= record["waited_s"] < 2 * link + 0.1
    assert set(record["by_rows"]) == {1, 300}
    assert all(wall >= link for _, _, wall in record["by_rows"].values())


def test_install_is_idempotent_and_uninstall_restores_the_method():
    target = Target()
    runner = Runner(target, uva(1.0))
    first = el.install(runner, 0.01)
    again = el.install(runner, 0.0)
    assert (
        again is first and first.seconds == 0.0 and first.forward.__func__ is Runner._model_forward
    )
    el.uninstall(runner)
    assert "_model_forward" not in vars(runner)
    assert runner._model_forward.__func__ is Runner._model_forward
    # no offload configured: nothing crosses, no wait
    plain = SimpleNamespace(model_runner=Runner(target, OffloadConfig()))
    assert el.install_link(plain, 25.0)["layers"] == []
    assert el.link_stats(plain)["seconds_per_forward"] == 0.0


def test_the_link_reads_vllms_uva_plan():
    target = Target()
    layers = target.model.layers
    for gb in (0.0, 1e-4, 2.5 * el.layer_bytes(layers[0]) / 2**30, 1.0):
        cfg = uva(gb)
        plan = el.link_plan(layers, cfg)
        assert plan.layers == planned_offload(layers, cfg)
        assert plan.bytes == sum(el.layer_bytes(layers[i]) for i in plan.layers)
        assert plan.num_layers == 6
    assert el.link_plan(layers, uva(1.0), only=[4, 1]).layers == [1, 4]


@pytest.mark.parametrize("want", [1, 4, 6])
def test_offload_gb_from_the_config_plans_exactly_that_many_layers(tmp_path, want):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    target = Target()
    n, nbytes = el.config_layer_bytes(str(tmp_path), "float32")
    assert (n, nbytes) == (6, el.layer_bytes(target.model.layers[0]))
    gb = el.offload_gb_for_layers(str(tmp_path), "float32", want)
    assert planned_offload(target.model.layers, uva(gb)) == list(range(want))


def test_the_gpu_ratio_comes_from_the_documented_constants():
    from benchmarks.projection import SUBSTITUTE_FRACTION, GpuSetting

    s, gpu = el.GpuScenario(), GpuSetting()
    assert (s.layer_gb, s.num_layers, s.bandwidth_gbps) == (
        gpu.layer_gb,
        gpu.num_layers,
        gpu.bandwidth_gbps,
    )
    # 26 of 28 layers under UVA on the 8 GB card (substitutes take GPU memory too)
    excess = gpu.weight_gb - (gpu.memory_gb - gpu.reserved_gb)
    assert math.ceil(excess / (1 - SUBSTITUTE_FRACTION) / gpu.layer_gb) == s.offloaded_layers
    assert s.plain_step_s() == pytest.approx(26 * 0.466 / 25)
    assert s.ratio() == pytest.approx(80.77, abs=0.01)
    assert el.scenario_layers(30) == 28 and el.scenario_layers(28) == 26


def test_calibration_sets_the_link_for_the_ratio():
    c = el.Calibration(ratio=80.0, draft_pass_s=0.005, plain_compute_s=0.04, link_bytes=4 * 10**8)
    assert c.link_s == pytest.approx(0.36)
    assert c.bandwidth_gbps == pytest.approx(0.4 / 0.36)
    assert c.achieved(c.plain_compute_s + c.link_s) == pytest.approx(80.0)
    assert c.achieved(0.5) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="does not exceed"):
        el.Calibration(ratio=5.0, draft_pass_s=0.005, plain_compute_s=0.04, link_bytes=1)


def test_wait_is_a_wall_clock_wait():
    for seconds in (0.0, 0.0015, 0.02):
        took = timed(el.wait, seconds)
        assert seconds <= took < seconds + 0.05  # (slack for a loaded machine)


def test_the_plan_sees_the_bytes_vllm_loaded_after_the_cpu_backend_packed_the_weights():
    """vLLM's CPU backend leaves a packed linear an empty `weight` (remove_weight): the plan
    counts the linear's (output, input) size per partition, as at load time."""
    target = Target()
    layers = target.model.layers
    full = el.layer_bytes(layers[0])
    cfg = uva(2.5 * full / 2**30)
    before = el.link_plan(layers, cfg)
    for layer in layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            lin.output_size_per_partition, lin.input_size_per_partition = lin.weight.shape
            lin.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    assert el.layer_bytes(layers[0]) < full / 100
    assert planned_offload(layers, cfg) == list(range(6))  # the packed layers: wrong plan
    after = el.link_plan(layers, cfg)
    assert after.layers == before.layers == [0, 1, 2]
    assert after.bytes == before.bytes == 3 * full
