"""Measure all-reduce bandwidth between the processes of a job, as nccl-tests' all_reduce_perf.

Every process sums a float32 tensor with all the others (torch.distributed.all_reduce, in
place), for sizes from --min-bytes to --max-bytes, doubling each step. Each size runs --warmup
untimed then --iters timed all-reduces; the time of a size is the slowest process's average.
Rank 0 prints a table with the two bandwidths nccl-tests defines for all-reduce:

    algbw = size / time                 what one process sees
    busbw = algbw * 2 * (n - 1) / n     what each link carries, for n processes

A ring all-reduce sends and receives 2(n-1)/n times the data on every link, so busbw is
comparable across process counts and with the hardware's link speed. It uses nccl on GPUs
(one process per GPU) and gloo on CPUs; it runs under torchrun (RANK, WORLD_SIZE, LOCAL_RANK)
or as one Slurm task per GPU (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), with MASTER_ADDR and
MASTER_PORT set in both cases.

    torchrun --standalone --nproc-per-node=2 allreduce_bench.py --device cpu
    sbatch node_check.sbatch -- --max-bytes 256M     # options after -- go to this script
"""

import argparse
import csv
import datetime
import glob
import os
import platform
import socket
import sys
import time
from pathlib import Path

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def size(text):
    """A size in bytes: 8192, 8K, 64M, 1G (powers of 1024)."""
    number, unit = text.upper().rstrip("B"), ""
    if number[-1:] in UNITS:
        number, unit = number[:-1], number[-1]
    if not number.isdigit() or int(number) * UNITS[unit] < 4:
        raise argparse.ArgumentTypeError(f"must be a size of 4 bytes or more, as 8K (got {text})")
    return int(number) * UNITS[unit]


def positive_int(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return int(text)


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def writable_file(text):
    """An output file: its folder is created if needed; it cannot be a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot create the folder {path.parent}: {error.strerror}"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {path.parent}: permission denied")
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--min-bytes", type=size, default=size("8K"))
    parser.add_argument(
        "--max-bytes", type=size, help="default: 1G with --device cuda, 64M on CPUs"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=5, help="untimed all-reduces per size"
    )
    parser.add_argument("--iters", type=positive_int, default=20, help="timed all-reduces")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds to wait")
    parser.add_argument("--csv", type=writable_file, help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    if args.max_bytes is not None and args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    return args


def fail(message):
    print(f"allreduce_bench.py: error: {message}", file=sys.stderr)
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


def gpu_index(local_rank, visible):
    """The GPU of this process, given how many it sees: its local rank's when it sees the GPUs
    of the whole node, device 0 when Slurm bound one GPU to the task (--gpus-per-task=1)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        fail(
            f"local rank {local_rank} but {visible} GPUs visible: request one GPU per process "
            "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)"
        )
    return local_rank


def distributed_env():
    """(rank, world size, local rank) from torchrun's variables, or else from srun's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    for name in (*names, "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            fail(f"{name} not set: start this script with torchrun or srun (node_check.sbatch)")
    for name in (*names, "MASTER_PORT"):
        if not os.environ[name].isdecimal():
            fail(f"{name}={os.environ[name]!r} is not a number")
    rank, world, local_rank = (int(os.environ[name]) for name in names)
    if not rank < world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    return rank, world, local_rank


def human(nbytes):
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def measure(torch, dist, nbytes, device, args):
    """Seconds per all-reduce of nbytes, the slowest rank's; raises if a sum is wrong."""
    world = dist.get_world_size()
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(args.warmup):
        dist.all_reduce(tensor)
    dist.barrier()  # every rank starts the timed loop together
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # all-reduces on GPUs return before they finish
    seconds = (time.perf_counter() - start) / args.iters
    tensor.fill_(1.0)  # then one more, checked: every element must equal the world size
    dist.all_reduce(tensor)
    wrong = (tensor != world).sum().item()
    stats = torch.tensor([seconds, wrong], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    seconds, wrong = stats.tolist()
    if wrong:
        raise RuntimeError(f"all-reduce of {nbytes} bytes gave {int(wrong)} wrong elements")
    return seconds


def device_name(torch, device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            models = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
    except OSError:
        models = []
    return models[0] if models else platform.machine()


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    import torch
    import torch.distributed as dist

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request GPUs (Slurm: --gpus-per-node=N, "
             "PBS: -l select=1:ncpus=4:ngpus=N, Grid Engine: -l gpu=N)")  # fmt: skip
    if use_cuda:
        device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        announce_gpu(torch, device)
    else:
        device = torch.device("cpu")
    max_bytes = args.max_bytes or size("1G" if use_cuda else "64M")
    if args.min_bytes > max_bytes:
        fail(f"--min-bytes {args.min_bytes} is larger than the default --max-bytes {max_bytes}")
    try:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            init_method="env://",  # MASTER_ADDR and MASTER_PORT
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
            device_id=device if use_cuda else None,
        )
    except (RuntimeError, TimeoutError) as error:
        fail(f"rank {rank}: not all {world} processes started within {args.timeout} s "
             f"({str(error).splitlines()[0] if str(error) else type(error).__name__})")  # fmt: skip
    backend = dist.get_backend()
    hosts = [None] * world
    dist.all_gather_object(hosts, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    name = device_name(torch, device)
    about = (f"{world} ranks on {len(set(hosts))} node(s), {backend}, {device.type} ({name}), "
             f"torch {torch.__version__}")  # fmt: skip

    rows = []
    nbytes = args.min_bytes
    if rank == 0:
        print(f"# all_reduce (sum, float32, in place): {about}")
        print(f"# {'size':>12} {'count':>12} {'type':>7} {'time':>10} {'algbw':>8} {'busbw':>8}")
        print(f"# {'(B)':>12} {'(elements)':>12} {'':>7} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    while nbytes <= max_bytes:
        count = nbytes // 4
        seconds = measure(torch, dist, count * 4, device, args)
        algbw = count * 4 / seconds / 1e9
        busbw = algbw * 2 * (world - 1) / world
        rows.append([count * 4, count, "float", seconds * 1e6, algbw, busbw])
        if rank == 0:
            print(f"  {count * 4:>12} {count:>12} {'float':>7} {seconds * 1e6:>10.1f} "
                  f"{algbw:>8.3f} {busbw:>8.3f}")  # fmt: skip
        nbytes *= 2
    if rank == 0:
        best = max(rows, key=lambda row: row[5])
        print(f"Peak bus bandwidth: {best[5]:.3f} GB/s at {human(best[0])} with {world} ranks "
              f"({backend})")  # fmt: skip
        if args.csv:
            with open(args.csv, "w", newline="", encoding="utf-8") as file:
                file.write(f"# allreduce_bench.py {' '.join(sys.argv[1:])}\n# {about}\n")
                writer = csv.writer(file)
                writer.writerow(["size_bytes", "count", "type", "time_us", "algbw_gbps",
                                 "busbw_gbps"])  # fmt: skip
                for row in rows:
                    writer.writerow([*row[:3], f"{row[3]:.1f}", f"{row[4]:.3f}", f"{row[5]:.3f}"])
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("allreduce_bench.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
