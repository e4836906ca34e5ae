"""Ranks that download a dataset into one folder at once: one of them reads a half-written file.

When every rank of a job runs the dataset's download (torchvision's download=True, or a fetch
of your own), they all write the same archive in the same folder: a rank that finds the file
already there extracts it while another rank is still writing it, and fails on a truncated
file ("Compressed file ended before the end-of-stream marker was reached", "unexpected end of
data", "File is not a zip file"), or reads wrong data. The script fakes the download, copying
a local archive in slow chunks (no network), and lets rank r start r x 0.2 s after rank 0, as
real ranks never start at the same instant. --fix rank0: rank 0 downloads, the others wait at a
barrier. --fix lock: a file lock lets one process download, into a temporary name that is
renamed only when complete, which also protects two jobs that share the folder. Better still,
download on a login node before the job: compute nodes often have no internet.

    torchrun --standalone --nproc-per-node=2 download_race.py --data-dir data
    torchrun --standalone --nproc-per-node=2 download_race.py --data-dir data --fix rank0
    torchrun --standalone --nproc-per-node=2 download_race.py --data-dir data --fix lock
"""

import argparse
import datetime
import fcntl
import math
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

ARCHIVE = "dataset.tar.gz"


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def non_negative_float(text):
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more (got {text})")
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
    parser.add_argument("--fix", choices=["rank0", "lock"], help="the way to avoid the race")
    parser.add_argument("--data-dir", type=folder_path, default=Path("data"))
    parser.add_argument(
        "--fake-size", type=positive_int, default=2000, help="samples in the dataset"
    )
    parser.add_argument(
        "--chunk-delay", type=non_negative_float, default=0.03, help="seconds per 64 KiB"
    )
    parser.add_argument(
        "--init-timeout",
        type=positive_int,
        default=60,
        help="seconds init and each barrier may wait",
    )
    return parser.parse_args(argv)


def fail(message):
    print(f"download_race.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def env_int(name):
    """A whole number from the environment, or one line that names the variable."""
    text = os.environ[name]
    if not text.isdecimal():
        fail(f"{name}={text!r} is not a whole number (set by torchrun, or in the job script)")
    return int(text)


def make_server(torch, folder, size):
    """The archive a real script would download: data/.server/dataset.tar.gz."""
    files = folder / "files" / "dataset"
    files.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    samples = {"images": torch.randn(size, 3, 8, 8, generator=generator),
               "labels": torch.randint(0, 10, (size,), generator=generator)}  # fmt: skip
    torch.save(samples, files / "train.pt")
    with tarfile.open(folder / ARCHIVE, "w:gz") as archive:
        archive.add(files, arcname="dataset")


def download(source, target, chunk_delay):
    """A slow download: 64 KiB at a time, as from a remote server."""
    with open(source, "rb") as remote, open(target, "wb") as local:
        while chunk := remote.read(65536):
            local.write(chunk)
            local.flush()
            time.sleep(chunk_delay)


def extract(archive, folder):
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(folder, filter="data")


# --- what every rank does when it runs the download itself (the race) ---
def prepare(source, data_dir, chunk_delay):
    archive = data_dir / ARCHIVE
    if not archive.exists():  # no one has downloaded it yet, or someone is doing it now
        download(source, archive, chunk_delay)
    extract(archive, data_dir)


# --- the lock: one process downloads, the final names appear only when complete ---
def prepare_locked(source, data_dir, chunk_delay):
    with open(data_dir / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, in this job or another
        if not (data_dir / "dataset").is_dir():
            partial = data_dir / f"{ARCHIVE}.{os.getpid()}.part"
            download(source, partial, chunk_delay)
            os.replace(partial, data_dir / ARCHIVE)  # atomic: complete or absent
            unpacked = data_dir / f"dataset.{os.getpid()}.part"
            extract(data_dir / ARCHIVE, unpacked)
            os.replace(unpacked / "dataset", data_dir / "dataset")
            shutil.rmtree(unpacked)


# --- end of the ways to prepare the data ---


def main(argv=None):
    args = parse_args(argv)
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]  # fmt: skip
    if missing:
        fail(f"{', '.join(missing)} not set: start this script with torchrun")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        env_int(name)  # checked here: torch's own error would be a traceback
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.init_timeout))
    rank = dist.get_rank()
    server = args.data_dir / ".server"
    if rank == 0:  # set-up: the "remote" archive, and no dataset yet
        args.data_dir.mkdir(parents=True, exist_ok=True)
        (args.data_dir / ARCHIVE).unlink(missing_ok=True)
        shutil.rmtree(args.data_dir / "dataset", ignore_errors=True)
        make_server(torch, server, args.fake_size)
    dist.barrier()
    time.sleep(0.2 * rank)  # ranks never start at the same instant

    source = server / ARCHIVE
    if args.fix == "rank0":
        if rank == 0:
            prepare(source, args.data_dir, args.chunk_delay)
        dist.barrier()  # the others wait until rank 0 has finished
    elif args.fix == "lock":
        prepare_locked(source, args.data_dir, args.chunk_delay)
    else:
        prepare(source, args.data_dir, args.chunk_delay)

    samples = torch.load(args.data_dir / "dataset" / "train.pt")
    print(f"rank {rank}: {len(samples['labels'])} samples")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("download_race.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
