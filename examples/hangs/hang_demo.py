"""A distributed job that hangs on purpose, to practise finding out where each rank waits.

Every rank trains a few steps and averages a value with all_reduce at each step, as DDP does
with gradients. At --hang-at-step, the last rank skips that all_reduce and goes on to the
barrier at the end of the loop (a rank that ran out of data, or a collective inside an `if`
that is not true everywhere). Collectives are matched by their order, not by the line that
calls them: the last rank's next all_reduce pairs with the others' skipped one, and the job
hangs only at the end of the loop, when that rank waits in the barrier and the others in their
last all_reduce, printing nothing until the process group's --timeout. Run dump_stacks.sh on
the job meanwhile to see it. It uses gloo on CPUs on purpose: it needs no GPU.

    sbatch hang_demo.sbatch                    # then: bash dump_stacks.sh <job id>
    torchrun --standalone --nproc-per-node=2 hang_demo.py --timeout 20
"""

import argparse
import datetime
import os
import sys
import time


def fail(message):
    print(f"hang_demo.py: error: {message}", file=sys.stderr)
    sys.exit(2)


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
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--hang-at-step", type=positive_int, default=3)
    parser.add_argument("--timeout", type=positive_int, default=300,
                        help="seconds a collective waits before the job fails")  # fmt: skip
    return parser.parse_args(argv)


def distributed_env():
    """Rank and world size from torchrun, else from srun; the rendezvous from the job script."""
    names = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("SLURM_PROCID", "SLURM_NTASKS")
    values = {}
    for name in (*names, "MASTER_PORT"):
        text = os.environ.get(name)
        if text is None:
            fail(f"{name} is not set: start this script with torchrun or srun (hang_demo.sbatch)")
        if not text.isdecimal():
            fail(f"{name}={text!r} is not a number")
        values[name] = int(text)
    if not os.environ.get("MASTER_ADDR"):
        fail("MASTER_ADDR is not set: the job script sets it to the first node")
    return values[names[0]], values[names[1]]


def main(argv=None):
    args = parse_args(argv)
    rank, world = distributed_env()
    if world < 2:
        fail("run at least 2 processes: one alone cannot wait for another")
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout)
    )
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    print(f"rank {rank}/{world} on {host}, pid {os.getpid()}", flush=True)
    value = torch.ones(1000)
    for step in range(1, args.steps + 1):
        time.sleep(0.1)  # the forward and backward passes
        # --- the bug: one rank skips a collective that the others call ---
        if not (step == args.hang_at_step and rank == world - 1):
            dist.all_reduce(value)
        # --- end of the bug ---
        print(f"rank {rank}: step {step} done", flush=True)
    dist.barrier()  # the end of the epoch
    print(f"rank {rank}: finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("hang_demo.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
