"""Report what PyTorch sees on this node: versions, CUDA, cuDNN, GPUs and CPU threads.

Run it after installing PyTorch (on a login node) and as your first job (on a compute node).
It prints one line per fact, runs a small matrix product on the chosen device, and warns,
naming the fix, when the GPU's architecture is missing from this PyTorch build ("no kernel
image is available for execution on the device") or when a GPU was requested but none is
visible, and says why: a CPU-only build, or an NVIDIA driver too old for the CUDA of this
build (nvidia-smi shows the newest CUDA the driver supports). ROCm builds are recognised.
With --device cuda it fails unless a usable GPU is there; so does a job that the scheduler
gave GPUs, on a node that has them or in a container (started without GPU support), unless
--device cpu.

    python check_pytorch.py
    python check_pytorch.py --device cuda

Job scripts: check_pytorch.sbatch (Slurm), check_pytorch.qsub (Grid Engine) and
check_pytorch.pbs (PBS).
"""

import argparse
import glob
import os
import platform
import re
import subprocess
import sys
import time

# Scheduler variables that say this job was given GPUs: lists of GPU indices, then counts
# (PBS_NGPUS: NCI Gadi; JOB_GPUS: exported by the guide's .pbs scripts from the job's request,
# as PBS sets no GPU variable by default).
GPU_LIST_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SGE_HGR_gpu")
GPU_COUNT_VARIABLES = (
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
    "PBS_NGPUS",
    "JOB_GPUS",
)
# The job's, which srun copies into every step: inside a step (SLURM_STEP_ID set), only the
# step's own SLURM_STEP_GPUS and SLURM_GPUS_ON_NODE say what it was given.
SLURM_JOB_LEVEL = ("SLURM_JOB_GPUS", "SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK")

# Device files that only a GPU node has (NVIDIA, AMD), and signs of an Apptainer/Singularity or
# Podman container, where a runtime started without GPU support leaves no device file (Docker
# passes no job variables into a container).
NVIDIA_DEVICE_FILES = "/dev/nvidia[0-9]*"
AMD_DEVICE_FILE = "/dev/kfd"
CONTAINER_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")
CONTAINER_FILES = ("/.singularity.d", "/run/.containerenv")
CONTAINER_WITHOUT_GPUS = (
    "this container has no GPU device: start the container with GPU support "
    "(apptainer --nv, podman --gpus all)"
)

HOW_TO_REQUEST_A_GPU = (
    "request one: Slurm '#SBATCH --gpus-per-node=1' (or --gres=gpu:1), "
    "Grid Engine '#$ -l gpu=1', PBS '#PBS -l select=1:ncpus=4:ngpus=1' (resource names vary: "
    "see your site's documentation)"
)


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
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="device for the test computation; 'cuda' fails when no GPU is usable",
    )
    parser.add_argument(
        "--size", type=positive_int, default=1024, help="matrix size of the test product"
    )
    return parser.parse_args(argv)


