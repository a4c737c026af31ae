"""Plugin registration: found through vLLM's entry point, idempotent, gated on vLLM's version."""

from importlib.metadata import entry_points

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_subspec.vllm_hooks import patches


@pytest.fixture
def unpatched(monkeypatch):
    """This test starts in a process where no SubSpec patch is applied (every wrapped vLLM
    function is vLLM's own again) and ends with the process as it was: the tests below see
    the same state whatever ran before them in this worker."""
    for owner, attr in list(patches._APPLIED.values()):
        monkeypatch.setattr(owner, attr, getattr(owner, attr).__subspec_original__)
    monkeypatch.setattr(patches, "_APPLIED", {})
    assert not hasattr(EngineArgs.create_speculative_config, "__subspec_original__")
    yield
    for owner, attr in patches._APPLIED.values():  # what the test applied (then monkeypatch
        setattr(owner, attr, getattr(owner, attr).__subspec_original__)  # restores the rest)


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("subspec") == "vllm_subspec.plugin:register"
    loggers = {ep.name: ep.value for ep in entry_points(group="vllm.stat_logger_plugins")}
    assert loggers.get("subspec_metrics") == "vllm_subspec.vllm_hooks.metrics:SubSpecStatLogger"


def test_vllm_loads_the_plugin(unpatched, monkeypatch):
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # (once per process in vLLM)
    vllm.plugins.load_general_plugins()
    assert hasattr(EngineArgs.create_speculative_config, "__subspec_original__")


def test_apply_is_idempotent(unpatched):
    assert patches.apply_all()
    wrapped = EngineArgs.create_speculative_config
    assert patches.apply_all()
    assert EngineArgs.create_speculative_config is wrapped
    # one layer of wrapping only: the original is vLLM's own function
    assert not hasattr(wrapped.__subspec_original__, "__subspec_original__")


@pytest.mark.parametrize("version, ok", [
    ("0.32.0", True), ("0.33.1", True), ("0.32.0+cpu", True),
    ("0.31.2", False), ("0.34.0", False), ("1.0.0", False), ("dev", False),
])
def test_version_gate(version, ok):
    assert patches.vllm_version_supported(version) is ok


def test_an_untested_vllm_disables_subspec_unless_allowed(unpatched, monkeypatch, vllm_caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(patches.ALLOW_UNTESTED_VLLM_ENV, raising=False)
    assert patches.apply_all() is False
    assert not hasattr(EngineArgs.create_speculative_config, "__subspec_original__")
    assert "found 0.99.0. SubSpec is disabled (set VLLM_SUBSPEC_ALLOW_UNTESTED_VLLM=1" \
        in vllm_caplog.text
    monkeypatch.setenv(patches.ALLOW_UNTESTED_VLLM_ENV, "1")
    assert patches.apply_all() is True  # warned, then applied
    assert "vLLM 0.99.0 is untested" in vllm_caplog.text
    assert hasattr(EngineArgs.create_speculative_config, "__subspec_original__")


def test_trees_keep_attention_out_of_cuda_graphs():
    from vllm.config import CUDAGraphMode

    from vllm_subspec.vllm_hooks.engine_rules import tree_cudagraph_mode

    assert tree_cudagraph_mode(None) == CUDAGraphMode.PIECEWISE  # vLLM's default would be FULL_*
    assert tree_cudagraph_mode(CUDAGraphMode.FULL_AND_PIECEWISE) == CUDAGraphMode.PIECEWISE
    assert tree_cudagraph_mode(CUDAGraphMode.FULL_DECODE_ONLY) == CUDAGraphMode.PIECEWISE
    assert tree_cudagraph_mode(CUDAGraphMode.PIECEWISE) == CUDAGraphMode.PIECEWISE
    assert tree_cudagraph_mode(CUDAGraphMode.NONE) == CUDAGraphMode.NONE


def test_one_version_everywhere():
    """pyproject's version is the package's and the changelog's newest entry (tagged vX.Y.Z)."""
    import re
    from pathlib import Path

    import vllm_subspec

    root = Path(__file__).resolve().parents[2]
    pyproject = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    newest = re.search(r"^## (\d+\.\d+\.\d+) \(", (root / "CHANGELOG.md").read_text(), re.M)
    assert pyproject.group(1) == vllm_subspec.__version__ == newest.group(1)
