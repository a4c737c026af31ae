"""The on-disk substitute cache: a warm start quantizes nothing, bad entries are rebuilt, the key
covers everything that changes a substitute (the engine using it:
tests/e2e/test_substitute_cache_engine.py)."""

import json
import os
import time

import pytest
import torch
from decoder_stub import decoder_stub

import vllm_subspec.draft_model.gemlite_tuning as gemlite_tuning
import vllm_subspec.draft_model.quantize as quantize_mod
from vllm_subspec.config import SubSpecConfigError, SubSpecOptions
from vllm_subspec.draft_model.kernels import GemliteKernel, Int4CpuKernel
from vllm_subspec.draft_model.quantize import quantize
from vllm_subspec.draft_model.substitute_set import build_substitutes
from vllm_subspec.draft_model.substitute_cache import (
    SubstituteCache,
    default_root,
    gemlite_autotune_path,
    pack_codes,
    unpack_codes,
    weight_fingerprint,
)

CPU = torch.device("cpu")
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _model(num_layers=2, h=128, seed=0):
    return decoder_stub(num_layers, h, qkv_bias=True, seed=seed)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights v1")
    (d / "config.json").write_text("{}")
    return d


def _cache(model_dir, root, **opts):
    options = SubSpecOptions.from_dict({"quantizer": "hqq", **opts})
    return SubstituteCache.create(str(model_dir), str(root), options), options


class _CountingQuantize:
    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(quantize_mod, "quantize", self)

    def __call__(self, weight, **kw):
        self.calls.append(tuple(weight.shape))
        return quantize(weight, **kw)


def _qws(subs):
    return {(i, n): s.kernel.qw for i, d in subs.layers.items() for n, s in d.items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for t in ("codes", "scale", "zero"):
            assert torch.equal(getattr(a[k], t), getattr(b[k], t)), (k, t)


def _build(model, options, cache):
    """Layers 0 and 1: their 8 linears and the draft's quantized lm_head, 9 entries."""
    opts = SubSpecOptions.from_dict({**options.to_dict(), "kernel": "reference"})
    return build_substitutes(model, [0, 1], opts, CPU, cache=cache)


def test_pack_roundtrip():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.shape == (8, 32)
    assert torch.equal(unpack_codes(packed, 4), codes)
    codes8 = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes8, 8), 8), codes8)


def test_warm_build_quantizes_nothing_and_matches(model_dir, tmp_path, monkeypatch):
    model = _model()
    counter = _CountingQuantize(monkeypatch)
    cache, options = _cache(model_dir, tmp_path / "cache")
    cold = _build(model, options, cache)
    assert len(counter.calls) == 9 and cold.built == 9 and cold.cache_hits == 0
    files = sorted(cache.folder.glob("*.safetensors"))
    assert len(files) == 9
    assert not list(cache.folder.glob(".*tmp*"))  # temp files were renamed into place
    mtimes = [f.stat().st_mtime_ns for f in files]

    counter.calls.clear()
    cache2, _ = _cache(model_dir, tmp_path / "cache")
    warm = _build(model, options, cache2)
    assert counter.calls == [] and warm.built == 0 and warm.cache_hits == 9
    _assert_same(_qws(warm), _qws(cold))
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # nothing rewritten
    # and the cold build equals a build without any cache
    _assert_same(_qws(_build(model, options, None)), _qws(cold))
    # biases are the target's, not cached
    target_bias = model.model.layers[0].self_attn.qkv_proj.bias
    assert torch.equal(warm.layers[0]["qkv_proj"].bias, target_bias)


def _corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    path.write_bytes(bytes(data))


def _wrong_key(path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        key = json.loads(f.metadata()["subspec_key"])
    key["layer"] += 1  # an entry for another linear under this name
    save_file(tensors, str(path), metadata={"subspec_key": json.dumps(key)})


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_corrupt_truncate, _corrupt_header, _wrong_key, _empty])
def test_bad_entry_is_rebuilt(model_dir, tmp_path, monkeypatch, damage, vllm_caplog):
    model = _model()
    cache, options = _cache(model_dir, tmp_path / "cache")
    cold = _build(model, options, cache)
    victim = sorted(cache.folder.glob("layers.1.down_proj-*.safetensors"))
    assert len(victim) == 1
    damage(victim[0])

    counter = _CountingQuantize(monkeypatch)
    cache2, _ = _cache(model_dir, tmp_path / "cache")
    with vllm_caplog.at_level("WARNING", logger="vllm.vllm_subspec.draft_model.substitute_cache"):
        again = _build(model, options, cache2)
    assert counter.calls == [(128, 256)]  # only layer 1's down_proj was quantized again
    assert cache2.rebuilt == 1 and cache2.hits == 8
    assert "unusable" in vllm_caplog.text and victim[0].name in vllm_caplog.text
    _assert_same(_qws(again), _qws(cold))

    counter.calls.clear()  # the rebuilt entry was written back and now loads
    cache3, _ = _cache(model_dir, tmp_path / "cache")
    _build(model, options, cache3)
    assert counter.calls == [] and cache3.hits == 9


