"""Train one configuration of a hyperparameter sweep: the row of a sweep file that a job array
task picks, and write its result where a last job collects them all.

make_sweep.py writes the sweep file, one configuration per row. Each task of a job array trains
the row with its task number (from the scheduler, or --task) on the same generated data, with
its own seed, and writes its result to <output-dir>/task-<N>.json, through a temporary file and
a rename, so that the collecting job never reads half a file. collect_results.py makes the
table. The job scripts read the copy of the sweep file frozen for their submission, and write
beside it: submit_sweep.sh (Slurm) and submit_sweep_ge.sh (Grid Engine) make that folder.

    python sweep_train.py --sweep sweep.csv --task 0 --output-dir results
    bash submit_sweep.sh --epochs 5            # Slurm: sweep.sbatch, then collect.sbatch
    bash submit_sweep_ge.sh --epochs 5         # Grid Engine: tasks 1 to N (row = task - 1)
"""

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import torch


def fail(message):
    sys.exit(f"sweep_train.py: error: {message}")


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


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
    parser.add_argument(
        "--sweep", type=existing_file, default=Path("sweep.csv"), help="from make_sweep.py"
    )
    parser.add_argument(
        "--task",
        type=non_negative_int,
        help="row of the sweep file, from 0; default: the array task",
    )
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--output-dir", type=writable_dir, default="results")
    return parser.parse_args(argv)


def task_number(args):
    """The row to train: --task, else Slurm's array task id, PBS's array index (both from 0 in
    the job scripts), else Grid Engine's task id (from 1)."""
    if args.task is not None:
        return args.task
    for name, first in (("SLURM_ARRAY_TASK_ID", 0), ("PBS_ARRAY_INDEX", 0), ("SGE_TASK_ID", 1)):
        value = os.environ.get(name, "")
        if value and value != "undefined":  # Grid Engine sets "undefined" outside arrays
            if not value.isdecimal() or int(value) < first:
                fail(f"{name}={value!r} is not a task number")
            return int(value) - first
    fail(
        "not an array task: pass --task N, or submit with sbatch --array, qsub -J (PBS) or "
        "qsub -t (Grid Engine)"
    )


def read_row(path, task):
    if not path.is_file():  # the default; a --sweep given is checked when parsed
        fail(f"no sweep file {path}: write it with make_sweep.py first")
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if task >= len(rows):
        fail(f"task {task}, but {path} has {len(rows)} rows (tasks 0 to {len(rows) - 1})")
    row = rows[task]
    try:
        return {"lr": float(row["lr"]), "batch_size": int(row["batch_size"]),
                "seed": int(row["seed"])}  # fmt: skip
    except (KeyError, ValueError):
        fail(f"row {task} of {path} needs lr, batch_size and seed: {row}")


def data():
    """The same generated classification data for every task: 2,048 points, 10 classes."""
    generator = torch.Generator().manual_seed(1234)
    centres = torch.randn(10, 16, generator=generator)
    labels = torch.randint(0, 10, (2048,), generator=generator)
    points = centres[labels] + 1.5 * torch.randn(2048, 16, generator=generator)
    return (points[:1536], labels[:1536]), (points[1536:], labels[1536:])


def train(config, epochs):
    torch.manual_seed(config["seed"])
    (x, y), (x_val, y_val) = data()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(x))
        for start in range(0, len(x), config["batch_size"]):
            batch = order[start : start + config["batch_size"]]
            optimizer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
        if not math.isfinite(loss.item()):
            fail(f"epoch {epoch}: the loss is {loss.item()}; this lr ({config['lr']}) is too high")
    with torch.no_grad():
        logits = model(x_val)
        val_loss = loss_fn(logits, y_val).item()
        accuracy = (logits.argmax(1) == y_val).float().mean().item()
    return val_loss, accuracy


def write_result(folder, task, result):
    """task-<N>.json through a temporary file and a rename: complete or absent."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(f"cannot create the output folder {folder}: {error.strerror}")
    path = folder / f"task-{task}.json"
    tmp = folder / f".task-{task}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def main(argv=None):
    args = parse_args(argv)
    task = task_number(args)
    config = read_row(args.sweep, task)
    # A result left by an earlier run of this task must not stand for this run if it fails.
    earlier = args.output_dir / f"task-{task}.json"
    try:
        earlier.unlink(missing_ok=True)
    except OSError as error:
        fail(f"cannot remove the earlier result {earlier}: {error.strerror}")
    start = time.perf_counter()
    val_loss, accuracy = train(config, args.epochs)
    job = (os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("PBS_ARRAY_ID")
           or os.environ.get("JOB_ID") or "local")  # fmt: skip
    result = {"task": task, **config, "epochs": args.epochs, "val_loss": round(val_loss, 4),
              "val_accuracy": round(accuracy, 4), "job": job,
              "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    path = write_result(args.output_dir, task, result)
    print(
        f"task {task}: lr={config['lr']} batch_size={config['batch_size']} "
        f"seed={config['seed']}: val_loss {val_loss:.4f}, accuracy {accuracy:.3f} -> {path}"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("sweep_train.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
