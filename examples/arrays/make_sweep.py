"""Write a sweep file: one configuration per row, for the tasks of a job array.

A grid tries every combination of the values given; --random N draws N configurations
instead, the learning rate log-uniformly between the smallest and largest value given. Each
row gets its own seed (--seeds repeats every configuration with several seeds). The last lines
printed are the commands that submit the sweep, with the array options they use.

    python make_sweep.py --lr 0.1 0.01 --batch-size 32 128              # a grid of 4
    python make_sweep.py --lr 0.001 0.3 --batch-size 32 128 --random 8  # 8 random draws
"""

import argparse
import csv
import itertools
import math
import os
import random
import sys
from pathlib import Path


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


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


def writable_file(text):
    """An output file: its folder is created if needed; it cannot be a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot create the folder {path.parent}: {error.strerror}"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {path.parent}: permission denied")
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--lr", type=positive_float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--batch-size", type=positive_int, nargs="+", default=[32, 128])
    parser.add_argument("--seeds", type=positive_int, default=1, help="runs per configuration")
    parser.add_argument("--random", type=positive_int, metavar="N", help="N random draws")
    parser.add_argument("--max-running", type=positive_int, default=4,
                        help="tasks that may run at once (the %%N of --array)")  # fmt: skip
    parser.add_argument("--output", type=writable_file, default="sweep.csv")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="for --random")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.random:
        rng = random.Random(args.seed)
        low, high = math.log(min(args.lr)), math.log(max(args.lr))
        configs = [(float(f"{math.exp(rng.uniform(low, high)):.3g}"), rng.choice(args.batch_size))
                   for _ in range(args.random)]  # fmt: skip
    else:
        configs = list(itertools.product(args.lr, args.batch_size))
    rows = [(lr, batch, seed) for lr, batch in configs for seed in range(args.seeds)]
    try:
        with args.output.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(["lr", "batch_size", "seed"])
            writer.writerows(rows)
    except OSError as error:
        sys.exit(f"make_sweep.py: error: cannot write {args.output}: {error.strerror}")
    print(f"Wrote {len(rows)} configurations to {args.output}")
    # The submit scripts freeze the sweep file for the tasks and size the array from it.
    print(f"Slurm:       MAX_RUNNING={args.max_running} bash submit_sweep.sh     "
          f"(--array=0-{len(rows) - 1}%{args.max_running})")  # fmt: skip
    print(f"Grid Engine: MAX_RUNNING={args.max_running} bash submit_sweep_ge.sh  "
          f"(-t 1-{len(rows)} -tc {args.max_running})")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("make_sweep.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