def test_key_covers_options_weights_and_linear(model_dir, tmp_path):
    root = tmp_path / "cache"
    base, _ = _cache(model_dir, root)
    key = base.key(3, "o_proj", (128, 128), torch.bfloat16, CPU)
    path = base.path(key)
    for opts in ({"bits": 8}, {"group_size": 128}, {"quantizer": "rtn"}):
        other, _ = _cache(model_dir, root, **opts)
        assert other.path(other.key(3, "o_proj", (128, 128), torch.bfloat16, CPU)) != path
    for args in ((4, "o_proj", (128, 128), torch.bfloat16), (3, "qkv_proj", (128, 128),
                 torch.bfloat16), (3, "o_proj", (256, 128), torch.bfloat16),
                 (3, "o_proj", (128, 128), torch.float32)):
        assert base.path(base.key(*args, CPU)) != path
    assert base.path(base.key(3, "o_proj", (128, 128), torch.bfloat16,
                              torch.device("meta"))) != path
    assert base.path(dict(key, versions=dict(key["versions"], hqq="0.0.0"))) != path
    # rewriting the weights (new size/mtime) gives a new fingerprint, hence a new folder
    before = weight_fingerprint(model_dir)
    time.sleep(0.01)
    (model_dir / "model.safetensors").write_bytes(b"weights v2, longer")
    assert weight_fingerprint(model_dir) != before
    assert _cache(model_dir, root)[0].folder != base.folder


def test_cache_off_or_unavailable(model_dir, tmp_path):
    options = SubSpecOptions()
    assert SubstituteCache.create(str(model_dir), False, options) is None
    assert SubstituteCache.create("no-such-org/no-such-model-xyz", None, options) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert SubstituteCache.create(str(empty), None, options) is None  # no weight files


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_SUBSPEC_CACHE_DIR", str(tmp_path / "a"))
    assert default_root() == tmp_path / "a"
    monkeypatch.delenv("VLLM_SUBSPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "vllm-subspec" / "substitutes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home" / ".cache" / "vllm-subspec" / "substitutes"


def test_gemlite_autotuning_is_kept_under_the_cache_folder_only_for_gemlite(monkeypatch,
                                                                            tmp_path):
    """The GemLite autotune file sits under the `substitute_cache` folder (default or given),
    per device name; none when the cache is off or no substitute runs GemLite."""
    monkeypatch.setattr(gemlite_tuning, "gemlite_autotune_file",
                        lambda root, device: root / "gemlite-autotune" / f"{device}.json")
    gemlite = object.__new__(GemliteKernel)  # a GemLite kernel, unbuilt
    int4 = Int4CpuKernel(quantize(torch.randn(32, 64)), torch.bfloat16)
    monkeypatch.setenv("VLLM_SUBSPEC_CACHE_DIR", str(tmp_path / "default"))
    on = SubSpecOptions(substitute_cache=True)
    assert gemlite_autotune_path(on, [int4, gemlite], "cuda:0") == \
        tmp_path / "default" / "gemlite-autotune" / "cuda:0.json"
    given = SubSpecOptions(substitute_cache=str(tmp_path / "given"))
    assert gemlite_autotune_path(given, [gemlite], "cuda:0").parent.parent == tmp_path / "given"
    assert gemlite_autotune_path(SubSpecOptions(substitute_cache=False), [gemlite], "cuda:0") \
        is None
    assert gemlite_autotune_path(on, [int4], "cuda:0") is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_cache_does_not_stop_the_build(model_dir, tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    cache, options = _cache(model_dir, root)
    subs = _build(_model(), options, cache)
    assert subs.built == 9 and cache.write_errors == 9


def test_unwritable_cache_path_does_not_stop_the_build(model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    cache, options = _cache(model_dir, blocker)
    subs = _build(_model(), options, cache)
    assert subs.built == 9 and cache.write_errors == 9 and len(subs.layers) == 2


def test_option_validation():
    assert SubSpecOptions.from_dict({"substitute_cache": False}).substitute_cache is False
    assert SubSpecOptions.from_dict({"substitute_cache": "/tmp/x"}).substitute_cache == "/tmp/x"
    for bad in (5, "", "  ", ["a"]):
        with pytest.raises(SubSpecConfigError, match="substitute_cache"):
            SubSpecOptions.from_dict({"substitute_cache": bad})
