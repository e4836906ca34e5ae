#!/bin/bash
# Submit the whole sweep to PBS from a login node: the array job, then the job that collects
# its results once every subjob has ended (-W depend=afterany). Options go to sweep_train.py.
# sweep.csv is first copied into a folder of this submission's own, sweeps/<date>-<time>-<xxxx>/:
# the subjobs read their rows from that copy and write their results beside it, so that a
# sweep.csv rewritten while subjobs still wait in the queue changes nothing they run, and a
# failed subjob leaves no result there: no result of an earlier sweep stands in for it.
# afterany starts the collecting job however the subjobs ended: collect_results.py names each
# row without a valid result and fails, and you rerun that row alone.
#
#     python make_sweep.py --lr 0.1 0.01 --batch-size 32 128
#     bash submit_sweep_pbs.sh --epochs 5
# MAX_RUNNING (default 4) caps how many subjobs run at once.
set -euo pipefail
[[ -f sweep.csv ]] || { echo "submit_sweep_pbs.sh: no sweep.csv here: run make_sweep.py first" >&2; exit 1; }
rows=$(($(wc -l < sweep.csv) - 1))   # rows without the header
((rows > 0)) || { echo "submit_sweep_pbs.sh: sweep.csv has no configuration" >&2; exit 1; }
max=${MAX_RUNNING:-4}
[[ $max =~ ^[1-9][0-9]*$ ]] || { echo "submit_sweep_pbs.sh: MAX_RUNNING=$max is not a whole number above 0" >&2; exit 1; }
for arg in "$@"; do   # PBS passes them in ARGS, quoted ('...') in the comma-separated qsub -v list
    [[ $arg != *"'"* ]] || { echo "submit_sweep_pbs.sh: an option with a ' cannot pass through qsub -v: $arg" >&2; exit 1; }
done

# The sweep as submitted, read-only, in a new folder that the subjobs and the collecting job get.
mkdir -p sweeps
sweep_dir=$(mktemp -d "sweeps/$(date +%Y%m%d-%H%M%S)-XXXX")
cp sweep.csv "$sweep_dir/sweep.csv"
chmod a-w "$sweep_dir/sweep.csv"

# Indices 0 to rows-1. A range needs two numbers: one row is 0-1:2 (from 0 to 1 in steps of 2).
range="0-$((rows - 1))%$max"
((rows > 1)) || range="0-1:2"
array=$(qsub -J "$range" -v "SWEEP_DIR=$sweep_dir,ARGS='$*'" sweep.pbs)
collect=$(qsub -W "depend=afterany:$array" -v "SWEEP_DIR=$sweep_dir" collect.pbs)
echo "Submitted array job $array ($rows rows) and collect job $collect (after all end)"
echo "Sweep and results in $sweep_dir; rerun row N there alone with -J N-<N+1>:2, e.g. row 2:"
echo "    qsub -J 2-3:2 -v \"SWEEP_DIR=$sweep_dir,ARGS='$*'\" sweep.pbs"
echo "Watch them with: qstat -u \"\$USER\" -t"
