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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fake-size", type=int, default=4096)
    parser.add_argument("--output", type=Path, default=Path("thread_scaling.csv"))
    return parser.parse_args(argv)


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
        print(
            f"thread_scaling.py: error: {max(args.threads)} threads asked, {available} CPUs "
            "available: ask the scheduler for more (--cpus-per-task)",
            file=sys.stderr,
        )
        sys.exit(2)
    rows = []
    for threads in args.threads:
        command = [sys.executable, str(script), "--fake-data", f"--fake-size={args.fake_size}",
                   f"--epochs={args.epochs}", f"--threads={threads}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        rate = float(re.search(r"^Throughput: (\d+) images/s", out, re.M)[1])
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
    main()
