#!/usr/bin/env bash
# Install StreamRL into the active Python environment: torch (pinned) first, then the rest.
# pip's `torch==2.13.0` is the CPU build where pip finds one (a local wheel); on a stock Linux
# machine PyPI serves the multi-GB CUDA build: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# to take torch from that index instead.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q -e ".[test,kernels]"
