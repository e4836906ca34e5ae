"""Measure how cnn_cpu.py's throughput grows with the number of threads, and write a CSV.

Runs cnn_cpu.py (beside this script) once per thread count, each in a fresh process, and
writes threads, images/s and the speed-up over one thread to --output, with the command and
the machine in comment lines. The guide's table is this script's output.

    python thread_scaling.py --threads 1 2 4 8 --output thread_scaling.csv
"""

import argparse
import csv
import os
import platform
import re
import subprocess
import sys
from pathlib import Path


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--fake-size", type=positive_int, default=4096)
    parser.add_argument("--output", type=writable_file, default="thread_scaling.csv")
    return parser.parse_args(argv)


def fail(message):
    print(f"thread_scaling.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main(argv=None):
    args = parse_args(argv)
    script = Path(__file__).with_name("cnn_cpu.py")
    available = len(os.sched_getaffinity(0))
    if max(args.threads) > available:
        fail(
            f"{max(args.threads)} threads asked, {available} CPUs available: ask the scheduler "
            "for more (--cpus-per-task)"
        )
    rows = []
    for threads in args.threads:
        command = [sys.executable, str(script), "--fake-data", f"--fake-size={args.fake_size}",
                   f"--epochs={args.epochs}", f"--threads={threads}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:  # cnn_cpu.py says why in its last line
            why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            fail(f"cnn_cpu.py --threads={threads}: {why.removeprefix('cnn_cpu.py: error: ')}")
        rate = float(re.search(r"^Throughput: (\d+) images/s", proc.stdout, re.M)[1])
        rows.append({"threads": threads, "images_per_s": round(rate)})
        print(f"{threads} threads: {rate:.0f} images/s")
    for row in rows:
        row["speedup"] = f"{row['images_per_s'] / rows[0]['images_per_s']:.2f}"

    import torch

    with args.output.open("w", newline="") as file:
        file.write(
            f"# cnn_cpu.py --fake-data --fake-size={args.fake_size} --epochs={args.epochs}\n"
        )
        file.write(f"# {cpu_name()}, {available} CPUs, PyTorch {torch.__version__}\n")
        writer = csv.DictWriter(file, fieldnames=["threads", "images_per_s", "speedup"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"Wrote {args.output}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("thread_scaling.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
