#!/usr/bin/env bash
# Lint, format and type checks of the package (configured in pyproject.toml), run by .ci/run
# before the tests: ruff's lint rules, ruff's formatter (as a check: `ruff format` fixes), mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh >/dev/null  # PY, the interpreter setup.sh installs into
"$PY" -m ruff check
"$PY" -m ruff format --check
"$PY" -m mypy
echo "[lint] ruff check, ruff format --check, mypy: clean"
