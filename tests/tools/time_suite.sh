#!/bin/bash
# The benchmark of the test suite itself: clone the repository afresh, as a contributor or CI
# does, time what a mode runs there, and add one row to the measurement log beside this file,
# tests/tools/suite-times.md (README.md shows the latest figures).
#
#   bash tests/tools/time_suite.sh warm     # make test, the machine's cache as it is (OpenPBS,
#                                           # Horovod's wheel, DeepSpeed's ops, the site builds)
#   bash tests/tools/time_suite.sh cold     # make test, an empty cache: everything built again
#   bash tests/tools/time_suite.sh busy     # warm, with a second suite running beside it
#   bash tests/tools/time_suite.sh ci       # CI=true .ci/run, as this workplace's CI runs it
#   bash tests/tools/time_suite.sh quick    # make test-quick
#   bash tests/tools/time_suite.sh changed [FILE]   # make test-changed after a one-line change
#                                           # to FILE (examples/troubleshooting/memory_growth.py);
#                                           # (quick, changed: the clone's venv and Node
#                                           # packages are made first, not timed, as a
#                                           # contributor has them)
#
# The clone has a venv of its own (made from requirements.txt, timed except in `quick` and
# `changed`).
# Needs root (the schedulers' tests), the system packages (make system-packages) and a
# committed tree: the clone has what HEAD has. The clone and its logs stay in
# ${TMPDIR:-/tmp}/time-suite-<mode>/ for a look afterwards.
set -euo pipefail
mode=${1:-warm}
case $mode in warm | cold | busy | ci | quick | changed) ;; *)
    echo "usage: $0 warm|cold|busy|ci|quick|changed [FILE]" >&2
    exit 2
    ;;
esac
file=${2:-examples/troubleshooting/memory_growth.py}
repo=$(git -C "$(dirname "$0")/../.." rev-parse --show-toplevel)
log=$repo/tests/tools/suite-times.md
work=${TMPDIR:-/tmp}/time-suite-$mode
rm -rf "$work"
mkdir -p "$work"
clone() {
    git clone --quiet "$repo" "$1"
}
clone "$work/clone"
command=(make test)
what="\`make test\` in a fresh clone, $mode"
case $mode in
cold) export PYTORCH_ON_HPC_CACHE=$work/empty-cache ;;
busy) # a second suite beside it, in a clone of its own
    clone "$work/other"
    (cd "$work/other" && make test >"$work/other.log" 2>&1) &
    other=$!
    ;;
ci)
    command=(env CI=true bash .ci/run)
    what="\`CI=true .ci/run\` on a fresh clone"
    ;;
quick)
    (cd "$work/clone" && make venv node-packages) >"$work/venv.log" 2>&1
    command=(make test-quick)
    what="\`make test-quick\` in a fresh clone (venv and Node packages made before)"
    ;;
changed)
    [[ -f $work/clone/$file ]] || { echo "$0: no $file in the repository" >&2; exit 2; }
    (cd "$work/clone" && make venv node-packages) >"$work/venv.log" 2>&1
    case $file in  # a line that changes the file, not what the tests expect of it
    *.md) echo >>"$work/clone/$file" ;;  # a blank line: no new message for the catalogs
    *) echo "# a one-line change" >>"$work/clone/$file" ;;
    esac
    command=(make test-changed)
    what="\`make test-changed\` after a one-line change to \`$file\` (venv and Node packages made before)"
    ;;
esac
start=$SECONDS
status=0
(cd "$work/clone" && "${command[@]}") >"$work/run.log" 2>&1 || status=$?
seconds=$((SECONDS - start))
if [[ $mode == busy ]]; then
    wait "$other" || echo "the suite beside it failed: $work/other.log" >&2
fi
# (|| true: a run that ended before pytest's summary still gets its row)
summary=$(grep -E '^=+ .*(passed|failed).* in ' "$work/run.log" | head -1 | tr -d '=' | xargs || true)
if [[ $mode == ci ]]; then
    summary="$(grep -o 'make test: [0-9]* s' "$work/run.log" | tail -1 || true); $summary"
fi
if [[ $mode == changed ]]; then
    summary="$(grep -c '^    examples/' "$work/run.log" || true) example mapped; $summary"
fi
[[ $status == 0 ]] || summary="FAILED (exit $status): $summary"
row=$(printf '| %s | %s | %s | %d cores | %d min %02d s | %s |' "$(date +%F)" "$what" \
    "$(git -C "$repo" rev-parse --short HEAD)" "$(nproc)" $((seconds / 60)) $((seconds % 60)) \
    "$summary")
echo "$row"
echo "$row" >>"$log"
exit "$status"
