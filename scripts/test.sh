#!/usr/bin/env bash
# The README's test command: install, then run the default (CPU) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q "$@"
