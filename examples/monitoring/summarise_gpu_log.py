"""Summarise a GPU log written by `nvidia-smi --query-gpu=... --format=csv -l N`.

For each GPU of each node (the host column that gpu_usage.sbatch adds): how many samples, the
mean and the lowest utilisation, the mean power and the most memory used, and a warning when
the GPU was mostly idle. Utilisation is the share of time in which at least one kernel ran:
100 % does not mean the GPU is used well, but a low figure means it waits (for data, for the
CPU, for other ranks). gpu_usage.sbatch runs it at the end.

    python summarise_gpu_log.py gpu-usage-123456.csv
    python summarise_gpu_log.py gpu-usage-123456.csv --idle-below 50
"""

import argparse
import csv
import math
import statistics
import sys
from pathlib import Path


def fail(message):
    print(f"summarise_gpu_log.py: error: {message}", file=sys.stderr)
    sys.exit(1)


def percent(text):
    value = float(text)
    if not math.isfinite(value) or not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be between 0 and 100 (got {text})")
    return value


def existing_file(text):
    """The log: it must exist."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"no log {path}: write one with nvidia-smi --query-gpu=... --format=csv -l N "
            "(gpu_usage.sbatch does)"
        )
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("log", type=existing_file, help="the CSV that nvidia-smi wrote")
    parser.add_argument("--idle-below", type=percent, default=50,
                        help="warn when a GPU's mean utilisation is below this (%%)")  # fmt: skip
    return parser.parse_args(argv)


def number(text):
    """A value of the log; None for "[N/A]" or "[Not Supported]", and units are dropped."""
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def read_samples(path):
    """{(host, gpu index): [row, ...]} with the columns named without their units
    ("power.draw"); the host is "" in a log without a host column."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        fail(f"cannot read {path}: {error.strerror}")
    rows = list(csv.reader(lines, skipinitialspace=True))
    if not rows or "index" not in [name.split(" [")[0] for name in rows[0]]:
        fail(f"{path} has no header with an index column: log with --format=csv, not noheader")
    names = [name.split(" [")[0] for name in rows[0]]
    gpus = {}
    for row in rows[1:]:
        if row == rows[0]:  # the header again: each node's sampler writes one
            continue
        if len(row) == len(names):  # the last line may be cut short when the job ended
            sample = dict(zip(names, row, strict=True))
            gpus.setdefault((sample.get("host", ""), sample["index"]), []).append(sample)
    if not gpus:
        fail(f"{path} holds no sample: did the job end before nvidia-smi's first one?")
    return gpus


def main(argv=None):
    args = parse_args(argv)
    gpus = read_samples(args.log)
    width = max(len(host) for host, _ in gpus)  # 0: no host column
    host_column = f"{'host':<{width}} " if width else ""
    print(f"{host_column}{'GPU':>3} {'samples':>7} {'mean util':>9} {'lowest':>6} "
          f"{'mean power':>10} {'most memory':>11}")  # fmt: skip
    idle = []
    for (host, index), samples in sorted(gpus.items()):
        util = [u for s in samples if (u := number(s.get("utilization.gpu", ""))) is not None]
        power = [p for s in samples if (p := number(s.get("power.draw", ""))) is not None]
        memory = [m for s in samples if (m := number(s.get("memory.used", ""))) is not None]
        mean_util = statistics.fmean(util) if util else math.nan
        lowest = min(util, default=math.nan)
        mean_power = statistics.fmean(power) if power else math.nan
        most_memory = max(memory, default=math.nan)
        print(
            f"{f'{host:<{width}} ' if width else ''}{index:>3} {len(samples):>7} "
            f"{mean_util:>8.0f}% {lowest:>5.0f}% {mean_power:>9.0f}W {most_memory:>7.0f} MiB"
        )
        if util and mean_util < args.idle_below:
            idle.append(f"{index} on {host}" if host else index)
    if idle:
        print(
            f"Warning: GPU {', '.join(idle)} below {args.idle_below:.0f}% on average: the job "
            "waits for something (data loading, the CPU, other ranks). Profile a few steps."
        )
    else:
        print(f"Every GPU at {args.idle_below:.0f}% or more on average.")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("summarise_gpu_log.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
