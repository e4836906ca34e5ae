"""torch.load refuses a checkpoint that pickles more than tensors: "Weights only load failed".

Since PyTorch 2.6, torch.load loads with weights_only=True by default: it rebuilds tensors,
state dicts, containers and plain Python types, and refuses any other object, because
unpickling an arbitrary object can run arbitrary code. A checkpoint that stores the run's
options as an argparse.Namespace then fails to load. The script writes such a checkpoint into
--output-dir and loads it. With --fix it shows the ways out: list what a file needs
(torch.serialization.get_unsafe_globals_in_checkpoint), allow a class you trust for one load
(torch.serialization.safe_globals), and, best, save plain types only (vars(args)).

    python weights_only.py --output-dir out          # UnpicklingError: Weights only load failed
    python weights_only.py --output-dir out --fix
"""

import argparse
import math
import os
import sys
from pathlib import Path


def positive_float(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--fix", action="store_true", help="show the three ways out")
    parser.add_argument("--output-dir", type=writable_dir, default="checkpoints")
    parser.add_argument(
        "--lr", type=positive_float, default=0.1, help="an option saved with the model"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    model = torch.nn.Linear(4, 2)
    old = args.output_dir / "with_namespace.pt"
    torch.save({"model": model.state_dict(), "args": args}, old)  # pickles a Namespace
    if not args.fix:
        torch.load(old)  # _pickle.UnpicklingError: Weights only load failed ...
        return

    # 1. What would a weights-only load have to allow? (reads the file, runs nothing)
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(old)
    print(f"{old.name} needs: {', '.join(sorted(needed))}")
    # 2. A file you wrote yourself: allow those classes, for this load only.
    with torch.serialization.safe_globals([argparse.Namespace, type(args.output_dir)]):
        checkpoint = torch.load(old)
    print(f"{old.name} loads with safe_globals: lr {checkpoint['args'].lr}")
    # 3. Better: save plain types (a Path is an object too), which every load accepts.
    options = vars(args) | {"output_dir": str(args.output_dir)}
    new = args.output_dir / "plain.pt"
    torch.save({"model": model.state_dict(), "args": options}, new)
    checkpoint = torch.load(new)
    print(f"{new.name} loads with the default weights_only=True: lr {checkpoint['args']['lr']}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("weights_only.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
