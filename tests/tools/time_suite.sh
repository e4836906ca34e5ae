#!/bin/bash
# The benchmark of the test suite itself (README.md, "How long make test takes"): clone the
# repository afresh, as a contributor or CI does, and time `make test` there (the venv made
# from requirements.txt included), then print one row for README's table.
#
#   bash tests/tools/time_suite.sh warm   # the machine's cache as it is (Horovod's wheel,
#                                         # DeepSpeed's ops, the site builds): the usual case
#   bash tests/tools/time_suite.sh cold   # an empty cache: everything built again
#   bash tests/tools/time_suite.sh busy   # warm, with a second suite running beside it
#
# Needs root (the Slurm and Grid Engine tests), the system packages (make system-packages) and
# a committed tree: the clone has what HEAD has. The clone and its logs stay in
# ${TMPDIR:-/tmp}/time-suite-<mode>/ for a look afterwards.
set -euo pipefail
mode=${1:-warm}
case $mode in warm | cold | busy) ;; *) echo "usage: $0 warm|cold|busy" >&2; exit 2 ;; esac
repo=$(git -C "$(dirname "$0")/../.." rev-parse --show-toplevel)
work=${TMPDIR:-/tmp}/time-suite-$mode
rm -rf "$work"
mkdir -p "$work"
clone() {
    git clone --quiet "$repo" "$1"
}
clone "$work/clone"
if [[ $mode == cold ]]; then
    export PYTORCH_ON_HPC_CACHE=$work/empty-cache
fi
if [[ $mode == busy ]]; then  # a second suite beside it, in a clone of its own
    clone "$work/other"
    (cd "$work/other" && make test >"$work/other.log" 2>&1) &
    other=$!
fi
start=$SECONDS
status=0
(cd "$work/clone" && make test) >"$work/make-test.log" 2>&1 || status=$?
seconds=$((SECONDS - start))
if [[ $mode == busy ]]; then
    wait "$other" || echo "the suite beside it failed: $work/other.log" >&2
fi
summary=$(grep -E '^=+ .*(passed|failed).* in ' "$work/make-test.log" | tail -1 | tr -d '=' | xargs)
printf '| %s | %s | %d cores | %d min %02d s | %s | %s |\n' "$(date +%F)" "$mode" "$(nproc)" \
    $((seconds / 60)) $((seconds % 60)) "$summary" "$(git -C "$repo" rev-parse --short HEAD)"
exit "$status"
