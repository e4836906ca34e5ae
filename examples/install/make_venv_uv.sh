#!/bin/bash
# Create the guide's virtual environment with uv instead of pip: the same environment, faster.
#
# Run it once, on a login node, with uv installed (module load uv, or once:
# python3 -m pip install --user uv):
#     TORCH_BUILD=cu128 bash make_venv_uv.sh
# TORCH_BUILD=auto lets uv choose the build for the NVIDIA driver it finds. Login nodes often
# have no GPU, so give it the driver version that nvidia-smi shows on a GPU node:
#     UV_CUDA_DRIVER_VERSION=570.86.15 bash make_venv_uv.sh
# It ends by running check_pytorch.py from the same folder. Next: submit check_pytorch.sbatch.
set -euo pipefail

# --- Site-specific: adapt these lines to your cluster -------------------------
module load python/3.11                  # the Python the venv is built on
VENV=${VENV:-$HOME/venvs/pytorch}        # home or project space: kept, not purged
TORCH_BUILD=${TORCH_BUILD:-auto}         # auto (from the driver), cu130, cu128, cu126, cpu
TORCH_INDEX=${TORCH_INDEX:-}             # a mirror of PyTorch's wheel server, if your site has one
# -------------------------------------------------------------------------------
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0               # the torchvision release made for this torch
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "make_venv_uv.sh: error: $*" >&2; exit 1; }
command -v uv >/dev/null || die "uv not found: module load uv, or python3 -m pip install --user uv"
[[ -e "$VENV" ]] && die "$VENV already exists; remove it or set VENV to a new path"
case $TORCH_BUILD in
    auto|cu126|cu128|cu130|cpu) ;;
    *) die "TORCH_BUILD=$TORCH_BUILD: use auto, cu130, cu128, cu126 or cpu" ;;
esac
if [[ $TORCH_BUILD == auto && -z ${UV_CUDA_DRIVER_VERSION:-} ]] && ! command -v nvidia-smi >/dev/null; then
    die "no GPU driver on $(hostname): uv would choose the CPU build; set TORCH_BUILD or UV_CUDA_DRIVER_VERSION"
fi
if [[ -n $TORCH_INDEX ]]; then
    [[ $TORCH_BUILD == auto ]] && die "TORCH_INDEX needs TORCH_BUILD: uv chooses only among download.pytorch.org's indexes"
    source_args=(--index-url "$TORCH_INDEX/$TORCH_BUILD")
else
    source_args=(--torch-backend "$TORCH_BUILD")   # download.pytorch.org for torch, PyPI for the rest
fi

# The module's Python (not one that uv downloads), and pip in the venv for later installs.
uv venv --seed --python "$(command -v python3)" "$VENV"
# The same pin as make_venv.sh: pip reads pip.conf; uv needs -c "$VENV/constraints.txt".
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
printf '[install]\nconstraint = %s\n' "$VENV/constraints.txt" > "$VENV/pip.conf"
echo "Installing torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION with uv (build: $TORCH_BUILD)"
uv pip install --python "$VENV/bin/python" "${source_args[@]}" \
    "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

"$VENV/bin/python" "$here/check_pytorch.py" --size 256
echo "Environment ready: source $VENV/bin/activate"
