#!/usr/bin/env bash
# GPU check for the Triton kernels, on a machine with a CUDA GPU and the project's venv already
# set up (installs nothing). Runs, compiled on CUDA (TRITON_INTERPRET=0):
#   1. tests/test_kernels.py          kernel vs torch reference (+ a full cross-product on CUDA)
#   2. tests/test_kernels_engine.py   native engine on CUDA: triton vs torch decode, greedy equal
#   3. bench/kernels.py --quick       bandwidth vs peak, vs SDPA dense, vs vLLM when importable
# Budget: < 5 minutes (each step has its own timeout). Usage: bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo '{"gpu_check": "skipped", "why": "no CUDA device visible to torch"}'
  exit 0
fi
"$PY" -c "import torch; print(f'# torch {torch.__version__} on {torch.cuda.get_device_name()}')"
"$PY" -c "import triton; print(f'# triton {triton.__version__}')" || { echo "triton missing: pip install -e .[kernels]"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader 2>/dev/null || true

status=0
start=$(date +%s)
echo "## tests (CUDA)"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/test_kernels.py tests/test_kernels_engine.py || status=1
echo "## bench/kernels.py --quick"
timeout 90 "$PY" bench/kernels.py --quick || status=1
echo "# gpu_check done in $(( $(date +%s) - start )) s, status $status"
exit $status
