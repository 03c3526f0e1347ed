#!/usr/bin/env bash
# The README's test command: install, then run the default (CPU) test suite.
set -euo pipefail
case "${1:-}" in
  -h|--help)
    echo "usage: scripts/test.sh [PYTEST_ARGS ...]"
    echo "Runs scripts/setup.sh (install), then python -m pytest -q PYTEST_ARGS (default: the CPU suite) with OMP_NUM_THREADS=1 unless set."
    exit 0 ;;
esac
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q "$@"
