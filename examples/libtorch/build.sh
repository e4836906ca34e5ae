#!/bin/bash
# Configure, build and run example.cpp against the LibTorch of the venv's torch.
#
# On a login node, or in an interactive job to use a GPU, from any folder:
#     bash build.sh                       # builds build/example, then runs it
#     bash build.sh --device cpu          # options go to the program
# Then run the program directly: build/example --epochs 10
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"      # the folder of this script and example.cpp

# --- Site-specific: your site's modules and the venv from make_venv.sh ---------
module load python/3.11                  # the Python the venv was built with
module load gcc/12                       # a C++20 compiler (and cmake, if your site has a module)
CUDA_MODULE=cuda                         # the CUDA toolkit's module, without the version ("": none)
VENV=${VENV:-$HOME/venvs/pytorch}        # made by make_venv.sh
# -------------------------------------------------------------------------------
# shellcheck source=/dev/null
source "$VENV/bin/activate"

# A CUDA wheel needs the CUDA toolkit of its own version to compile against (a CPU wheel none).
cuda=$(python -c 'import torch; print(torch.version.cuda or "")')
if [[ -n $cuda && -n $CUDA_MODULE ]]; then
    if ! module load "$CUDA_MODULE/$cuda" 2>/dev/null; then
        echo "build.sh: error: torch was built with CUDA $cuda but there is no module $CUDA_MODULE/$cuda: ask your site, or install a torch for a CUDA it has" >&2
        exit 1
    fi
    echo "Loaded $CUDA_MODULE/$cuda, the CUDA of torch $(python -c 'import torch; print(torch.__version__)')"
elif [[ -n $cuda ]] && ! command -v nvcc >/dev/null; then   # CUDA_MODULE="": a toolkit on PATH
    echo "build.sh: error: torch was built with CUDA $cuda and there is no nvcc on PATH: install the CUDA $cuda toolkit, or set CUDA_MODULE to your site's module" >&2
    exit 1
fi

# TorchConfig.cmake is inside the torch package: no separate LibTorch download.
cmake -S . -B build -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
cmake --build build -j "${SLURM_CPUS_PER_TASK:-2}"
build/example "$@"
