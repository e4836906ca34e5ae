#!/bin/bash
# Submit the whole sweep from a login node: the job array, then the job that collects its
# results, which waits until every task has succeeded (afterok). Options go to sweep_train.py.
# sweep.csv is first copied into a folder of this submission's own, sweeps/<date>-<time>-<xxxx>/:
# the tasks read their rows from that copy and write their results beside it, so that a
# sweep.csv rewritten while tasks still wait in the queue changes nothing they run.
#
#     python make_sweep.py --lr 0.1 0.01 --batch-size 32 128
#     bash submit_sweep.sh --epochs 5
# MAX_RUNNING (default 4) caps how many tasks run at once.
set -euo pipefail
[[ -f sweep.csv ]] || { echo "submit_sweep.sh: no sweep.csv here: run make_sweep.py first" >&2; exit 1; }
tasks=$(($(wc -l < sweep.csv) - 1))   # rows without the header
((tasks > 0)) || { echo "submit_sweep.sh: sweep.csv has no configuration" >&2; exit 1; }

# The sweep as submitted, read-only, in a new folder that the tasks and the collecting job get.
mkdir -p sweeps
sweep_dir=$(mktemp -d "sweeps/$(date +%Y%m%d-%H%M%S)-XXXX")
cp sweep.csv "$sweep_dir/sweep.csv"
chmod a-w "$sweep_dir/sweep.csv"

# --parsable prints the job id alone (and ";cluster" on multi-cluster sites).
array=$(sbatch --parsable --array="0-$((tasks - 1))%${MAX_RUNNING:-4}" \
    --export=ALL,SWEEP_DIR="$sweep_dir" sweep.sbatch "$@")
array=${array%%;*}
collect=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
    --export=ALL,SWEEP_DIR="$sweep_dir" collect.sbatch)
collect=${collect%%;*}
echo "Submitted array job $array ($tasks tasks) and collect job $collect (after all succeed)"
echo "Sweep and results in $sweep_dir; rerun a task N there with:"
echo "    sbatch --array=N --export=ALL,SWEEP_DIR=$sweep_dir sweep.sbatch $*"
echo "Watch them with: squeue --me --jobs $array,$collect"
