"""Measure how fast the same images read as many small files and as a few tar shards.

It writes N generated PNG images twice into --work-dir, once as one file each and once packed
into tar shards, then reads each copy with a cold page cache (the files evicted from memory
first, as on a node that has not read them yet) and again warm (from memory), and prints
images/s and MB/s. Run it where your data would live, on the file system you want to measure:
project space, scratch, node-local disk. Eviction asks the kernel to drop clean cached pages
(posix_fadvise); a parallel file system may keep its own caches, so read "cold" there as
"not in this node's memory".

    python read_benchmark.py --work-dir /scratch/$USER/read-benchmark --output results.csv
"""

import argparse
import io
import os
import platform
import shutil
import sys
import tarfile
import time
from pathlib import Path


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def writable_dir(text):
    """An output folder: created if needed; the reason given when it cannot be."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot create {path}: {error.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {path}: permission denied")
    return path


def writable_file(text):
    """An output file: its folder created if needed; never an existing folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    writable_dir(path.parent)
    return path


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
    parser.add_argument("--images", type=positive_int, default=20000)
    parser.add_argument("--image-size", type=positive_int, default=64, help="pixels per side")
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="images per shard")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="passes per measurement; the median is reported",
    )
    parser.add_argument(
        "--work-dir",
        type=folder_path,
        default=Path("read-benchmark"),
        help="a new folder on the file system to measure (removed at the end)",
    )
    parser.add_argument("--output", type=writable_file, help="also write the results as CSV")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)  # fmt: skip


def fail(message):
    print(f"read_benchmark.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def write_images(folder, args):
    """The images as one PNG file each, in 100 subfolders, and as tar shards."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(args.seed)
    files, shards = folder / "files", folder / "shards"
    shards.mkdir(parents=True)
    tar = None
    for index in range(args.images):
        pixels = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        data = buffer.getvalue()
        path = files / f"{index % 100:02d}" / f"{index:08d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if index % args.shard_size == 0:
            if tar:
                tar.close()
            tar = tarfile.open(shards / f"shard-{index // args.shard_size:06d}.tar", "w")
        info = tarfile.TarInfo(f"{index:08d}.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    tar.close()
    os.sync()  # written to disk, so that the cached pages are clean and can be dropped


def evict(paths):
    """Drop the files' pages from the page cache (clean pages only; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths):
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def read_shards(paths):
    total = 0
    for path in paths:
        with tarfile.open(path, mode="r|") as tar:
            for member in tar:
                total += len(tar.extractfile(member).read())
    return total


def measure(read, paths, cold, repeats):
    """Median seconds of `repeats` passes and the bytes read."""
    times = []
    for _ in range(repeats):
        if cold:
            evict(paths)
        else:
            read(paths)  # bring everything into memory first
        start = time.perf_counter()
        size = read(paths)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], size


def main(argv=None):
    args = parse_args(argv)
    if args.work_dir.exists():
        fail(f"{args.work_dir} exists: give --work-dir a new folder (it is removed at the end)")
    try:
        args.work_dir.mkdir(parents=True)
    except OSError as error:
        fail(f"cannot create {args.work_dir}: {error.strerror}")
    try:
        write_images(args.work_dir, args)
        files = sorted((args.work_dir / "files").rglob("*.png"))
        shards = sorted((args.work_dir / "shards").glob("*.tar"))
        rows = []
        for layout, read, paths in (("files", read_files, files), ("shards", read_shards, shards)):
            for cache in ("cold", "warm"):
                seconds, size = measure(read, paths, cache == "cold", args.repeats)
                rate, megabytes = args.images / seconds, size / seconds / 1e6
                rows.append((layout, len(paths), cache, rate, megabytes))
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)

    header = "layout,files,cache,images_per_s,mb_per_s"
    lines = [
        f"{layout},{count},{cache},{rate:.0f},{mb:.1f}" for layout, count, cache, rate, mb in rows
    ]
    print(f"{args.images} images of {args.image_size}x{args.image_size} pixels, "
          f"median of {args.repeats} passes")  # fmt: skip
    print(f"{'layout':8} {'files':>7} {'cache':6} {'images/s':>10} {'MB/s':>8}")
    for layout, count, cache, rate, mb in rows:
        print(f"{layout:8} {count:>7} {cache:6} {rate:>10.0f} {mb:>8.1f}")
    if args.output:
        machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
        command = " ".join(["read_benchmark.py", *(argv if argv is not None else sys.argv[1:])])
        comments = [f"# {command}", f"# {machine}, file system of --work-dir: {filesystem(args)}"]
        args.output.write_text("\n".join([*comments, header, *lines]) + "\n")


def filesystem(args):
    """The type of the file system that held --work-dir (from /proc/self/mounts)."""
    target, best = str(args.work_dir.resolve()), ("", "unknown")
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if (target + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best[0]):
                best = (mount, kind)
    except OSError:
        pass
    return best[1]


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("read_benchmark.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
