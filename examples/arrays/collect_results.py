"""Collect the results of a sweep into one table, best first, once every task has written.

Reads <results>/task-<N>.json for every row of the sweep file, prints a table sorted by
validation loss and writes it to <results>/summary.csv. A task without a result is named, and
the exit status is 1: rerun that task alone (sbatch --array=N sweep.sbatch) and collect again.

    python collect_results.py --sweep sweep.csv --results results
    sbatch --dependency=afterok:<array job id> collect.sbatch   # after every task succeeded
"""

import argparse
import csv
import json
import os
import sys
from pathlib import Path

COLUMNS = ["task", "lr", "batch_size", "seed", "val_loss", "val_accuracy", "seconds"]


def existing_file(text):
    """An input file that must exist: here the sweep file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no sweep file {path}: write it with make_sweep.py first")
    return path


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--sweep", type=existing_file, default="sweep.csv")
    parser.add_argument("--results", type=writable_dir, default="results")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with args.sweep.open(newline="", encoding="utf-8") as handle:
        tasks = range(len(list(csv.DictReader(handle))))
    results, missing = [], []
    for task in tasks:
        path = args.results / f"task-{task}.json"
        try:
            results.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            missing.append(task)
    results.sort(key=lambda result: result["val_loss"])
    print(" ".join(f"{name:>12}" for name in COLUMNS))
    for result in results:
        print(" ".join(f"{result[name]!s:>12}" for name in COLUMNS))
    if results:
        with (args.results / "summary.csv").open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, COLUMNS, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows(results)
        best = results[0]
        print(f"Best: task {best['task']} (lr={best['lr']}, batch_size={best['batch_size']}), "
              f"val_loss {best['val_loss']}; table in {args.results / 'summary.csv'}")  # fmt: skip
    if missing:
        sys.exit(f"collect_results.py: error: no result from task(s) "
                 f"{','.join(map(str, missing))} in {args.results}")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("collect_results.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