def fail(message):
    """Print a one-line error and exit non-zero (no traceback for a reader to decode)."""
    print(f"check_pytorch.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_count(name):
    """A count set by the scheduler (1 or more), or one line naming the variable and its value."""
    value = os.environ[name]
    if not (value.isdecimal() and int(value) > 0):
        fail(f"{name}={value!r} is not a whole number above 0 (set by the scheduler, or in the "
             "job script)")  # fmt: skip
    return int(value)


def gpus_in(name, value):
    """How many GPUs a scheduler variable names: a list of indices ("0,1", "0-3", Grid
    Engine's "0 1") or a count, possibly typed ("2", "gpu:10", "gpu:a100:2", "a100:2,h100:1")."""
    if name in GPU_LIST_VARIABLES:
        total = 0
        for part in re.split(r"[,\s]+", value.strip()):
            low, _, high = part.partition("-")
            if not low.strip().isdigit() or (high and not high.strip().isdigit()):
                return 0
            total += int(high) - int(low) + 1 if high else 1
        return total
    total = 0
    for part in value.split(","):
        count = part.split("(")[0].rsplit(":", 1)[-1].strip()
        total += int(count) if count.isdigit() else 0
    return total


def gpu_request():
    """Return 'NAME=value' for the first scheduler variable that shows a GPU request."""
    in_step = "SLURM_STEP_ID" in os.environ
    for name in GPU_LIST_VARIABLES + GPU_COUNT_VARIABLES:
        value = os.environ.get(name, "")
        if value in ("", "(null)") or gpus_in(name, value) == 0:
            continue
        if in_step and name in SLURM_JOB_LEVEL:
            continue
        return f"{name}={value}"
    return None


def nvidia_node():
    return bool(glob.glob(NVIDIA_DEVICE_FILES))


def amd_node():
    return os.path.exists(AMD_DEVICE_FILE)


def in_container():
    return any(os.environ.get(name) for name in CONTAINER_VARIABLES) or any(
        os.path.exists(path) for path in CONTAINER_FILES
    )


def driver_cuda():
    """(driver version, newest CUDA version it supports) from nvidia-smi, or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    driver = re.search(r"Driver Version: *([\d.]+)", out)
    cuda = re.search(r"CUDA Version: *(\d+)\.(\d+)", out)
    if not (driver and cuda):
        return None
    return driver[1], (int(cuda[1]), int(cuda[2]))


def build_for_driver(cuda):
    """The PyTorch wheel index (cu126, cu128, cu130) for a driver's newest CUDA version.
    Within one major CUDA version a newer runtime runs on an older driver; not across."""
    if cuda >= (13, 0):
        return "cu130"
    if cuda >= (12, 0):
        return "cu128 (cu126 for V100 and other Volta GPUs)"
    return None


def why_no_gpu(torch, driver):
    """Why a CUDA or ROCm build sees no GPU that the scheduler gave, in one sentence."""
    if in_container() and not (nvidia_node() or amd_node()):
        return CONTAINER_WITHOUT_GPUS
    if torch.version.hip:
        if nvidia_node() and not amd_node():
            return (
                "this node has NVIDIA GPUs and this PyTorch is a ROCm build: install a CUDA build "
                "(make_venv.sh with TORCH_BUILD=cu128) or your site's module"
            )
        return "check HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES and that the job has the GPUs"
    if not torch.version.cuda:
        return (
            "this PyTorch is a CPU-only build: install a CUDA build (make_venv.sh with "
            "TORCH_BUILD=cu128, or your site's module)"
        )
    if amd_node() and not nvidia_node():
        return (
            "this node has AMD GPUs and this PyTorch is a CUDA build: install a ROCm build "
            "(pip's index https://download.pytorch.org/whl/rocm<version>) or your site's module"
        )
    built = tuple(int(n) for n in torch.version.cuda.split(".")[:2])
    if driver and driver[1][0] < built[0]:
        version, cuda = driver
        wheel = build_for_driver(cuda)
        fix = (
            f"reinstall with TORCH_BUILD={wheel.split()[0]} bash make_venv.sh ({wheel})"
            if wheel
            else "ask your site for a newer driver"
        )
        return (
            f"the NVIDIA driver {version} supports CUDA up to {cuda[0]}.{cuda[1]}, older than "
            f"the CUDA {torch.version.cuda} this PyTorch is built for: {fix}"
        )
    return "check CUDA_VISIBLE_DEVICES (the scheduler sets it; a job script must not reset it)"


def cpu_threads():
    """CPUs this process may use: the scheduler's allocation first, else the CPU affinity mask."""
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return env_count("SLURM_CPUS_PER_TASK"), "SLURM_CPUS_PER_TASK"
    if os.environ.get("NSLOTS"):  # Grid Engine: slots of a parallel environment
        return env_count("NSLOTS"), "NSLOTS"
    if os.environ.get("PBS_JOBID") and os.environ.get("NCPUS"):  # PBS: ncpus of this chunk
        return env_count("NCPUS"), "NCPUS"
    return len(os.sched_getaffinity(0)), "CPU affinity"


def kernels_available(capability, arch_list, gcn_arch=""):
    """True when a build compiled for arch_list can run on a GPU of this compute capability.

    A cubin for sm_XY runs on GPUs of the same major version and a minor version >= Y;
    PTX for compute_XY is compiled at load time for any GPU >= X.Y; an arch-specific
    target (sm_90a) runs only on exactly that capability. An AMD GPU (ROCm build) needs
    code for its own gfx target: gcn_arch is its gcnArchName ("gfx90a:sramecc+:xnack-"),
    compared without the feature suffixes.
    """
    if gcn_arch:
        return gcn_arch.split(":")[0] in {arch.split(":")[0] for arch in arch_list}
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
    if torch.version.hip:
        print(f"CUDA build:      none: a ROCm build, HIP {torch.version.hip} (AMD GPUs)")
    else:
        print(f"CUDA build:      {torch.version.cuda or 'none (CPU-only build)'}")
    driver = driver_cuda() if torch.version.cuda else None
    if driver:
        print(f"NVIDIA driver:   {driver[0]} (supports CUDA up to {driver[1][0]}.{driver[1][1]})")
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
        gcn_arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
        ok = kernels_available(capability, arch_list, gcn_arch)
        usable += ok
        print(
            f"GPU {index}:           {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, kernels in this build: {'yes' if ok else 'NO'}"
        )
        target = gcn_arch.split(":")[0] or f"sm_{props.major}{props.minor}"
        error = (
            "HIP error: invalid device function"
            if gcn_arch
            else "no kernel image is available for execution on the device"
        )
        if not ok:
            print(
                f"WARNING: this PyTorch has no kernels for {target} "
                f"(built for {' '.join(arch_list)}): GPU calls will fail with '{error}'. "
                f"Install a build that lists {target} (a newer PyTorch wheel, or your site's "
                "module)."
            )

    # On a GPU node or in a container, a job given GPUs stops here rather than pass on the CPU;
    # elsewhere (a scheduler whose GPUs are not real, as on the guide's test cluster) it warns.
    on_gpu_node = nvidia_node() or amd_node()
    if requested and usable == 0 and (on_gpu_node or in_container()) and args.device != "cpu":
        if count == 0:
            fail(f"the scheduler gave this job GPUs ({requested}) but PyTorch sees none: "
                 f"{why_no_gpu(torch, driver)}")  # fmt: skip
        fail(f"the scheduler gave this job GPUs ({requested}) but this PyTorch has no kernels "
             "for them (see the WARNING above)")  # fmt: skip
    if requested and count == 0:
        print(
            f"WARNING: the scheduler gave this job GPUs ({requested}) but PyTorch sees none: "
            f"{why_no_gpu(torch, driver)}."
        )

    if args.device == "cuda" and usable == 0:
        if count == 0 and requested:
            fail(f"--device cuda was given but PyTorch sees no GPU: {why_no_gpu(torch, driver)}")
        if count == 0:
            fail(f"--device cuda was given but no GPU is visible; {HOW_TO_REQUEST_A_GPU}")
        fail("--device cuda was given but this PyTorch has no kernels for the visible GPUs")
    device = "cuda" if args.device != "cpu" and usable else "cpu"
    if device == "cuda":  # one line per GPU that ran: make site-check counts them
        props = torch.cuda.get_device_properties(0)
        print(f"GPU in use: {props.uuid} ({props.name}) on {platform.node()}")

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
    try:
        main()
    except KeyboardInterrupt:
        print("check_pytorch.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
