"""Time torch.compile of a small model with the compile cache it finds: cold or warm.

torch.compile generates and compiles code the first time a model runs: seconds to minutes.
It keeps the results in TORCHINDUCTOR_CACHE_DIR (and the GPU kernels in TRITON_CACHE_DIR), so
a later process that compiles the same model with the same PyTorch reuses them. This script
compiles a small MLP, runs a few training steps, and prints how long the first step took and
how many files the cache held before and after. Run it twice with the same cache: the second
run is warm.

    TORCHINDUCTOR_CACHE_DIR=$PWD/compile-cache python compile_cache.py
    sbatch compile_cache.sbatch                # a per-job copy of a shared cache

A cache is warm only for the PyTorch and the device model that filled it: with
--print-cache-key, the script prints a folder name made of both, and compile_cache.sbatch
keeps one shared cache per name.
"""

import argparse
import glob
import os
import platform
import re
import sys
import time
from pathlib import Path


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--width", type=positive_int, default=256, help="hidden units")
    parser.add_argument("--steps", type=positive_int, default=5, help="training steps")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--print-cache-key", action="store_true",
                        help="print the shared cache's folder name for this PyTorch and device, "
                        "and exit")  # fmt: skip
    return parser.parse_args(argv)


def fail(message):
    print(f"compile_cache.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def cache_folder():
    """TORCHINDUCTOR_CACHE_DIR: set, and a folder or one that can be made."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        fail("TORCHINDUCTOR_CACHE_DIR is not set: point it at the cache to use (see the page)")
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    for part in (cache, *cache.parents):  # a folder, or one to be made: not under a file
        if part.exists():
            if not part.is_dir():
                fail(f"TORCHINDUCTOR_CACHE_DIR={cache}: {part} is a file, not a folder")
            break
    return cache


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


def cache_key(torch_version, device_name, capability=None):
    """A folder name for the compile cache of one PyTorch version on one device model (a
    cache filled by another version or model holds nothing this one can use). Letters, digits
    and '._+-' only, never '.' or '..': no device name (with '/', spaces, '..') can put the
    folder anywhere else."""
    parts = [f"torch-{torch_version}", device_name]
    if capability is not None:
        parts.append("cc{}.{}".format(*capability))  # compute capability
    key = re.sub(r"[^A-Za-z0-9._+-]+", "-", "-".join(parts)).strip(".-")
    return key[:120] or "unknown"


def device_key(torch, device):
    """cache_key for the device this process compiles for: the GPU model and its compute
    capability, or the CPU's architecture."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return cache_key(torch.__version__, props.name, (props.major, props.minor))
    return cache_key(torch.__version__, f"cpu-{platform.machine()}")


def count_files(folder):
    return sum(len(files) for _, _, files in os.walk(folder))


def main(argv=None):
    args = parse_args(argv)
    cache = None if args.print_cache_key else cache_folder()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request one (Slurm: --gpus-per-node=1, "
             "PBS: -l select=1:ncpus=4:ngpus=1, Grid Engine: -l gpu=1)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    device = torch.device("cuda" if use_cuda else "cpu")
    if args.print_cache_key:
        print(device_key(torch, device))
        return
    if use_cuda:
        announce_gpu(torch, device)
    before = count_files(cache) if cache.is_dir() else 0

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, 10),
    ).to(device)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    inputs = torch.randn(128, 64, device=device)
    labels = torch.randint(0, 10, (128,), device=device)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(compiled(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    after = count_files(cache)
    state = "warm" if before else "cold"
    print(f"Cache {cache}: {before} files before, {after} after ({state})")
    print(f"First step (compiles): {times[0]:.1f} s; later steps: {min(times[1:] or times):.4f} s")
    print(f"loss {loss.item():.4f} on {device.type}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("compile_cache.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
