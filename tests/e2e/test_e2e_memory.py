"""On vLLM's CPU backend, a RAM share too small for the draft fails before anything is built,
with SubSpec's own message (draft_model/host_memory.py), not vLLM's negative KV size after
minutes of quantization."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import sys
from vllm import LLM
LLM(model=sys.argv[1], enforce_eager=True, dtype="bfloat16", max_model_len=2048,
    gpu_memory_utilization=float(sys.argv[3]),
    speculative_config={"method": "subspec", "substitute_cache": sys.argv[2]})
"""


def test_a_ram_share_without_room_for_the_draft_fails_before_building(smollm2, tmp_path):
    # 3% of this machine's RAM: less than the loaded target already holds
    proc = subprocess.run([sys.executable, "-c", SCRIPT, smollm2, str(tmp_path / "cache"), "0.03"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "vllm-subspec: not enough memory for the draft and the KV cache" in out, out[-3000:]
    assert "Nothing was built" in out and "gpu_memory_utilization" in out
    assert "SubSpec: 4-bit substitutes" not in out  # no progress bar: no linear was quantized
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
