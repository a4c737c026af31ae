#!/usr/bin/env bash
# Set up everything (idempotent) and run the test suite on vLLM's CPU backend: two pytest
# workers, one per core (each worker's engines are bound to its own core: tests/conftest.py),
# whole files per worker so module-scoped engines and references are shared.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec python3 -m pytest -v --durations=15 -p no:cacheprovider -n "${SUBSPEC_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder \
  tests "$@"
