#!/bin/bash
# The GPU evidence in one call of the device tool (see ../shared/notes/gpu.md): the GPU test
# suite, then the measurements the pages show, each under its own time limit, all written to
# OUTPUT_DIR/gpu-evidence.tgz (the device tool brings back at most 8 files, so everything travels
# in one archive). Unpack it into tests/records/gpu-run-<date>/ and copy its gpu.json to
# tests/records/gpu.json.
# Usage: bash tests/tools/gpu_evidence.sh OUTPUT_DIR [SECONDS_FOR_THE_TESTS]
set -u -o pipefail
archive=${1:?usage: gpu_evidence.sh OUTPUT_DIR [SECONDS_FOR_THE_TESTS]}/gpu-evidence.tgz
out=$(mktemp -d)
trap 'tar czf "$archive" -C "$out" . && rm -rf "$out"' EXIT
test_budget=${2:-300}
examples=$PWD/examples
export PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$SECONDS
stamp() { echo ">>> $((SECONDS - start)) s: $*" | tee -a "$out/timeline.txt"; }
mps_runs() {  # $1: file prefix; one run each with 1, 2 and 4 replicas on the GPU
  for n in 1 2 4; do
    timeout 60 torchrun --standalone --nproc-per-node=$n "$examples/mps/mps_ddp.py" \
      --device cuda --fake-data --epochs 2 > "$out/$1-$n.txt" 2>&1
    echo "rc=$?" >> "$out/$1-$n.txt"
  done
}

stamp "machine"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1

stamp "make test-gpu, $test_budget s"
timeout -k 20 -s INT "$test_budget" python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark \
  -n 4 -rA --junitxml="$out/gpu-junit.xml" > "$out/gpu-tests.log" 2>&1
echo "rc=$?" >> "$out/gpu-tests.log"
cp tests/records/gpu.json "$out/" 2>/dev/null

stamp "check_pytorch.py, precision.py, cnn_gpu.py --benchmark"
timeout 60 python3 "$examples/install/check_pytorch.py" --device cuda > "$out/check_pytorch-cuda.out" 2>&1
timeout 60 python3 "$examples/precision/precision.py" --device cuda --size 4096 > "$out/precision-gpu.txt" 2>&1
timeout 120 python3 "$examples/one-gpu/cnn_gpu.py" --device cuda --fake-data --fake-size 100000 \
  --epochs 2 --benchmark > "$out/cnn-benchmark.txt" 2>&1

stamp "MPS: replicas without, then with the daemon"
mps_runs mps-no-daemon
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-evidence/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-evidence/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
{ nvidia-cuda-mps-control -d; echo "rc=$?"; } > "$out/mps-daemon-start.txt" 2>&1
mps_runs mps-daemon
echo quit | nvidia-cuda-mps-control
cat "$CUDA_MPS_LOG_DIRECTORY/control.log" >> "$out/mps-daemon-start.txt" 2>/dev/null
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

stamp "ResNet-50 amp_bf16 training, batch 256, channels_last (the page's target)"
timeout 120 python3 "$examples/benchmark/resnet_benchmark.py" --models resnet50 --modes train \
  --precisions amp_bf16 --batch-size 256 --channels-last --steps 30 \
  --output-dir "$out/resnet50" > "$out/resnet50.log" 2>&1

# At the source's settings (batch 12, 224x224, no channels_last), so that the rows can be
# appended to examples/benchmark/resnet_benchmark.csv and join the page's table.
stamp "ResNet family, one model at a time, until 560 s"
for model in resnet18 resnet34 resnet50 resnet101 resnet152 resnext50_32x4d \
  resnext101_32x8d wide_resnet50_2 wide_resnet101_2; do
  left=$((560 - (SECONDS - start)))
  ((left > 15)) || break
  timeout "$left" python3 "$examples/benchmark/resnet_benchmark.py" --models "$model" \
    --precisions double,float,half,bfloat16,amp_bf16 --warmup 5 --steps 20 --output-dir "$out/family" >> "$out/family.log" 2>&1
done
stamp "done"
