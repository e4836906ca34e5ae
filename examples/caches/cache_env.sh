#!/bin/bash
# Move the caches of pip, uv, conda, PyTorch and its libraries out of your home directory.
#
# Source it from ~/.bashrc (so that login nodes and jobs both see it) or at the top of a job
# script, after setting PROJECT_DIR to your project space:
#     source cache_env.sh
# Then check with: python show_caches.py
# Caches that jobs share and keep go to project space. Nothing here must be backed up: every
# cache can be deleted, and the tool fills it again.

# --- Site-specific: your project space ----------------------------------------
PROJECT_DIR=${PROJECT_DIR:-/project/$USER}   # shared by your jobs, kept, not backed up
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
# torch.compile's caches (Inductor, and Triton's inside it): shared ones need file locks that
# work across nodes; compile_cache.sbatch gives each job its own copy instead.
export TORCHINDUCTOR_CACHE_DIR="$CACHE_ROOT/inductor"
