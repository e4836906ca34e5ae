"""Time a checkpoint write on a file system and print how often to checkpoint (Young/Daly).

The script writes a checkpoint of --size-mb megabytes of random float32 tensors into --dir as
a training does (torch.save to a temporary file, flush, fsync, rename), --repeats times, and
takes the median time. With the mean time between failures of one node (--mtbf-hours, from
your site) and the number of nodes of the job (--nodes), it prints the interval that loses the
least time, sqrt(2 x write time x MTBF of the job) (Young 1974, Daly 2006). Run it on the file
system your checkpoints go to, with the size of your checkpoint (model, optimizer state).

    python checkpoint_interval.py --dir "$SCRATCH" --size-mb 2048 --mtbf-hours 40000 --nodes 16
"""

import argparse
import contextlib
import math
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def folder_path(text):
    """A folder that may not exist yet, but cannot be a file or lie under one."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise argparse.ArgumentTypeError(f"{part} is a file, not a folder")
            break
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    scratch = os.environ.get("SLURM_TMPDIR", "/tmp")
    parser.add_argument(
        "--dir", type=folder_path, default=Path(scratch), help="file system to test"
    )
    parser.add_argument("--size-mb", type=positive_int, default=1024, help="checkpoint size")
    parser.add_argument("--repeats", type=positive_int, default=3, help="writes, median taken")
    parser.add_argument(
        "--mtbf-hours",
        type=positive_float,
        required=True,
        help="mean time between failures of one node",
    )
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes of the job")
    return parser.parse_args(argv)


def fail(message):
    print(f"checkpoint_interval.py: error: {message}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def ctrl_c_waits():
    """Ctrl-C (SIGINT) during the block takes effect after it: torch.save is not cut short
    (which would end in a RuntimeError, not in KeyboardInterrupt)."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt


def file_system(folder):
    """The type and device of the file system that holds folder (Linux), e.g. "ext4 /dev/sda1"."""
    folder, best = os.path.realpath(folder), ("unknown", "", "")
    with open("/proc/self/mounts") as mounts:
        for device, mount_point, kind, *_ in (line.split() for line in mounts):
            if folder.startswith(mount_point.rstrip("/") + "/") or folder == mount_point:
                best = max(best, (kind, device, mount_point), key=lambda entry: len(entry[2]))
    return f"{best[0]} ({best[1]} on {best[2]})" if best[2] else "unknown"


def timed_write(torch, state, folder):
    """Seconds to write state as a checkpoint: save, flush, fsync, rename, sync the folder."""
    path, temporary = folder / "checkpoint.pt", folder / "checkpoint.pt.tmp"
    start = time.perf_counter()
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return time.perf_counter() - start


def young_daly(write_seconds, mtbf_seconds):
    """The checkpoint interval that minimises the expected time lost (first order)."""
    return math.sqrt(2 * write_seconds * mtbf_seconds)


def main(argv=None):
    args = parse_args(argv)
    if not args.dir.is_dir() or not os.access(args.dir, os.W_OK):
        fail(f"--dir {args.dir} is not a folder you can write to")
    import torch

    # Random numbers: a file system that compresses gets no easier job than with real weights.
    chunks = max(1, args.size_mb // 64)
    state = {f"tensor{i}": torch.rand(args.size_mb * 2**20 // 4 // chunks) for i in range(chunks)}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-interval-") as folder:
        seconds = []
        for _ in range(args.repeats):
            with ctrl_c_waits():
                seconds.append(timed_write(torch, state, Path(folder)))
    write = statistics.median(seconds)
    job_mtbf_hours = args.mtbf_hours / args.nodes  # any one node failing stops the job
    interval = young_daly(write, job_mtbf_hours * 3600)

    print(f"# python checkpoint_interval.py {shlex.join(map(str, argv or sys.argv[1:]))}")
    print(
        f"# {platform.node()}, {platform.system()} {platform.release()}, torch {torch.__version__}"
    )
    print(f"checkpoint: {args.size_mb} MB, {args.repeats} writes into {args.dir}, "
          f"file system {file_system(args.dir)}")  # fmt: skip
    low, high = min(seconds), max(seconds)
    print(f"write time: {write:.3f} s median (min {low:.3f} s, max {high:.3f} s), "
          f"{args.size_mb / write:.0f} MB/s")  # fmt: skip
    print(f"MTBF: {args.mtbf_hours:g} h per node, {args.nodes} node(s): {job_mtbf_hours:g} h for "
          "the job")  # fmt: skip
    print(f"Young/Daly interval: sqrt(2 x {write:.3f} s x {job_mtbf_hours * 3600:.0f} s) = "
          f"{interval:.0f} s ({interval / 60:.1f} min)")  # fmt: skip
    print(f"time spent writing checkpoints: {100 * write / interval:.2f}%")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the temporary folder is removed on the way out
        print("checkpoint_interval.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
