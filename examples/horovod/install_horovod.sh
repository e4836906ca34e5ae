#!/bin/bash
# Build Horovod 0.28.1 from source for the PyTorch of the active venv: CPU tensors, or GPUs.
#
# Horovod's last release, 0.28.1, no longer builds with a plain `pip install horovod` on current
# PyTorch: pip's build isolation hides torch from it, and its CMake files ask for C++14 where
# torch's headers need C++17. This script downloads the source, switches it to C++17 and builds
# it against the torch already in the venv, with gloo as controller (horovodrun --gloo, no MPI).
# Without options, Horovod averages CPU tensors only; with --gpu, it averages CUDA tensors with
# NCCL, the NCCL of the torch wheel, and compiles with the CUDA toolkit of torch's CUDA version.
# Run it once (it downloads), in the venv your job scripts activate; with --gpu, on a node where
# the CUDA module loads:
#     source ~/venvs/pytorch/bin/activate          # the venv from make_venv.sh
#     bash install_horovod.sh                      # CPU tensors; several minutes
#     bash install_horovod.sh --gpu                # GPU tensors with NCCL
#     bash install_horovod.sh --gpu --print-env    # show the build settings, build nothing
# To install the same build into several venvs, keep its wheel: --wheel-dir DIR builds it once
# into DIR/torch-<torch version>-py<Python version>-<cpu|gpu>/, and a later run for the same
# torch, Python and --gpu installs that wheel without building (remove it to build again):
#     bash install_horovod.sh --wheel-dir ~/wheels # first venv: builds, keeps the wheel
#     bash install_horovod.sh --wheel-dir ~/wheels # another venv: installs it, in seconds
# Then: horovodrun -np 2 -H localhost:2 --gloo python horovod_train.py --fake-data
set -euo pipefail

USAGE="usage: install_horovod.sh [--gpu] [--print-env] [--wheel-dir DIR]"
die() {
    echo "install_horovod.sh: error: $*" >&2
    exit 1
}

gpu=0 print_only=0 wheel_dir=""
while (($#)); do
    case $1 in
        --gpu) gpu=1 ;;
        --print-env) print_only=1 ;;
        --wheel-dir)
            [[ -n "${2:-}" ]] || die "--wheel-dir needs a folder ($USAGE)"
            wheel_dir=$2
            shift
            ;;
        -h | --help) echo "$USAGE" && exit 0 ;;
        *) die "unknown option $1 ($USAGE)" ;;
    esac
    shift
done
[[ -n "${VIRTUAL_ENV:-}" ]] || die "no active venv: source <venv>/bin/activate first"

# --- Site-specific: a C++17 compiler, CMake >= 3.13, the CUDA module's name ----
module load gcc/12                       # g++; add your site's cmake module if it has one
CUDA_MODULE=cuda                         # with --gpu: cuda/<torch.version.cuda> ("": none)
# -------------------------------------------------------------------------------
HOROVOD_VERSION=0.28.1

for tool in g++ cmake; do
    command -v "$tool" >/dev/null || die "$tool not found: load your site's module for it"
done
python -c "import torch" 2>/dev/null || die "torch is not installed in $VIRTUAL_ENV"

