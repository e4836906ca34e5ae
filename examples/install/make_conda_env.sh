#!/bin/bash
# Create a conda environment with PyTorch from environment.yml (beside this script).
#
# Run it once, on a login node:
#     bash make_conda_env.sh
# The environment lives under a prefix in home or project space, not in the shared base
# installation. It ends by running check_pytorch.py inside the new environment.
set -euo pipefail

# --- Site-specific: adapt these lines to your cluster -------------------------
module load miniconda3                                 # the site's conda
CONDA_ENV=${CONDA_ENV:-$HOME/conda-envs/pytorch}       # home or project space
# -------------------------------------------------------------------------------
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [[ -e "$CONDA_ENV" ]]; then
    echo "make_conda_env.sh: error: $CONDA_ENV already exists; remove it or set CONDA_ENV" >&2
    exit 1
fi
conda env create --prefix "$CONDA_ENV" --file "$here/environment.yml"
conda run --prefix "$CONDA_ENV" python "$here/check_pytorch.py" --size 256
echo "Environment ready: conda activate $CONDA_ENV"
