#!/bin/bash
# A follow-up to gpu_evidence.sh for one device call: the ResNet family models run b did not
# reach, the MPS runs without and with the daemon, then the GPU suite in the time left. All in
# $OUT/gpu-evidence.tgz, packed after each step so that a call cut off still returns what it did.
set -u
o=$(mktemp -d); s=$SECONDS; e=$PWD/examples; export PYTHONUNBUFFERED=1
pack() { echo ">>> $((SECONDS - s)) s: $*" >> "$o/timeline.txt"; tar czf "$OUT/gpu-evidence.tgz" -C "$o" .; }
nvidia-smi > "$o/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$o/gpu.txt" 2>&1
pack start
for m in resnext101_32x8d wide_resnet50_2 wide_resnet101_2; do
  timeout 110 python3 "$e/benchmark/resnet_benchmark.py" --models "$m" \
    --precisions double,float,half,bfloat16,amp_bf16 --warmup 5 --steps 20 \
    --output-dir "$o/family" >> "$o/family.log" 2>&1
  echo "rc=$?" >> "$o/family.log"; pack "family $m"
done
mps() {
  for n in 1 2 4; do
    timeout 40 torchrun --standalone --nproc-per-node=$n "$e/mps/mps_ddp.py" --device cuda \
      --fake-data --epochs 2 > "$o/$1-$n.txt" 2>&1
    echo "rc=$?" >> "$o/$1-$n.txt"
  done
}
mps mps-no-daemon; pack "mps without daemon"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mpse/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mpse/log
mkdir -p /tmp/mpse/pipe /tmp/mpse/log
{ nvidia-cuda-mps-control -d; echo "rc=$?"; } > "$o/mps-daemon-start.txt" 2>&1
mps mps-daemon
echo quit | nvidia-cuda-mps-control
cat /tmp/mpse/log/control.log >> "$o/mps-daemon-start.txt" 2>/dev/null
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; pack "mps with daemon"
left=$((530 - (SECONDS - s)))
if ((left > 60)); then
  timeout -k 10 -s INT "$left" python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark -n 4 \
    -rA > "$o/gpu-tests.log" 2>&1
  echo "rc=$?" >> "$o/gpu-tests.log"
  cp tests/records/gpu.json "$o/gpu-run.json" 2>/dev/null
fi
pack finished
