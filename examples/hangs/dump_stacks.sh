#!/bin/bash
# Print the Python stack of every process of a running Slurm job, node by node, with py-spy.
#
#     bash dump_stacks.sh <job id>
# Run it from the login node with the job's venv active (pip install py-spy). It starts one
# task per node of the job with `srun --overlap`, which shares the job's CPUs instead of
# waiting for free ones, and dumps every Python process of that job on that node. --label
# starts each line with the number of the node's task (0: for the first node), since the
# nodes' lines arrive mixed: sort -s -n -k1,1 puts each node's lines together.
set -euo pipefail
job=${1:?usage: bash dump_stacks.sh JOB_ID}
command -v py-spy > /dev/null || { echo "dump_stacks.sh: no py-spy: pip install py-spy in the venv" >&2; exit 1; }

if [[ -z ${DUMP_STACKS_ON_NODE:-} ]]; then  # on the login node: one task on each node
  nodes=$(squeue --noheader --jobs "$job" --states=RUNNING --format=%D 2> /dev/null || true)
  [[ -n $nodes ]] || { echo "dump_stacks.sh: job $job is not running" >&2; exit 1; }
  exec srun --jobid="$job" --overlap --nodes="$nodes" --ntasks-per-node=1 --cpus-per-task=1 \
    --label --export=ALL,DUMP_STACKS_ON_NODE=1 bash "$(realpath "$0")" "$job"
fi

# On a node of the job: its Python processes are those whose environment holds its job id.
node=${SLURMD_NODENAME:-$(hostname)}
found=0
for pid in $(pgrep -u "$(id -u)" '^python'); do
  environ=/proc/$pid/environ
  grep -qzx "SLURM_JOB_ID=$job" "$environ" 2> /dev/null || continue
  grep -qzx "SLURMD_NODENAME=$node" "$environ" 2> /dev/null || continue
  grep -qzx "DUMP_STACKS_ON_NODE=1" "$environ" 2> /dev/null && continue   # not this script's
  found=1
  echo "=== $node, process $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline")"
  py-spy dump --pid "$pid" || echo "(py-spy could not read process $pid: see the page)"
done
((found)) || echo "=== $node: no Python process of job $job"
