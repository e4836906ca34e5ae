#!/bin/bash
# Build OpenPBS once per machine into the tests' cache (make clean-cache removes it), from the
# upstream repository at a pinned commit, or, where the machine cannot reach it, from the offline
# copy of that commit in ../shared/mirror/ (checked against its sha256). Needs root (apt-get).
#
#     bash tests/pbs/build.sh         # prints the install prefix (PBS_EXEC)
#
# Debian has no OpenPBS package. The build took 4 minutes on 2 idle cores, about 20 on 2 busy
# ones. OPENPBS_UPSTREAM and OPENPBS_MIRROR name another repository or archive.
set -euo pipefail

COMMIT=cd7ab5edaf03dcac2f1cb9e2f42d75eb117d468a
SHA256=99d7e9fd6661c215b0f7405713520a61c837400ceaf08013c31c8a285d9df2c9
VERSION=23.06.06
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${PYTORCH_ON_HPC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pytorch-on-hpc}
prefix=$cache/openpbs-${COMMIT:0:12}
# The offline copy: ../shared/mirror/ beside the clone (OPENPBS_MIRROR names another).
archive=openpbs-${COMMIT:0:12}.tar.gz
mirror=${OPENPBS_MIRROR:-}
if [[ -z $mirror ]]; then
    for dir in "$here/../../../shared/mirror" /work/shared/mirror; do
        [[ -f $dir/$archive ]] && { mirror=$dir/$archive; break; }
    done
fi
DEPS=(gcc make libtool autoconf automake libhwloc-dev libx11-dev libxt-dev libedit-dev
      libical-dev libncurses-dev perl postgresql postgresql-server-dev-all postgresql-contrib
      python3-dev tcl-dev tk-dev swig libexpat1-dev libssl-dev libxext-dev libxft-dev
      libcjson-dev)

die() { echo "tests/pbs/build.sh: $*" >&2; exit 1; }

if [[ -x $prefix/sbin/pbs_server.bin && -f $prefix/.built ]]; then
    echo "$prefix"
    exit 0
fi
[[ $(id -u) -eq 0 ]] || die "needs root (it installs OpenPBS's build dependencies with apt-get)"

missing=()
for p in "${DEPS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
    echo "Installing OpenPBS's build dependencies: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

work=$(mktemp -d /var/tmp/openpbs-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
# Upstream first, at the pinned commit; the offline copy of the same commit otherwise.
if timeout 60 git clone -q --filter=blob:none "${OPENPBS_UPSTREAM:-https://github.com/openpbs/openpbs}" "$work/src" \
        2>/dev/null && git -C "$work/src" checkout -q "$COMMIT" 2>/dev/null; then
    echo "OpenPBS source: github.com/openpbs/openpbs at ${COMMIT:0:12}" >&2
else
    rm -rf "$work/src"
    [[ -n $mirror && -f $mirror ]] || die "cannot reach github.com/openpbs/openpbs and found no offline copy $archive (../shared/mirror/ beside the clone, or OPENPBS_MIRROR=path)"
    echo "$SHA256  $mirror" | sha256sum --check --quiet - \
        || die "$mirror is not upstream commit ${COMMIT:0:12} (sha256 differs)"
    mkdir "$work/src"
    tar -xzf "$mirror" -C "$work/src" --strip-components=1
    echo "OpenPBS source: $mirror (upstream ${COMMIT:0:12})" >&2
fi

cd "$work/src"
log=$work/build.log
echo "Building OpenPBS $VERSION into $prefix (about 20 minutes; log: $log)" >&2
{
    ./autogen.sh
    # The system Python, whose headers Debian installs with python3-dev.
    PYTHON=/usr/bin/python3 ./configure --prefix="$prefix"
    make -j"$(nproc)"
    rm -rf "$prefix"
    make install
} >"$log" 2>&1 || { tail -30 "$log" >&2; trap - EXIT; die "the build failed; the whole log is $log"; }
echo "$VERSION $COMMIT" > "$prefix/.built"
echo "$prefix"
