#!/usr/bin/env bash
# GPU check: the CUDA paths and the Triton kernels, on a machine with a CUDA GPU and a Python that
# has torch (CUDA build), triton, transformers, tokenizers, safetensors, pyyaml, jinja2, pytest
# (lightgbm too for step 6; installs nothing; the repo root goes on PYTHONPATH, so no `pip install -e` is needed). Runs:
#   1. pytest (compiled kernels, TRITON_INTERPRET=0): tests/test_cuda.py (model, engine with
#      and without CUDA graphs, trainer on CUDA), tests/test_kernels.py (+ the full CUDA
#      cross-product), tests/test_kernels_norm_rope.py, tests/test_kernels_engine.py
#   2. bench/engine_throughput.py --device cuda: native engine (triton; eager and CUDA graphs)
#      vs transformers generate on the GPU, workloads a, b, c (ENGINE_TORCH=1: then the torch
#      attention path too)
#   3. bench/kernels.py --sweep: the decode kernel's launch choices per shape vs choose_launch
#   4. bench/kernels.py: bandwidth vs HBM peak, vs SDPA dense, vs the torch paged path
#   5. the quickstart on the GPU (3 ranks on one GPU; the engine's default "auto" attention,
#      i.e. triton + CUDA-graph decode in the RL loop): full SFT warm start, 30 RL iterations
#   6. multirank: 5 ranks on the GPU (controller, 2 generation instances, 2 data-parallel
#      trainer ranks: all-reduce and weight sync of CUDA tensors over gloo), StreamRL-Sync
#      ("stream") with skewness-aware dispatch on a LightGBM ranker bootstrapped from the
#      policy's own lengths, then StreamRL-Async ("async_stream") on the small-LM ranker
# The runs (5, 6) go before the benches (2-4), so a short lease checks the product first.
# STEPS="tests engine sweep kernels quickstart multirank" (the default) picks steps to run.
# Each step has its own timeout; output also goes to $LOG_DIR (default: gpu_check_logs/).
# Budget: about 7 minutes on an H100/H200. Usage: bash bench/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
QUICK=${1:-}
LOG_DIR=${LOG_DIR:-gpu_check_logs}
mkdir -p "$LOG_DIR"
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo '{"gpu_check": "skipped", "why": "no CUDA device visible to torch"}'
  exit 0
fi
{
  "$PY" -c "import torch; print(f'# torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}')"
  "$PY" -c "import triton; print(f'# triton {triton.__version__}')" || echo "# triton missing"
  "$PY" -c "import transformers; print(f'# transformers {transformers.__version__}')" || echo "# transformers missing"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,driver_version --format=csv,noheader 2>/dev/null || true
  nproc
} 2>&1 | tee "$LOG_DIR/env.txt"

status=0
start=$(date +%s)
STEPS=${STEPS:-tests engine sweep kernels quickstart multirank}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "## $name ($(( $(date +%s) - start )) s in)"
  timeout "$t" "$@" 2>&1 | tee "$LOG_DIR/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "## $name: rc $rc"
  [ "$rc" = 0 ] || status=1
}
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 8"
want tests && step tests 120 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" $XDIST -rfEs \
  tests/test_cuda.py tests/test_kernels.py tests/test_kernels_norm_rope.py tests/test_kernels_engine.py
if [ "$QUICK" = "--quick" ]; then
  step bench_kernels 90 "$PY" bench/kernels.py --quick
else
  rm -rf /tmp/gpu_quickstart /tmp/gpu_multirank
  want quickstart && step quickstart 170 "$PY" -m torch.distributed.run --nproc-per-node 3 controller/main.py \
    --config configs/quickstart.yaml --set engine.device=cuda --set train.iterations=30 \
    --set logging.logdir=/tmp/gpu_quickstart \
    --set model.path=/tmp/gpu_quickstart/model
  LGBM=lgbm
  if want multirank && ! "$PY" -c "import lightgbm" 2>/dev/null; then
    LGBM=lm; echo "# lightgbm missing: the stream run's ranker is the small LM too (carry lightgbm's wheel for it)"
  fi
  for pair in stream:$LGBM async_stream:lm; do
    mode=${pair%:*} ranker=${pair#*:}
    want multirank && step "multirank_$mode" 120 "$PY" -m torch.distributed.run --nproc-per-node 5 \
      controller/main.py --config configs/quickstart.yaml --set engine.device=cuda \
      --set placement.generation=[1,2] --set placement.trainer=[3,4] --set pipeline.mode=$mode \
      --set dispatch.name=skew --set ranker.kind=$ranker --set ranker.path=/tmp/gpu_multirank/ranker_$ranker \
      --set ranker.bootstrap_prompts=32 --set train.iterations=10 --set logging.logdir=/tmp/gpu_multirank/$mode \
      --set model.path=/tmp/gpu_multirank/model
  done
  # native last: native_eager and hf are printed even if a graph capture fails
  want engine && step engine_triton 150 "$PY" bench/engine_throughput.py --device cuda --attention triton \
    --competitors native_eager,hf,native --threads 4
  want sweep && step kernels_sweep 150 "$PY" bench/kernels.py --sweep
  want kernels && step bench_kernels 100 "$PY" bench/kernels.py
  want engine && [ "${ENGINE_TORCH:-0}" = 1 ] && step engine_torch 60 "$PY" bench/engine_throughput.py \
    --device cuda --attention torch --competitors native --threads 4
fi
echo "# gpu_check done in $(( $(date +%s) - start )) s, status $status"
exit $status
