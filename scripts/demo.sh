#!/usr/bin/env bash
# Set up everything (idempotent) and run the SubSpec demo on SmolLM2-135M-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PY, the interpreter setup.sh installs into (a venv: activated)
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/demo.py "$@"
