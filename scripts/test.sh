#!/usr/bin/env bash
# Set up everything (idempotent) and run the test suite on vLLM's CPU backend: two pytest
# workers, one per core (each worker's engines are bound to its own core: tests/conftest.py),
# whole files per worker so module-scoped engines and references are shared.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PY, the interpreter setup.sh installs into (a venv: activated)
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# Arguments go to pytest; the whole suite unless one names a test path (relative to the
# repository): `bash scripts/test.sh tests/unit tests/e2e/test_e2e_greedy.py -x`.
SELECTION=(tests)
for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then SELECTION=(); fi
done
exec "$PY" -m pytest -v --durations=15 -p no:cacheprovider -n "${SUBSPEC_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder \
  "${SELECTION[@]}" "$@"
