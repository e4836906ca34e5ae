#!/bin/bash
# Build Horovod 0.28.1 from source for the PyTorch of the active venv (gloo, no MPI).
#
# Horovod's last release, 0.28.1, no longer builds with a plain `pip install horovod` on current
# PyTorch: pip's build isolation hides torch from it, and its CMake files ask for C++14 where
# torch's headers need C++17. This script downloads the source, switches it to C++17 and builds
# it against the torch already in the venv. Run it once, on a login node (it downloads):
#     source ~/venvs/pytorch/bin/activate          # the venv from make_venv.sh
#     bash install_horovod.sh                      # several minutes
# Then: horovodrun -np 2 -H localhost:2 --gloo python horovod_train.py --fake-data
set -euo pipefail

die() {
    echo "install_horovod.sh: error: $*" >&2
    exit 1
}

[[ -n "${VIRTUAL_ENV:-}" ]] || die "no active venv: source <venv>/bin/activate first"

# --- Site-specific: a C++17 compiler and CMake >= 3.13 -------------------------
module load gcc/12                       # g++; add your site's cmake module if it has one
# -------------------------------------------------------------------------------
HOROVOD_VERSION=0.28.1

for tool in g++ cmake; do
    command -v "$tool" >/dev/null || die "$tool not found: load your site's module for it"
done
python -c "import torch" 2>/dev/null || die "torch is not installed in $VIRTUAL_ENV"

# A private build folder, removed however the script ends.
work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

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

# Build against the venv's torch (no build isolation), with gloo and without MPI. Without
# build isolation, the build tools must be in the venv.
python -m pip install --quiet setuptools wheel
jobs=$(nproc)
export MAKEFLAGS=${MAKEFLAGS:-"-j$((jobs < 8 ? jobs : 8))"}
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    python -m pip install --no-build-isolation "$src"

horovodrun --check-build
echo "Horovod $HOROVOD_VERSION installed in $VIRTUAL_ENV"
