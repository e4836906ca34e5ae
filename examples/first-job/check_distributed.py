"""Check that every process of a multi-node job can reach the others through torch.distributed.

Each process joins one process group (NCCL on GPUs, gloo on CPUs), adds up its rank + 1
with all the others (all_reduce) and reports where it runs. Run it before a long
distributed training to find network, port and GPU-binding problems in seconds.

Under Slurm, one process per task (ranks from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID;
MASTER_ADDR and MASTER_PORT from the job script):

    sbatch check_distributed.sbatch

Anywhere, with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):

    torchrun --standalone --nproc-per-node=2 check_distributed.py
"""

import argparse
import datetime
import glob
import math
import os
import socket
import sys


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--timeout", type=positive_float, default=60, help="seconds to wait for the other processes"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"check_distributed.py: error: {message}", file=sys.stderr)
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


def env_int(name):
    """The whole number in environment variable `name`, or one line that names it."""
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        source = "srun" if name.startswith("SLURM_") else "torchrun, or in the job script"
        fail(f"{name}={text!r} is not a whole number (set by {source})")


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


def distributed_environment():
    """rank, world size, local rank, address and port, from torchrun's or Slurm's variables."""
    if "RANK" in os.environ:  # torchrun
        names = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}
    else:  # srun: one task per process
        names = {"rank": "SLURM_PROCID", "world_size": "SLURM_NTASKS"}
        names["local_rank"] = "SLURM_LOCALID"
    names.update(addr="MASTER_ADDR", port="MASTER_PORT")
    missing = [variable for variable in names.values() if not os.environ.get(variable)]
    if missing:
        fail(
            f"{', '.join(missing)} not set: start this script with srun from a job script that "
            "exports MASTER_ADDR and MASTER_PORT, or with torchrun"
        )
    env = {key: os.environ[variable] for key, variable in names.items()}
    for key in ("rank", "world_size", "local_rank", "port"):
        env[key] = env_int(names[key])
    if not 0 < env["port"] < 65536:
        fail(f"MASTER_PORT={env['port']} is not a port number (1 to 65535)")
    if not 0 <= env["rank"] < env["world_size"]:
        fail(f"rank {env['rank']} is outside the world size {env['world_size']}")
    return env


def main(argv=None):
    args = parse_args(argv)
    env = distributed_environment()
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request GPUs (Slurm: --gpus-per-node=N, "
             "PBS: -l select=1:ncpus=4:ngpus=N, Grid Engine: -l gpu=N)")  # fmt: skip
    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda:
        device = torch.device("cuda", gpu_index(env["local_rank"], torch.cuda.device_count()))
        torch.cuda.set_device(device)
        announce_gpu(torch, device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"

    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env['addr']}:{env['port']}",
            rank=env["rank"],
            world_size=env["world_size"],
            timeout=datetime.timedelta(seconds=args.timeout),
            device_id=device if use_cuda else None,
        )
    except (RuntimeError, OSError) as error:  # DistNetworkError and timeouts are RuntimeErrors
        reason = str(error).strip().splitlines()[0]
        fail(
            f"rank {env['rank']} could not join the {env['world_size']} processes at "
            f"{env['addr']}:{env['port']} within {args.timeout:g} s: {reason}"
        )

    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    total = torch.tensor([env["rank"] + 1.0], device=device)
    dist.all_reduce(total)
    expected = env["world_size"] * (env["world_size"] + 1) / 2
    where = f"rank {env['rank']}/{env['world_size']} on {node}, {device} ({backend})"
    sys.stdout.write(f"{where}: sum {total.item():g}\n")  # one write: lines of ranks never mix
    sys.stdout.flush()
    nodes = [None] * env["world_size"]
    dist.all_gather_object(nodes, node)
    dist.destroy_process_group()
    if total.item() != expected:
        fail(f"all_reduce gave {total.item():g}, expected {expected:g}")
    if env["rank"] == 0:
        print(
            f"All {env['world_size']} processes on {len(set(nodes))} node(s) "
            f"({', '.join(sorted(set(nodes)))}) reached each other: sum {expected:g} as expected"
        )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("check_distributed.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
