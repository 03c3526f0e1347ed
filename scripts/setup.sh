#!/usr/bin/env bash
# Install StreamRL into the active Python environment: torch (pinned) first, then the rest.
# pip's `torch==2.13.0` is the CPU build where pip finds one (a local wheel); on a stock Linux
# machine PyPI serves the multi-GB CUDA build: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# to take torch from that index instead.
set -euo pipefail
case "${1:-}" in
  -h|--help)
    echo "usage: scripts/setup.sh [EXTRAS]   (env TORCH_INDEX_URL=URL: take torch from that index)"
    echo "Installs torch==2.13.0, then StreamRL (pip install -e) into the active Python, with EXTRAS"
    echo "if given: comma-separated setup.cfg extras, e.g. 'test' (the default test suite) or"
    echo "'test,kernels' (adds triton, ~1 GB, for pytest -m triton)."
    exit 0 ;;
esac
extras=${1:-}
if [[ ! "$extras" =~ ^[a-z,]*$ ]]; then
    echo "scripts/setup.sh: EXTRAS must be comma-separated extra names (test, kernels, parquet), got '$extras'" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q -e ".${extras:+[$extras]}"
