"""Collect the results of a sweep into one table, best first, once every task has written.

Reads <results>/task-<N>.json for every row of the sweep file and checks that each result is
that row's: same task, learning rate, batch size and seed. It prints a table of the valid
results sorted by validation loss and writes it to <results>/summary.csv. Each task without a
valid result (missing, unreadable, or another row's) gets one line on stderr, and the exit
status is 1: rerun that task alone in the sweep's folder (as sweep.sbatch and sweep.qsub say)
and collect again.

    python collect_results.py --sweep sweep.csv --results results
    bash submit_sweep.sh     # Slurm: collect.sbatch runs it with SWEEP_DIR, after every task
"""

import argparse
import csv
import json
import math
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
        rows = list(csv.DictReader(handle))
    results, problems = [], []
    for task, row in enumerate(rows):
        result, problem = check(args.results / f"task-{task}.json", task, row)
        if problem:
            problems.append(task)
            print(f"collect_results.py: task {task}: {problem}", file=sys.stderr)
        else:
            results.append(result)
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
    if problems:
        rerun = ",".join(map(str, problems))
        sys.exit(f"collect_results.py: error: {len(problems)} of {len(rows)} tasks have no "
                 f"valid result in {args.results}: rerun rows {rerun}")  # fmt: skip


def check(path, task, row):
    """(the result, None) when path holds the result of this row, else (None, why not)."""
    try:
        wanted = {"task": task, "lr": float(row["lr"]), "batch_size": int(row["batch_size"]),
                  "seed": int(row["seed"])}  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None, f"its row is not a configuration (lr, batch_size, seed): {row}"
    if not path.exists():
        return None, f"no result ({path})"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        got = {name: result[name] for name in wanted}
        loss = result["val_loss"]
    except KeyError as error:
        return None, f"incomplete result {path}: no {error}"
    except (OSError, ValueError, TypeError) as error:
        return None, f"unreadable result {path}: {error}"
    if got != wanted:
        return None, (f"{path} is the result of {describe(got)}, not of its row: "
                      f"{describe(wanted)}")  # fmt: skip
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return None, f"no validation loss in {path}: {loss!r}"
    return result, None


def describe(config):
    return ", ".join(f"{name}={value}" for name, value in config.items())


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("collect_results.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