# A private build folder, removed however the script ends.
work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
if ((gpu)); then
    # nvcc of the CUDA version torch was built with, for Horovod's few CUDA kernels.
    cuda=$(python -c 'import torch; print(torch.version.cuda or "")')
    [[ -n $cuda ]] || die "--gpu needs a CUDA build of torch, and torch in $VIRTUAL_ENV is a" \
        "CPU build: install a CUDA torch first, or build without --gpu"
    if [[ -n $CUDA_MODULE ]]; then
        module load "$CUDA_MODULE/$cuda" 2>/dev/null \
            || die "torch was built with CUDA $cuda but there is no module $CUDA_MODULE/$cuda"
        nvcc=$(command -v nvcc) || die "no nvcc after module load $CUDA_MODULE/$cuda"
    else  # CUDA_MODULE="": the site's toolkit is on PATH
        nvcc=$(command -v nvcc) || die "no nvcc on PATH: install the CUDA $cuda toolkit, or set" \
            "CUDA_MODULE to your site's module"
    fi
    # The NCCL of the wheel (the nvidia-nccl pip package), the one torch loads: two NCCLs in
    # one process conflict. It has libnccl.so.2 but not the libnccl.so that CMake looks for.
    nccl=$(python -c 'import pathlib, torch
found = sorted(pathlib.Path(torch.__file__).parents[1].glob("nvidia/*/include/nccl.h"))
print(found[0].parents[1] if found else "")')
    [[ -n $nccl && -e $nccl/lib/libnccl.so.2 ]] \
        || die "the torch wheel brings no NCCL (nvidia-nccl pip package): reinstall torch from PyPI"
    mkdir -p "$work/nccl/lib"
    ln -s "$nccl/include" "$work/nccl/include"
    ln -s "$nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=$work/nccl HOROVOD_NCCL_LINK=SHARED
    HOROVOD_CUDA_HOME=$(dirname "$(dirname "$nvcc")")
    # GPU code for the GPUs torch itself has code for (sm_80 -> 80, sm_90a -> 90), not every
    # nvcc knows. The build's own list: torch.cuda.get_arch_list() is empty where no GPU is
    # visible, as on a login node, and Horovod's build stops on an empty list.
    HOROVOD_BUILD_CUDA_CC_LIST=$(python -c 'import torch
flags = getattr(torch._C, "_cuda_getArchFlags", lambda: "")() or ""
ccs = [a[3:].rstrip("af") for a in flags.split() if a.startswith("sm_")]
print(",".join(dict.fromkeys(cc for cc in ccs if cc.isdigit())))')
    [[ -n $HOROVOD_BUILD_CUDA_CC_LIST ]] || die "the torch in $VIRTUAL_ENV names no GPU" \
        "architecture (sm_XY) it was built for: reinstall torch from PyPI or the PyTorch wheel server"
    export HOROVOD_CUDA_HOME HOROVOD_BUILD_CUDA_CC_LIST
    echo "Building Horovod $HOROVOD_VERSION for GPU tensors: NCCL of $nccl, CUDA $cuda ($nvcc)"
else
    echo "Building Horovod $HOROVOD_VERSION for CPU tensors only (gloo)"
fi
env | grep '^HOROVOD_' | sort
((print_only)) && exit 0

# The wheel is built into the build folder, or with --wheel-dir into a folder of its own for
# this torch, Python and kind of build: the binary fits only the torch it was built against.
wheels=$work/dist
if [[ -n $wheel_dir ]]; then
    wheels=$wheel_dir/$(python -c 'import sys, torch
print(f"torch-{torch.__version__}-py{sys.version_info[0]}.{sys.version_info[1]}")')
    wheels+=-$( ((gpu)) && echo gpu || echo cpu)
fi
wheel=$(find "$wheels" -maxdepth 1 -name "horovod-$HOROVOD_VERSION-*.whl" 2>/dev/null | head -n 1) \
    || true
if [[ -n $wheel ]]; then
    echo "Installing $wheel, built earlier by this script (remove it to build again)"
else
    python -m pip download --quiet --no-deps --no-binary :all: --dest "$work" \
        "horovod==$HOROVOD_VERSION"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"

    # C++17 instead of C++14, in the two CMake files that set the standard.
    for file in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$file" \
            || die "no 'set(CMAKE_CXX_STANDARD 14)' in $file of horovod $HOROVOD_VERSION"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$file"
    done

    # Build against the venv's torch (no build isolation). Without build isolation, the build
    # tools must be in the venv.
    python -m pip install --quiet setuptools wheel
    jobs=$(nproc)
    export MAKEFLAGS=${MAKEFLAGS:-"-j$((jobs < 8 ? jobs : 8))"}
    python -m pip wheel --no-build-isolation --no-deps --wheel-dir "$work/built" "$src"
    built=$(find "$work/built" -name "horovod-$HOROVOD_VERSION-*.whl")
    # Into the folder under a hidden name first, then renamed: a build that stops halfway
    # leaves no wheel there that a later run would install.
    mkdir -p "$wheels"
    wheel=$wheels/$(basename "$built")
    cp "$built" "$wheels/.partial.$$"
    mv "$wheels/.partial.$$" "$wheel"
fi
# Replaces a Horovod of the same version already in the venv, then adds its dependencies.
python -m pip install --quiet --force-reinstall --no-deps "$wheel"
python -m pip install "$wheel"

horovodrun --check-build
echo "Horovod $HOROVOD_VERSION installed in $VIRTUAL_ENV"
