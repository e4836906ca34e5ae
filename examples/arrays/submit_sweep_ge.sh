#!/bin/bash
# Submit the whole sweep to Grid Engine from a login node: the array job, then the job that
# collects its results once every task has ended (-hold_jid). Options go to sweep_train.py.
# Grid Engine has no "after success only": collect_results.py names a task without a result
# and fails, and you rerun that task with qsub -t N sweep.qsub.
#
#     python make_sweep.py --lr 0.1 0.01 --batch-size 32 128
#     bash submit_sweep_ge.sh --epochs 5
# MAX_RUNNING (default 4) caps how many tasks run at once.
set -euo pipefail
[[ -f sweep.csv ]] || { echo "submit_sweep_ge.sh: no sweep.csv here: run make_sweep.py first" >&2; exit 1; }
tasks=$(($(wc -l < sweep.csv) - 1))   # rows without the header
((tasks > 0)) || { echo "submit_sweep_ge.sh: sweep.csv has no configuration" >&2; exit 1; }

# -terse prints "<job id>.<first>-<last>:<step>" for an array job: keep the job id.
array=$(qsub -terse -t "1-$tasks" -tc "${MAX_RUNNING:-4}" sweep.qsub "$@")
array=${array%%.*}
collect=$(qsub -terse -hold_jid "$array" collect.qsub)
echo "Submitted array job $array ($tasks tasks) and collect job $collect (after all end)"
echo "Watch them with: qstat -u \"\$USER\""
