#!/bin/bash
# Move the caches of pip, uv, conda, PyTorch and its libraries out of your home directory.
#
# Source it from ~/.bashrc (so that login nodes and jobs both see it) or at the top of a job
# script, after setting PROJECT_DIR to your project space:
#     source cache_env.sh
# Then check with: python show_caches.py
# Downloads that jobs share and keep go to project space. torch.compile's caches, which jobs
# write into while they run, go to a folder of your own (COMPILE_DIR). Nothing here must be
# backed up: every cache can be deleted, and the tool fills it again.

# --- Site-specific: project space, torch.compile's caches ---------------------
PROJECT_DIR=${PROJECT_DIR:-/project/$USER}   # shared by your jobs, kept, not backed up
# Yours alone: node-local disk that outlives a job, or fast storage of your own whose file
# locks work across nodes. Not $TMPDIR, which is the job's own at many sites.
COMPILE_DIR=${COMPILE_DIR:-/tmp/torch-compile-$USER}
# -------------------------------------------------------------------------------
CACHE_ROOT="$PROJECT_DIR/.cache"

export PIP_CACHE_DIR="$CACHE_ROOT/pip"            # downloaded and built wheels
export UV_CACHE_DIR="$CACHE_ROOT/uv"              # uv: keep it on the venv's file system
export CONDA_PKGS_DIRS="$CACHE_ROOT/conda-pkgs"   # conda's package tarballs
export TORCH_HOME="$CACHE_ROOT/torch"             # torch.hub and torchvision weights
export HF_HOME="$CACHE_ROOT/huggingface"          # Hugging Face models and datasets
export TORCH_EXTENSIONS_DIR="$CACHE_ROOT/torch_extensions"   # JIT-built C++/CUDA ops
export CUDA_CACHE_PATH="$CACHE_ROOT/nv-compute-cache"        # the driver's compiled PTX
export APPTAINER_CACHEDIR="$CACHE_ROOT/apptainer"           # image layers

# torch.compile runs the code it finds in its cache: use the folder only if it is yours.
if mkdir -p "$COMPILE_DIR" 2>/dev/null && [[ -O "$COMPILE_DIR" ]] && chmod 700 "$COMPILE_DIR"; then
    export TORCHINDUCTOR_CACHE_DIR="$COMPILE_DIR/inductor"      # Inductor's generated code
    export TRITON_CACHE_DIR="$TORCHINDUCTOR_CACHE_DIR/triton"   # every Triton GPU kernel
else
    echo "cache_env.sh: $COMPILE_DIR is not yours: torch.compile's caches not moved" >&2
fi
