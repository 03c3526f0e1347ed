#!/usr/bin/env bash
# Install StreamRL into the active Python environment: torch (pinned) first, then the rest.
# pip's `torch==2.13.0` is the CPU build where pip finds one (a local wheel); on a stock Linux
# machine PyPI serves the multi-GB CUDA build: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# to take torch from that index instead.
set -euo pipefail
case "${1:-}" in
  -h|--help)
    echo "usage: scripts/setup.sh   (no arguments; env TORCH_INDEX_URL=URL: take torch from that index)"
    echo "Installs torch==2.13.0, then StreamRL with its test and kernels extras (pip install -e), into the active Python."
    exit 0 ;;
esac
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q -e ".[test,kernels]"
