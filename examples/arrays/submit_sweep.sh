#!/bin/bash
# Submit the whole sweep from a login node: the job array, then the job that collects its
# results, which waits until every task has succeeded (afterok). Options go to sweep_train.py.
#
#     python make_sweep.py --lr 0.1 0.01 --batch-size 32 128
#     bash submit_sweep.sh --epochs 5
# MAX_RUNNING (default 4) caps how many tasks run at once.
set -euo pipefail
[[ -f sweep.csv ]] || { echo "submit_sweep.sh: no sweep.csv here: run make_sweep.py first" >&2; exit 1; }
tasks=$(($(wc -l < sweep.csv) - 1))   # rows without the header
((tasks > 0)) || { echo "submit_sweep.sh: sweep.csv has no configuration" >&2; exit 1; }

# --parsable prints the job id alone (and ";cluster" on multi-cluster sites).
array=$(sbatch --parsable --array="0-$((tasks - 1))%${MAX_RUNNING:-4}" sweep.sbatch "$@")
array=${array%%;*}
collect=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes collect.sbatch)
collect=${collect%%;*}
echo "Submitted array job $array ($tasks tasks) and collect job $collect (after all succeed)"
echo "Watch them with: squeue --me --jobs $array,$collect"
