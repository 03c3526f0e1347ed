#!/usr/bin/env bash
# Install StreamRL into the active Python environment: torch (pinned, CPU build) first, then the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0
pip install -q -e ".[test,kernels]"
