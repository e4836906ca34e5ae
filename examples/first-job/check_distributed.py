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


# Scheduler variables that say this job was given GPUs, and the device files of a GPU node.
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SGE_HGR_gpu", "CUDA_VISIBLE_DEVICES")
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")


def gpu_usable(torch):
    """True when PyTorch can use a GPU. When it cannot, on a node with GPUs that the scheduler
    gave this job (a CPU-only build, a driver older than the build's CUDA), stop in one line:
    a job given GPUs never trains on the CPU unnoticed."""
    if torch.cuda.is_available():
        return True
    unset = ("", "(null)", "-1", "NoDevFiles")  # "0" is a GPU: the first
    given = [name for name in GPU_VARIABLES if os.environ.get(name, "").strip() not in unset]
    if given and any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        fail(f"this job was given GPUs ({given[0]}={os.environ[given[0]]}) but PyTorch "
             f"{torch.__version__} can use none: run check_pytorch.py in the job to see why, "
             "or pass --device cpu")  # fmt: skip
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
        fail("--device cuda was given but no GPU is visible; request GPUs with --gpus-per-node")
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
