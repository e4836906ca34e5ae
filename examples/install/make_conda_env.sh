#!/bin/bash
# Create a conda environment with PyTorch from environment.yml (beside this script).
#
# Run it once, on a login node:
#     bash make_conda_env.sh
# Pick the PyTorch build that your GPU nodes' NVIDIA driver supports, as for make_venv.sh (see
# the install page; nvidia-smi on a GPU node shows the newest CUDA version the driver supports):
#     TORCH_BUILD=cu128 bash make_conda_env.sh      # driver for CUDA 12.x (cu126 for V100s)
# The environment lives under a prefix in home or project space, not in the shared base
# installation. It ends by running check_pytorch.py inside the new environment.
set -euo pipefail

# --- Site-specific: adapt these lines to your cluster -------------------------
module load miniconda3                                 # the site's conda
CONDA_ENV=${CONDA_ENV:-$HOME/conda-envs/pytorch}       # home or project space
TORCH_BUILD=${TORCH_BUILD:-default}      # default (CUDA 13, driver >= 580), cu130, cu128, cu126, cpu
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl}   # PyTorch's wheel server, or a mirror
# -------------------------------------------------------------------------------
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "make_conda_env.sh: error: $*" >&2; exit 1; }
[[ -e "$CONDA_ENV" ]] && die "$CONDA_ENV already exists; remove it or set CONDA_ENV"
env_file=$here/environment.yml
case $TORCH_BUILD in
    default) ;;                           # the package index's torch: a CUDA 13 build
    cu126|cu128|cu130|cpu)
        [[ $TORCH_INDEX =~ ^https?://[A-Za-z0-9.~:/@%+=,_-]+$ ]] \
            || die "TORCH_INDEX=$(printf %q "$TORCH_INDEX") is not an http(s) address"
        # A copy of environment.yml whose pip section takes torch from this build's index.
        work=$(mktemp -d "${TMPDIR:-/tmp}/conda-env.XXXXXX")
        trap 'rm -rf "$work"' EXIT
        env_file=$work/environment.yml
        INDEX_URL=$TORCH_INDEX/$TORCH_BUILD awk '
            { print }
            /^ *- pip:$/ { match($0, /^ */); indent = sprintf("%" (RLENGTH + 4) "s", "")
                           print indent "- --index-url " ENVIRON["INDEX_URL"]; n++ }
            END { exit n != 1 }' "$here/environment.yml" > "$env_file" \
            || die "no '- pip:' section in $here/environment.yml"
        ;;
    *) die "TORCH_BUILD=$TORCH_BUILD: use default, cu130, cu128, cu126 or cpu" ;;
esac

echo "Creating $CONDA_ENV (PyTorch build: $TORCH_BUILD)"
conda env create --prefix "$CONDA_ENV" --file "$env_file"
conda run --prefix "$CONDA_ENV" python "$here/check_pytorch.py" --size 256
echo "Environment ready: conda activate $CONDA_ENV"
