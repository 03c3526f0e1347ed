#!/usr/bin/env bash
# The README's test command: install, then run the default (CPU) test suite.
set -euo pipefail
case "${1:-}" in
  -h|--help)
    echo "usage: scripts/test.sh [PYTEST_ARGS ...]"
    echo "Runs scripts/setup.sh test (install with the test extra), then python -m pytest -q PYTEST_ARGS"
    echo "(default: the CPU suite) with OMP_NUM_THREADS=1 unless set. Triton's interpreter tests skip"
    echo "unless triton is installed: scripts/setup.sh test,kernels, then pytest -m triton."
    exit 0 ;;
esac
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q "$@"
