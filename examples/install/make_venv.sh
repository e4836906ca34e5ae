#!/bin/bash
# Create the Python virtual environment that this guide's job scripts activate.
#
# Run it once, on a login node (compute nodes often cannot reach the internet):
#     bash make_venv.sh
# Pick the PyTorch build that your GPU nodes' NVIDIA driver supports (see the install page;
# nvidia-smi on a GPU node shows the newest CUDA version the driver supports):
#     TORCH_BUILD=cu128 bash make_venv.sh      # driver for CUDA 12.x (cu126 for V100s)
# At a site that serves its own wheels (a wheelhouse; pip then never contacts an index):
#     WHEELHOUSE=/path/to/wheelhouse bash make_venv.sh
# It ends by running check_pytorch.py from the same folder. Next: submit check_pytorch.sbatch.
set -euo pipefail

# --- Site-specific: adapt these lines to your cluster -------------------------
module load python/3.11                  # the Python the venv is built on
VENV=${VENV:-$HOME/venvs/pytorch}        # home or project space: kept, not purged
WHEELHOUSE=${WHEELHOUSE:-}               # a folder of wheels: install with --no-index
TORCH_BUILD=${TORCH_BUILD:-default}      # default (CUDA 13, driver >= 580), cu130, cu128, cu126, cpu
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl}   # PyTorch's wheel server, or a mirror
# -------------------------------------------------------------------------------
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0               # the torchvision release made for this torch
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "make_venv.sh: error: $*" >&2; exit 1; }
[[ -e "$VENV" ]] && die "$VENV already exists; remove it or set VENV to a new path"
pip_args=()
case $TORCH_BUILD in
    default) ;;                           # the package index's torch: a CUDA 13 build
    cu126|cu128|cu130|cpu) pip_args=(--index-url "$TORCH_INDEX/$TORCH_BUILD") ;;
    *) die "TORCH_BUILD=$TORCH_BUILD: use default, cu130, cu128, cu126 or cpu" ;;
esac
if [[ -n "$WHEELHOUSE" ]]; then
    [[ -d "$WHEELHOUSE" ]] || die "WHEELHOUSE=$WHEELHOUSE is not a directory"
    pip_args=(--no-index --find-links "$WHEELHOUSE")
fi

python3 -m venv "$VENV"
# shellcheck source=/dev/null
source "$VENV/bin/activate"
# torch is pinned as a constraint in the venv's own pip.conf: every later pip install in this
# venv keeps this torch (a package that needs another one fails instead of replacing it).
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
printf '[install]\nconstraint = %s\n' "$VENV/constraints.txt" > "$VENV/pip.conf"
echo "Installing torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION (build: $TORCH_BUILD)"
python -m pip install "${pip_args[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

python "$here/check_pytorch.py" --size 256
echo "Environment ready: source $VENV/bin/activate"
