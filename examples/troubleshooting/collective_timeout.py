"""A rank that skips a collective: the other ranks wait for it until the timeout.

Every rank must call the same collectives in the same order. Here only rank 0 sums a metric
with all_reduce (inside `if rank == 0:`), while the other ranks go on to the barrier at the end
of the epoch: no collective can complete, and the job hangs until the process group's timeout,
30 minutes for gloo and 10 for nccl by default. The script passes a short --init-timeout, so the
hang ends after seconds with gloo's "Timed out waiting ... for recv operation to complete" (or
the NCCL watchdog's timeout on GPUs). With TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch compares
the collectives of all ranks before it runs them and reports the mismatch at once. --fix
calls all_reduce on every rank.

    torchrun --standalone --nproc-per-node=2 collective_timeout.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 collective_timeout.py
    torchrun --standalone --nproc-per-node=2 collective_timeout.py --fix
"""

import argparse
import datetime
import os
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
    parser.add_argument("--fix", action="store_true", help="every rank calls all_reduce")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--init-timeout",
        type=positive_int,
        default=10,
        help="seconds init and each collective may wait",
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"collective_timeout.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_int(name):
    """A whole number from the environment, or one line that names the variable."""
    text = os.environ[name]
    if not text.isdecimal():
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")
    return int(text)


def main(argv=None):
    args = parse_args(argv)
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]  # fmt: skip
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env_int(name)  # checked here: torch's own error would be a traceback
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if args.device == "cuda":
        local_rank = env_int("LOCAL_RANK")
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} but {torch.cuda.device_count()} GPUs visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=args.init_timeout),  # default: 30 min (gloo), 10 (nccl)
    )
    dist.barrier()
    rank = dist.get_rank()
    count = torch.tensor([float(rank + 1)], device=device)  # something each rank counted

    # --- the bug: a collective inside a condition that is not true on every rank ---
    if args.fix or rank == 0:
        dist.all_reduce(count)
    # --- end of the bug ---
    dist.barrier()  # the end of the epoch
    print(f"rank {rank}: total {count.item():.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("collective_timeout.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
