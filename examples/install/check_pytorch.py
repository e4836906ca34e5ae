"""Report what PyTorch sees on this node: versions, CUDA, cuDNN, GPUs and CPU threads.

Run it after installing PyTorch (on a login node) and as your first job (on a compute node).
It prints one line per fact, runs a small matrix product on the chosen device, and warns,
naming the fix, when the GPU's architecture is missing from this PyTorch build ("no kernel
image is available for execution on the device") or when a GPU was requested but none is
visible. With --device cuda it fails unless a usable GPU is there.

    python check_pytorch.py
    python check_pytorch.py --device cuda

Job scripts: check_pytorch.sbatch (Slurm) and check_pytorch.qsub (Grid Engine).
"""

import argparse
import os
import platform
import sys
import time

# Scheduler variables that say this job was given GPUs: lists of GPU indices, then counts.
GPU_LIST_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SGE_HGR_gpu")
GPU_COUNT_VARIABLES = (
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
)

HOW_TO_REQUEST_A_GPU = (
    "request one: Slurm '#SBATCH --gpus-per-node=1' (or --gres=gpu:1), "
    "Grid Engine '#$ -l gpu=1' (resource names vary: see your site's documentation)"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="device for the test computation; 'cuda' fails when no GPU is usable",
    )
    parser.add_argument("--size", type=int, default=1024, help="matrix size of the test product")
    return parser.parse_args(argv)


def fail(message):
    """Print a one-line error and exit non-zero (no traceback for a reader to decode)."""
    print(f"check_pytorch.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def gpu_request():
    """Return 'NAME=value' for the first scheduler variable that shows a GPU request."""
    for name in GPU_LIST_VARIABLES + GPU_COUNT_VARIABLES:
        value = os.environ.get(name, "")
        if value in ("", "(null)") or (name in GPU_COUNT_VARIABLES and value.endswith("0")):
            continue
        return f"{name}={value}"
    return None


def cpu_threads():
    """CPUs this process may use: the Slurm allocation first, else the CPU affinity mask."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return int(os.environ["SLURM_CPUS_PER_TASK"]), "SLURM_CPUS_PER_TASK"
    if os.environ.get("NSLOTS"):  # Grid Engine: slots of a parallel environment
        return int(os.environ["NSLOTS"]), "NSLOTS"
    return len(os.sched_getaffinity(0)), "CPU affinity"


def kernels_available(capability, arch_list):
    """True when a build compiled for arch_list can run on a GPU of this compute capability.

    A cubin for sm_XY runs on GPUs of the same major version and a minor version >= Y;
    PTX for compute_XY is compiled at load time for any GPU >= X.Y; an arch-specific
    target (sm_90a) runs only on exactly that capability.
    """
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        exact = number.endswith("a")
        number = number.rstrip("af")
        if not number.isdigit() or len(number) < 2:
            continue
        arch_major, arch_minor = int(number[:-1]), int(number[-1])
        if kind == "sm" and arch_major == major:
            if arch_minor == minor or (arch_minor < minor and not exact):
                return True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        fail(
            f"PyTorch is not installed for {sys.executable}: activate your environment "
            "first (source $HOME/venvs/pytorch/bin/activate) or load your site's pytorch module"
        )

    print(f"Python:          {platform.python_version()} ({sys.executable})")
    print(f"PyTorch:         {torch.__version__}")
    print(f"CUDA build:      {torch.version.cuda or 'none (CPU-only build)'}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"cuDNN:           {cudnn or 'not available'}")
    arch_list = torch.cuda.get_arch_list()
    print(f"GPU archs built: {' '.join(arch_list) or 'none'}")
    threads, source = cpu_threads()
    torch.set_num_threads(threads)
    print(f"CPU threads:     {threads} (from {source})")

    requested = gpu_request()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs visible:    {count}")
    if requested:
        print(f"GPUs requested:  {requested}")
    usable = 0
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        ok = kernels_available(capability, arch_list)
        usable += ok
        print(
            f"GPU {index}:           {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, kernels in this build: {'yes' if ok else 'NO'}"
        )
        if not ok:
            print(
                f"WARNING: this PyTorch has no kernels for sm_{props.major}{props.minor} "
                f"(built for {' '.join(arch_list)}): CUDA calls will fail with 'no kernel image "
                "is available for execution on the device'. Install a build that lists "
                f"sm_{props.major}{props.minor} (a newer PyTorch wheel, or your site's module)."
            )

    if requested and count == 0:
        print(
            f"WARNING: the scheduler gave this job GPUs ({requested}) but PyTorch sees none: "
            "check CUDA_VISIBLE_DEVICES and that this PyTorch is a CUDA build "
            "(CUDA build above must not be 'none')."
        )

    if args.device == "cuda" and usable == 0:
        if count == 0:
            fail(f"--device cuda was given but no GPU is visible; {HOW_TO_REQUEST_A_GPU}")
        fail("--device cuda was given but this PyTorch has no kernels for the visible GPUs")
    device = "cuda" if args.device != "cpu" and usable else "cpu"

    a = torch.randn(args.size, args.size, device=device)
    b = torch.randn(args.size, args.size, device=device)
    torch.mm(a, b)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    c = torch.mm(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if not torch.isfinite(c).all():
        fail(f"the test product on {device} gave non-finite values")
    gflops = 2 * args.size**3 / elapsed / 1e9
    size = f"{args.size}x{args.size}"
    print(f"Test product:    {size} on {device}: {elapsed * 1e3:.1f} ms, {gflops:.1f} GFLOP/s")
    print(f"Result: PyTorch {torch.__version__} works on {device}")


if __name__ == "__main__":
    main()
