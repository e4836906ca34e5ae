"""Two processes on one GPU: NCCL stops with "Duplicate GPU detected".

An NCCL communicator takes one GPU per process. When two ranks of a job use the same GPU,
NCCL's set-up fails with "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...".
The usual causes: the script never calls torch.cuda.set_device(local_rank), so every process
works on cuda:0; or the job gives all the tasks of a node one shared GPU (--gpus-per-node=1
with --ntasks-per-node=2). By default the script makes the first mistake. With --fix, each
process takes the GPU of its local rank (or the only one it sees, when Slurm gives each task
its own), and before NCCL starts the processes compare, over gloo, the GPUs they hold: two on
one GPU stop with a message that names them and says what to request.

    torchrun --standalone --nproc-per-node=2 duplicate_gpu.py          # Duplicate GPU detected
    torchrun --standalone --nproc-per-node=2 duplicate_gpu.py --fix    # one GPU per process
"""

import argparse
import datetime
import os
import socket
import sys


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
    parser.add_argument("--fix", action="store_true", help="one GPU per process, checked")
    parser.add_argument(
        "--init-timeout", type=positive_int, default=60, help="seconds to wait for ranks"
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"duplicate_gpu.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_int(name):
    """A whole number from the environment, or one line that names the variable."""
    text = os.environ[name]
    if not text.isdecimal():
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")
    return int(text)


def gpu_index(local_rank, visible):
    """The GPU this process takes: its local rank's, or the only one it sees."""
    if visible == 1:
        return 0  # Slurm gave this task its own GPU (--gpus-per-task=1), or one GPU is shared
    if local_rank >= visible:
        fail(f"local rank {local_rank} but {visible} GPUs visible: request one GPU per process")
    return local_rank


def shared_gpus(placements):
    """Ranks that hold the same GPU, from placements[rank] = (host, GPU UUID)."""
    first_rank = {}
    shared = []
    for rank, place in enumerate(placements):
        if place in first_rank:
            shared.append((first_rank[place], rank, place[0]))
        else:
            first_rank[place] = rank
    return shared


def main(argv=None):
    args = parse_args(argv)
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]  # fmt: skip
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun or srun")
    local_rank = env_int("LOCAL_RANK")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        env_int(name)  # checked here: torch's own error would be a traceback
    import torch
    import torch.distributed as dist

    visible = torch.cuda.device_count()
    if visible == 0:
        fail("no GPU visible: request one per process, e.g. #SBATCH --gpus-per-node=2 with "
             "--ntasks-per-node=2")  # fmt: skip
    if not args.fix:
        device = torch.device("cuda")  # the bug: cuda:0 in every process
    else:
        device = torch.device("cuda", gpu_index(local_rank, visible))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.init_timeout)
    dist.init_process_group("nccl", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)  # on CPU: NCCL is not set up yet
    dist.barrier(group=gloo)  # returns once all processes have joined
    rank = dist.get_rank()
    if args.fix:  # compare the GPUs, before NCCL sees them
        placements = [None] * dist.get_world_size()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        dist.all_gather_object(placements, (socket.gethostname(), uuid), group=gloo)
        for first, second, host in shared_gpus(placements):
            fail(
                f"ranks {first} and {second} share one GPU on {host}: give each process its "
                "own (--gpus-per-node equal to --ntasks-per-node, or --gpus-per-task=1)"
            )
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # NCCL sets up its communicator here: "Duplicate GPU detected"
    print(f"rank {rank} on {device}: all_reduce gives {total.item():.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("duplicate_gpu.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
