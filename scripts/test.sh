#!/usr/bin/env bash
# Set up everything (idempotent) and run the test suite on vLLM's CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec python3 -m pytest -v -p no:cacheprovider tests "$@"
