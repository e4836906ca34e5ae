#!/bin/bash
# Create the Python virtual environment that this guide's job scripts activate.
#
# Run it once, on a login node (compute nodes often cannot reach the internet):
#     bash make_venv.sh
# At a site that serves its own wheels (a wheelhouse; pip then never contacts an index):
#     WHEELHOUSE=/path/to/wheelhouse bash make_venv.sh
# It ends by running check_pytorch.py from the same folder. Next: submit check_pytorch.sbatch.
set -euo pipefail

# --- Site-specific: adapt these lines to your cluster -------------------------
module load python/3.11                  # the Python the venv is built on
VENV=${VENV:-$HOME/venvs/pytorch}        # home or project space: kept, not purged
WHEELHOUSE=${WHEELHOUSE:-}               # a folder of wheels: install with --no-index
# -------------------------------------------------------------------------------
TORCH_VERSION=2.13.0
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [[ -e "$VENV" ]]; then
    echo "make_venv.sh: error: $VENV already exists; remove it or set VENV to a new path" >&2
    exit 1
fi
pip_args=()
if [[ -n "$WHEELHOUSE" ]]; then
    if [[ ! -d "$WHEELHOUSE" ]]; then
        echo "make_venv.sh: error: WHEELHOUSE=$WHEELHOUSE is not a directory" >&2
        exit 1
    fi
    pip_args=(--no-index --find-links "$WHEELHOUSE")
fi

python3 -m venv "$VENV"
# shellcheck source=/dev/null
source "$VENV/bin/activate"
# torch is pinned exactly and also as a constraint, so no other package can upgrade it.
echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
export PIP_CONSTRAINT="$VENV/constraints.txt"
python -m pip install "${pip_args[@]}" "torch==$TORCH_VERSION"

python "$here/check_pytorch.py" --size 256
echo "Environment ready: source $VENV/bin/activate"
