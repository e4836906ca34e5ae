"""Pack an image-folder dataset (one file per image) into a few large tar shards.

A parallel file system serves a few large files fast and millions of small ones slowly: every
open is a request to its metadata servers, and every file counts against the inode quota.
This script packs a folder laid out as <class>/<image> into tar shards in the layout that
WebDataset reads (each sample is <key>.png and <key>.cls side by side), in shuffled order,
and writes a SHA256SUMS file that `sha256sum -c` checks after each copy. Run it once, on a
login node or in a short CPU job, and keep the shards in project space.

    python make_shards.py --input-dir images --output-dir shards
    python make_shards.py --fake 2000 --input-dir images --output-dir shards   # try it out
"""

import argparse
import hashlib
import io
import os
import random
import sys
import tarfile
from pathlib import Path

EXTENSIONS = {".png", ".jpg", ".jpeg"}


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
    parser.add_argument(
        "--input-dir",
        type=folder_path,
        default="images",
        help="the image folder: one subfolder per class",
    )
    parser.add_argument("--output-dir", type=writable_dir, default="shards")
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="images per shard")
    parser.add_argument(
        "--fake",
        type=positive_int,
        metavar="N",
        help="first write N generated 32x32 images into --input-dir",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_args(argv)  # fmt: skip


def fail(message):
    print(f"make_shards.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def write_fake_images(folder, count, seed):
    """Ten classes, each a random colour pattern plus noise, as PNG files."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, (10, 32, 32, 3))
    for index in range(count):
        label = index % 10
        noise = rng.integers(-48, 49, (32, 32, 3))
        pixels = np.clip(patterns[label] + noise, 0, 255).astype(np.uint8)
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"class{label}" / f"{index:06d}.png")


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def main(argv=None):
    args = parse_args(argv)
    if args.fake:
        write_fake_images(args.input_dir, args.fake, args.seed)
    if not args.input_dir.is_dir():
        fail(f"{args.input_dir} is not a folder: give --input-dir the dataset's image folder")
    classes = sorted(p.name for p in args.input_dir.iterdir() if p.is_dir())
    samples = [
        (path, label)
        for label, name in enumerate(classes)
        for path in sorted((args.input_dir / name).iterdir())
        if path.suffix.lower() in EXTENSIONS
    ]
    if not samples:
        fail(f"no images in {args.input_dir}/<class>/: expected .png or .jpg files")
    # Shuffled once here, so that each shard holds every class; the reader shuffles again.
    random.Random(args.seed).shuffle(samples)

    sums = []
    for first in range(0, len(samples), args.shard_size):
        name = f"shard-{first // args.shard_size:06d}.tar"
        partial = args.output_dir / f".{name}.partial"  # renamed once complete
        with tarfile.open(partial, "w") as tar:
            for key, (path, label) in enumerate(samples[first : first + args.shard_size], first):
                add(tar, f"{key:08d}{path.suffix.lower()}", path.read_bytes())
                add(tar, f"{key:08d}.cls", str(label).encode())
        os.replace(partial, args.output_dir / name)
        sums.append(f"{hashlib.sha256((args.output_dir / name).read_bytes()).hexdigest()}  {name}")
    (args.output_dir / "classes.txt").write_text("\n".join(classes) + "\n")
    (args.output_dir / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    size = sum((args.output_dir / line.split()[1]).stat().st_size for line in sums)
    print(f"{len(samples)} images in {len(classes)} classes from {args.input_dir}")
    print(f"{len(sums)} shards, {size / 1e6:.1f} MB, in {args.output_dir} (checksums: SHA256SUMS)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("make_shards.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
