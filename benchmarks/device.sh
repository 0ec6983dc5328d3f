#!/usr/bin/env bash
# The paired vidax-vs-reference benchmarks on an accelerator, in one command.
#
#   bash benchmarks/device.sh [--pairs N] [--only dit,vae] [--skip-install]   # GPU or TPU machine
#   bash benchmarks/device.sh --install-only    # just the venv (a first call; the run in a second)
#   bash benchmarks/device.sh --dry-run         # CPU, tiny sizes
#
# On a machine with an NVIDIA GPU (nvidia-smi) or a TPU (/dev/accel*): creates or reuses a venv
# ($VIDAX_DEVICE_VENV, default .venv-device), installs '.[test,cuda]' (jax[cuda12]; torch pinned by
# the test extra, whose Linux x86_64 wheel on PyPI is the CUDA build; $TORCH_INDEX_URL is tried when
# that torch cannot see the GPU) or '.[test,tpu]', then runs `python -m benchmarks.device --profile
# gpu|tpu` (benchmarks/device.py: Wan2.1-1.3B's DiT at real widths, 8 blocks, 480p token count,
# bf16 with cuDNN attention; UMT5-XXL layers; the Wan VAE decode at real widths; a whole tiny run;
# each against diffusers/transformers on the same GPU). Prints the table and writes device.json and
# device.md to $OUT (when set, e.g. by the device tool) or benchmarks/results/device.
# --dry-run: the same runner on CPU with tiny sizes, no installs, the current Python ($PYTHON, else
# .venv/bin/python, else python3); part of `make test` (tests/test_benchmarks_device.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dry=0
skip_install=0
install_only=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --skip-install) skip_install=1 ;;
    --install-only) install_only=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done
out_dir="${OUT:-benchmarks/results/device}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"

if [ "$dry" = 1 ]; then
  py="${PYTHON:-}"
  if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  if ! "$py" -c 'import jax, torch, diffusers, transformers' 2>/dev/null; then
    echo "error: --dry-run needs vidax's test extras in $py (make venv, or PYTHON=/path/to/python)" >&2
    exit 2
  fi
  export JAX_PLATFORMS=cpu
  exec "$py" -m benchmarks.device --profile dry --out-dir "$out_dir" ${args[@]+"${args[@]}"}
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  kind=gpu; platform=cuda; extra=cuda
elif ls /dev/accel* >/dev/null 2>&1 || [ -n "${TPU_ACCELERATOR_TYPE:-}" ]; then
  kind=tpu; platform=tpu; extra=tpu
else
  echo "error: no GPU (nvidia-smi) or TPU (/dev/accel*) on this machine; use --dry-run on a CPU" >&2
  exit 2
fi

venv="${VIDAX_DEVICE_VENV:-.venv-device}"
if [ ! -x "$venv/bin/python" ]; then
  base=""
  for cand in python3.12 python3.11 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      base="$cand"; break
    fi
  done
  if [ -z "$base" ]; then echo "error: vidax needs Python >= 3.11 (none found on PATH)" >&2; exit 2; fi
  "$base" -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.installed-$kind-$(cksum < pyproject.toml | cut -d' ' -f1)"
if [ "$skip_install" = 0 ] && [ ! -e "$stamp" ]; then
  echo "[device.sh] installing .[test,$extra] into $venv" >&2
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q -e ".[test,$extra]"
  if [ "$kind" = gpu ] && ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    torch_pin="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
    echo "[device.sh] torch $torch_pin cannot see the GPU; the CUDA wheel from ${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" >&2
    "$py" -m pip install -q --force-reinstall "torch==$torch_pin" \
      --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" --extra-index-url https://pypi.org/simple
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

export JAX_PLATFORMS="$platform"
"$py" - <<'EOF' >&2
import jax, torch
print(f"[device.sh] jax {jax.__version__}: {jax.devices()}; torch {torch.__version__}, "
      f"cuda {torch.cuda.is_available()}")
EOF
if [ "$install_only" = 1 ]; then exit 0; fi
exec "$py" -m benchmarks.device --profile "$kind" --out-dir "$out_dir" ${args[@]+"${args[@]}"}
