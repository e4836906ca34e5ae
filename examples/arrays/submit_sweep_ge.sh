#!/bin/bash
# Submit the whole sweep to Grid Engine from a login node: the array job, then the job that
# collects its results once every task has ended (-hold_jid). Options go to sweep_train.py.
# sweep.csv is first copied into a folder of this submission's own, sweeps/<date>-<time>-<xxxx>/:
# the tasks read their rows from that copy and write their results beside it, so that a
# sweep.csv rewritten while tasks still wait in the queue changes nothing they run, and a
# failed task leaves no result there: no result of an earlier sweep stands in for it.
# Grid Engine has no "after success only": collect_results.py names each task without a valid
# result and fails, and you rerun that task alone.
#
#     python make_sweep.py --lr 0.1 0.01 --batch-size 32 128
#     bash submit_sweep_ge.sh --epochs 5
# MAX_RUNNING (default 4) caps how many tasks run at once.
set -euo pipefail
[[ -f sweep.csv ]] || { echo "submit_sweep_ge.sh: no sweep.csv here: run make_sweep.py first" >&2; exit 1; }
tasks=$(($(wc -l < sweep.csv) - 1))   # rows without the header
((tasks > 0)) || { echo "submit_sweep_ge.sh: sweep.csv has no configuration" >&2; exit 1; }

# The sweep as submitted, read-only, in a new folder that the tasks and the collecting job get.
mkdir -p sweeps
sweep_dir=$(mktemp -d "sweeps/$(date +%Y%m%d-%H%M%S)-XXXX")
cp sweep.csv "$sweep_dir/sweep.csv"
chmod a-w "$sweep_dir/sweep.csv"

# -terse prints "<job id>.<first>-<last>:<step>" for an array job: keep the job id.
array=$(qsub -terse -t "1-$tasks" -tc "${MAX_RUNNING:-4}" -v SWEEP_DIR="$sweep_dir" sweep.qsub "$@")
array=${array%%.*}
collect=$(qsub -terse -hold_jid "$array" -v SWEEP_DIR="$sweep_dir" collect.qsub)
echo "Submitted array job $array ($tasks tasks) and collect job $collect (after all end)"
echo "Sweep and results in $sweep_dir; rerun row N there (task N+1) with:"
echo "    qsub -t N+1 -v SWEEP_DIR=$sweep_dir sweep.qsub $*"
echo "Watch them with: qstat -u \"\$USER\""
