#!/bin/bash
# TaskProlog of the tests' cluster: before each task of a job step starts, append what Slurm
# allocated to that step to the run folder's log/steps.log, one line per task:
#     <job id>.<step id> task=<rank> <the step's CPUs=, Tasks= and cpus-per-task as scontrol shows them>
# The tests read it to check that each srun step got the cores the job asked for (Slurm 22.05
# to 23.02: srun does not inherit --cpus-per-task from the batch job). They submit jobs with
# SLURM_EXACT=1 (srun --exact): then a step's CPUs= is its tasks x srun's cores per task, where
# without it a step gets all of the job's cores, however few srun asked for per task.
[[ ${SLURM_STEP_ID:-batch} =~ ^[0-9]+$ ]] || exit 0   # the batch and extern steps: nothing to check
step=$(scontrol show step --oneliner "$SLURM_JOB_ID.$SLURM_STEP_ID" 2>&1)
fields=$(grep -oE '\b(CPUs|Tasks|CpusPerTask|TRES)=[^ ]*' <<<"$step" | tr '\n' ' ')
echo "$SLURM_JOB_ID.$SLURM_STEP_ID task=${SLURM_PROCID:-?} $fields" >> "@RUN@/log/steps.log"
exit 0
