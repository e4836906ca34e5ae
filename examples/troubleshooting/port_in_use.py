"""Two jobs on one node with one fixed MASTER_PORT: the second fails with EADDRINUSE.

Rank 0 of a distributed job opens a TCP server, the TCPStore, on MASTER_PORT, where the other
ranks meet it. When two jobs land on the same node with the same fixed port (29500 is the usual
choice), the second job's rank 0 cannot listen and stops with "address already in use". The
script plays both jobs on this machine, as two one-process gloo jobs started a moment apart;
the first one holds its port until the second has ended. With --fix, each job derives its port
from its job id, as the job scripts of this guide do: MASTER_PORT=15000 + job id % 10000.

    python port_in_use.py              # job 2: DistNetworkError ... EADDRINUSE
    python port_in_use.py --fix        # both jobs run
"""

import argparse
import datetime
import os
import subprocess
import sys


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def port(text):
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535 (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--fix", action="store_true", help="derive each job's port from its id")
    parser.add_argument("--port", type=port, default=29500, help="the fixed MASTER_PORT")
    parser.add_argument("--job-ids", type=positive_int, nargs=2, default=[4242001, 4242002])
    parser.add_argument(
        "--init-timeout", type=positive_int, default=10, help="seconds to wait for ranks"
    )
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one job's rank 0
    return parser.parse_args(argv)


def fail(message):
    print(f"port_in_use.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_int(name):
    """A whole number from the environment, or one line that names the variable."""
    text = os.environ[name]
    if not text.isdecimal():
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")
    return int(text)


def job(args):
    """Rank 0 of a one-process job: what a training script does first."""
    import torch.distributed as dist

    job_id, port = os.environ["SLURM_JOB_ID"], os.environ["MASTER_PORT"]
    dist.init_process_group(  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        "gloo", timeout=datetime.timedelta(seconds=args.init_timeout)
    )
    dist.barrier()
    print(f"job {job_id}: rank 0 listens on port {port}", flush=True)
    sys.stdin.read()  # "training", until the script that started this job says stop
    dist.destroy_process_group()
    print(f"job {job_id}: done", flush=True)


def start_job(args, job_id):
    port = 15000 + job_id % 10000 if args.fix else args.port  # what the job script sets
    env = dict(os.environ, SLURM_JOB_ID=str(job_id), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")  # fmt: skip
    command = [sys.executable, __file__, "--job", "--init-timeout", str(args.init_timeout)]
    return subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def main(argv=None):
    args = parse_args(argv)
    if "MASTER_PORT" in os.environ:  # a job's own (--job), or a job script's: torch reads it
        env_int("MASTER_PORT")
    if args.job:
        try:
            job(args)
        except KeyboardInterrupt:  # Ctrl-C reaches the jobs too: the starter says it once
            sys.exit(130)
        return
    first = start_job(args, args.job_ids[0])
    line = first.stdout.readline()  # the first job holds its port from now on
    print(line, end="")
    if "listens on port" not in line:
        first.communicate("")
        fail(f"job {args.job_ids[0]} did not start: is port {args.port} already taken?")
    second = start_job(args, args.job_ids[1])
    print(second.communicate("")[0], end="")
    print(first.communicate("")[0], end="")  # now the first job ends
    if second.returncode != 0:
        print(f"job {args.job_ids[1]} failed: its port was taken by job {args.job_ids[0]}")
    sys.exit(first.returncode or second.returncode)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("port_in_use.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
