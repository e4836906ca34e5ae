"""Measure the error and the speed of a matrix product in each floating-point mode.

Multiplies two random square matrices in float64 (the reference), float32, TF32 (GPUs from
Ampere on), bfloat16 and float16, and prints a table: the largest error against float64,
relative to the largest value, and the time and speed of one product. Then it trains a small
model for a few steps with automatic mixed precision (torch.amp) in the dtype --amp selects.

    python precision.py --device cuda --size 8192
    sbatch precision.sbatch
"""

import argparse
import glob
import math
import os
import statistics
import sys
import time


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def train_steps(text):
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2: the first and the last loss are compared (got {text})"
        )
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--size", type=positive_int, default=4096, help="rows and columns of the matrices"
    )
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed products per mode")
    parser.add_argument("--amp", choices=["bf16", "fp16", "none"], default="bf16")
    parser.add_argument("--train-steps", type=train_steps, default=20, help="mixed-precision steps")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)


def fail(message):
    print(f"precision.py: error: {message}", file=sys.stderr)
    sys.exit(2)


# The scheduler's word that this job was given GPUs: lists of GPU indices ("0" is a GPU), then
# counts ("0" is none; the guide's .pbs scripts export JOB_GPUS from the job's request).
GPU_LIST_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SGE_HGR_gpu")
GPU_COUNT_VARIABLES = ("PBS_NGPUS", "JOB_GPUS")
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")
# Signs of an Apptainer/Singularity or Podman container (Docker passes no job variables in).
CONTAINER_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")
CONTAINER_FILES = ("/.singularity.d", "/run/.containerenv")


def gpus_given():
    """'NAME=value' of the first scheduler variable that gave this job GPUs, or None. Inside a
    Slurm step (srun), SLURM_JOB_GPUS is the job's, copied into every step: it does not count."""
    for name in GPU_LIST_VARIABLES + GPU_COUNT_VARIABLES:
        value = os.environ.get(name, "").strip()
        none = ("", "0") if name in GPU_COUNT_VARIABLES else ("", "(null)", "-1", "NoDevFiles")
        in_step = name == "SLURM_JOB_GPUS" and "SLURM_STEP_ID" in os.environ
        if value not in none and not in_step:
            return f"{name}={value}"
    return None


def gpu_usable(torch):
    """True when PyTorch can use a GPU. When it cannot in a job given GPUs, on a node with GPU
    device files or in a container (started without GPU support), stop in one line: a job given
    GPUs never trains on the CPU unnoticed. A bare CUDA_VISIBLE_DEVICES counts on a GPU node."""
    if torch.cuda.is_available():
        return True
    devices = any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)
    container = any(os.environ.get(name) for name in CONTAINER_VARIABLES) or any(
        os.path.exists(path) for path in CONTAINER_FILES
    )
    given = gpus_given() if devices or container else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if devices and not given and visible not in ("", "(null)", "-1", "NoDevFiles"):
        given = f"CUDA_VISIBLE_DEVICES={visible}"
    if given:
        fix = "run check_pytorch.py in the job to see why"
        if not devices:  # a container started without them
            fix = "start the container with GPU support (apptainer --nv, podman --gpus all)"
        fail(f"this job was given GPUs ({given}) but PyTorch {torch.__version__} can use none: "
             f"{fix}, or pass --device cpu")  # fmt: skip
    return False


def announce_gpu(torch, device):
    """One line per process that runs on a GPU: make site-check counts the GPUs that ran."""
    props = torch.cuda.get_device_properties(device)
    print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)


def set_tf32(torch, enabled):
    """Allow TF32 in float32 matrix products, or not. set_float32_matmul_precision works on
    every release since 1.12 and keeps the legacy and the per-backend settings consistent;
    setting torch.backends.cuda.matmul.fp32_precision instead makes
    torch.get_float32_matmul_precision() raise on 2.9 to 2.13, and Lightning calls it."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")


def time_product(torch, a, b, repeats):
    """Median seconds of one product, after a warm-up, waiting for the GPU each time."""
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    torch.mm(a, b)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare_modes(torch, device, size, repeats):
    a64 = torch.randn(size, size, dtype=torch.float64, device=device)
    b64 = torch.randn(size, size, dtype=torch.float64, device=device)
    reference = torch.mm(a64, b64)
    scale = reference.abs().max().item()
    modes = [
        ("float64", torch.float64, False),
        ("float32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bfloat16", torch.bfloat16, False),
        ("float16", torch.float16, False),
    ]
    print(f"{'mode':<10}{'max error / max value':>24}{'time (ms)':>12}{'TFLOP/s':>10}")
    for name, dtype, tf32 in modes:
        if tf32 and device.type != "cuda":
            print(f"{name:<10}{'(needs an NVIDIA GPU, Ampere or newer)':>46}")
            continue
        set_tf32(torch, tf32)
        a, b = a64.to(dtype), b64.to(dtype)
        error = (torch.mm(a, b).double() - reference).abs().max().item() / scale
        seconds = time_product(torch, a, b, repeats)
        print(
            f"{name:<10}{error:>24.1e}{seconds * 1e3:>12.2f}{2 * size**3 / seconds / 1e12:>10.2f}"
        )
    set_tf32(torch, False)


def train_with_amp(torch, device, amp, steps):
    """A few optimizer steps of a small model, with autocast and, for float16, a GradScaler."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": torch.float32}[amp]
    # float16 gradients can underflow to zero: the scaler multiplies the loss before backward
    # and divides the gradients again before the step. bfloat16 has float32's range: no scaler.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    inputs = torch.randn(512, 64, device=device)
    targets = inputs[:, :8].sum(dim=1, keepdim=True)
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        with torch.amp.autocast(device.type, dtype=dtype, enabled=amp != "none"):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            fail(f"loss is {losses[-1]} at step {step} with --amp {amp}: try another --amp")
    return losses


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        announce_gpu(torch, device)
    torch.manual_seed(args.seed)
    name = torch.cuda.get_device_name(device) if use_cuda else "CPU"
    print(f"Matrix product of {args.size}x{args.size} on {name}, PyTorch {torch.__version__}")
    compare_modes(torch, device, args.size, args.repeats)

    losses = train_with_amp(torch, device, args.amp, args.train_steps)
    steps = f"Mixed precision ({args.amp}), {args.train_steps} steps"
    print(f"{steps}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if not losses[-1] < losses[0]:
        fail("the loss did not go down")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("precision.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
